"""RL from sessions: GRPO updates of a checkpoint on production sessions, off-policy.

    python -m composer_dag.traces.rl_job --config job.json

Each usable session becomes a rollout (``offpolicy.session_rollouts``: the logged tokens, their
behaviour logprobs, a reward regraded in the sandbox where the starting task is here, else the
recorded outcome); advantages are the reward minus the mean of its group (sessions from the same
starting task), or of all sessions for a session alone in its group; the clipped ratio against
the logged logprobs weights each action by importance. ``out_dir/hf`` is the updated checkpoint
(the input unchanged, and said so, when no session is usable); ``out_dir/result.json`` the summary.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Optional

from pydantic import Field

from ..runtime.config import StageConfig


class SessionRLConfig(StageConfig):
    """GRPO on production sessions (a cycle's RL stage)."""

    model_dir: str
    sessions_dirs: list[str]               # each holds sessions.parquet (production_traces partitions)
    out_dir: str
    tasks_dir: Optional[str] = Field(None, description="tasks to grade sessions again in (their start.snapshot)")
    current_version: str = Field("", description="the version the updates start from")
    versions: list[str] = Field([], description="the registry's promoted versions, oldest first")
    max_staleness: int = Field(2, ge=0, description="sessions served more than this many promotions ago are dropped")
    steps: int = Field(1, ge=0, description="GRPO updates over the sessions")
    lr: float = 1e-5
    micro_batch: int = 4
    clip_eps: float = 0.2
    seed: int = 0


def advantages(rollouts: list[dict]) -> None:
    """Set ``advantage``: reward minus its group's mean (the mean of all for a group of one)."""
    groups: dict[str, list[dict]] = {}
    for r in rollouts:
        groups.setdefault(r["group_id"], []).append(r)
    overall = sum(r["reward"] for r in rollouts) / len(rollouts) if rollouts else 0.0
    for members in groups.values():
        base = sum(r["reward"] for r in members) / len(members) if len(members) > 1 else overall
        for r in members:
            r["advantage"] = r["reward"] - base


def run(cfg: SessionRLConfig, rep=None) -> dict:
    import pyarrow.parquet as pq

    from ..rl.trainer import GRPOTrainer, TrainerConfig
    from ..train.tokenizer import load_tokenizer
    from .offpolicy import session_rollouts

    log = (rep.log if rep is not None else print)
    t0 = time.perf_counter()
    tok = load_tokenizer(cfg.model_dir)
    rows = [r for d in cfg.sessions_dirs for r in pq.read_table(os.path.join(d, "sessions.parquet")).to_pylist()]
    rollouts, summary = session_rollouts(rows, tok, current_version=cfg.current_version, versions=cfg.versions,
                                         max_staleness=cfg.max_staleness, tasks_dir=cfg.tasks_dir)
    advantages(rollouts)
    hf = os.path.join(cfg.out_dir, "hf")
    steps = []
    usable = [r for r in rollouts if r["advantage"] != 0.0]
    if cfg.steps and usable:
        trainer = GRPOTrainer(cfg.model_dir, TrainerConfig(lr=cfg.lr, micro_batch=cfg.micro_batch, clip_eps=cfg.clip_eps,
                                                           warmup_steps=0), batch_size=len(usable), seed=cfg.seed)
        for k in range(cfg.steps):
            st = trainer.train_step(usable)
            steps.append(st)
            log(f"rl from sessions: step {k + 1}/{cfg.steps} loss {st['loss']:.4f} ratio {st['ratio_mean']:.4f} "
                f"clip {st['clip_frac']:.3f} on {st['train_tokens']} tokens")
        trainer.export_hf(hf, tokenizer_dir=cfg.model_dir)
    else:
        shutil.copytree(cfg.model_dir, hf, dirs_exist_ok=True, ignore=shutil.ignore_patterns("manifest.json"))
        log(f"rl from sessions: no update ({len(rollouts)} usable sessions, {len(usable)} with a nonzero advantage)")
    result = {**summary, "updated": bool(steps), "steps": steps, "with_advantage": len(usable),
              "rewards": [r["reward"] for r in rollouts], "seconds": time.perf_counter() - t0}
    with open(os.path.join(cfg.out_dir, "result.json"), "w") as f:
        json.dump(result, f, indent=2, default=str)
    return result


def main(argv: list[str] | None = None) -> dict:
    from ..pipes import entry_point

    return entry_point(SessionRLConfig, "GRPO on production sessions", run, argv)


if __name__ == "__main__":
    main()
