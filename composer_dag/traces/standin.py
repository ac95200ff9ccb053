"""A stand-in for production: the served policy runs episodes through the harness on tasks, a
simulated user accepts the edits when the project's tests pass, and each episode is written as a
``composer-session/1`` session, one JSON Lines file per hour, as the serving side would.

It also writes what production sends that intake must survive, one of each per call (``bad``):
a line that is not JSON, a session breaking the schema, a session of a version never promoted,
a session without training consent, and a file whose last line was cut mid-record. The summary
says how many of each it wrote, so a test can hold intake's counts against them.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import random
from pathlib import Path

from composer_dag import harness as harnesses
from .format import FORMAT, to_openai
from .intake import HOUR_DIR, PARTITION

def _segments(mask: list[int]) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of 1s in ``mask``: one per assistant message."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def written_paths(messages: list[dict], harness="composer") -> list[str]:
    """The paths that the calls of ``messages`` (the harness's own messages) asked to write: the
    calls of the harness's write tools that name a path as a string, done or not."""
    h = harnesses.get(harness)
    out = []
    for m in messages:
        for c in m.get("tool_calls") or []:
            fn = c.get("function", c) if isinstance(c, dict) else {}
            tool = h.tool(fn.get("name")) if isinstance(fn, dict) and isinstance(fn.get("name"), str) else None
            if tool is None or tool.kind != "write":
                continue
            args = fn.get("arguments")
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except ValueError:
                continue
            path = tool.action_args(args).get("path") if isinstance(args, dict) else None
            if isinstance(path, str):
                out.append(path)
    return out


def session_from_rollout(rollout: dict, *, session_id: str, user_id: str, consent: bool, ended_at: dt.datetime,
                         model_version: str, model_digest: str, tokenizer_digest: str, persona=None) -> dict:
    """One session from an agent-loop rollout record; the simulated user accepts the edits when
    the tests passed and rejects them otherwise, and rates the session the same way."""
    own = json.loads(rollout["messages"])
    messages = to_openai(own)
    ids, mask, lps = rollout["completion_ids"], rollout["loss_mask"], rollout["logprobs"]
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    gens = []
    for idx, (a, b) in zip(assistant, _segments(mask)):
        gens.append({"message_index": idx, "token_ids": [int(x) for x in ids[a:b]],
                     "logprobs": [min(0.0, float(x)) for x in lps[a:b]]})
    passed = rollout["tests_passed"] > 0 and rollout["tests_failed"] == 0
    edits = [{"path": path, "accepted": passed} for path in written_paths(own, rollout.get("harness") or "composer")]
    started = ended_at - dt.timedelta(seconds=max(1.0, float(rollout.get("episode_seconds") or 1.0)))
    record = {
        "format": FORMAT, "session_id": session_id, "user_id": user_id, "consent": {"training": consent},
        "started_at": started.isoformat(), "ended_at": ended_at.isoformat(),
        "model": {"version": model_version, "digest": model_digest}, "tokenizer_digest": tokenizer_digest,
        "messages": messages, "generations": gens,
        "outcome": {"edits": edits, "commands": [],
                    "tests": [{"command": "pytest", "passed": int(rollout["tests_passed"]),
                               "failed": int(rollout["tests_failed"])}],
                    "next_user_message": "thanks, that works" if passed else "the tests still fail",
                    "rating": 1 if passed else -1},
        "start": {"snapshot": rollout["task_id"]},
    }
    if persona is not None:
        record["client"] = {"user": persona.user, "host": persona.hostname, "home": persona.home}
    return record


def write_hours(storage, incoming_url: str, hours: list[str], sessions: list[dict], bad: bool = True,
                seed: int = 0) -> dict:
    """Spread ``sessions`` over ``hours`` (partition keys) round-robin, each hour one file
    ``<incoming>/<YYYY-MM-DDTHH>/sessions-<n>.jsonl`` (ended_at moved into its hour), plus the bad
    records when ``bad``. Returns ``{"files": {hour: url}, "written": {hour: n}, "bad": {reason: n}}``."""
    rng = random.Random(seed)
    by_hour: dict[str, list[bytes]] = {h: [] for h in hours}
    for k, s in enumerate(sessions):
        h = hours[k % len(hours)]
        start = dt.datetime.strptime(h, PARTITION).replace(tzinfo=dt.timezone.utc)
        end = start + dt.timedelta(minutes=rng.randrange(1, 59))
        length = dt.datetime.fromisoformat(s["ended_at"]) - dt.datetime.fromisoformat(s["started_at"])
        s = {**s, "started_at": (end - length).isoformat(), "ended_at": end.isoformat()}
        by_hour[h].append(json.dumps(s).encode())
    bad_counts: dict[str, int] = {}
    truncated_hour = None
    if bad and sessions:
        h = hours[0]
        template = sessions[0]
        lines = by_hour[h]
        lines.append(b'{"format": "composer-session/1", "session_id": "x",,}')
        lines.append(json.dumps({k: v for k, v in template.items() if k != "user_id"} | {"session_id": "bad-schema"}).encode())
        lines.append(json.dumps(template | {"session_id": "unknown-model",
                                            "model": {"version": "never-promoted", "digest": "0" * 64}}).encode())
        lines.append(json.dumps(template | {"session_id": "no-consent", "user_id": "user-optout",
                                            "consent": {"training": False}}).encode())
        bad_counts = {"malformed_json": 1, "schema_violation": 1, "unknown_model_version": 1, "no_consent": 1,
                      "truncated": 1}
        truncated_hour = hours[-1]
    files, written = {}, {}
    for n, h in enumerate(hours):
        body = b"".join(line + b"\n" for line in by_hour[h])
        if h == truncated_hour:
            cut = json.dumps(sessions[-1] | {"session_id": "cut"}).encode()
            body += cut[: len(cut) // 2]  # the writer died mid-record: no newline
        url = f"{incoming_url.rstrip('/')}/{dt.datetime.strptime(h, PARTITION).strftime(HOUR_DIR)}/sessions-{n}.jsonl"
        storage.write_bytes(url, body)
        files[h] = url
        written[h] = len(by_hour[h]) + (1 if h == truncated_hour else 0)
    return {"files": files, "written": written, "bad": bad_counts}


def reference_engine(tok, calls, harness="composer"):
    """A served model that writes a task's reference calls, one per turn (an ``Engine``)."""
    import time

    from ..inference.engine import Completion, Engine, EngineStats

    h = harnesses.get(harness)

    class ReferenceEngine(Engine):
        def __init__(self):
            self.texts = [h.render_turn("", [c]) + "<|im_end|>" for c in calls]
            self.turn, self.stats = 0, EngineStats()

        def generate(self, prompts, params):
            text = self.texts[min(self.turn, len(self.texts) - 1)]
            self.turn += 1
            ids = tok(text, add_special_tokens=False).input_ids
            return self._account([Completion(p, ids, [-0.25] * len(ids), text, "stop") for p in prompts],
                                 time.perf_counter())

    return ReferenceEngine()


def serve_episodes(policy_dir: str, tokenizer_dir: str, tasks: list, served: int, reference_calls,
                   agent_cfg=None, seed: int = 1) -> list[dict]:
    """Rollouts of the harness: the first ``served`` task directories answered by the policy at
    ``policy_dir`` (its sampled ids and logprobs), the rest by a model writing the reference
    (``reference_calls(task_dir, task)``: the calls, e.g. ``sft.trajectories.reference_calls``)."""
    import json as _json

    from transformers import AutoTokenizer

    from ..agent import AgentConfig, AgentLoop
    from ..inference.engine import HFEngine

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = agent_cfg or AgentConfig(max_turns=3, max_new_tokens=64, max_context=2048, workers=2)
    loop = AgentLoop(HFEngine(policy_dir), tok, cfg)
    out = loop.run([(str(d), f"g{k}", 0) for k, d in enumerate(tasks[:served])], version=0, seed=seed)
    loop.close()
    for d in tasks[served:]:
        task = _json.loads((Path(d) / "task.json").read_text())
        loop = AgentLoop(reference_engine(tok, reference_calls(Path(d), task)), tok, cfg)
        out += loop.run([(str(d), "ref", 0)], version=0)
        loop.close()
    return out


def tokenizer_digest(tokenizer_dir) -> str:
    """sha256 over the tokenizer's files (name and bytes, in name order)."""
    h = hashlib.sha256()
    for p in sorted(Path(tokenizer_dir).glob("tokenizer*.json")) + sorted(Path(tokenizer_dir).glob("special_tokens_map.json")):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()
