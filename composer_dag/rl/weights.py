"""Weight publication for remote inference workers: a full checkpoint every ``full_every``
versions and compressed deltas in between, each verified by a digest on reconstruction.

Layout under ``<prefix>/`` on a ``Storage``::

    v00000004.json                 the version's manifest: {"version", "kind": "full"|"delta", "base",
                                    "digest" (of the tensors), "sha256" (of the blob), "bytes",
                                    "full_bytes", "dtype", "tensors": [[name, dtype, shape], ...]};
                                   written after the blob, so a version without it does not exist
    v00000004.full.safetensors     kind "full"
    v00000005.delta.zst            kind "delta": zstd of the XOR of the raw bytes against version
                                   ``base`` (= version - 1), byte planes split so that the
                                   unchanged high bytes of each value compress to almost nothing
    latest.json                    {"version", "digest"}: the newest version, written last

The trainer publishes what the inference fleet runs: with ``dtype="bfloat16"`` the state is
cast to bf16 first, so a full checkpoint is half the fp32 size and a delta is the XOR of the
bf16 bit patterns of two versions (at RL learning rates most bf16 values do not change, see
benchmarks/bench_fleet.py). ``reconstruct(storage, prefix, v)`` loads the nearest full version
at or below ``v``, applies the deltas up to ``v`` and checks each blob's sha256 and each
version's digest: the result equals the published tensors bit for bit. ``WeightCache`` keeps
the last rebuilt version so that a follower applies only the new deltas.
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


def cast_state(sd: dict[str, torch.Tensor], dtype: str | None) -> dict[str, torch.Tensor]:
    """``sd`` with floating tensors cast to ``dtype`` (``None``: as it is), on the CPU."""
    dt = getattr(torch, dtype) if dtype else None
    return {k: (v.detach().to("cpu", dt) if dt is not None and v.is_floating_point() else v.detach().cpu()).contiguous()
            for k, v in sd.items()}


def _layout(sd) -> list[list]:
    return [[k, str(sd[k].dtype).removeprefix("torch."), list(sd[k].shape)] for k in sorted(sd)]


def _encode_delta(new: dict, old: dict, level: int = 3) -> bytes:
    import zstandard

    parts = []
    for k in sorted(new):
        a, b = _raw(new[k]), _raw(old[k])
        if a.shape != b.shape:
            raise ValueError(f"{k}: shape changed between versions")
        item = new[k].element_size()
        x = np.bitwise_xor(a, b)
        parts.append(x.reshape(-1, item).T.reshape(-1) if item > 1 else x)  # byte planes
    return zstandard.ZstdCompressor(level=level).compress(np.concatenate(parts).tobytes())


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
            prev: tuple[int, dict] | None = None, dtype: str | None = None, level: int = 3) -> dict:
    """Publish ``state_dict`` (cast to ``dtype`` if given) as ``version``: full when
    ``version % full_every == 0`` or when the previous version is unknown, else a delta against
    ``prev = (version - 1, state in the published dtype)`` (read back from storage when not
    given). Returns the metadata plus ``fraction`` (blob / full bytes) and ``seconds``."""
    from safetensors.torch import save

    t0 = time.perf_counter()
    sd = cast_state(state_dict, dtype)
    full_bytes = sum(v.numel() * v.element_size() for v in sd.values())
    if prev is None and version > 0 and version % full_every and storage.exists(_name(prefix, version - 1, "json")):
        prev = (version - 1, reconstruct(storage, prefix, version - 1))
    delta = (prev is not None and prev[0] == version - 1 and version % full_every != 0
             and _layout(prev[1]) == _layout(sd))
    if delta:
        blob, kind, base = _encode_delta(sd, prev[1], level), "delta", version - 1
        storage.write_bytes(_name(prefix, version, "delta.zst"), blob)
    else:
        blob, kind, base = save(sd), "full", None
        storage.write_bytes(_name(prefix, version, "full.safetensors"), blob)
    meta = {"version": version, "kind": kind, "base": base, "digest": state_digest(sd),
            "sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob), "full_bytes": full_bytes,
            "dtype": dtype or "as_trained", "tensors": _layout(sd)}
    storage.write_json(_name(prefix, version, "json"), meta)
    storage.write_json(f"{prefix.rstrip('/')}/latest.json", {"version": version, "digest": meta["digest"]})
    return {**{k: v for k, v in meta.items() if k != "tensors"}, "fraction": len(blob) / full_bytes,
            "seconds": time.perf_counter() - t0}


def latest_version(storage, prefix: str) -> int | None:
    """The newest published version (``None`` before the first)."""
    url = f"{prefix.rstrip('/')}/latest.json"
    return storage.read_json(url)["version"] if storage.exists(url) else None


def version_manifest(storage, prefix: str, version: int) -> dict | None:
    """The manifest of a published version (``None`` if it is not published)."""
    url = _name(prefix, version, "json")
    return storage.read_json(url) if storage.exists(url) else None


def _blob(storage, prefix: str, meta: dict, verify: bool) -> bytes:
    ext = "full.safetensors" if meta["kind"] == "full" else "delta.zst"
    blob = storage.read_bytes(_name(prefix, meta["version"], ext))
    if verify and "sha256" in meta and hashlib.sha256(blob).hexdigest() != meta["sha256"]:
        raise DigestMismatch(f"version {meta['version']}: {ext} does not match the sha256 of its manifest")
    return blob


def reconstruct(storage, prefix: str, version: int, verify: bool = True,
                have: tuple[int, dict] | None = None) -> dict[str, torch.Tensor]:
    """The state dict of ``version``: nearest full at or below it (or ``have = (v, state)``
    when the chain passes through ``v``), then the deltas; each blob's sha256 and each step's
    digest are checked against the published ones (``DigestMismatch`` otherwise)."""
    from safetensors.torch import load

    chain, v, sd = [], version, None
    while True:
        if have is not None and v == have[0]:
            sd = have[1]
            break
        meta = storage.read_json(_name(prefix, v, "json"))
        chain.append(meta)
        if meta["kind"] == "full":
            break
        v = meta["base"]
    for meta in reversed(chain):
        v = meta["version"]
        if meta["kind"] == "full":
            sd = load(_blob(storage, prefix, meta, verify))
        else:
            sd = _apply_delta(sd, _blob(storage, prefix, meta, verify), meta["tensors"])
        if verify and state_digest(sd) != meta["digest"]:
            raise DigestMismatch(f"version {v}: digest {state_digest(sd)[:12]} != published {meta['digest'][:12]}")
    return sd


def write_weights_dir(state: dict[str, torch.Tensor], directory: str) -> str:
    """``directory/model.safetensors`` (written atomically): what vLLM's ``reload_weights``
    loads in place."""
    import os

    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, ".model.safetensors.tmp")
    save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(directory, "model.safetensors"))
    return directory


class WeightCache:
    """A follower's copy of the published weights: ``get(v)`` rebuilds version ``v`` from the
    last one it holds when the delta chain allows (else from the nearest full), verified."""

    def __init__(self, storage, prefix: str):
        self.storage, self.prefix = storage, prefix
        self.have: tuple[int, dict] | None = None
        self.last_seconds = 0.0

    def get(self, version: int) -> dict[str, torch.Tensor]:
        if self.have is not None and self.have[0] == version:
            return self.have[1]
        t0 = time.perf_counter()
        have = self.have if self.have is not None and self.have[0] < version else None
        sd = reconstruct(self.storage, self.prefix, version, have=have)
        self.have = (version, sd)
        self.last_seconds = time.perf_counter() - t0
        return sd


class WeightPublisher:
    """Keeps the last published state (in the published dtype) in memory so each delta costs
    one XOR + compress."""

    def __init__(self, storage, prefix: str, full_every: int = 10, dtype: str | None = None, level: int = 3):
        self.storage, self.prefix, self.full_every = storage, prefix, max(1, full_every)
        self.dtype, self.level = dtype, level
        self.prev: tuple[int, dict] | None = None

    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> dict:
        sd = cast_state(state_dict, self.dtype)
        # a cast that copied nothing shares the caller's memory: keep our own copy
        sd = {k: v.clone() if v.data_ptr() == state_dict[k].data_ptr() else v for k, v in sd.items()}
        info = publish(self.storage, self.prefix, version, sd, self.full_every, self.prev, self.dtype, self.level)
        self.prev = (version, sd)
        return info
