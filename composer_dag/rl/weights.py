"""Weight publication for remote inference workers: a full checkpoint every ``full_every``
versions and compressed deltas in between, each verified by a digest on reconstruction.

Layout under ``<prefix>/`` on a ``Storage``::

    v00000004.json                 {"version", "kind": "full"|"delta", "base", "digest", "bytes",
                                    "full_bytes", "tensors": [[name, dtype, shape], ...]}
    v00000004.full.safetensors     kind "full"
    v00000005.delta.zst            kind "delta": zstd of the XOR of the raw bytes against version
                                   ``base`` (= version - 1), byte planes split so that the
                                   unchanged high bytes of each value compress to almost nothing
    latest.json                    the newest version

``reconstruct(storage, prefix, v)`` loads the nearest full version at or below ``v``, applies
the deltas up to ``v`` and checks the digest recorded at publish time: the result equals the
trainer's tensors bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import time

import numpy as np
import torch


class DigestMismatch(ValueError):
    pass


def _raw(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def state_digest(sd: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(sd):
        t = sd[k]
        h.update(f"{k}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}\n".encode())
        h.update(_raw(t).tobytes())
    return h.hexdigest()


def _layout(sd) -> list[list]:
    return [[k, str(sd[k].dtype).removeprefix("torch."), list(sd[k].shape)] for k in sorted(sd)]


def _encode_delta(new: dict, old: dict) -> bytes:
    import zstandard

    parts = []
    for k in sorted(new):
        a, b = _raw(new[k]), _raw(old[k])
        if a.shape != b.shape:
            raise ValueError(f"{k}: shape changed between versions")
        item = new[k].element_size()
        x = np.bitwise_xor(a, b)
        parts.append(x.reshape(-1, item).T.reshape(-1) if item > 1 else x)  # byte planes
    return zstandard.ZstdCompressor(level=3).compress(np.concatenate(parts).tobytes())


def _apply_delta(old: dict, blob: bytes, layout: list) -> dict:
    import zstandard

    buf = np.frombuffer(zstandard.ZstdDecompressor().decompress(blob), dtype=np.uint8)
    out, off = {}, 0
    for name, dtype, shape in layout:
        base = old[name]
        n = base.numel() * base.element_size()
        x = buf[off:off + n]
        off += n
        item = base.element_size()
        if item > 1:
            x = x.reshape(item, -1).T.reshape(-1)
        raw = np.bitwise_xor(_raw(base), x)
        out[name] = torch.from_numpy(raw.copy()).view(getattr(torch, dtype)).reshape(shape)
    if off != buf.size:
        raise DigestMismatch(f"delta has {buf.size - off} trailing bytes")
    return out


def _name(prefix: str, version: int, ext: str) -> str:
    return f"{prefix.rstrip('/')}/v{version:08d}.{ext}"


def publish(storage, prefix: str, version: int, state_dict: dict[str, torch.Tensor], full_every: int = 10,
            prev: tuple[int, dict] | None = None) -> dict:
    """Publish ``state_dict`` as ``version``: full when ``version % full_every == 0`` or when
    the previous version is unknown, else a delta against ``prev = (version - 1, state)``
    (read back from storage when not given). Returns the metadata plus ``seconds``."""
    from safetensors.torch import save

    t0 = time.perf_counter()
    sd = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
    full_bytes = sum(v.numel() * v.element_size() for v in sd.values())
    if prev is None and version > 0 and version % full_every and storage.exists(_name(prefix, version - 1, "json")):
        prev = (version - 1, reconstruct(storage, prefix, version - 1))
    delta = prev is not None and prev[0] == version - 1 and version % full_every != 0
    if delta:
        blob, kind, base = _encode_delta(sd, prev[1]), "delta", version - 1
        storage.write_bytes(_name(prefix, version, "delta.zst"), blob)
    else:
        blob, kind, base = save(sd), "full", None
        storage.write_bytes(_name(prefix, version, "full.safetensors"), blob)
    meta = {"version": version, "kind": kind, "base": base, "digest": state_digest(sd), "bytes": len(blob),
            "full_bytes": full_bytes, "tensors": _layout(sd)}
    storage.write_json(_name(prefix, version, "json"), meta)
    storage.write_json(f"{prefix.rstrip('/')}/latest.json", {"version": version})
    return {**{k: v for k, v in meta.items() if k != "tensors"}, "fraction": len(blob) / full_bytes,
            "seconds": time.perf_counter() - t0}


def reconstruct(storage, prefix: str, version: int, verify: bool = True) -> dict[str, torch.Tensor]:
    """The state dict of ``version``: nearest full at or below it, then the deltas; each
    step's digest is checked against the published one (``DigestMismatch`` otherwise)."""
    from safetensors.torch import load

    chain, v = [], version
    while True:
        meta = storage.read_json(_name(prefix, v, "json"))
        chain.append(meta)
        if meta["kind"] == "full":
            break
        v = meta["base"]
    sd = None
    for meta in reversed(chain):
        v = meta["version"]
        if meta["kind"] == "full":
            sd = load(storage.read_bytes(_name(prefix, v, "full.safetensors")))
        else:
            sd = _apply_delta(sd, storage.read_bytes(_name(prefix, v, "delta.zst")), meta["tensors"])
        if verify and state_digest(sd) != meta["digest"]:
            raise DigestMismatch(f"version {v}: digest {state_digest(sd)[:12]} != published {meta['digest'][:12]}")
    return sd


class WeightPublisher:
    """Keeps the last published state in memory so each delta costs one XOR + compress."""

    def __init__(self, storage, prefix: str, full_every: int = 10):
        self.storage, self.prefix, self.full_every = storage, prefix, max(1, full_every)
        self.prev: tuple[int, dict] | None = None

    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> dict:
        info = publish(self.storage, self.prefix, version, state_dict, self.full_every, self.prev)
        self.prev = (version, {k: v.detach().cpu().clone() for k, v in state_dict.items()})
        return info
