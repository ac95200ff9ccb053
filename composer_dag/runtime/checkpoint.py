"""Checkpoints and files that must never be read half-written: sealing with a manifest,
choosing the checkpoint to resume from, RNG state, atomic JSON files and directories.

Shared by every stage that trains or resumes (mid-training, RL, evaluation).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import pickle
import random
import shutil
import time
import uuid
from typing import Iterator

import numpy as np


@contextlib.contextmanager
def atomic_dir(out_dir: str) -> Iterator[str]:
    """Yield a temporary sibling directory; on success it replaces ``out_dir`` in one rename."""
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(out_dir)}.tmp-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        yield tmp
        if os.path.isdir(out_dir):
            old = tmp + ".old"
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _pack(obj) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


def _unpack(s: str):
    return pickle.loads(base64.b64decode(s))


def rng_state() -> dict:
    import torch

    return {"python": _pack(random.getstate()), "numpy": _pack(np.random.get_state()),
            "torch": _pack(torch.get_rng_state())}


def set_rng_state(state: dict) -> None:
    import torch

    random.setstate(_unpack(state["python"]))
    np.random.set_state(_unpack(state["numpy"]))
    torch.set_rng_state(_unpack(state["torch"]))


def write_json_atomic(path: str, obj) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_latest(out_dir: str) -> dict | None:
    path = os.path.join(out_dir, "latest")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


PER_NODE_ENV = "COMPOSER_PER_NODE_STATE"


def per_node_state() -> bool:
    """Whether each node keeps its own ``out_dir`` (``$COMPOSER_PER_NODE_STATE=1``, set by the
    cluster job runner on a multi-node job: no disk is shared). Then the first rank of every
    node seals its own part of each checkpoint (its ranks' optimizer partitions) and commits
    its own ``latest``; the job runner sends each node's part through storage."""
    return os.environ.get(PER_NODE_ENV) == "1"


SAVE_PAUSE_ENV = "COMPOSER_SAVE_PAUSE_S"


def pause_before_seal() -> None:
    """Sleep ``$COMPOSER_SAVE_PAUSE_S`` seconds (unset: not at all) between writing a
    checkpoint's files and sealing it, so a fault test can kill a save midway."""
    pause = float(os.environ.get(SAVE_PAUSE_ENV) or 0)
    if pause > 0:
        time.sleep(pause)


def seal_checkpoint(ckpt_dir: str) -> str:
    """Write the checkpoint's ``manifest.json`` (size and sha256 of every file); call it once
    every file is written. Returns the manifest digest."""
    from ..storage import Storage

    store = Storage(ckpt_dir)
    return store.write_manifest(store.root)


def clear_checkpoint(ckpt_dir: str) -> None:
    """Remove what a save cut short left under ``ckpt_dir`` before saving there again."""
    shutil.rmtree(ckpt_dir, ignore_errors=True)


def commit_latest(out_dir: str, ckpt_root: str, latest: dict, keep: int) -> None:
    """Commit a sealed checkpoint: ``out_dir/latest`` (``latest``, with its ``tag``) pointed at it,
    atomically, then all but the newest ``keep`` checkpoints under ``ckpt_root`` removed. A kill
    in between leaves an extra old checkpoint, never a ``latest`` without its checkpoint."""
    write_json_atomic(os.path.join(out_dir, "latest"), latest)
    for old in sorted(t for t in os.listdir(ckpt_root) if t.startswith("step_"))[:-keep]:
        shutil.rmtree(os.path.join(ckpt_root, old), ignore_errors=True)


def resume_checkpoint(out_dir: str, ckpt_root: str, log=lambda msg: None) -> str | None:
    """The tag of the checkpoint to resume from: the one ``latest`` names if it matches its
    manifest, else the newest older one that does; None when there is none.

    A checkpoint newer than ``latest`` was never committed and is ignored; one without a
    manifest (its save was cut short) or whose files differ from it is skipped with a log line.
    """
    from ..storage import ArtifactError, Storage

    try:
        latest = read_latest(out_dir)
        if latest is not None and not str(latest.get("tag", "")).startswith("step_"):
            raise ValueError(f"no checkpoint tag in {latest!r}")
    except (OSError, ValueError, AttributeError) as exc:
        log(f"unreadable {os.path.join(out_dir, 'latest')} ({exc}): looking for a complete checkpoint")
        latest = None
    tags = sorted((t for t in os.listdir(ckpt_root) if t.startswith("step_")), reverse=True) \
        if os.path.isdir(ckpt_root) else []
    if latest is not None:
        tags = [t for t in tags if t <= latest["tag"]]
    for tag in tags:
        store = Storage(os.path.join(ckpt_root, tag))
        try:
            store.verify_manifest(store.root)
        except (ArtifactError, OSError, ValueError) as exc:
            log(f"checkpoint {tag} is not usable, skipped: {exc}")
            continue
        if latest is not None and tag != latest["tag"]:
            log(f"falling back from {latest['tag']} to {tag}, the newest complete checkpoint")
        return tag
    if latest is not None:
        log(f"no complete checkpoint at or before {latest['tag']}: starting from the beginning")
    return None


def trim_metrics(path: str, step: int) -> int:
    """Drop metric lines past ``step`` (written after the checkpoint a run resumes from) and
    torn lines; returns how many torn lines were dropped."""
    if not os.path.exists(path):
        return 0
    keep, torn = [], 0
    with open(path) as f:
        for ln in f:
            if not ln.strip():
                continue
            try:
                rec = json.loads(ln) if ln.endswith("\n") else None
            except ValueError:
                rec = None
            if rec is None:
                torn += 1
            elif rec["step"] <= step:
                keep.append(ln)
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)
    return torn
