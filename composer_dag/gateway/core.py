"""The gateway's state: episode keys, their calls' records, and serving one chat or completion
request (no HTTP here: ``server`` puts this behind an OpenAI-compatible endpoint)."""

from __future__ import annotations

import json
import secrets
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from composer_dag.inference.engine import Sampling
from composer_dag.inference.server import ServerDown
from composer_dag.gateway.chat import BadRequest, Renderer, Turn, normal, parse_reply
from composer_dag.gateway.records import CallRecord, extension, segments, session_record
from composer_dag.gateway.upstream import Upstream


class Refused(Exception):
    """A request refused for its episode (HTTP ``status``; OpenAI-style ``code``)."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class EpisodeKey:
    key: str
    episode: str
    max_calls: int
    created: float = field(default_factory=time.time)
    open: bool = True
    records: list[CallRecord] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    refused: Counter = field(default_factory=Counter)
    conversation: dict | None = None  # the latest chat request's messages and tools, with its reply
    lock: threading.Lock = field(default_factory=threading.Lock)


class Gateway:
    """``tokenizer``: the served checkpoint's; ``max_model_len``: the servers' context;
    ``records_dir``: where each key's calls are appended as JSON lines (None: in memory only)."""

    def __init__(self, upstream: Upstream, tokenizer, model: str, max_model_len: int,
                 default_max_tokens: int = 256, max_calls: int = 200, records_dir: str | None = None,
                 sessions_dir: str | None = None):
        self.upstream, self.model, self.max_model_len = upstream, model, max_model_len
        self.renderer = Renderer(tokenizer)
        self.tok = tokenizer
        self.default_max_tokens, self.max_calls = default_max_tokens, max_calls
        self.records_dir = Path(records_dir) if records_dir else None
        if self.records_dir:
            self.records_dir.mkdir(parents=True, exist_ok=True)
        self.sessions_dir = Path(sessions_dir) if sessions_dir else None
        self.keys: dict[str, EpisodeKey] = {}
        self.refused: Counter = Counter()
        self._lock = threading.Lock()

    # -- keys
    def issue(self, episode: str | None = None, max_calls: int | None = None) -> str:
        key = "ep-" + secrets.token_urlsafe(24)
        with self._lock:
            self.keys[key] = EpisodeKey(key, episode or uuid.uuid4().hex[:12], max_calls or self.max_calls)
        return key

    def revoke(self, key: str) -> None:
        with self._lock:
            if key in self.keys:
                self.keys[key].open = False

    def forget(self, key: str) -> None:
        with self._lock:
            self.keys.pop(key, None)

    def _episode(self, key: str | None) -> EpisodeKey:
        ep = self.keys.get(key or "")
        if ep is None or not ep.open:
            self.refused["unknown or closed key"] += 1
            raise Refused(401, "invalid or expired API key", "invalid_api_key")
        return ep

    def records(self, key: str) -> dict:
        ep = self.keys.get(key)
        if ep is None:
            raise KeyError(key)
        with ep.lock:
            recs = list(ep.records)
        return {"key": key, "episode": ep.episode, "records": [r.to_dict() for r in recs],
                "segments": [s.to_dict() for s in segments(recs)], "extension": extension(recs),
                "refused": dict(ep.refused), "conversation": ep.conversation}

    def close_session(self, key: str, meta: dict) -> dict:
        """End a product session: its key is closed and forgotten, and the session becomes a
        ``composer-session/2`` record (``records.session_record``; ``meta``: ``user_id``,
        ``training_consent``, ``model`` {version, digest}, ``tokenizer_digest``, ``harness``
        {name, version}, and where known ``outcome``, ``start``, ``client``), appended to
        ``sessions_dir/<YYYY-MM-DDTHH>/gateway-<pid>.jsonl`` for the hour it ended in, where
        ``production_traces`` takes it in. Returns the record."""
        import datetime as dt
        import os

        ep = self.keys.get(key)
        if ep is None:
            raise KeyError(key)
        self.revoke(key)
        missing = [k for k in ("user_id", "training_consent", "model", "tokenizer_digest", "harness") if k not in meta]
        if missing:
            raise BadRequest(f"a session needs {', '.join(missing)}")
        iso = lambda t: dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        ended = time.time()
        rec = session_record(self.records(key), session_id=str(meta.get("session_id") or ep.episode),
                             user_id=str(meta["user_id"]), training_consent=bool(meta["training_consent"]),
                             model=meta["model"], tokenizer_digest=str(meta["tokenizer_digest"]), harness=meta["harness"],
                             started_at=iso(ep.created), ended_at=iso(ended), outcome=meta.get("outcome"),
                             client=meta.get("client"), start=meta.get("start"))
        if self.sessions_dir is not None:
            hour = self.sessions_dir / dt.datetime.fromtimestamp(ended, dt.timezone.utc).strftime("%Y-%m-%dT%H")
            hour.mkdir(parents=True, exist_ok=True)
            with self._lock, open(hour / f"gateway-{os.getpid()}.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
        self.forget(key)
        return rec

    def stats(self) -> dict:
        with self._lock:
            eps = list(self.keys.values())
        calls = sum(len(e.records) for e in eps)
        return {"keys": len(eps), "open": sum(e.open for e in eps), "calls": calls,
                "refused": dict(self.refused + sum((e.refused for e in eps), Counter()))}

    # -- serving
    def _sampling(self, body: dict, prompt_len: int) -> Sampling:
        if body.get("n", 1) != 1:
            raise BadRequest("only n = 1 is served (one sample per call)")
        room = self.max_model_len - prompt_len
        if room <= 0:
            raise BadRequest(f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                             f"messages resulted in {prompt_len} tokens. Please reduce the length of the messages.",
                             "context_length_exceeded")
        asked = body.get("max_completion_tokens") or body.get("max_tokens") or self.default_max_tokens
        if not isinstance(asked, int) or isinstance(asked, bool) or asked < 1:
            raise BadRequest("max_tokens must be a positive integer")
        temperature, top_p = body.get("temperature", 1.0), body.get("top_p", 1.0)
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (temperature, top_p)):
            raise BadRequest("temperature and top_p must be numbers")
        seed = body.get("seed")
        return Sampling(1, float(temperature), float(top_p), min(asked, room), self.renderer.stops,
                        seed if isinstance(seed, int) and not isinstance(seed, bool) else None)

    def _call(self, ep: EpisodeKey, endpoint: str, prompt_ids: list[int], body: dict, extends: int | None):
        """Sample one completion for ``prompt_ids`` and record it (a failure too)."""
        t0 = time.perf_counter()
        with ep.lock:
            if len(ep.records) >= ep.max_calls:
                ep.refused["call limit"] += 1
                raise Refused(429, f"the episode's call limit ({ep.max_calls}) is reached", "episode_call_limit")
            rec = CallRecord(ep.key, len(ep.records), endpoint, list(prompt_ids), extends=extends, started_at=time.time())
            ep.records.append(rec)
        try:
            sampling = self._sampling(body, len(prompt_ids))
            t1 = time.perf_counter()
            c, server, version = self.upstream.complete(prompt_ids, sampling, ep.key)
            rec.server_s = time.perf_counter() - t1
        except (BadRequest, ServerDown) as e:
            rec.error, rec.finish_reason = f"{type(e).__name__}: {e}", "error"
            ep.refused[getattr(e, "code", "server down")] += 1
            self._persist(rec)
            raise
        rec.completion_ids, rec.logprobs = list(c.token_ids), list(c.logprobs or [])
        rec.server, rec.policy_version, rec.finish_reason = server, version, c.finish_reason
        rec.total_s = time.perf_counter() - t0
        return rec, c

    def _persist(self, rec: CallRecord) -> None:
        if self.records_dir:
            with open(self.records_dir / f"{rec.key}.jsonl", "a") as f:
                f.write(json.dumps(rec.to_dict()) + "\n")

    def chat(self, key: str | None, body: dict) -> dict:
        ep = self._episode(key)
        messages, tools = body.get("messages"), body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise BadRequest("'tools' must be a list")
        if body.get("tool_choice") not in (None, "auto", "none") and tools:
            raise BadRequest("tool_choice must be 'auto' or 'none' (a forced call is not served)")
        with ep.lock:
            turns = list(ep.turns)
        prompt, extends, miss = self.renderer.render(messages, tools, turns)
        rec, c = self._call(ep, "chat", prompt, body, None if extends is None else turns[extends].index)
        rec.miss = miss
        ended = bool(c.token_ids) and c.token_ids[-1] in self.renderer.stops
        text = self.tok.decode(c.token_ids[:-1] if ended else c.token_ids, skip_special_tokens=False)
        content, calls = parse_reply(text, bool(tools) and body.get("tool_choice") != "none")
        reply = {"role": "assistant", "content": content if content or not calls else None,
                 **({"tool_calls": calls} if calls else {})}
        finish = "tool_calls" if calls else ("stop" if c.finish_reason == "stop" else "length")
        rec.finish_reason = finish
        with ep.lock:
            ep.conversation = {"messages": [*messages, reply], "tools": tools}
            ep.turns.append(Turn([normal(m) for m in messages], normal(reply), json.dumps(tools, sort_keys=True) if tools else "",
                                 list(prompt) + list(c.token_ids), ended, rec.index))
        self._persist(rec)
        return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model") or self.model,
                "choices": [{"index": 0, "message": reply, "finish_reason": finish, "logprobs": None}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(c.token_ids),
                          "total_tokens": len(prompt) + len(c.token_ids)}}

    def completions(self, key: str | None, body: dict) -> dict:
        ep = self._episode(key)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.renderer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise BadRequest("'prompt' must be a string or a list of token ids (one prompt per call)")
        if any(t < 0 or t >= len(self.tok) for t in ids):
            raise BadRequest("a prompt token id is outside the vocabulary")
        rec, c = self._call(ep, "completions", ids, body, None)
        self._persist(rec)
        text = self.tok.decode(c.token_ids, skip_special_tokens=False)
        return {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
                "model": body.get("model") or self.model,
                "choices": [{"index": 0, "text": text, "finish_reason": c.finish_reason, "logprobs": None}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(c.token_ids),
                          "total_tokens": len(ids) + len(c.token_ids)}}
