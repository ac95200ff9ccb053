"""The Harness interface: what a policy sees of the tools and how its text becomes actions.

A harness names its tools (OpenAI function specs), writes the system prompt, parses a
completion into calls and renders calls and their results as messages, and renders a
reference action (``Action``: run a command, read lines, write text, submit) as its own calls
for SFT demonstrations. Each tool performs one harness-neutral action (``KINDS``); the
``Episode`` carries the action out on the task's workspace and sandbox and logs it in those
neutral terms (``kind``, ``command`` or ``path``), which is what grading reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import NamedTuple

from composer_dag.grading.action_log import KINDS  # noqa: F401  (the actions a tool performs)



class ToolError(Exception):
    pass


def truncate(text: str, budget: int) -> str:
    """Keep the head and tail of ``text`` within ``budget`` characters, with a marker between."""
    if len(text) <= budget:
        return text
    head = int(budget * 0.7)
    tail = max(0, budget - head)
    cut = len(text) - head - tail
    return f"{text[:head]}\n[... {cut} characters truncated ...]\n{text[len(text) - tail:] if tail else ''}"


def defang(text: str, control) -> str:
    """``text`` with every control-token string of ``control`` broken by a zero-width space."""
    for t in sorted(control, key=len, reverse=True):
        if t in text:
            text = text.replace(t, t[0] + "\u200b" + t[1:])
    return text


def _encodable(text: str) -> bool:
    """False for text holding lone surrogates (invalid UTF-8 bytes decoded with surrogateescape
    or escaped in JSON), which no file name, file or command can hold."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


@dataclass(frozen=True)
class Tool:
    """One tool: its OpenAI function spec, the action it performs, and which of its arguments
    is which of the action's (``args``: tool argument -> action argument; unnamed ones keep
    their name)."""

    schema: dict
    kind: str
    args: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    @property
    def parameters(self) -> dict:
        return self.schema["function"]["parameters"]

    def action_args(self, args: dict) -> dict:
        return {self.args.get(k, k): v for k, v in args.items()}

    def tool_args(self, action_args: dict) -> dict:
        back = {v: k for k, v in self.args.items()}
        return {back.get(k, k): v for k, v in action_args.items()}


class Action(NamedTuple):
    """A harness-neutral action: ``kind`` (one of ``KINDS``) and its arguments: exec
    ``command``; read ``path``, ``start_line``, ``end_line``; list ``path``; search
    ``pattern``, ``path``; write ``path``, ``old``, ``new`` (old "" creates the file)."""

    kind: str
    args: dict = {}


class Parsed(NamedTuple):
    calls: list[dict]   # each {"name": ..., "arguments": {...}} (or the OpenAI function form)
    errors: list[str]   # one error observation per malformed call
    prose: str          # the completion's text outside its calls


