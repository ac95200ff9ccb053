"""The model registry: which versions were promoted, which one serves, and since when.

Under ``<root>/registry/``::

    promoted.json              the version that serves now (what ``promoted_model`` and each
                               passed cycle write; ``serve`` points it at an earlier one)
    history/<name>.json        every promoted entry: version, checkpoint_uri and digest, when
    served.jsonl               one line per change of the served version: {version, since,
                               reason ("promoted", "cycle <partition>", "rollback", "withdrawn: ..."),
                               weights_version}; version null when nothing may serve
    withdrawn.jsonl            versions withdrawn (trained on sessions a user asked to delete):
                               {version, checkpoint_uri, at, reason}; never served again

A version is ``YYYYMMDDTHHMMSSZ-<digest prefix>``. Sessions name the version that served them;
intake accepts only versions in the history, with their digest. Serving a version publishes its
weights at the fleet's ``weights_uri`` as the next weight version (full or delta, see
``composer_dag.rl.weights``), which the rollout and serving servers follow.
"""

from __future__ import annotations

import datetime as dt
import json
import posixpath


def model_version(entry: dict) -> str:
    """A promoted entry's version: its own ``version``, else (entries written before versions
    were) the run that promoted it."""
    return str(entry.get("version") or entry.get("run_id") or "")


def new_version(checkpoint_digest: str, when: dt.datetime | None = None) -> str:
    """``YYYYMMDDTHHMMSSZ-<digest prefix>``: sorts by time, names the weights."""
    when = when or dt.datetime.now(dt.timezone.utc)
    return f"{when.strftime('%Y%m%dT%H%M%SZ')}-{(checkpoint_digest or 'unknown')[:8]}"


def history(storage) -> list[dict]:
    """Every promoted entry, oldest first."""
    out = []
    for url in storage.find(storage.url("registry", "history")):
        if url.endswith(".json"):
            out.append(storage.read_json(url))
    return sorted(out, key=lambda e: (str(e.get("promoted_at") or ""), model_version(e)))


def known_models(storage) -> dict[str, str]:
    """Every version the registry ever promoted -> its checkpoint digest."""
    return {model_version(e): str(e["checkpoint_digest"]) for e in history(storage) if e.get("checkpoint_digest")}


def current(storage) -> dict | None:
    url = storage.url("registry", "promoted.json")
    return storage.read_json(url) if storage.exists(url) else None


def served_log(storage) -> list[dict]:
    url = storage.url("registry", "served.jsonl")
    if not storage.exists(url):
        return []
    return [json.loads(line) for line in storage.read_bytes(url).decode().splitlines() if line.strip()]


def _append(storage, name: str, lines: list[dict]) -> None:
    """``lines`` appended to ``registry/<name>`` (JSON lines)."""
    url = storage.url("registry", name)
    have = storage.read_bytes(url) if storage.exists(url) else b""
    storage.write_bytes(url, have + "".join(json.dumps(x) + "\n" for x in lines).encode())


def _record_served(storage, entry: dict, reason: str, weights_version: int | None) -> dict:
    line = {"version": model_version(entry) or None, "since": dt.datetime.now(dt.timezone.utc).isoformat(),
            "reason": reason, "weights_version": weights_version}
    _append(storage, "served.jsonl", [line])
    return line


def promote(storage, entry: dict, name: str, reason: str = "promoted", weights_uri: str | None = None,
            full_every: int = 10, dtype: str | None = None) -> dict:
    """Record ``entry`` (``version``, ``checkpoint_uri``, ``checkpoint_digest``, ...) in the history
    as ``name``, make it the served version, and publish its weights at ``weights_uri`` when given.
    Returns the served-log line."""
    entry = {**entry, "promoted_at": entry.get("promoted_at") or dt.datetime.now(dt.timezone.utc).isoformat()}
    storage.write_json(storage.url("registry", "history", f"{name}.json"), entry)
    return _serve(storage, entry, reason, weights_uri, full_every, dtype)


