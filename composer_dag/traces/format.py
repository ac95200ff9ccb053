"""The session format (``composer-session/1``): its JSON Schema, reading session files, and the
mapping between the harness's own messages and the OpenAI-compatible ones a session file holds.

A session file is JSON Lines, one session per line, written by the serving side. Reading one
never raises on bad content: every line becomes a session or a reason (``malformed_json``,
``truncated``: the file's last line, cut before its end; ``too_large``; ``schema_violation``).

The harness writes a call as ``{"name": ..., "arguments": {...}}`` in an assistant message's
``tool_calls``, each answered by the next ``tool`` message, in order. A session holds the same
turns in the OpenAI chat shape: ``{"id": "call_<k>", "type": "function", "function": {"name",
"arguments": "<JSON text>"}}``, each ``tool`` message naming its ``tool_call_id``.
``to_openai`` and ``from_openai`` turn one into the other and back unchanged.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Iterator

from composer_dag.gateway.records import session_record as gateway_session  # noqa: F401  (the /2 writer)

FORMAT = "composer-session/1"
FORMAT_2 = "composer-session/2"  # recorded by the gateway (gateway.records.session_record): the harness,
# its tools, every call's exact ids
SCHEMA_PATH = Path(__file__).with_name("session.schema.json")


@functools.lru_cache(maxsize=1)
def schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


@functools.lru_cache(maxsize=1)
def _validator():
    import jsonschema

    cls = jsonschema.validators.validator_for(schema())
    cls.check_schema(schema())
    return cls(schema(), format_checker=cls.FORMAT_CHECKER)


def schema_errors(record) -> list[str]:
    """Every way ``record`` breaks the schema, as ``path: message`` lines ([] when it is valid)."""
    errors = []
    for err in sorted(_validator().iter_errors(record), key=lambda e: list(map(str, e.absolute_path))):
        where = "/".join(map(str, err.absolute_path)) or "(record)"
        errors.append(f"{where}: {err.message[:200]}")
    if not errors and isinstance(record, dict):
        n = len(record["messages"])
        for g in record["generations"]:
            i = g["message_index"]
            if i >= n or record["messages"][i]["role"] != "assistant":
                errors.append(f"generations: message_index {i} is not an assistant message")
            elif g.get("logprobs") is not None and len(g["logprobs"]) != len(g["token_ids"]):
                errors.append(f"generations: message {i} has {len(g['token_ids'])} token ids "
                              f"and {len(g['logprobs'])} logprobs")
        for c in record.get("calls") or []:
            if len(c["logprobs"]) != len(c["completion_ids"]):
                errors.append(f"calls: call {c['index']} has {len(c['completion_ids'])} completion ids "
                              f"and {len(c['logprobs'])} logprobs")
        if record["ended_at"] < record["started_at"]:
            errors.append("ended_at: before started_at")
    return errors


def read_sessions(data: bytes, max_record_bytes: int = 4_000_000) -> Iterator[tuple[int, dict | None, str]]:
    """``(line number, session or None, reason)`` for each non-blank line of a session file;
    reason ``ok`` with a session, else why the line is not one."""
    lines = data.split(b"\n")
    last = len(lines) - 1
    for k, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        if len(raw) > max_record_bytes:
            yield k, None, "too_large"
            continue
        try:
            record = json.loads(raw)
        except (ValueError, RecursionError):  # JSONDecodeError, bad UTF-8, nesting too deep
            # the file's last line without its newline: the writer stopped mid-record
            yield k, None, "truncated" if k - 1 == last and not data.endswith(b"\n") else "malformed_json"
            continue
        if schema_errors(record):
            yield k, None, "schema_violation"
            continue
        yield k, record, "ok"


def to_openai(messages: list[dict]) -> list[dict]:
    """Harness messages -> the session's OpenAI-compatible ones (call ids ``call_<k>``, each tool
    message answering the oldest unanswered call)."""
    out, pending, k = [], [], 0
    for m in messages:
        m = dict(m)
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = c.get("function", c)
                args = fn.get("arguments", {})
                calls.append({"id": f"call_{k}", "type": "function",
                              "function": {"name": str(fn.get("name", "")),
                                           "arguments": args if isinstance(args, str) else json.dumps(args)}})
                pending.append(f"call_{k}")
                k += 1
            m["tool_calls"] = calls
        elif m.get("role") == "assistant":
            m.pop("tool_calls", None)
        elif m.get("role") == "tool" and pending:
            m["tool_call_id"] = pending.pop(0)
        out.append(m)
    return out


def from_openai(messages: list[dict]) -> list[dict]:
    """The session's messages -> the harness's own (``{"name", "arguments": {...}}`` calls, no ids);
    arguments that are not a JSON object stay as their text."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k != "tool_call_id"}
        if m.get("role") == "assistant":
            calls = []
            for c in m.get("tool_calls") or []:
                fn = c.get("function", c)
                try:
                    args = json.loads(fn.get("arguments") or "{}")
                except (ValueError, TypeError):
                    args = fn.get("arguments")
                calls.append({"name": fn.get("name"), "arguments": args})
            m["tool_calls"] = calls
            m.setdefault("content", "")
        out.append(m)
    return out

