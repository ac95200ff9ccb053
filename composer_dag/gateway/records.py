"""What the gateway keeps of each call, and the token-exact training rows built from it.

A record per call (``CallRecord``): the episode's key, the call's index in the episode, the
endpoint, the prompt ids the server saw, the completion ids and their sampling logprobs, the
policy version that sampled them, the finish reason, timings, and the earlier call whose tokens
the prompt extends (``extends``). A call that failed (a context overrun, a server lost) is
recorded with its ``error`` and no completion.

``segments``: calls whose prompt extends the previous segment's tokens exactly are merged into
one sequence (loss on completion tokens only); any other call starts a new segment. Nothing is
re-tokenized: every id is one a server saw or sampled.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

SESSION_FORMAT = "composer-session/2"


@dataclass
class CallRecord:
    key: str
    index: int
    endpoint: str                      # "chat" | "completions"
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_version: str | None = None
    finish_reason: str = ""            # "stop" | "length" | "tool_calls" | "error"
    error: str | None = None
    server: str | None = None
    extends: int | None = None         # the index of the earlier call whose tokens this prompt continues
    miss: str | None = None            # why the prompt does not continue the episode's latest call
    queued_s: float = 0.0
    server_s: float = 0.0
    total_s: float = 0.0
    started_at: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CallRecord":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass
class Segment:
    ids: list[int]
    mask: list[int]           # 1 on sampled tokens
    logprobs: list[float]     # sampling logprobs on sampled tokens, 0.0 elsewhere
    calls: list[int]          # the call indices merged into it
    policy_versions: list[str | None]

    def to_dict(self) -> dict:
        return asdict(self)


def segments(records: list[CallRecord]) -> list[Segment]:
    """The token-exact sequences of an episode's calls (in call order; failed calls left out)."""
    out: list[Segment] = []
    for r in sorted((r for r in records if r.error is None and r.completion_ids), key=lambda r: r.index):
        cur = out[-1] if out else None
        if cur is not None and len(r.prompt_ids) >= len(cur.ids) and r.prompt_ids[:len(cur.ids)] == cur.ids:
            new = r.prompt_ids[len(cur.ids):]
        else:
            cur = Segment([], [], [], [], [])
            out.append(cur)
            new = list(r.prompt_ids)
        lps = list(r.logprobs) if len(r.logprobs) == len(r.completion_ids) else [0.0] * len(r.completion_ids)
        cur.ids += new + list(r.completion_ids)
        cur.mask += [0] * len(new) + [1] * len(r.completion_ids)
        cur.logprobs += [0.0] * len(new) + lps
        cur.calls.append(r.index)
        cur.policy_versions.append(r.policy_version)
    return out


def extension(records: list[CallRecord]) -> dict:
    """How many calls after an episode's first extended the one before exactly (prompt + completion
    a prefix of the call's prompt), and which did not, with why."""
    ok = [r for r in sorted(records, key=lambda r: r.index) if r.error is None and r.completion_ids]
    misses = []
    for prev, r in zip(ok, ok[1:]):
        head = list(prev.prompt_ids) + list(prev.completion_ids)
        if r.prompt_ids[:len(head)] != head:
            same = next((i for i, (a, b) in enumerate(zip(head, r.prompt_ids)) if a != b), min(len(head), len(r.prompt_ids)))
            misses.append({"call": r.index, "previous": prev.index, "first_difference": same,
                           "why": r.miss or ("a completions call: its prompt is the client's" if r.endpoint == "completions"
                                             else "the prompt continues an older call")})
    pairs = max(0, len(ok) - 1)
    return {"pairs": pairs, "extended": pairs - len(misses), "rate": (pairs - len(misses)) / pairs if pairs else None,
            "misses": misses}


def session_message(m: dict) -> dict:
    """A harness's chat message in the session's message shape (text content; calls with ids)."""
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    out = {"role": m["role"], "content": content if content is None or isinstance(content, str) else str(content)}
    if m.get("tool_calls"):
        out["tool_calls"] = [{"id": str(c.get("id") or f"call_{k}"), "type": "function", "function": {
            "name": str((c.get("function") or {}).get("name", "")),
            "arguments": a if isinstance(a := (c.get("function") or {}).get("arguments", ""), str) else json.dumps(a)}}
            for k, c in enumerate(m["tool_calls"])]
    if m.get("tool_call_id"):
        out["tool_call_id"] = str(m["tool_call_id"])
    return out


def session_record(records: dict, *, session_id: str, user_id: str, training_consent: bool, model: dict,
                    tokenizer_digest: str, harness: dict, started_at: str, ended_at: str, outcome: dict | None = None,
                    client: dict | None = None, start: dict | None = None) -> dict:
    """A ``composer-session/2`` record (``traces.format`` reads and checks it) of one session the gateway served (``records``: its
    ``Gateway.records(key)``): the harness's last request with the reply as the messages, its
    tools, and every call that completed with the exact ids the server saw and sampled."""
    conv = records.get("conversation") or {}
    calls = [{"index": r["index"], "prompt_ids": r["prompt_ids"], "completion_ids": r["completion_ids"],
              "logprobs": r["logprobs"] if len(r["logprobs"]) == len(r["completion_ids"]) else [0.0] * len(r["completion_ids"]),
              "policy_version": r.get("policy_version"), "finish_reason": r.get("finish_reason")}
             for r in records.get("records", []) if r.get("error") is None and r.get("completion_ids")]
    rec = {"format": SESSION_FORMAT, "session_id": session_id, "user_id": user_id, "consent": {"training": training_consent},
           "started_at": started_at, "ended_at": ended_at, "model": model, "tokenizer_digest": tokenizer_digest,
           "harness": harness, "tools": conv.get("tools"), "messages": [session_message(m) for m in conv.get("messages") or []],
           "generations": [], "calls": calls, "outcome": outcome or {}}
    if client:
        rec["client"] = client
    if start:
        rec["start"] = start
    return rec

