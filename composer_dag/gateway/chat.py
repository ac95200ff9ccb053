"""Chat requests as token ids, and completions as chat replies.

``render``: the prompt of a chat request, with the checkpoint's chat template (``tools``
rendered by it), as the text and ids the server sees. Where the request's messages begin with
the messages of an earlier call of the same episode followed by that call's reply, the prompt is
that call's prompt and sampled completion, token for token, then the new messages: a harness that
keeps its history gets prompts that extend the previous call exactly, however it re-serializes
the turns it sends back (ids, key order, stripped special tokens, merged newlines).

``parse_reply``: a completion's text as ``content`` and OpenAI ``tool_calls`` (the
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks the models here are trained
to write); each call's ``arguments`` is the JSON text as sampled.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


class BadRequest(ValueError):
    """A request the gateway cannot serve (an OpenAI-style 400 ``message``, with its ``code``)."""

    def __init__(self, message: str, code: str = "invalid_request_error"):
        super().__init__(message)
        self.code = code


def _text(content) -> str:
    """A message's content as text (a string, None, or a list of text parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    raise BadRequest("a message's content must be a string, null or a list of text parts")


def _arguments(raw):
    if isinstance(raw, str):
        try:
            return json.loads(raw) if raw.strip() else {}
        except ValueError:
            return raw
    return raw


def normal(message: dict) -> tuple:
    """What identifies a message whatever the harness's serialization: role, text (stripped),
    and each tool call's name and parsed arguments; a tool result's text."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise BadRequest("each message must be an object with a string 'role'")
    calls = []
    for c in message.get("tool_calls") or []:
        fn = c.get("function", c) if isinstance(c, dict) else {}
        calls.append((fn.get("name"), json.dumps(_arguments(fn.get("arguments")), sort_keys=True)))
    return message["role"], _text(message.get("content")).strip(), tuple(calls)


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as the chat template takes them: text content, tool calls as
    ``{"name", "arguments"}`` with arguments as given (a JSON string stays the string)."""
    out = []
    for m in messages:
        normal(m)  # checks the shape
        t = {"role": m["role"], "content": _text(m.get("content"))}
        if m.get("tool_calls"):
            t["tool_calls"] = [{"name": (c.get("function", c) or {}).get("name"),
                                "arguments": (c.get("function", c) or {}).get("arguments", {})} for c in m["tool_calls"]]
        out.append(t)
    return out


@dataclass
class Turn:
    """An earlier call of an episode: the messages it was given, its reply, and the tokens."""

    messages: list[tuple]
    reply: tuple
    tools_key: str
    ids: list[int]           # prompt + sampled completion
    ended: bool              # the completion ended with a stop token
    index: int = -1          # the call's index in its episode


