"""RL: vLLM rollouts in the sandboxes, GRPO updates, weight sync -> rl_rollouts + rl_checkpoint.

One RL run is one job on the cluster resource (``python -m composer_dag.rl.run``); rank 0's
summary comes back through Pipes and becomes the two materializations.
"""

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import dagster as dg

from assets._common import copy_artifact, latest_metadata, latest_uri, plot_md, publish_dir
from assets.train import midtrained_checkpoint, work_dir
from resources import ArtifactStorage, CatalogResource
from resources.cluster import ClusterResource


class RLParams(dg.Config):
    """GRPO settings (see composer_dag.rl.run.RLConfig for every field). ``environment``:
    ``tasks`` (the rl_tasks asset) or ``learnable`` (the small task family a tiny model can
    learn on CPU within minutes, with a short tool-syntax warm-up: the demo of learning)."""

    environment: str = "tasks"
    steps: int = 2
    tasks_per_step: int = 2
    group_size: int = 4
    max_turns: int = 2
    max_new_tokens: int = 96
    max_context: int = 2048
    temperature: float = 1.0
    lr: float = 1e-5
    kl_coef: float = 0.0
    max_staleness: int = 1
    async_generation: bool = True
    engine: str = "vllm"
    full_every: int = 5
    system_style: str = "compact"
    seed: int = 0
    max_flag_rate: float = 0.5


LEARNABLE_RUN = {"steps": 16, "tasks_per_step": 2, "group_size": 8, "max_turns": 2, "max_new_tokens": 40,
                 "max_context": 512, "lr": 1e-3, "micro_batch": 16, "system_style": "compact", "engine": "hf",
                 "torch_threads": 1, "workers": 2, "async_generation": False}
"""The settings under which the learnable family's reward rises (tests/test_rl_learn.py)."""

_RUN_FIELDS = ("steps", "tasks_per_step", "group_size", "max_turns", "max_new_tokens", "max_context", "temperature",
               "lr", "kl_coef", "max_staleness", "async_generation", "engine", "full_every", "system_style", "seed")


