"""Where sessions live, and deleting a user's.

- incoming: ``<incoming>/<YYYY-MM-DDTHH>/*.jsonl``, written by the serving side;
- taken in: ``<root>/production_traces/<YYYY-MM-DDTHH>/<run id>/`` (``sessions.parquet``,
  ``summary.json``, manifest), one per hour partition, and one row per session in the catalog's
  ``traces`` table (``uri`` names the artifact);
- deletion requests: ``<root>/traces/deletions.jsonl``, the ``user_hash`` of each user, read by
  every later intake (a deleted user's sessions still arriving are dropped as ``deleted_user``).

``delete_user`` removes a user's sessions everywhere they were copied: each partition's Parquet
(rewritten, its manifest with it), the incoming files, the catalog's ``traces`` rows, the SFT
trajectories built from them (Parquet and catalog rows); it lists every checkpoint trained on
them, following the catalog's ``checkpoint_inputs`` lineage from the trajectories and from the
session partitions RL read (SFT -> RL -> promoted, a cycle -> the cycles built on it), and
withdraws every promoted version among them (``registry.withdraw``): never served again, and
the newest clean version serves instead when the served one is withdrawn. The next cycle starts
from that clean version, on sessions the user's are no longer among.
"""

from __future__ import annotations

import datetime as dt
import json
import posixpath

from .intake import partition_key, user_hash

DELETIONS = ("traces", "deletions.jsonl")


def list_incoming(storage, url: str, fingerprints: dict[str, str] | None = None) -> dict[str, list[str]]:
    """Partition key -> the session files (``*.jsonl``) in that hour's folder, sorted; folders
    that are not an hour are ignored. ``fingerprints``, when given, is filled with each file's
    size and modification time (or ETag) from the same listing: one request for the whole tree."""
    out: dict[str, list[str]] = {}
    for f, info in storage.find_info(url).items():
        rel = f[len(url.rstrip("/")) + 1:]
        parts = rel.split("/")
        if len(parts) != 2 or not parts[1].endswith(".jsonl") or parts[1].startswith("."):
            continue
        key = partition_key(parts[0])
        if key is not None:
            out.setdefault(key, []).append(f)
            if fingerprints is not None:
                stamp = info.get("mtime") or info.get("LastModified") or info.get("ETag") or info.get("created")
                fingerprints[f] = f"{info.get('size')}:{stamp}"
    return {k: sorted(v) for k, v in sorted(out.items())}


def deleted_users(storage) -> set[str]:
    url = storage.url(*DELETIONS)
    if not storage.exists(url):
        return set()
    return {json.loads(line)["user_hash"] for line in storage.read_bytes(url).decode().splitlines() if line.strip()}


def _table_exists(catalog, name: str) -> bool:
    return name in catalog.tables()


def trained_on(catalog, trajectory_uris: set[str]) -> list[dict]:
    """Every checkpoint whose inputs lead back to one of ``trajectory_uris``: ``{checkpoint,
    run_id, uri}``, nearest first."""
    if not trajectory_uris or not _table_exists(catalog, "checkpoint_inputs"):
        return []
    rows = catalog.query("SELECT checkpoint, run_id, uri, input_uri FROM checkpoint_inputs")
    found, frontier, seen = [], set(trajectory_uris), set()
    while frontier:
        nxt = set()
        for checkpoint, run_id, uri, input_uri in rows:
            if input_uri in frontier and (checkpoint, run_id) not in seen:
                seen.add((checkpoint, run_id))
                found.append({"checkpoint": checkpoint, "run_id": run_id, "uri": uri})
                nxt.add(uri)
        frontier = nxt
    return found


