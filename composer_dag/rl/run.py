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

import json
import os
import random
import shutil
import threading
import time
from typing import Literal, Optional
from pathlib import Path

from pydantic import Field, model_validator

from ..agent import AgentConfig
from ..inference.engine import InferenceConfig
from ..pipes import Reporter, entry_point
from ..runtime.config import StageConfig
from .fleet.config import FleetConfig
from .trainer import TrainerConfig


class RLConfig(StageConfig):
    """One RL run: the orchestrator drives agent episodes on the inference engine, the trainer
    updates the policy with GRPO, new weights go back to the engine and to ``weights_uri``.
    Defaults fit the embedded default (a tiny model on CPU, a short run)."""

    policy_dir: str                 # Hugging Face checkpoint (+ tokenizer) to start from
    tasks_dir: str                  # a directory of task directories (each with task.json)
    out_dir: str
    environment: Literal["tasks", "learnable"] = Field("tasks", description="learnable: see LEARNABLE_RUN")
    task_sources: Optional[list[str]] = Field(
        ["learnable"], description="train on tasks of these sources only (None: every task); the default fits the "
                                   "tiny CPU model, which solves no HumanEval or bug-fix task yet")
    steps: int = Field(8, description="policy updates")
    tasks_per_step: int = 4
    group_size: int = Field(4, description="samples per task (a GRPO group)")
    max_staleness: int = Field(1, description="versions a batch may lag the trainer")
    async_generation: bool = Field(True, description="generate the next batch while training on this one")
    queue_size: Optional[int] = Field(None, description="batches generated ahead (default: max(1, max_staleness))")
    full_every: int = Field(5, description="published weights: a full checkpoint every N versions")
    weights_uri: Optional[str] = Field(None, description="where to publish (default out_dir/weights); s3:// works")
    publish_dtype: Optional[Literal["bfloat16", "float16", "float32"]] = Field(
        "bfloat16", description="the dtype the weights are published in (what the inference fleet runs); "
                                "None: as trained")
    save_every: int = Field(1, description="checkpoint every N updates (and at the end)")
    keep_checkpoints: int = 2
    torch_threads: Optional[int] = None
    seed: int = 0
    max_flag_rate: float = Field(0.5, description="the cheat-flag rate the rl_rollouts check allows")
    trainer: TrainerConfig = Field(
        TrainerConfig(lr=3e-4, kl_coef=0.1, warmup_steps=3),
        description="the default run's: a KL term to the starting (SFT) policy, the learning rate warmed up over "
                    "3 updates (benchmarks/RESULTS.md, 'The recipe')")
    orchestrator: AgentConfig = AgentConfig()
    inference: InferenceConfig = InferenceConfig()
    fleet: Optional[FleetConfig] = Field(None, description="distributed mode: rollout servers, orchestrator and "
                                                           "trainer as separate processes (rl/fleet/)")

    @model_validator(mode="after")
    def _fleet_checkpoints_every_version(self) -> "RLConfig":
        # A fleet trainer resumed from a checkpoint older than the newest published version would
        # publish version numbers again with other weights, under servers already serving them.
        if self.fleet is not None and self.save_every != 1:
            raise ValueError(f"save_every {self.save_every}: the distributed mode (fleet) checkpoints every "
                             "version before publishing it, so save_every must be 1")
        return self


LEARNABLE_RUN = {"steps": 16, "tasks_per_step": 2, "group_size": 8, "async_generation": False, "torch_threads": 1,
                 "trainer": {"lr": 1e-3, "micro_batch": 16, "kl_coef": 0.1, "warmup_steps": 0},
                 "orchestrator": {"max_turns": 2, "max_new_tokens": 40, "max_context": 512, "system_style": "compact",
                                  "workers": 2},
                 "inference": {"engine": "hf"}}
"""``environment: learnable``: the small task family a tiny model learns on CPU within minutes
(tests/test_rl_learn.py), with a freshly built policy warmed up on the tool-call syntax; these
settings replace the run's. The KL term to the warmed-up policy keeps this learning rate from
collapsing the policy: without it, some runs drift into repeating one token, every episode fails,
and with no group-relative signal left nothing brings them back (benchmarks/RESULTS.md, "The
learnable family's collapse")."""


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