@dg.multi_asset(
    specs=[
        dg.AssetSpec("rl_rollouts", group_name="rl", kinds={"parquet", "duckdb"},
                     deps=[midtrained_checkpoint, "rl_tasks"],
                     description="Every rollout of the RL run: turns, token ids, sampling logprobs, reward, flags, timings."),
        dg.AssetSpec("rl_checkpoint", group_name="rl", kinds={"pytorch", "deepspeed"},
                     deps=[midtrained_checkpoint, "rl_tasks"],
                     description="The policy after GRPO: Hugging Face directory + trainer state."),
    ],
    pool="gpu",
    retry_policy=dg.RetryPolicy(max_retries=1, delay=5),
    check_specs=[
        dg.AssetCheckSpec("every_rollout_has_reward", asset="rl_rollouts", blocking=True),
        dg.AssetCheckSpec("cheat_flag_rate_below_threshold", asset="rl_rollouts", blocking=True),
        dg.AssetCheckSpec("staleness_within_bound", asset="rl_rollouts", blocking=True),
        dg.AssetCheckSpec("loss_has_no_nan", asset="rl_checkpoint", blocking=True),
        dg.AssetCheckSpec("published_weights_verified", asset="rl_checkpoint", blocking=True,
                          description="Weights rebuilt from the published full checkpoint + deltas equal the trainer's, bit for bit."),
    ],
)
def rl_run(context: dg.AssetExecutionContext, config: RLParams, artifacts: ArtifactStorage,
           catalog: CatalogResource, cluster: ClusterResource):
    storage = artifacts.get()
    ckpt_meta = latest_metadata(context.instance, "midtrained_checkpoint") or {}
    tasks_meta = latest_metadata(context.instance, "rl_tasks") or {}
    params = config.model_dump()
    wd = work_dir("rl", str(ckpt_meta.get("manifest_digest")), str(tasks_meta.get("manifest_digest")), json.dumps(params, sort_keys=True))
    policy_dir, tasks_dir, out_dir = (os.path.join(wd, d) for d in ("policy", "tasks", "run"))
    if not os.path.exists(os.path.join(policy_dir, "manifest.json")):
        copy_artifact(storage, latest_uri(context.instance, "midtrained_checkpoint"), policy_dir)
    run_cfg = {k: params[k] for k in _RUN_FIELDS}
    if config.environment == "learnable":
        from composer_dag.rl.learnable import make_learnable_setup

        context.log.info("building the learnable environment and warming up the tool-call syntax")
        if not os.path.exists(os.path.join(wd, "learnable", "policy", "config.json")):
            make_learnable_setup(os.path.join(wd, "learnable"), n_tasks=8, seed=config.seed, words=("red", "blue"))
        policy_dir, tasks_dir = os.path.join(wd, "learnable", "policy"), os.path.join(wd, "learnable", "tasks")
        run_cfg.update(LEARNABLE_RUN)
    elif config.environment == "tasks":
        if not os.path.exists(os.path.join(tasks_dir, "manifest.json")):
            copy_artifact(storage, latest_uri(context.instance, "rl_tasks"), tasks_dir)
    else:
        raise dg.Failure(description=f"environment must be 'tasks' or 'learnable', not {config.environment!r}", allow_retries=False)
    cfg = {**run_cfg, "policy_dir": policy_dir, "tasks_dir": tasks_dir, "out_dir": out_dir}
    cfg_path = os.path.join(wd, "rl.json")
    Path(cfg_path).write_text(json.dumps(cfg, indent=2))
    context.log.info(f"RL run in {wd} (resumes from its last policy checkpoint if interrupted)")
    result = cluster.run(context, "composer_dag.rl.run", ["--config", cfg_path], name="composer-rl", launcher="python")

    run_id = context.run.run_id
    rollouts_url = storage.url("rl_rollouts", run_id)
    rollout_files = sorted(Path(out_dir, "rollouts").glob("step_*.parquet"))
    for f in rollout_files:
        storage.put_file(str(f), f"{rollouts_url}/{f.name}")
    rollouts_digest = storage.write_manifest(rollouts_url)
    urls = [f"{rollouts_url}/{f.name}" for f in rollout_files]
    if urls:
        catalog.get().replace_rows(
            "rollouts", urls, exclude=("messages", "prompt_ids", "completion_ids", "loss_mask", "logprobs"),
            extra={"run_id": run_id},
        )

    ckpt_url = storage.url("rl_checkpoint", run_id)
    with tempfile.TemporaryDirectory(prefix="composer-rl-") as tmp:
        shutil.copytree(result["hf_dir"], tmp, dirs_exist_ok=True)
        state = os.path.join(out_dir, "checkpoints", result["checkpoint"], "trainer_state.json")
        if os.path.exists(state):
            shutil.copy2(state, os.path.join(tmp, "trainer_state.json"))
        for name in ("result.json", "metrics.jsonl"):
            if os.path.exists(os.path.join(out_dir, name)):
                shutil.copy2(os.path.join(out_dir, name), os.path.join(tmp, name))
        ckpt_digest = publish_dir(storage, tmp, ckpt_url)

    hist = [json.loads(x) for x in open(os.path.join(out_dir, "metrics.jsonl"))] if os.path.exists(os.path.join(out_dir, "metrics.jsonl")) else []
    steps = [h["step"] for h in hist]
    phases = ("generate_s", "grade_s", "train_s", "sync_s")
    split_md = "| step | " + " | ".join(p[:-2] for p in phases) + " | wall |\n|---|" + "---:|" * (len(phases) + 1) + "\n" + "\n".join(
        f"| {h['step']} | " + " | ".join(f"{h.get(p, 0.0):.2f}" for p in phases) + f" | {h.get('step_s', 0.0):.2f} |" for h in hist)
    rows = [r for u in urls for r in storage.read_parquet(u, columns=["reward", "flags", "staleness"]).to_pylist()]
    n = len(rows)
    flag_rate = sum(bool(r["flags"]) for r in rows) / n if n else 0.0
    yield dg.MaterializeResult(
        asset_key="rl_rollouts",
        metadata={
            "dagster/uri": rollouts_url,
            "dagster/row_count": n,
            "manifest_digest": rollouts_digest,
            "reward_curve": plot_md([("mean reward", steps, [h["reward_mean"] for h in hist]),
                                     ("pass rate", steps, [h["pass_rate"] for h in hist])], "policy version", "reward", "RL reward"),
            "reward_mean": round(sum(r["reward"] or 0.0 for r in rows) / n, 4) if n else 0.0,
            "pass_rate": round(float(result.get("pass_rate") or 0.0), 4),
            "cheat_flag_rate": round(flag_rate, 4),
            "gen_tokens_per_s": round(float(result.get("gen_tokens_per_s") or 0.0), 1),
            "step_time_split_s": dg.MetadataValue.md(split_md),
            "dropped_stale_rollouts": int(result.get("dropped_stale_rollouts") or 0),
            "environment": config.environment,
            "engine": config.engine,
        },
    )
    yield dg.MaterializeResult(
        asset_key="rl_checkpoint",
        metadata={
            "dagster/uri": ckpt_url,
            "manifest_digest": ckpt_digest,
            "policy_version": int(result["steps"]),
            "weight_sync_seconds_mean": round(float(result["weight_sync_seconds"].get("mean", 0.0)), 4),
            "delta_fraction_mean": round(float(result["delta_fraction"].get("mean", 1.0)), 4),
            "publish_seconds_mean": round(float(result["publish_seconds"].get("mean", 0.0)), 4),
            "resumed_from": str(result.get("resumed_from")),
            "work_dir": wd,
        },
    )
    yield dg.AssetCheckResult(asset_key="rl_rollouts", check_name="every_rollout_has_reward",
                              passed=n > 0 and all(r["reward"] is not None and math.isfinite(r["reward"]) for r in rows),
                              metadata={"rollouts": n})
    yield dg.AssetCheckResult(asset_key="rl_rollouts", check_name="cheat_flag_rate_below_threshold",
                              passed=flag_rate <= config.max_flag_rate,
                              metadata={"flag_rate": flag_rate, "threshold": config.max_flag_rate})
    worst = max((r["staleness"] or 0 for r in rows), default=0)
    yield dg.AssetCheckResult(asset_key="rl_rollouts", check_name="staleness_within_bound",
                              passed=worst <= config.max_staleness,
                              metadata={"max_staleness_seen": worst, "bound": config.max_staleness})
    losses = [h.get("loss") for h in hist]
    yield dg.AssetCheckResult(asset_key="rl_checkpoint", check_name="loss_has_no_nan",
                              passed=bool(losses) and all(x is not None and math.isfinite(x) for x in losses)
                              and int(result.get("nan_loss_skipped") or 0) == 0,
                              metadata={"steps": len(losses), "nan_skipped": int(result.get("nan_loss_skipped") or 0)})
    yield dg.AssetCheckResult(asset_key="rl_checkpoint", check_name="published_weights_verified",
                              passed=bool(result.get("weights_verified")))