class Renderer:
    """Prompts for one checkpoint's tokenizer and chat template."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.stops = tuple(sorted({t for t in (tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id)
                                   if isinstance(t, int) and t >= 0 and t != tokenizer.unk_token_id}))
        self.end_text = "<|im_end|>" if "<|im_end|>" in tokenizer.get_vocab() else tokenizer.eos_token

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False).input_ids

    def template(self, messages: list[dict], tools: list | None, generation: bool) -> str:
        try:
            return self.tok.apply_chat_template(template_messages(messages), tools=tools or None, tokenize=False,
                                                add_generation_prompt=generation)
        except BadRequest:
            raise
        except Exception as e:  # a template that cannot render these messages (jinja raises many kinds)
            raise BadRequest(f"the chat template cannot render these messages: {type(e).__name__}: {e}") from None

    @staticmethod
    def why_not(norm: list[tuple], key: str, t: Turn) -> str:
        """Why a request does not continue the earlier call ``t``."""
        k = len(t.messages)
        if t.tools_key != key:
            return f"the tools differ from call {t.index}'s"
        if len(norm) <= k:
            return f"the request has {len(norm)} messages; call {t.index} was given {k}, then replied"
        if norm[:k] != t.messages:
            i = next(i for i, (a, b) in enumerate(zip(norm, t.messages)) if a != b)
            return f"message {i} ({norm[i][0]}) is not the one call {t.index} was given"
        if norm[k] != t.reply:
            return f"message {k} ({norm[k][0]}) is not call {t.index}'s reply"
        return f"the chat template renders call {t.index}'s turns otherwise with the new messages"

    def conversation(self, messages: list[dict], tools: list | None) -> tuple[list[int], list[int]]:
        """``(ids, mask)`` of a whole conversation as a harness that keeps its history is served
        it: each prompt rendered with the generation prompt, each assistant turn encoded on its
        own up to its end-of-turn token (mask 1), as the server samples it; what the template
        writes after a turn opens the next prompt. An SFT row in the harness's own format."""
        ids, mask, done = [], [], 0
        full = self.template(messages, tools, False)
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            start = len(self.template(messages[:i], tools, True))
            head = self.template(messages[:i + 1], tools, False)
            end = head.rfind(self.end_text)
            if not full.startswith(head) or end < start:
                raise BadRequest(f"the chat template does not render message {i} as a continuation of the earlier ones")
            end += len(self.end_text)
            for piece, m_ in ((full[done:start], 0), (full[start:end], 1)):
                p_ids = self.encode(piece) if piece else []
                ids, mask = ids + p_ids, mask + [m_] * len(p_ids)
            done = end
        tail = self.encode(full[done:]) if full[done:] else []
        return ids + tail, mask + [0] * len(tail)

    def render(self, messages: list[dict], tools: list | None, turns: list[Turn]) -> tuple[list[int], int | None, str | None]:
        """The prompt ids of a chat request, the index of the earlier turn it extends (None), and
        why it does not continue the latest turn (None where it does)."""
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list")
        norm = [normal(m) for m in messages]
        key = json.dumps(tools, sort_keys=True) if tools else ""
        full = self.template(messages, tools, True)
        miss = self.why_not(norm, key, turns[-1]) if turns else None
        for i in range(len(turns) - 1, -1, -1):
            t = turns[i]
            k = len(t.messages)
            if t.tools_key != key or len(norm) <= k or norm[:k] != t.messages or norm[k] != t.reply:
                continue
            head = self.template(messages[:k + 1], tools, False)
            cut = head.rfind(self.end_text)
            if cut < 0 or not full.startswith(head):
                continue
            gap = head[cut + len(self.end_text):]  # what the template writes after the end of a turn
            end = [] if t.ended else self.encode(self.end_text)
            return t.ids + end + self.encode(gap + full[len(head):]), i, None if i == len(turns) - 1 else miss
        return self.encode(full), None, miss


def parse_reply(text: str, with_tools: bool) -> tuple[str, list[dict]]:
    """``content`` and OpenAI ``tool_calls`` of a completion's text (the stop token removed);
    without tools in the request, the text is all content."""
    if not with_tools:
        return text, []
    calls = []
    for body in _CALL.findall(text):
        body = body.strip()
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):
            continue  # not a call: it stays in the content for the harness to see
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", {})
        m = re.search(r'"arguments"\s*:\s*', body)
        raw = json.dumps(args)
        if m:  # the arguments' JSON as sampled, when it is the object's last member
            tail = body[m.end():].rstrip()
            if tail.endswith("}"):
                candidate = tail[:-1].rstrip()
                try:
                    if json.loads(candidate) == args:
                        raw = candidate
                except ValueError:
                    pass
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": obj["name"], "arguments": raw}})
    content = _CALL.sub(lambda m: "" if _is_call(m.group(1)) else m.group(0), text).strip() if calls else text
    return content, calls


def _is_call(body: str) -> bool:
    try:
        obj = json.loads(body.strip())
    except (ValueError, RecursionError):
        return False
    return isinstance(obj, dict) and isinstance(obj.get("name"), str)
