"""Taking in one hour of production sessions: read, check, scrub, deduplicate, decontaminate.

The serving side drops session files (JSON Lines, ``composer-session/1``) under
``<incoming>/<YYYY-MM-DDTHH>/`` for the hour their sessions ended in. ``intake`` turns one hour's
files into rows (one per kept session, the scrubbed session kept whole in ``record``) and a
summary in which every line read is kept or counted under one reason::

    records_in == kept + sum(dropped.values())

Reasons, in the order they are tried: ``malformed_json``, ``truncated``, ``too_large``,
``schema_violation``, ``unknown_model_version`` (a version the registry never promoted, or
its digest differs), ``no_consent`` (dropped here, before anything else reads it),
``deleted_user`` (a deletion request names the user), ``duplicate_session`` (the same session
id or the same scrubbed conversation in an earlier partition or earlier in this one),
``contaminated`` (shares an n-gram with an evaluation task). A file whose bytes were already
taken in for another hour is skipped whole (``files_duplicate``): each file is taken in once,
keyed by its digest.

Scrubbing: every free-text field (message contents, tool-call arguments, outcome commands, the
user's next message, paths, the repository) goes through the corpus's secret redactor and then
the identity pass (home paths, the client's user and host names, ``user@host``, addresses),
counted per kind. The ``client`` block is dropped. An assistant message that scrubbing changed
loses its token ids and logprobs (they would spell what was removed), counted in
``generations_dropped``.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections import Counter
from typing import Iterable

from pydantic import Field

from ..dedup.secrets import redact, redact_identities
from ..runtime.config import StageConfig
from .format import FORMAT, read_sessions

REASONS = ("malformed_json", "truncated", "too_large", "schema_violation", "unknown_model_version", "no_consent",
           "deleted_user", "duplicate_session", "contaminated")
HOUR_DIR = "%Y-%m-%dT%H"
PARTITION = "%Y-%m-%d-%H:%M"  # Dagster's hourly partition keys


class TraceConfig(StageConfig):
    """Where production sessions arrive and how they are taken in."""

    incoming: str = Field("traces/incoming", description="prefix the serving side writes session files under "
                          "(<prefix>/<YYYY-MM-DDTHH>/*.jsonl); relative to the storage root, or a full URL")
    max_record_bytes: int = Field(4_000_000, ge=1, description="a longer line is dropped as too_large")
    decontaminate: bool = Field(True, description="drop sessions sharing an n-gram with an evaluation task")


def hour_dir(partition_key: str) -> str:
    """``2026-12-04-13:00`` (the partition key) -> ``2026-12-04T13`` (the folder)."""
    return dt.datetime.strptime(partition_key, PARTITION).strftime(HOUR_DIR)


def partition_key(folder: str) -> str | None:
    """``2026-12-04T13`` -> ``2026-12-04-13:00``; None for a name that is not an hour."""
    try:
        return dt.datetime.strptime(folder, HOUR_DIR).strftime(PARTITION)
    except ValueError:
        return None


def incoming_url(storage, incoming: str) -> str:
    """The full URL of ``TraceConfig.incoming`` on ``storage``."""
    return incoming.rstrip("/") if "://" in incoming else storage.url(*incoming.strip("/").split("/"))


def user_hash(user_id: str) -> str:
    """What the tables keep of a user id (deletion requests are matched by it)."""
    return hashlib.sha256(f"composer-user:{user_id}".encode()).hexdigest()[:32]


def file_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class _Scrubber:
    def __init__(self, users: tuple[str, ...], hosts: tuple[str, ...]):
        self.users, self.hosts = users, hosts
        self.counts: Counter = Counter()

    def __call__(self, text):
        if not isinstance(text, str) or not text:
            return text
        data, secrets = redact(text.encode("utf-8", "surrogatepass"))
        out, ids = redact_identities(data.decode("utf-8", "surrogatepass"), self.users, self.hosts)
        self.counts.update(secrets)
        self.counts.update(ids)
        return out


def scrub(record: dict) -> tuple[dict, Counter, int]:
    """``(scrubbed copy, redactions per kind, generations dropped)``; ``client`` is dropped."""
    client = record.get("client") or {}
    home = str(client.get("home") or "")
    users = tuple(x for x in (client.get("user"), home.rstrip("/").rsplit("/", 1)[-1] if home else None) if x)
    s = _Scrubber(users, tuple(x for x in (client.get("host"),) if x))
    out = {k: v for k, v in record.items() if k != "client"}
    changed = set()
    messages = []
    for i, m in enumerate(record["messages"]):
        m2 = dict(m)
        m2["content"] = s(m.get("content"))
        if m.get("tool_calls"):
            m2["tool_calls"] = [{**c, "function": {**c["function"], "arguments": s(c["function"]["arguments"])}}
                                for c in m["tool_calls"]]
        if m2 != m:
            changed.add(i)
        messages.append(m2)
    out["messages"] = messages
    oc = dict(record.get("outcome") or {})
    oc["edits"] = [{**e, "path": s(e["path"])} for e in oc.get("edits") or []]
    oc["commands"] = [{**c, "command": s(c["command"])} for c in oc.get("commands") or []]
    oc["tests"] = [{**t, "command": s(t["command"])} for t in oc.get("tests") or []]
    oc["next_user_message"] = s(oc.get("next_user_message"))
    out["outcome"] = oc
    if record.get("start") and "repository" in record["start"]:
        out["start"] = {**record["start"], "repository": s(record["start"]["repository"])}
    gens = [g for g in record["generations"] if g["message_index"] not in changed]
    out["generations"] = gens
    dropped = len(record["generations"]) - len(gens)
    if record.get("calls"):
        # a call's ids hold the text of every message and tool before it: kept only when scrubbing
        # changed none of them (else the ids would carry what the text no longer does)
        tools = record.get("tools")
        clean = json.dumps(tools) if tools else ""
        if changed or (tools and json.dumps(json.loads(s(clean))) != clean):
            out["calls"], dropped = [], dropped + len(record["calls"])
    return out, s.counts, dropped


def conversation_digest(record: dict) -> str:
    body = json.dumps([{k: m.get(k) for k in ("role", "content", "tool_calls")} for m in record["messages"]],
                      sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()


def judge(record: dict) -> tuple[str, list[str], bool]:
    """``(outcome, flags, good)``: outcome ``accepted`` (edits, all accepted; or no edit and a
    positive rating), ``rejected`` (an edit rejected or a negative rating) or ``none``; flags for
    what makes a session unfit to imitate; good = accepted, unflagged, tests passing where run."""
    oc = record.get("outcome") or {}
    edits = oc.get("edits") or []
    rating = oc.get("rating")
    if any(not e["accepted"] for e in edits) or rating == -1:
        outcome = "rejected"
    elif edits or rating == 1:
        outcome = "accepted"
    else:
        outcome = "none"
    flags = []
    msgs = record["messages"]
    if any(m.get("error") for m in msgs if m["role"] == "tool"):
        flags.append("tool_error")
    if any(m.get("truncated") for m in msgs):
        flags.append("truncated_turn")
    if any(t["failed"] for t in oc.get("tests") or []):
        flags.append("tests_failing")
    if any(c["exit_code"] != 0 for c in oc.get("commands") or []):
        flags.append("command_failed")
    if not msgs or msgs[-1]["role"] == "user":
        flags.append("unanswered")
    return outcome, flags, outcome == "accepted" and not flags


def _text(record: dict) -> str:
    parts = [m.get("content") or "" for m in record["messages"]]
    parts += [c["function"]["arguments"] for m in record["messages"] for c in m.get("tool_calls") or []]
    return "\n".join(parts)


def intake(files: Iterable[tuple[str, bytes]], hour: str, cfg: TraceConfig | dict | None = None, *,
           known_models: dict[str, str], earlier=None,
           deleted_users: set[str] = frozenset(), taken_elsewhere: dict[str, str] | None = None,
           eval_tasks_dir=None) -> tuple[list[dict], dict]:
    """Take in one hour (partition key ``hour``) from ``files`` (``(name, bytes)``).

    ``known_models``: promoted version -> checkpoint digest. ``earlier``: the session ids and
    conversation digests other partitions hold, as ``{"session_ids", "conversations"}``, or a
    function ``(ids, conversations) -> that dict`` asked once for this hour's candidates only (so
    that the earlier partitions are never read whole). ``deleted_users``: ``user_hash`` of each
    user with a deletion request. ``taken_elsewhere``: file digest -> the hour it was taken in for.
    Returns ``(rows, summary)``."""
    cfg = TraceConfig.load(cfg)
    taken_elsewhere = taken_elsewhere or {}
    dropped: Counter = Counter()
    redactions: Counter = Counter()
    per_file, candidates = [], []
    records_in = gens_dropped = 0
    files_seen: set[str] = set()
    for name, data in files:
        digest = file_digest(data)
        if digest in files_seen or taken_elsewhere.get(digest, hour) != hour:
            per_file.append({"file": name, "digest": digest, "records": 0, "kept": 0,
                             "skipped": "duplicate_file", "taken_in_for": taken_elsewhere.get(digest, hour)})
            continue
        files_seen.add(digest)
        n_file = kept_file = 0
        for line, record, why in read_sessions(data, cfg.max_record_bytes):
            records_in += 1
            n_file += 1
            if record is not None:
                why = _admit(record, known_models, deleted_users)
            if why != "ok":
                dropped[why] += 1
                continue
            clean, counts, lost = scrub(record)
            redactions.update(counts)
            gens_dropped += lost
            candidates.append((name, digest, line, clean, counts))
            kept_file += 1
        per_file.append({"file": name, "digest": digest, "records": n_file, "kept": kept_file, "skipped": None})
    convs = [conversation_digest(rec) for _, _, _, rec, _ in candidates]
    if callable(earlier):
        earlier = earlier(sorted({c[3]["session_id"] for c in candidates}), sorted(set(convs))) if candidates else {}
    earlier = earlier or {}
    seen_ids = set(earlier.get("session_ids") or ())
    seen_conv = set(earlier.get("conversations") or ())
    rows = []
    for (name, digest, line, rec, counts), conv in zip(candidates, convs):
        if rec["session_id"] in seen_ids or conv in seen_conv:
            dropped["duplicate_session"] += 1
            continue
        seen_ids.add(rec["session_id"])
        seen_conv.add(conv)
        rows.append(_row(rec, hour, digest, conv, counts))
    if cfg.decontaminate and eval_tasks_dir is not None and rows:
        from ..evals.contamination import contamination_report

        texts = {r["session_id"]: _text(json.loads(r["record"])) for r in rows}
        leaks = contamination_report(texts.items(), eval_tasks_dir)
        bad = {x["shard_item"] for x in leaks}
        dropped["contaminated"] += sum(r["session_id"] in bad for r in rows)
        rows = [r for r in rows if r["session_id"] not in bad]
    for f in per_file:  # kept per file after the later drops
        f["kept"] = sum(r["file_digest"] == f["digest"] for r in rows) if f["skipped"] is None else 0
    summary = {
        "hour": hour, "format": FORMAT,
        "files": len(per_file), "files_duplicate": sum(f["skipped"] == "duplicate_file" for f in per_file),
        "records_in": records_in, "kept": len(rows),
        "dropped": {r: dropped[r] for r in REASONS if dropped[r]},
        "redactions": dict(sorted(redactions.items())),
        "generations_dropped": gens_dropped,
        "good": sum(r["good"] for r in rows),
        "by_outcome": dict(Counter(r["outcome"] for r in rows)),
        "per_file": per_file,
    }
    return rows, summary


def _admit(record: dict, known_models: dict[str, str], deleted_users: set[str]) -> str:
    model = record["model"]
    if known_models.get(model["version"]) != model["digest"]:
        return "unknown_model_version"
    if not record["consent"]["training"]:
        return "no_consent"
    if user_hash(record["user_id"]) in deleted_users:
        return "deleted_user"
    return "ok"


def _row(rec: dict, hour: str, file_digest_: str, conv: str, counts: Counter) -> dict:
    outcome, flags, good = judge(rec)
    oc = rec.get("outcome") or {}
    tests = oc.get("tests") or []
    return {
        "session_id": rec["session_id"], "hour": hour, "user_hash": user_hash(rec["user_id"]),
        "model_version": rec["model"]["version"], "model_digest": rec["model"]["digest"],
        "tokenizer_digest": rec["tokenizer_digest"], "started_at": rec["started_at"], "ended_at": rec["ended_at"],
        "num_messages": len(rec["messages"]), "num_turns": sum(m["role"] == "assistant" for m in rec["messages"]),
        "generations": len(rec["generations"]),
        "edits_accepted": sum(e["accepted"] for e in oc.get("edits") or []),
        "edits_rejected": sum(not e["accepted"] for e in oc.get("edits") or []),
        "tests_ran": len(tests), "tests_passed": sum(t["passed"] for t in tests),
        "tests_failed": sum(t["failed"] for t in tests), "rating": oc.get("rating"),
        "outcome": outcome, "flags": flags, "good": good,
        "start_kind": next(iter(rec["start"]), None) if rec.get("start") else None,
        "redactions": sum(counts.values()),
        "conversation_digest": conv, "file_digest": file_digest_,
        "record": json.dumps(rec, sort_keys=True),
    }


def row_schema():
    import pyarrow as pa

    return pa.schema([
        ("session_id", pa.string()), ("hour", pa.string()), ("user_hash", pa.string()),
        ("model_version", pa.string()), ("model_digest", pa.string()), ("tokenizer_digest", pa.string()),
        ("started_at", pa.string()), ("ended_at", pa.string()), ("num_messages", pa.int32()),
        ("num_turns", pa.int32()), ("generations", pa.int32()), ("edits_accepted", pa.int32()),
        ("edits_rejected", pa.int32()), ("tests_ran", pa.int32()), ("tests_passed", pa.int32()),
        ("tests_failed", pa.int32()), ("rating", pa.int32()), ("outcome", pa.string()),
        ("flags", pa.list_(pa.string())), ("good", pa.bool_()), ("start_kind", pa.string()),
        ("redactions", pa.int32()), ("conversation_digest", pa.string()), ("file_digest", pa.string()),
        ("record", pa.string()),
    ])