def serve(storage, version: str, weights_uri: str | None = None, full_every: int = 10,
          dtype: str | None = None) -> dict:
    """Serve the earlier promoted ``version`` again (a rollback): the registry points at it, the
    served log says since when, and its weights go out at ``weights_uri`` as the next weight
    version. A version never promoted, or withdrawn, is a ValueError that says so."""
    entries = {model_version(e): e for e in history(storage)}
    if version not in entries:
        raise ValueError(f"version {version!r} was never promoted (known: {', '.join(sorted(entries)) or 'none'})")
    gone = withdrawn(storage)
    if version in gone:
        raise ValueError(f"version {version!r} was withdrawn ({gone[version]['reason']}) and is never served again")
    return _serve(storage, entries[version], "rollback", weights_uri, full_every, dtype)


def withdrawn(storage) -> dict[str, dict]:
    """Every withdrawn version -> its ``withdrawn.jsonl`` line."""
    url = storage.url("registry", "withdrawn.jsonl")
    if not storage.exists(url):
        return {}
    lines = [json.loads(line) for line in storage.read_bytes(url).decode().splitlines() if line.strip()]
    return {line["version"]: line for line in lines}


def withdraw(storage, checkpoint_uris: set[str], reason: str, weights_uri: str | None = None, full_every: int = 10,
             dtype: str | None = None) -> dict:
    """Withdraw every promoted version whose checkpoint is one of ``checkpoint_uris`` (what a
    deletion request found trained on the user's sessions): recorded in ``withdrawn.jsonl`` and
    never served again. When the served version is among them, the newest promoted version not
    withdrawn serves instead (its weights published at ``weights_uri``); when there is none,
    nothing serves (``promoted.json`` removed, a served-log line with version null) until the
    next promotion. Returns ``{"withdrawn": [versions], "served": served-log line or None}``;
    a second call with the same checkpoints withdraws nothing more."""
    entries = history(storage)
    gone = withdrawn(storage)
    new = [e for e in entries if e.get("checkpoint_uri") in checkpoint_uris and model_version(e) not in gone]
    if new:
        at = dt.datetime.now(dt.timezone.utc).isoformat()
        lines = [{"version": model_version(e), "checkpoint_uri": e["checkpoint_uri"], "at": at, "reason": reason}
                 for e in new]
        _append(storage, "withdrawn.jsonl", lines)
        gone.update({x["version"]: x for x in lines})
    out: dict = {"withdrawn": [model_version(e) for e in new], "served": None}
    now = current(storage)
    if now is None or model_version(now) not in gone:
        return out
    clean = [e for e in entries if model_version(e) not in gone]
    if clean:
        out["served"] = _serve(storage, clean[-1], f"withdrawn: {reason}", weights_uri, full_every, dtype)
    else:
        storage.remove(storage.url("registry", "promoted.json"))
        out["served"] = _record_served(storage, {}, f"withdrawn: {reason}; no clean version", None)
    return out


def _serve(storage, entry: dict, reason: str, weights_uri: str | None, full_every: int, dtype: str | None) -> dict:
    """Publish ``entry``'s weights (when ``weights_uri``), point ``promoted.json`` at it, log it."""
    weights = publish_checkpoint(storage, entry["checkpoint_uri"], weights_uri, full_every, dtype) if weights_uri else None
    storage.write_json(storage.url("registry", "promoted.json"), entry)
    return _record_served(storage, entry, reason, weights["version"] if weights else None)


def publish_checkpoint(storage, checkpoint_uri: str, weights_uri: str, full_every: int = 10,
                       dtype: str | None = None) -> dict:
    """The checkpoint's ``model.safetensors`` published at ``weights_uri`` as the next weight
    version (a delta against the previous one where the layout matches and the cadence allows)."""
    from safetensors.torch import load

    from ..rl.weights import latest_version, publish
    from ..storage import open_storage

    wstore = open_storage(weights_uri)
    state = load(storage.read_bytes(posixpath.join(checkpoint_uri, "model.safetensors")))
    last = latest_version(wstore, wstore.root)
    return publish(wstore, wstore.root, 0 if last is None else last + 1, state, full_every=full_every, dtype=dtype)
