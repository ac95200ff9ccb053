"""The RL step both modes run (one process, ``rl.run``; distributed, ``rl.fleet.trainer``), and
the summary both write.

A step takes a batch of rollouts, computes the group advantages over the rollouts without an
``infra_error`` (those get 0 and are not trained on), writes every rollout of the batch to
``rollouts/step_NNNN.parquet``, makes one GRPO update on the rest, and records the step's line of
``metrics.jsonl``. What differs between the modes is only where the batch comes from and how the
new weights reach the engines.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

TRAIN_METRICS = ("loss", "lr", "clip_frac", "ratio_mean", "kl", "grad_norm", "nan_skipped", "train_tokens",
                 "groups_trained", "groups_uniform")


def find_tasks(tasks_dir: str, sources: Optional[list[str]] = None) -> list[Path]:
    """The task directories under ``tasks_dir`` (of ``sources`` only, when given)."""
    dirs = sorted(p.parent for p in Path(tasks_dir).glob("*/task.json"))
    if not dirs:
        raise FileNotFoundError(f"no task directories (*/task.json) under {tasks_dir}")
    if sources is not None:
        found = {d: json.loads((d / "task.json").read_text()).get("source") for d in dirs}
        dirs = [d for d in dirs if found[d] in sources]
        if not dirs:
            raise FileNotFoundError(f"no task of the sources {sources} under {tasks_dir} (found: "
                                    f"{sorted(set(map(str, found.values())))}); set task_sources")
    return dirs


def choose_tasks(tasks: list, cfg, index: int) -> list:
    """Step ``index``'s tasks: ``tasks_per_step`` drawn without replacement (with, when there are
    fewer), seeded by the run's seed and the step. With ``cfg.source_weights`` each draw first
    picks a source by its weight (a source without a weight is not drawn), then a task of it."""
    import random

    rng = random.Random(cfg.seed * 1_000_003 + index)
    n = cfg.tasks_per_step
    weights = getattr(cfg, "source_weights", None)
    if not weights:
        return rng.sample(tasks, n) if n <= len(tasks) else [rng.choice(tasks) for _ in range(n)]
    by_src: dict[str, list] = {}
    for t in tasks:
        by_src.setdefault(json.loads((Path(t) / "task.json").read_text()).get("source"), []).append(t)
    srcs = [s for s in sorted(by_src, key=str) if weights.get(s, 0) > 0]
    if not srcs:
        raise ValueError(f"source_weights {weights} name none of the task sources {sorted(map(str, by_src))}")
    pools = {s: list(by_src[s]) for s in srcs}
    out = []
    for _ in range(n):
        s = rng.choices(srcs, weights=[weights[x] for x in srcs])[0]
        pool = pools[s] = pools[s] or list(by_src[s])
        out.append(pool.pop(rng.randrange(len(pool))))
    return out


def fit_context(orchestrator, max_model_len: int):
    """The agent settings with the episode's context cut to what the engine's model covers (its
    position embeddings)."""
    if orchestrator.max_context > max_model_len:
        return orchestrator.replace(max_context=max_model_len)
    return orchestrator


def stats(xs) -> dict:
    """mean/max/min/n of the values that are not None ({"n": 0} when there are none)."""
    xs = [x for x in xs if x is not None]  # (a record restored from a checkpoint has no step and publish times)
    return {"mean": sum(xs) / len(xs), "max": max(xs), "min": min(xs), "n": len(xs)} if xs else {"n": 0}


def advantages(rows: list[dict], normalize_std: bool = True) -> list[float]:
    """Group advantages over the rollouts without ``infra_error``; those get 0 (and are not trained on)."""
    from .grpo import group_advantages

    return group_advantages([r["reward"] for r in rows], [r["group_id"] for r in rows], normalize_std,
                            include=[r.get("infra_error") is None for r in rows])


def train_step(trainer, store, rows: list[dict], step: int, normalize_std: bool,
               uniform_groups: bool = True) -> tuple[dict, list[dict]]:
    """One update from ``rows`` (the batch for ``step``): advantages, the rollouts written under
    ``rollouts/``, GRPO on those without ``infra_error``, and of those only the groups whose rewards
    differ unless ``uniform_groups``: a group that all failed (or all passed) has advantage 0, so it
    would only dilute the batch's token mean and pull on the KL term. Returns the trainer's step
    stats (with ``groups_trained`` and ``groups_uniform``) and the rollouts without ``infra_error``
    (what the step's reward is measured on)."""
    from ..agent import rollouts_to_table
    from .grpo import informative

    for r, a in zip(rows, advantages(rows, normalize_std)):
        r["advantage"], r["step"] = a, step
    store.write_parquet(rollouts_to_table(rows), store.url("rollouts", f"step_{step:04d}.parquet"))
    used = [r for r in rows if r.get("infra_error") is None]
    signal = informative([r["reward"] for r in used], [r["group_id"] for r in used])
    trained = used if uniform_groups else [r for r, s in zip(used, signal) if s]
    ts = trainer.train_step(trained)
    ts["groups_trained"] = len({r["group_id"] for r in trained})
    ts["groups_uniform"] = len({r["group_id"] for r in used}) - len({r["group_id"] for r, s in zip(used, signal) if s})
    return ts, used


def step_record(version: int, used: list[dict], ts: dict, **extra) -> dict:
    """The metrics line of the update that made ``version``: the rewards and outcomes of the
    rollouts it trained on, the trainer's stats, then ``extra`` (each mode's own timings)."""
    n = max(1, len(used))
    return {
        "step": version, "reward_mean": sum(r["reward"] for r in used) / n,
        "pass_rate": sum(r["tests_failed"] == 0 and r["tests_passed"] > 0 for r in used) / n,
        "flag_rate": sum(bool(r["flags"]) for r in used) / n,
        "malformed_per_rollout": sum(r.get("malformed_calls") or 0 for r in used) / n,
        "submit_rate": sum(r.get("finish") == "submit" for r in used) / n,
        "turns_mean": sum(r.get("num_turns") or 0 for r in used) / n,
        "train_s": ts["train_seconds"], **{k: ts[k] for k in TRAIN_METRICS if k in ts}, **extra,
    }


def append_metrics(path: Path, rec: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(x) for x in open(path) if x.strip()] if Path(path).exists() else []


def summary(hist: list[dict], seconds: tuple[str, ...]) -> dict:
    """What both modes' ``result.json`` say about the run's steps: the reward curve, its first and
    last quarters, the pass, flag and malformed-call rates, the staleness, and each of ``seconds``
    per step."""
    k = max(1, len(hist) // 4)

    def mean(key):
        return sum(h[key] for h in hist) / len(hist) if hist else None

    return {
        "reward_curve": [[h["step"], h["reward_mean"]] for h in hist],
        "reward_first": sum(h["reward_mean"] for h in hist[:k]) / k if hist else None,
        "reward_last": sum(h["reward_mean"] for h in hist[-k:]) / k if hist else None,
        "pass_rate": mean("pass_rate"), "cheat_flag_rate": mean("flag_rate"),
        "malformed_per_rollout": mean("malformed_per_rollout") if all("malformed_per_rollout" in h for h in hist) else None,
        "staleness": {**stats([h["staleness"] for h in hist]),
                      "histogram": {str(s): sum(h["staleness"] == s for h in hist)
                                    for s in sorted({h["staleness"] for h in hist})}},
        "step_seconds": {key: stats([h.get(key) for h in hist]) for key in seconds},
    }


def finish(trainer, out: Path, policy_dir: str, wstore, wprefix: str, publish_dtype: str) -> dict:
    """The end of a run: the published weights of the final version checked against the
    trainer's, bit for bit, and the final policy exported to ``out/hf``."""
    import time

    from .weights import cast_state, reconstruct, state_digest

    t0 = time.perf_counter()
    verified = (state_digest(reconstruct(wstore, wprefix, trainer.version))
                == state_digest(cast_state(trainer.state_dict(), publish_dtype)))
    return {"weights_verified": verified, "reconstruct_seconds": time.perf_counter() - t0,
            "weights_uri": wprefix, "nan_loss_skipped": trainer.nan_skipped,
            "hf_dir": trainer.export_hf(str(out / "hf"), policy_dir)}
