"""The model registry: which versions were promoted, which one serves, and since when.

Under ``<root>/registry/``::

    promoted.json              the version that serves now (what ``promoted_model`` and each
                               passed cycle write; ``serve`` points it at an earlier one)
    history/<name>.json        every promoted entry: version, checkpoint_uri and digest, when
    served.jsonl               one line per change of the served version: {version, since,
                               reason ("promoted", "cycle <partition>", "rollback"), weights_version}

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


def _record_served(storage, entry: dict, reason: str, weights_version: int | None) -> dict:
    line = {"version": model_version(entry), "since": dt.datetime.now(dt.timezone.utc).isoformat(),
            "reason": reason, "weights_version": weights_version}
    url = storage.url("registry", "served.jsonl")
    have = storage.read_bytes(url) if storage.exists(url) else b""
    storage.write_bytes(url, have + json.dumps(line).encode() + b"\n")
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
    version. A version never promoted is a ValueError naming the known ones."""
    entries = {model_version(e): e for e in history(storage)}
    if version not in entries:
        raise ValueError(f"version {version!r} was never promoted (known: {', '.join(sorted(entries)) or 'none'})")
    return _serve(storage, entries[version], "rollback", weights_uri, full_every, dtype)


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
