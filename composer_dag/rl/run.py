"""The RL run: orchestrator (agent episodes on an inference engine), GRPO trainer, weight sync.

    python -m composer_dag.rl.run --config CONFIG.json [--set key=json_value ...]

Writes under ``out_dir``::

    rollouts/step_0003.parquet   the rollouts the update to version 4 used (see agent.rollout_schema)
    checkpoints/step_0000004/    DeepSpeed state, hf/ (Hugging Face export), trainer_state.json
    latest                       {"tag", "step"}: the checkpoint a restarted run resumes from (if
                                 it matches its manifest, else the newest older one that does)
    weights/                     published versions: full every ``full_every``, deltas between
    sync/v00000004/              model.safetensors the in-process engine reloads
    metrics.jsonl                one line per update
    hf/                          the final policy
    result.json                  the summary (also the Pipes result / last stdout line)
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

from ..pipes import Reporter, entry_point
from .config import LEARNABLE_RUN, RLConfig  # noqa: F401  (RLConfig, LEARNABLE_RUN: this module's public names too)
from .step import (append_metrics, choose_tasks, find_tasks, finish, fit_context, read_metrics, stats, step_record, summary,
                   train_step)


def prepare(cfg: RLConfig, log=lambda msg: None) -> RLConfig:
    """The config the run uses. For ``environment: learnable`` the tasks and a warmed-up policy
    are built next to ``out_dir`` (once) and ``LEARNABLE_RUN`` applies."""
    if cfg.environment != "learnable":
        return cfg
    from .learnable import make_learnable_setup

    root = Path(cfg.out_dir).parent / "learnable"
    if not (root / "policy" / "config.json").exists():
        log("building the learnable environment and warming up the tool-call syntax")
        make_learnable_setup(str(root), n_tasks=8, seed=cfg.seed, words=("red", "blue"))
    return cfg.replace(policy_dir=str(root / "policy"), tasks_dir=str(root / "tasks"), **LEARNABLE_RUN)


class _Generation:
    """The one-process mode's rollouts: agent episodes on an in-process engine, which reloads the
    trainer's newest weights (``offer``) in place when the rollout source syncs."""

    def __init__(self, cfg: RLConfig, engine_dir: str, version: int, log):
        from ..agent import agent_loop
        from ..inference import engine_from_config, fit_to_model
        from ..train.tokenizer import load_tokenizer

        self.cfg, self.tasks = cfg, find_tasks(cfg.tasks_dir, cfg.task_sources)
        self.inference = fit_to_model(cfg.inference, cfg.policy_dir, log)
        orch = fit_context(cfg.orchestrator, self.inference.max_model_len)
        self.engine = engine_from_config(self.inference, engine_dir, seed=cfg.seed)
        self.agent = agent_loop(self.engine, load_tokenizer(cfg.policy_dir), orch)
        self.lock = threading.Lock()
        self.offered = {"version": version, "dir": None}   # newest weights for the engine
        self.version = version                             # the engine's
        self.syncs: list[dict] = []   # {"version", "seconds"}: each in-place reload of the engine

    def offer(self, version: int, weights_dir: str) -> None:
        with self.lock:
            self.offered = {"version": version, "dir": weights_dir}

    def sync(self) -> int:
        with self.lock:
            v, d = self.offered["version"], self.offered["dir"]
        if d is not None and v > self.version:
            self.syncs.append({"version": v, "seconds": round(self.engine.load_weights(d), 4)})
            self.version = v
        return self.version

    def produce(self, index: int, version: int):
        from .loop import Batch

        cfg, t0 = self.cfg, time.perf_counter()
        chosen = choose_tasks(self.tasks, cfg, index)
        jobs = [(str(t), f"b{index:05d}-{k}-{t.name}", j) for k, t in enumerate(chosen) for j in range(cfg.group_size)]
        g0, n0 = self.engine.stats.seconds, self.engine.stats.generated_tokens
        rollouts = self.agent.run(jobs, version, seed=cfg.seed * 7_919 + index * 131)
        return Batch(index, version, rollouts, {
            "generate": self.engine.stats.seconds - g0, "generated_tokens": self.engine.stats.generated_tokens - n0,
            "tools": sum(r["tool_seconds"] for r in rollouts), "grade": sum(r["grade_seconds"] for r in rollouts),
            "wall": time.perf_counter() - t0})


