"""Process-group setup for training entry points (torchrun, deepspeed, or none)."""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_distributed() -> tuple[int, int, "torch.device"]:
    """Initialise torch.distributed the DeepSpeed way; works without a launcher too."""
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(k, v)
    chosen = "MASTER_PORT" not in os.environ  # no launcher: a free port picked here
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    import deepspeed

    if not cuda and os.environ.get("COMPOSER_DS_SHM_COMM", "0") != "1":
        # DeepSpeed's CPU backend builds its shared-memory all-reduce kernel (a C++ compile of
        # about a minute on 2 cores, repeated wherever the build cache is new: every isolated
        # job's scratch) when its process group starts. CPU training here is the embedded default
        # and its tests, where gloo's all-reduce of a small model costs milliseconds; set
        # COMPOSER_DS_SHM_COMM=1 to build and use it. DeepSpeed keeps this probe's result in one
        # module-level dict, meant to be edited. GPUs use NCCL and never build it.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    for attempt in range(3):
        try:
            deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
            break
        except torch.distributed.DistNetworkError as exc:
            # the port picked here was free when picked; another process (an outgoing
            # connection's ephemeral port) can take it before the store listens: pick again
            if not chosen or attempt == 2 or "EADDRINUSE" not in str(exc):
                raise
            os.environ["MASTER_PORT"] = str(free_port())
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), device