def delete_user(storage, catalog, user_id: str, incoming: str | None = None, log=lambda msg: None,
                weights_uri: str | None = None) -> dict:
    """Delete ``user_id``'s sessions (see the module); return what was removed, the checkpoints
    trained on them, the versions withdrawn and the served-log line when the served version
    changed (its weights published at ``weights_uri``). Idempotent: a second request removes
    and withdraws nothing and lists the same checkpoints."""
    from . import registry

    import pyarrow.compute as pc

    h = user_hash(user_id)
    ledger = storage.url(*DELETIONS)
    have = storage.read_bytes(ledger) if storage.exists(ledger) else b""
    if h not in {json.loads(line)["user_hash"] for line in have.decode().splitlines() if line.strip()}:
        line = json.dumps({"user_hash": h, "requested_at": dt.datetime.now(dt.timezone.utc).isoformat()})
        storage.write_bytes(ledger, have + line.encode() + b"\n")
    result = {"user_hash": h, "sessions": 0, "partitions": [], "incoming_files": 0, "trajectories": 0,
              "trajectory_artifacts": [], "checkpoints": []}
    ids: set[str] = set()
    uris: list[str] = []
    if _table_exists(catalog, "traces"):
        found = catalog.query("SELECT session_id, hour, uri FROM traces WHERE user_hash = ?", [h])
        ids = {r[0] for r in found}
        uris = sorted({r[2] for r in found})
        result["partitions"] = sorted({r[1] for r in found})
    for uri in uris:
        url = posixpath.join(uri, "sessions.parquet")
        table = storage.read_parquet(url)
        keep = table.filter(pc.invert(pc.equal(table["user_hash"], h)))
        result["sessions"] += table.num_rows - keep.num_rows
        storage.write_parquet(keep, url)
        storage.write_manifest(uri)
    if incoming:
        for files in list_incoming(storage, incoming).values():
            for f in files:
                data = storage.read_bytes(f)
                lines = data.split(b"\n")
                kept = [ln for ln in lines if not _is_user(ln, user_id)]
                if len(kept) != len(lines):
                    storage.write_bytes(f, b"\n".join(kept))
                    result["incoming_files"] += 1
    if ids:
        catalog.query("DELETE FROM traces WHERE user_hash = ?", [h])
    traj_uris: set[str] = set()
    if ids and _table_exists(catalog, "sft_trajectories"):
        marks = ",".join("?" * len(ids))
        cols = {r[0] for r in catalog.query("DESCRIBE sft_trajectories")}
        runs = catalog.query(f"SELECT DISTINCT run_id, {'uri' if 'uri' in cols else 'NULL'} FROM sft_trajectories "
                             f"WHERE origin = 'session' AND task_id IN ({marks})", sorted(ids))
        for run_id, uri in runs:  # sft_trajectories' artifact, or a cycle's trajectories
            uri = uri or storage.url("sft_trajectories", run_id)
            traj_uris.add(uri)
            url = posixpath.join(uri, "trajectories.parquet")
            if storage.exists(url):
                table = storage.read_parquet(url)
                mine = pc.and_(pc.equal(table["origin"], "session"), pc.is_in(table["task_id"], value_set=_array(ids)))
                keep = table.filter(pc.invert(mine))
                result["trajectories"] += table.num_rows - keep.num_rows
                storage.write_parquet(keep, url)
                storage.write_manifest(uri)
        catalog.query(f"DELETE FROM sft_trajectories WHERE origin = 'session' AND task_id IN ({marks})", sorted(ids))
    result["trajectory_artifacts"] = sorted(traj_uris)
    # trained on them: through the SFT trajectories, or on the partitions themselves (RL from sessions)
    result["checkpoints"] = trained_on(catalog, traj_uris | set(uris))
    w = registry.withdraw(storage, {c["uri"] for c in result["checkpoints"]},
                          f"trained on sessions of deleted user {h[:12]}", weights_uri)
    result.update(withdrawn=w["withdrawn"], served=w["served"])
    log(f"deleted user {h[:12]}: {result['sessions']} sessions in {len(result['partitions'])} partitions, "
        f"{result['incoming_files']} incoming files rewritten, {result['trajectories']} trajectories; "
        f"{len(result['checkpoints'])} checkpoints were trained on them; withdrawn: "
        f"{', '.join(w['withdrawn']) or 'none'}"
        + (f"; now serving {w['served']['version'] or 'nothing'}" if w["served"] else ""))
    return result


def _array(values):
    import pyarrow as pa

    return pa.array(sorted(values), pa.string())


def _is_user(line: bytes, user_id: str) -> bool:
    """The line is a session of ``user_id``; a line that is not JSON (a record cut mid-write)
    counts as the user's when it spells the user's id as its ``user_id`` field."""
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError):
        quoted = json.dumps(user_id).encode()
        return any(b'"user_id"' + sep + quoted in line for sep in (b":", b": "))
    return isinstance(rec, dict) and rec.get("user_id") == user_id


def session_artifacts(catalog, hours: list[str]) -> list[str]:
    """The newest ``production_traces`` artifact of each of ``hours`` that kept a session."""
    if "traces" not in catalog.tables() or not hours:
        return []
    return [u for (u,) in catalog.query(f"SELECT DISTINCT uri FROM traces WHERE hour IN ({','.join('?' * len(hours))}) "
                                        "ORDER BY uri", list(hours))]


def good_sessions(storage, catalog, hours: list[str] | None = None) -> list[dict]:
    """The good sessions taken in (for ``hours`` when given): rows of each hour's newest
    ``sessions.parquet``, as the catalog's ``traces`` table names them."""
    if "traces" not in catalog.tables() or hours == []:
        return []
    where, params = "good", []
    if hours is not None:
        where += f" AND hour IN ({','.join('?' * len(hours))})"
        params = list(hours)
    found = catalog.query(f"SELECT uri, list(session_id) FROM traces WHERE {where} GROUP BY uri ORDER BY uri", params)
    out = []
    for uri, ids in found:
        wanted = set(ids)
        out += [r for r in storage.read_parquet(f"{uri}/sessions.parquet").to_pylist() if r["session_id"] in wanted]
    return out