def _open_run(cfg: RLConfig, out: Path, rep: Reporter):
    """The run's directories (temporaries a killed run left removed), its trainer resumed from the
    newest sealed checkpoint, and its counters."""
    from ..runtime.checkpoint import resume_checkpoint, trim_metrics
    from ..storage import sweep_temporaries
    from .trainer import GRPOTrainer

    for d in ("rollouts", "checkpoints", "sync"):
        (out / d).mkdir(parents=True, exist_ok=True)
    # a run killed while writing a batch's rollouts left its temporary file; this run owns out_dir
    stale = sweep_temporaries(out / "rollouts") + sweep_temporaries(out / "sync")
    if stale:
        rep.log(f"removed {stale} temporary file(s) of writes an earlier, killed run left unfinished")
    trainer = GRPOTrainer(cfg.policy_dir, cfg.trainer, batch_size=cfg.tasks_per_step * cfg.group_size,
                          temperature=cfg.orchestrator.temperature, seed=cfg.seed)
    counters = {"dropped_stale_rollouts": 0, "dropped_stale_batches": 0, "next_batch": 0}
    ckpt_root = str(out / "checkpoints")
    resumed = resume_checkpoint(str(out), ckpt_root, rep.log)
    if resumed:
        counters.update(trainer.load_checkpoint(ckpt_root, resumed).get("counters", {}))
        if trim_metrics(str(out / "metrics.jsonl"), trainer.version):
            rep.log(f"dropped torn lines from {out / 'metrics.jsonl'}")
        rep.log(f"resumed from {resumed} at policy version {trainer.version}")
    return trainer, counters, resumed


def run(cfg: RLConfig, rep: Reporter | None = None) -> dict:
    import torch

    from ..runtime.checkpoint import write_json_atomic
    from ..storage import Storage, open_storage
    from .loop import RolloutSource
    from .weights import WeightPublisher

    rep = rep or Reporter()
    cfg = prepare(cfg, rep.log)
    if cfg.fleet is not None:
        from .fleet.launch import run_distributed

        return run_distributed(cfg, rep)
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    out = Path(cfg.out_dir)
    trainer, counters, resumed = _open_run(cfg, out, rep)
    store = Storage(str(out))
    wstore = open_storage(cfg.weights_uri) if cfg.weights_uri else store
    wprefix = wstore.root if cfg.weights_uri else store.url("weights")
    metrics_path = out / "metrics.jsonl"
    resumed_from = trainer.version if resumed else None
    gen = _Generation(cfg, os.path.join(out, "checkpoints", resumed, "hf") if resumed else cfg.policy_dir,
                      trainer.version, rep.log)
    publisher = WeightPublisher(wstore, wprefix, cfg.full_every, cfg.publish_dtype)
    source = RolloutSource(gen.produce, gen.sync, cfg.max_staleness, cfg.async_generation, cfg.queue_size,
                           start_index=counters["next_batch"], limit=cfg.steps - trainer.version)
    dropped0 = (counters["dropped_stale_rollouts"], counters["dropped_stale_batches"])
    rep.log(f"rl: {len(gen.tasks)} tasks, {cfg.tasks_per_step}x{cfg.group_size} rollouts/step, engine "
            f"{gen.inference.engine}, steps {trainer.version}->{cfg.steps}, async {cfg.async_generation}, "
            f"max staleness {cfg.max_staleness}")
    source.start()
    publish_info: list[dict] = []
    tag = resumed
    try:
        while trainer.version < cfg.steps:
            t_step = time.perf_counter()
            batch = source.get(trainer.version)
            wait_s, step = time.perf_counter() - t_step, trainer.version
            ts, used = train_step(trainer, store, batch.rollouts, step, cfg.trainer.normalize_std,
                                  cfg.trainer.uniform_groups)
            version, t0 = trainer.version, time.perf_counter()
            sd = trainer.state_dict()
            gen.offer(version, trainer.save_weights(str(out / "sync" / f"v{version:08d}"), sd))
            save_s = time.perf_counter() - t0
            pub = publisher.publish(version, sd)
            publish_info.append(pub)
            if not cfg.async_generation:
                gen.sync()
            _prune_syncs(out / "sync")
            counters.update(next_batch=source.next_index,
                            dropped_stale_rollouts=dropped0[0] + source.dropped_rollouts,
                            dropped_stale_batches=dropped0[1] + source.dropped_batches)
            sec = batch.seconds
            rec = step_record(
                version, used, ts, batch=batch.index, policy_version=batch.version, staleness=step - batch.version,
                generated_tokens=sec["generated_tokens"], gen_tokens_per_s=sec["generated_tokens"] / max(sec["generate"], 1e-9),
                generate_s=sec["generate"], tools_s=sec["tools"], grade_s=sec["grade"], rollout_wall_s=sec["wall"],
                sync_s=sec.get("sync", 0.0), wait_s=wait_s, save_weights_s=save_s, publish_s=pub["seconds"],
                publish_kind=pub["kind"], publish_fraction=pub["fraction"], step_s=time.perf_counter() - t_step,
                dropped_stale_rollouts=counters["dropped_stale_rollouts"])
            append_metrics(metrics_path, rec)
            if version % cfg.save_every == 0 or version == cfg.steps:
                tag = trainer.commit_checkpoint(str(out), cfg.policy_dir, {"counters": counters}, cfg.keep_checkpoints)
            rep.progress(_progress_line(version, cfg.steps, rec))
    finally:
        source.stop()
        gen.agent.close()

    if tag is None:  # nothing to train (already done, or steps 0): still leave a checkpoint
        tag = trainer.commit_checkpoint(str(out), cfg.policy_dir, {"counters": counters}, cfg.keep_checkpoints)
    end = finish(trainer, out, cfg.policy_dir, wstore, wprefix, cfg.publish_dtype)
    gen.engine.close()
    result = _result(cfg, trainer.version, resumed_from, read_metrics(metrics_path), counters, gen, publish_info,
                     {**end, "checkpoint": tag})
    write_json_atomic(str(out / "result.json"), result)
    return result


