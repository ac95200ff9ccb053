"""RL: vLLM rollouts in the sandboxes, GRPO updates, weight sync -> rl_rollouts + rl_checkpoint.

One RL run is one job on the cluster resource (``python -m composer_dag.rl.run``); rank 0's
summary comes back through Pipes and becomes the two materializations.
"""

import json
import math
import os

import dagster as dg

from assets._common import plot_md, run_stage
from assets.sft import sft_checkpoint
from assets.train import CHECKPOINT_FILES
from composer_dag.rl.run import RLConfig
from resources import ArtifactStorage, CatalogResource
from resources.cluster import ClusterResource
from resources.dagster_config import dagster_config

RLParams = dagster_config(RLConfig, module=__name__)
"""GRPO settings: ``trainer`` (the update), ``orchestrator`` (the agent episodes), ``inference``
(the engine). ``environment: learnable`` runs the small task family a tiny model learns on CPU
within minutes (see ``composer_dag.rl.run.LEARNABLE_RUN``)."""


@dg.multi_asset(
    specs=[
        dg.AssetSpec("rl_rollouts", group_name="rl", kinds={"parquet", "duckdb"},
                     deps=[sft_checkpoint, "rl_tasks"],
                     description="Every rollout of the RL run: turns, token ids, sampling logprobs, reward, flags, timings."),
        dg.AssetSpec("rl_checkpoint", group_name="rl", kinds={"pytorch", "deepspeed"},
                     deps=[sft_checkpoint, "rl_tasks"],
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
    cfg, job = run_stage(
        context, storage, cluster, "rl", RLConfig, config, ["sft_checkpoint", "rl_tasks"],
        lambda d, wd: {"policy_dir": d["sft_checkpoint"], "tasks_dir": d["rl_tasks"], "out_dir": os.path.join(wd, "run")},
        "composer_dag.rl.run", launcher="python", copy_inputs=config.environment == "tasks",
        outputs={"rl_rollouts": [["", "rollouts/step_*.parquet"]], "rl_checkpoint": CHECKPOINT_FILES})
    result = job["summary"]

    run_id = context.run.run_id
    rollouts_url, rollouts_digest = job["outputs"]["rl_rollouts"]["url"], job["outputs"]["rl_rollouts"]["digest"]
    ckpt_url, ckpt_digest = job["outputs"]["rl_checkpoint"]["url"], job["outputs"]["rl_checkpoint"]["digest"]
    urls = [u for u in storage.find(rollouts_url) if u.endswith(".parquet")]
    if urls:
        catalog.get().replace_rows(
            "rollouts", urls, exclude=("messages", "prompt_ids", "completion_ids", "loss_mask", "logprobs"),
            extra={"run_id": run_id},
        )

    metrics_url = f"{ckpt_url}/metrics.jsonl"
    hist = [json.loads(x) for x in storage.read_bytes(metrics_url).decode().splitlines() if x.strip()] \
        if storage.exists(metrics_url) else []
    steps = [h["step"] for h in hist]
    phases = ("generate_s", "grade_s", "train_s", "sync_s")
    split_md = "| step | " + " | ".join(p[:-2] for p in phases) + " | wall |\n|---|" + "---:|" * (len(phases) + 1) + "\n" + "\n".join(
        f"| {h['step']} | " + " | ".join(f"{h.get(p, 0.0):.2f}" for p in phases) + f" | {h.get('step_s', 0.0):.2f} |" for h in hist)
    rows = [r for u in urls for r in storage.read_parquet(u, columns=["reward", "flags", "staleness"]).to_pylist()]
    n = len(rows)
    flag_rate = sum(bool(r["flags"]) for r in rows) / n if n else 0.0
    try:
        fam_rows = [r for u in urls for r in storage.read_parquet(u, columns=["step", "flag_families"]).to_pylist()]
    except Exception:  # noqa: BLE001 - rollouts written before the column existed
        fam_rows = []
    fam_steps = sorted({r["step"] for r in fam_rows if r["step"] is not None})
    families = sorted({f for r in fam_rows for f in (r["flag_families"] or [])})
    per_step = {s: [r for r in fam_rows if r["step"] == s] for s in fam_steps}
    family_md = plot_md([(f, fam_steps, [sum(f in (r["flag_families"] or []) for r in per_step[s]) / len(per_step[s])
                                         for s in fam_steps]) for f in families] or [("no flags", fam_steps, [0.0] * len(fam_steps))],
                        "step", "share of rollouts flagged", "Cheat flags by family")
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
            "cheat_flag_rate_by_family": family_md,
            "gen_tokens_per_s": round(float(result.get("gen_tokens_per_s") or 0.0), 1),
            "step_time_split_s": dg.MetadataValue.md(split_md),
            "dropped_stale_rollouts": int(result.get("dropped_stale_rollouts") or 0),
            "environment": cfg.environment,
            "engine": str(result.get("engine")),
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
        },
    )
    yield dg.AssetCheckResult(asset_key="rl_rollouts", check_name="every_rollout_has_reward",
                              passed=n > 0 and all(r["reward"] is not None and math.isfinite(r["reward"]) for r in rows),
                              metadata={"rollouts": n})
    yield dg.AssetCheckResult(asset_key="rl_rollouts", check_name="cheat_flag_rate_below_threshold",
                              passed=flag_rate <= cfg.max_flag_rate,
                              metadata={"flag_rate": flag_rate, "threshold": cfg.max_flag_rate})
    worst = max((r["staleness"] or 0 for r in rows), default=0)
    yield dg.AssetCheckResult(asset_key="rl_rollouts", check_name="staleness_within_bound",
                              passed=worst <= cfg.max_staleness,
                              metadata={"max_staleness_seen": worst, "bound": cfg.max_staleness})
    losses = [h.get("loss") for h in hist]
    yield dg.AssetCheckResult(asset_key="rl_checkpoint", check_name="loss_has_no_nan",
                              passed=bool(losses) and all(x is not None and math.isfinite(x) for x in losses)
                              and int(result.get("nan_loss_skipped") or 0) == 0,
                              metadata={"steps": len(losses), "nan_skipped": int(result.get("nan_loss_skipped") or 0)})
    yield dg.AssetCheckResult(asset_key="rl_checkpoint", check_name="published_weights_verified",
                              passed=bool(result.get("weights_verified")))
