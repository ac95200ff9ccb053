"""RL: vLLM rollouts in the sandboxes, GRPO updates, weight sync -> rl_rollouts + rl_checkpoint.

One RL run is one job on the cluster resource (``python -m composer_dag.rl.run``); rank 0's
summary comes back through Pipes and becomes the two materializations. With ``fleet`` settings
(and no ``fleet.urls``) the rollout servers are the cluster's services for the step
(``cluster.services``: local process groups, Slurm jobs, k8s Deployments; stopped with the step
or a cancelled run), each following the weights the job publishes on artifact storage by itself
(``weight_sync: server``, ``composer_dag.rl.fleet.serve``), and the job gets their URLs.
"""

import contextlib
import json
import os

import dagster as dg

from assets.common import GPU_STAGE, latest_uri, md_table, plot_md, run_stage, record_provenance
from assets.sft import sft_checkpoint
from assets.train import CHECKPOINT_FILES
from composer_dag.rl.fleet.config import FleetConfig
from composer_dag.rl.fleet.launch import server_services
from composer_dag.rl.report import flag_family_shares, read_rollout_rows, rl_checks, rl_summary, step_time_table
from composer_dag.rl.run import RLConfig
from resources import ArtifactStorage, CatalogResource
from resources.cluster import ClusterResource
from resources.dagster_config import dagster_config

RLParams = dagster_config(RLConfig, module=__name__)
"""GRPO settings: ``trainer`` (the update), ``orchestrator`` (the agent episodes), ``inference``
(the engine). ``environment: learnable`` runs the small task family a tiny model learns on CPU
within minutes (see ``composer_dag.rl.run.LEARNABLE_RUN``)."""


def _num(x, digits: int = 4):
    """A number as Dagster metadata (a float rounded, ``None`` as null)."""
    if x is None:
        return dg.MetadataValue.null()
    return dg.MetadataValue.int(x) if isinstance(x, int) else dg.MetadataValue.float(round(float(x), digits))


def summary_metadata(sm: dict) -> tuple[dict, dict]:
    """``rl_summary``'s dict as the metadata of rl_rollouts and of rl_checkpoint."""
    fleet = sm["mode"] == "fleet"
    names = [s["server"] for s in sm["servers"]]
    rollouts = {
        "rl_mode": sm["mode"],
        "staleness_max": _num(sm["staleness_max"]),
        "staleness_mean": _num(sm["staleness_mean"]),
        "retried_episodes": _num(sm["retried_episodes"]),
        "infra_masked_episodes": _num(sm["infra_masked_episodes"]),
        "episodes_per_step": md_table(
            ["step", "rollouts", "infra-masked", "retried", "max staleness", "policy versions"] + names,
            [[x["step"], x["rollouts"], x["infra_masked"], x["retried"], x["staleness_max"],
              ", ".join(map(str, x["policy_versions"]))] + [x["servers"].get(n, 0) for n in names]
             for x in sm["steps"]], "_no steps_"),
    }
    checkpoint = {
        "full_checkpoint_bytes": _num(sm["full_bytes"]),
        "delta_bytes_mean": _num(sm["delta_bytes_mean"], 1),
        "delta_share_mean": _num(sm["delta_share_mean"]),
        "delta_share_max": _num(sm["delta_share_max"]),
        "published_weights": md_table(["version", "kind", "bytes", "share of full"],
                                      [[p["version"], p["kind"], p["bytes"], p["fraction"]] for p in sm["published"]],
                                      "_no published versions recorded_"),
        "reload_seconds_by_version": md_table(
            ["version"] + (names or ["engine"]) + (["rebuild s", "lag s (max)", "probe diff max"] if fleet else []),
            [[x["version"]] + [x["reload_s"].get(n) for n in (names or ["engine"])]
             + ([x["rebuild_s"], x["lag_s_max"], x["probe_diff_max"]] if fleet else []) for x in sm["reloads"]],
            "_no reloads recorded_"),
    }
    if fleet:
        rollouts["rollout_servers"] = md_table(
            ["server", "url", "up at the end", "deaths", "versions served", "episodes", "retried", "infra-masked",
             "reload s (mean)", "probe diff max"],
            [[s["server"], s["url"], "yes" if s["alive"] else "no", s["deaths"],
              ", ".join(map(str, s["versions_served"])), s["episodes"], s["retried"], s["infra_masked"],
              s["reload_s_mean"], s["probe_diff_max"]] for s in sm["servers"]])
        rollouts["servers_serving_every_version"] = _num(sum(
            set(s["versions_served"]) >= {p["version"] for p in sm["published"]} for s in sm["servers"]))
    return rollouts, checkpoint