def _prune_syncs(sync_dir: Path) -> None:
    """Keep the last two weight directories handed to the generation side."""
    for d in sorted(sync_dir.iterdir())[:-2]:
        shutil.rmtree(d, ignore_errors=True)


def _progress_line(version: int, steps: int, rec: dict) -> str:
    return (f"step {version:>4}/{steps} reward {rec['reward_mean']:.3f} pass {rec['pass_rate']:.2f} "
            f"loss {rec['loss']:+.4f} gen {rec['gen_tokens_per_s']:.0f} tok/s staleness {rec['staleness']} "
            f"dropped {rec['dropped_stale_rollouts']}")


def _result(cfg: RLConfig, steps: int, resumed_from, hist: list[dict], counters: dict, gen, publish_info: list[dict],
            end: dict) -> dict:
    """A run's result.json: the steps' timings summed up, the weight syncs and publications."""
    gen_tok, gen_s = sum(h["generated_tokens"] for h in hist), sum(h["generate_s"] for h in hist)
    return {
        "steps": steps, "resumed_from": resumed_from, "engine": gen.inference.engine,
        **summary(hist, ("generate_s", "tools_s", "grade_s", "rollout_wall_s", "train_s", "sync_s", "wait_s",
                         "save_weights_s", "publish_s", "step_s")),
        "gen_tokens_per_s": gen_tok / gen_s if gen_s else None, "max_staleness": cfg.max_staleness,
        "dropped_stale_rollouts": counters["dropped_stale_rollouts"],
        "dropped_stale_batches": counters["dropped_stale_batches"],
        "weight_sync_seconds": stats([w["seconds"] for w in gen.syncs]), "weight_syncs": gen.syncs,
        "published": [{k2: p[k2] for k2 in ("version", "kind", "bytes", "fraction", "seconds")} for p in publish_info],
        "delta_fraction": stats([p["fraction"] for p in publish_info if p["kind"] == "delta"]),
        "publish_seconds": stats([p["seconds"] for p in publish_info]),
        **end, "config": cfg.to_dict(),
    }


def main(argv: list[str] | None = None) -> dict:
    return entry_point(RLConfig, "GRPO on agent episodes", run, argv)

if __name__ == "__main__":
    main()