def find_tasks(tasks_dir: str, sources: Optional[list[str]] = None) -> list[Path]:
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


def _stats(xs: list[float]) -> dict:
    return {"mean": sum(xs) / len(xs), "max": max(xs), "min": min(xs), "n": len(xs)} if xs else {"n": 0}


def run(cfg: RLConfig, rep: Reporter | None = None) -> dict:
    import torch

    from ..inference import engine_from_config, fit_to_model
    from ..storage import Storage, open_storage, sweep_temporaries
    from ..runtime.checkpoint import resume_checkpoint, trim_metrics, write_json_atomic
    from ..train.tokenizer import load_tokenizer
    from ..agent import AgentLoop, rollouts_to_table
    from .grpo import group_advantages
    from .loop import Batch, RolloutSource
    from .trainer import GRPOTrainer
    from .weights import WeightPublisher, cast_state, reconstruct, state_digest

    rep = rep or Reporter()
    cfg = prepare(cfg, rep.log)
    if cfg.fleet is not None:
        from .fleet.launch import run_distributed

        return run_distributed(cfg, rep)
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    out = Path(cfg.out_dir)
    for d in ("rollouts", "checkpoints", "sync"):
        (out / d).mkdir(parents=True, exist_ok=True)
    # a run killed while writing a batch's rollouts left its temporary file; this run owns out_dir
    stale = sweep_temporaries(out / "rollouts") + sweep_temporaries(out / "sync")
    if stale:
        rep.log(f"removed {stale} temporary file(s) of writes an earlier, killed run left unfinished")
    store = Storage(str(out))
    wstore = open_storage(cfg.weights_uri) if cfg.weights_uri else store
    wprefix = wstore.root if cfg.weights_uri else store.url("weights")
    metrics_path, ckpt_root = out / "metrics.jsonl", str(out / "checkpoints")
    tasks = find_tasks(cfg.tasks_dir, cfg.task_sources)

    trainer = GRPOTrainer(cfg.policy_dir, cfg.trainer, batch_size=cfg.tasks_per_step * cfg.group_size,
                          temperature=cfg.orchestrator.temperature, seed=cfg.seed)
    counters = {"dropped_stale_rollouts": 0, "dropped_stale_batches": 0, "next_batch": 0}
    engine_dir, resumed_from = cfg.policy_dir, None
    resumed = resume_checkpoint(str(out), ckpt_root, rep.log)
    if resumed:
        st = trainer.load_checkpoint(ckpt_root, resumed)
        counters.update(st.get("counters", {}))
        engine_dir, resumed_from = os.path.join(ckpt_root, resumed, "hf"), trainer.version
        if trim_metrics(str(metrics_path), trainer.version):
            rep.log(f"dropped torn lines from {metrics_path}")
        rep.log(f"resumed from {resumed} at policy version {trainer.version}")

    # The context can't exceed what the policy's position embeddings cover.
    inference = fit_to_model(cfg.inference, cfg.policy_dir, rep.log)
    orch = cfg.orchestrator
    if orch.max_context > inference.max_model_len:
        orch = orch.replace(max_context=inference.max_model_len)
    engine = engine_from_config(inference, engine_dir, seed=cfg.seed)
    tok = load_tokenizer(cfg.policy_dir)
    agent = AgentLoop(engine, tok, orch)
    publisher = WeightPublisher(wstore, wprefix, cfg.full_every, cfg.publish_dtype)

    lock = threading.Lock()
    live = {"version": trainer.version, "dir": None}     # newest weights for the engine
    engine_state = {"version": trainer.version}
    sync_seconds: list[float] = []
    weight_syncs: list[dict] = []   # {"version", "seconds"}: each in-place reload of the engine

    def sync() -> int:
        with lock:
            v, d = live["version"], live["dir"]
        if d is not None and v > engine_state["version"]:
            sync_seconds.append(engine.load_weights(d))
            weight_syncs.append({"version": v, "seconds": round(sync_seconds[-1], 4)})
            engine_state["version"] = v
        return engine_state["version"]

    def produce(index: int, version: int) -> Batch:
        t0 = time.perf_counter()
        rng = random.Random(cfg.seed * 1_000_003 + index)
        chosen = rng.sample(tasks, cfg.tasks_per_step) if cfg.tasks_per_step <= len(tasks) else \
            [rng.choice(tasks) for _ in range(cfg.tasks_per_step)]
        jobs = [(str(t), f"b{index:05d}-{k}-{t.name}", j) for k, t in enumerate(chosen) for j in range(cfg.group_size)]
        g0, n0 = engine.stats.seconds, engine.stats.generated_tokens
        rollouts = agent.run(jobs, version, seed=cfg.seed * 7_919 + index * 131)
        return Batch(index, version, rollouts, {
            "generate": engine.stats.seconds - g0, "generated_tokens": engine.stats.generated_tokens - n0,
            "tools": sum(r["tool_seconds"] for r in rollouts), "grade": sum(r["grade_seconds"] for r in rollouts),
            "wall": time.perf_counter() - t0})

    source = RolloutSource(produce, sync, cfg.max_staleness, cfg.async_generation, cfg.queue_size,
                           start_index=counters["next_batch"], limit=cfg.steps - trainer.version)
    dropped0 = (counters["dropped_stale_rollouts"], counters["dropped_stale_batches"])
    rep.log(f"rl: {len(tasks)} tasks, {cfg.tasks_per_step}x{cfg.group_size} rollouts/step, engine {inference.engine}, "
            f"steps {trainer.version}->{cfg.steps}, async {cfg.async_generation}, max staleness {cfg.max_staleness}")
    source.start()
    publish_info: list[dict] = []
    tag = resumed
    try:
        while trainer.version < cfg.steps:
            t_step = time.perf_counter()
            batch = source.get(trainer.version)
            wait_s = time.perf_counter() - t_step
            rs, step = batch.rollouts, trainer.version
            for r, a in zip(rs, group_advantages([r["reward"] for r in rs], [r["group_id"] for r in rs],
                                                 cfg.trainer.normalize_std)):
                r["advantage"], r["step"] = a, step
            store.write_parquet(rollouts_to_table(rs), store.url("rollouts", f"step_{step:04d}.parquet"))
            ts = trainer.train_step(rs)
            version = trainer.version
            t0 = time.perf_counter()
            sd = trainer.state_dict()
            sync_dir = trainer.save_weights(str(out / "sync" / f"v{version:08d}"), sd)
            with lock:
                live["version"], live["dir"] = version, sync_dir
            save_s = time.perf_counter() - t0
            pub = publisher.publish(version, sd)
            publish_info.append(pub)
            if not cfg.async_generation:
                sync()
            for d in sorted((out / "sync").iterdir())[:-2]:
                shutil.rmtree(d, ignore_errors=True)
            counters.update(next_batch=source.next_index,
                            dropped_stale_rollouts=dropped0[0] + source.dropped_rollouts,
                            dropped_stale_batches=dropped0[1] + source.dropped_batches)
            n = len(rs)
            rec = {
                "step": version, "batch": batch.index, "policy_version": batch.version,
                "staleness": step - batch.version, "reward_mean": sum(r["reward"] for r in rs) / n,
                "pass_rate": sum(r["tests_failed"] == 0 and r["tests_passed"] > 0 for r in rs) / n,
                "flag_rate": sum(bool(r["flags"]) for r in rs) / n,
                "malformed_per_rollout": sum(r["malformed_calls"] for r in rs) / n,
                "submit_rate": sum(r["finish"] == "submit" for r in rs) / n,
                "turns_mean": sum(r["num_turns"] for r in rs) / n,
                "generated_tokens": batch.seconds["generated_tokens"],
                "gen_tokens_per_s": batch.seconds["generated_tokens"] / max(batch.seconds["generate"], 1e-9),
                "generate_s": batch.seconds["generate"], "tools_s": batch.seconds["tools"],
                "grade_s": batch.seconds["grade"], "rollout_wall_s": batch.seconds["wall"],
                "sync_s": batch.seconds.get("sync", 0.0), "wait_s": wait_s, "train_s": ts["train_seconds"],
                "save_weights_s": save_s, "publish_s": pub["seconds"], "publish_kind": pub["kind"],
                "publish_fraction": pub["fraction"], "step_s": time.perf_counter() - t_step,
                **{k: ts[k] for k in ("loss", "lr", "clip_frac", "ratio_mean", "kl", "grad_norm", "nan_skipped", "train_tokens")},
                "dropped_stale_rollouts": counters["dropped_stale_rollouts"],
            }
            with open(metrics_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            if version % cfg.save_every == 0 or version == cfg.steps:
                tag = trainer.commit_checkpoint(str(out), cfg.policy_dir, {"counters": counters}, cfg.keep_checkpoints)
            rep.progress(f"step {version:>4}/{cfg.steps} reward {rec['reward_mean']:.3f} pass {rec['pass_rate']:.2f} "
                         f"loss {rec['loss']:+.4f} gen {rec['gen_tokens_per_s']:.0f} tok/s staleness {rec['staleness']} "
                         f"dropped {rec['dropped_stale_rollouts']}")
    finally:
        source.stop()
        agent.close()

    # the published weights of the final version must equal the trainer's, bit for bit
    t0 = time.perf_counter()
    final_sd = trainer.state_dict()
    verified = (state_digest(reconstruct(wstore, wprefix, trainer.version))
                == state_digest(cast_state(final_sd, cfg.publish_dtype)))
    apply_s = time.perf_counter() - t0
    if tag is None:
        tag = f"step_{trainer.version:07d}"
        trainer.save_checkpoint(ckpt_root, tag, cfg.policy_dir, {"step": trainer.version, "counters": counters})
        write_json_atomic(str(out / "latest"), {"tag": tag, "step": trainer.version})
    hf_dir = trainer.export_hf(str(out / "hf"), cfg.policy_dir)
    engine.close()

    hist = [json.loads(x) for x in open(metrics_path)] if metrics_path.exists() else []
    gen_tok, gen_s = sum(h["generated_tokens"] for h in hist), sum(h["generate_s"] for h in hist)
    deltas = [p["fraction"] for p in publish_info if p["kind"] == "delta"]
    k = max(1, len(hist) // 4)
    result = {
        "steps": trainer.version, "resumed_from": resumed_from, "engine": inference.engine,
        "reward_curve": [[h["step"], h["reward_mean"]] for h in hist],
        "reward_first": sum(h["reward_mean"] for h in hist[:k]) / k if hist else None,
        "reward_last": sum(h["reward_mean"] for h in hist[-k:]) / k if hist else None,
        "pass_rate": sum(h["pass_rate"] for h in hist) / len(hist) if hist else None,
        "cheat_flag_rate": sum(h["flag_rate"] for h in hist) / len(hist) if hist else None,
        "malformed_per_rollout": sum(h["malformed_per_rollout"] for h in hist) / len(hist) if hist else None,
        "gen_tokens_per_s": gen_tok / gen_s if gen_s else None,
        "step_seconds": {k2: _stats([h[k2] for h in hist]) for k2 in
                         ("generate_s", "tools_s", "grade_s", "rollout_wall_s", "train_s", "sync_s", "wait_s",
                          "save_weights_s", "publish_s", "step_s")},
        "staleness": {**_stats([h["staleness"] for h in hist]),
                      "histogram": {str(s): sum(h["staleness"] == s for h in hist) for s in
                                    sorted({h["staleness"] for h in hist})}},
        "max_staleness": cfg.max_staleness,
        "dropped_stale_rollouts": counters["dropped_stale_rollouts"],
        "dropped_stale_batches": counters["dropped_stale_batches"],
        "weight_sync_seconds": _stats(sync_seconds),
        "weight_syncs": weight_syncs,
        "published": [{k2: p[k2] for k2 in ("version", "kind", "bytes", "fraction", "seconds")} for p in publish_info],
        "delta_fraction": _stats(deltas), "publish_seconds": _stats([p["seconds"] for p in publish_info]),
        "reconstruct_seconds": apply_s, "weights_verified": verified, "weights_uri": wprefix,
        "nan_loss_skipped": trainer.nan_skipped, "hf_dir": hf_dir, "checkpoint": tag, "config": cfg.to_dict(),
    }
    write_json_atomic(str(out / "result.json"), result)
    return result


def main(argv: list[str] | None = None) -> dict:
    return entry_point(RLConfig, "GRPO on agent episodes", run, argv)

if __name__ == "__main__":
    main()
