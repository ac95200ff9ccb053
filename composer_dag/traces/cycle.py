"""The cycle: a new checkpoint from the sessions of the last few hours.

One cycle (one ``cycle_checkpoints`` partition, a time window, 5 hours by default) takes the
good sessions of its window, fine-tunes the served checkpoint on them (SFT with replay, on the
cluster), runs off-policy GRPO on all the window's sessions (``rl_job``), evaluates the candidate against the served checkpoint through the same harness and gate
as ``evaluated_model``, and when the gate passes promotes it (a new version in the registry) and
publishes its weights at ``weights_uri`` for the serving fleet. A failed gate leaves the served
version in place and says why. A window without enough good sessions is skipped with its reason.

This module holds what the asset runs between the cluster jobs (plain Python).
"""

from __future__ import annotations

import datetime as dt
from typing import Optional

from pydantic import Field

from ..evals.evaluate import EvalConfig
from ..evals.gate import GateConfig
from ..runtime.config import StageConfig
from .intake import PARTITION


class CycleSFT(StageConfig):
    """The cycle's fine-tuning (fields of ``SFTConfig``; the paths are the cycle's)."""

    max_steps: int = 20
    lr: float = 1e-3
    min_lr: float = 1e-3
    warmup_steps: int = 2
    micro_batch: int = 4
    seq_len: int = 512
    pretrain_share: float = Field(0.25, description="replay of token_shards in every micro-batch (0: none)")
    eval_every: int = 10
    save_every: int = 20
    log_every: int = 5
    early_stop_patience: Optional[int] = None
    format_samples: int = 4
    min_format_share: float = 0.0
    sample_tokens: int = 0


class CycleRL(StageConfig):
    """The cycle's RL from sessions (fields of ``SessionRLConfig``): off-policy GRPO on every
    session of the window, good or not, after the fine-tuning."""

    steps: int = Field(1, ge=0, description="GRPO updates (0: no RL stage)")
    lr: float = 1e-5
    max_staleness: int = Field(2, ge=0, description="sessions served more than this many promotions ago are dropped")
    micro_batch: int = 4
    clip_eps: float = 0.2


class CycleConfig(StageConfig):
    """One cycle: which sessions, the fine-tuning, the evaluation and gate, where weights go."""

    min_good_sessions: int = Field(1, ge=1, description="fewer good sessions in the window: the cycle skips")
    sft: CycleSFT = CycleSFT()
    rl: CycleRL = CycleRL()
    eval: EvalConfig = EvalConfig(samples_per_task=2, ks=[1, 2], max_tasks=4,
                                  gate=GateConfig(min_tasks=10, max_ppl_increase=0.1))
    candidate_uri: Optional[str] = Field(None, description="evaluate this checkpoint (a storage URL with a "
                                                           "manifest) instead of training one: a candidate made "
                                                           "elsewhere goes through the same gate")
    weights_uri: str = Field("serving/weights", description="where promoted weights are published for the "
                                                            "serving fleet (relative to the storage root, or a URL)")
    weights_dtype: Optional[str] = Field(None, description="cast before publishing (e.g. bfloat16); None: as trained")
    full_every: int = Field(10, ge=1, description="a full weight version every N, deltas between")


def hours_in(start: dt.datetime, end: dt.datetime) -> list[str]:
    """The hourly partition keys of ``[start, end)``."""
    out, t = [], start.replace(minute=0, second=0, microsecond=0)
    if t < start:
        t += dt.timedelta(hours=1)
    while t < end:
        out.append(t.strftime(PARTITION))
        t += dt.timedelta(hours=1)
    return out


def weights_url(storage, cfg: CycleConfig) -> str:
    return cfg.weights_uri if "://" in cfg.weights_uri else storage.url(*cfg.weights_uri.strip("/").split("/"))