class Harness:
    """Base of every harness. A subclass sets ``name``, ``version``, ``tools``, ``intro`` (the
    system prompt's head), ``control_tokens`` (strings an observation may not carry as they are),
    ``no_call`` (the observation of a turn without a call) and defines ``parse`` and ``render_call``."""

    name: str = ""
    version: str = ""
    tools: tuple[Tool, ...] = ()
    intro: str = ""
    control_tokens: tuple[str, ...] = ()
    no_call: str = "Error: no tool call found."

    def tool(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)

    def tool_schemas(self) -> list[dict]:
        return [t.schema for t in self.tools]

    # -- the prompt
    def system_prompt(self, style: str = "full") -> str:
        """``intro``, then the tools: full, their JSON specs; compact, one signature per line."""
        fns = [t.schema["function"] for t in self.tools]
        if style == "full":
            tools = "\n".join(json.dumps(f) for f in fns)
        elif style == "compact":
            sig = lambda f: ", ".join(f"{k}: {v['type']}" for k, v in f["parameters"]["properties"].items())
            tools = "\n".join(f"{f['name']}({sig(f)})" for f in fns)
        else:
            raise ValueError(f"system_style must be 'full' or 'compact', not {style!r}")
        return f"{self.intro}\nTools:\n{tools}"

    def prompt_messages(self, user: str, style: str = "full") -> list[dict]:
        return [{"role": "system", "content": self.system_prompt(style)}, {"role": "user", "content": user}]

    def render_prompt(self, tokenizer, user: str, style: str = "full") -> str:
        return tokenizer.apply_chat_template(self.prompt_messages(user, style), tokenize=False,
                                             add_generation_prompt=True)

    # -- the call format
    def parse(self, text: str) -> Parsed:
        raise NotImplementedError

    def render_call(self, name: str, arguments: dict) -> str:
        raise NotImplementedError

    def render_turn(self, content: str, calls: list[dict]) -> str:
        """An assistant turn's text (before the end of turn): its prose, then its calls."""
        body = "\n".join(self.render_call(c.get("name"), c.get("arguments") or {}) for c in calls)
        return "\n".join(x for x in ((content or "").strip(), body) if x)

    def result_message(self, content: str) -> dict:
        """The message that carries a call's result (already cut and defanged) back to the policy."""
        return {"role": "tool", "content": content}

    def control(self, tokenizer=None) -> list[str]:
        """The strings defanged in observations: the harness's and the tokenizer's special tokens."""
        extra = [t for t in getattr(tokenizer, "all_special_tokens", None) or [] if len(t) > 1]
        return sorted(set(self.control_tokens) | set(extra), key=len, reverse=True)

    # -- reference actions (SFT demonstrations)
    def render_action(self, action: Action) -> list[dict]:
        """``action`` as this harness's calls: by default one call of the tool of its kind."""
        tool = next((t for t in self.tools if t.kind == action.kind), None)
        if tool is None:
            raise ValueError(f"harness {self.name!r} has no tool for {action.kind!r}")
        return [{"name": tool.name, "arguments": tool.tool_args(action.args)}]

    def render_actions(self, actions: list[Action]) -> list[dict]:
        return [c for a in actions for c in self.render_action(a)]

    # -- calls in, actions out
    def check(self, call) -> tuple[Tool, dict]:
        """The tool and arguments of ``call`` (``{"name", "arguments"}``, or the OpenAI
        ``{"function": {...}}`` form with arguments as a JSON string), checked against the
        tool's parameters; raises ``ToolError`` with what is wrong."""
        if not isinstance(call, dict):
            raise ToolError("a tool call must be an object with 'name' and 'arguments'")
        fn = call.get("function", call)
        if not isinstance(fn, dict):
            raise ToolError("'function' must be an object with 'name' and 'arguments'")
        name, args = fn.get("name"), fn.get("arguments", {})
        names = ", ".join(t.name for t in self.tools)
        if not isinstance(name, str):
            # Checked before the lookup: a list or dict name is unhashable and cannot be a tool anyway.
            raise ToolError(f"the tool name must be a string, not {type(name).__name__}; available: {names}")
        tool = self.tool(name)
        if tool is None:
            raise ToolError(f"unknown tool {truncate(repr(name), 200)}; available: {names}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError) as e:  # JSONDecodeError, over-long integers, deep nesting
                raise ToolError(f"arguments are not valid JSON: {truncate(str(e), 300)}") from None
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise ToolError("arguments must be a JSON object")
        check_args(name, tool.parameters, args)
        return tool, args

    def describe(self, tool: Tool, args: dict) -> dict:
        """The harness-neutral fields of a call for the action log: ``kind``, and ``command``
        (exec) or ``path`` (read, list, search, write)."""
        act = tool.action_args(args)
        if tool.kind == "exec":
            return {"kind": "exec", "command": str(act.get("command", ""))}
        if tool.kind in ("read", "list", "search", "write"):
            return {"kind": tool.kind, "path": str(act.get("path", "."))}
        return {"kind": tool.kind}

    def run(self, episode, entry: dict, tool: Tool, args: dict) -> str:
        """Carry a checked call out in ``episode``; returns the observation's text."""
        return episode.act(tool.kind, entry, **tool.action_args(args))


def check_args(name: str, schema: dict, args: dict) -> None:
    """Raise ``ToolError`` unless ``args`` fit ``schema`` (known names, the required ones, strings
    and positive integers as declared, no NUL byte, valid UTF-8)."""
    unknown = set(args) - set(schema["properties"])
    if unknown:
        raise ToolError(f"{name}: unexpected argument(s) {sorted(unknown)}")
    missing = [k for k in schema["required"] if k not in args]
    if missing:
        raise ToolError(f"{name}: missing required argument(s) {missing}")
    for k, v in args.items():
        want = schema["properties"][k]["type"]
        if want == "string" and not isinstance(v, str) or want == "integer" and (
                not isinstance(v, int) or isinstance(v, bool) or v < schema["properties"][k].get("minimum", v)):
            raise ToolError(f"{name}: argument {k!r} must be {'a positive integer' if want == 'integer' else 'a string'}")
        if isinstance(v, str) and ("\0" in v or not v.isascii() and not _encodable(v)):
            raise ToolError(f"{name}: argument {k!r} holds a NUL byte or text that is not valid UTF-8")