def _run_job(context: dg.AssetExecutionContext, config: RLParams, storage, cluster: ClusterResource):
    """The RL stage's job on the cluster; in the distributed mode with its rollout servers started
    as services first (stopped when the job ends). Returns the stage config and the job's result."""
    fleet = config.model_dump().get("fleet")
    with contextlib.ExitStack() as stack:
        given = {}
        if fleet and not fleet.get("urls"):  # the distributed mode: the rollout servers are services
            if config.environment != "tasks":
                raise dg.Failure(description="fleet settings need environment 'tasks': the rollout servers load "
                                             "sft_checkpoint before the RL job starts", allow_retries=False)
            weights_uri = config.weights_uri or storage.url("work", "rl-fleet", context.run.run_id, "weights")
            servers = stack.enter_context(cluster.services(context)).start_many(server_services(
                FleetConfig.load(fleet), latest_uri(context.instance, "sft_checkpoint"), weights_uri,
                config.inference.max_model_len, config.seed))
            context.log.info(f"rl: {len(servers)} rollout servers up: {', '.join(h.url for h in servers)}")
            given = {"weights_uri": weights_uri,
                     "fleet": {**fleet, "urls": [h.url for h in servers], "weight_sync": "server"}}
        cfg, job = run_stage(
            context, storage, cluster, "rl", RLConfig, config, ["sft_checkpoint", "rl_tasks"],
            lambda d, wd: {"policy_dir": d["sft_checkpoint"], "tasks_dir": d["rl_tasks"],
                           "out_dir": os.path.join(wd, "run"), **given},
            "composer_dag.rl.run", launcher="python", copy_inputs=config.environment == "tasks",
            outputs={"rl_rollouts": [["", "rollouts/step_*.parquet"]], "rl_checkpoint": CHECKPOINT_FILES})
    return cfg, job


def _family_plot(rows: list[dict]):
    """The share of each step's rollouts flagged, per cheat-flag family."""
    series = flag_family_shares(rows)
    steps = sorted({r["step"] for r in rows if r["step"] is not None})
    return plot_md(series or [("no flags", steps, [0.0] * len(steps))],
                   "step", "share of rollouts flagged", "Cheat flags by family")


@dg.multi_asset(
    specs=[
        dg.AssetSpec("rl_rollouts", group_name="rl", kinds={"parquet", "duckdb"},
                     deps=[sft_checkpoint, "rl_tasks"],
                     description="Every rollout of the RL run: turns, token ids, sampling logprobs, reward, flags, timings."),
        dg.AssetSpec("rl_checkpoint", group_name="rl", kinds={"pytorch", "deepspeed"},
                     deps=[sft_checkpoint, "rl_tasks"],
                     description="The policy after GRPO: Hugging Face directory + trainer state."),
    ],
    **GPU_STAGE,
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
    record_provenance(context)
    storage = artifacts.get()
    cfg, job = _run_job(context, config, storage, cluster)
    result = job["summary"]

    run_id = context.run.run_id
    rollouts_url, rollouts_digest = job["outputs"]["rl_rollouts"]["url"], job["outputs"]["rl_rollouts"]["digest"]
    ckpt_url, ckpt_digest = job["outputs"]["rl_checkpoint"]["url"], job["outputs"]["rl_checkpoint"]["digest"]
    catalog.get().insert_records("checkpoint_inputs", [{  # lineage for deletion requests (traces.store)
        "checkpoint": "rl_checkpoint", "run_id": run_id, "uri": ckpt_url, "input": "sft_checkpoint",
        "input_uri": latest_uri(context.instance, "sft_checkpoint")}], where={"checkpoint": "rl_checkpoint", "run_id": run_id})
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
    split_md = dg.MetadataValue.md(step_time_table(hist, bool(cfg.fleet)))
    rows = read_rollout_rows(storage, urls)
    rollouts_md, checkpoint_md = summary_metadata(rl_summary(result, rows, hist))
    n = len(rows)
    checks = rl_checks(result, rows, hist, cfg.max_flag_rate, cfg.max_staleness)
    family_md = _family_plot(rows)
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
            "cheat_flag_rate": round(checks["cheat_flag_rate_below_threshold"][1]["flag_rate"], 4),
            "cheat_flag_rate_by_family": family_md,
            "gen_tokens_per_s": round(float(result.get("gen_tokens_per_s") or 0.0), 1),
            "step_time_split_s": split_md,
            "dropped_stale_rollouts": int(result.get("dropped_stale_rollouts") or 0),
            "environment": cfg.environment,
            "engine": str(result.get("engine", "vllm servers" if cfg.fleet else None)),
            **rollouts_md,
        },
    )
    yield dg.MaterializeResult(
        asset_key="rl_checkpoint",
        metadata={
            "dagster/uri": ckpt_url,
            "manifest_digest": ckpt_digest,
            "policy_version": int(result["steps"]),
            "weight_sync_seconds_mean": round(float((result.get("weight_sync_seconds") or {}).get("mean", 0.0)), 4),
            "delta_fraction_mean": round(float((result.get("delta_fraction") or {}).get("mean", 1.0)), 4),
            "publish_seconds_mean": round(float((result.get("publish_seconds") or
                                                 (result.get("step_seconds") or {}).get("publish_s") or {}).get("mean", 0.0)), 4),
            "resumed_from": str(result.get("resumed_from")),
            **checkpoint_md,
        },
    )
    asset_of = {"every_rollout_has_reward": "rl_rollouts", "cheat_flag_rate_below_threshold": "rl_rollouts",
                "staleness_within_bound": "rl_rollouts"}
    for name, (passed, meta) in checks.items():
        yield dg.AssetCheckResult(asset_key=asset_of.get(name, "rl_checkpoint"), check_name=name, passed=passed,
                                  metadata=meta)
