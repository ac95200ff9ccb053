"""evaluated_model: every candidate on the held-out tasks, the promotion gate, and the registry.

Each candidate (base model, mid-trained checkpoint, RL checkpoint) goes through the same
harness, sandbox and grader as RL, on the cluster resource (``python -m composer_dag.evals.run``).
The blocking check ``rl_not_worse_than_midtrained`` decides whether ``promoted_model`` may
materialize.
"""

import json
import os
import shutil
from pathlib import Path
from typing import Optional

import dagster as dg

from assets._common import copy_artifact, latest_metadata, latest_uri, plot_md, publish_dir
from assets.train import work_dir
from composer_dag.evals.contamination import contamination_report
from composer_dag.evals.gate import compare, report_markdown
from resources import ArtifactStorage, CatalogResource
from resources.cluster import ClusterResource

CANDIDATES = ("base_model", "midtrained_checkpoint", "rl_checkpoint")


class EvalParams(dg.Config):
    """Evaluation settings (every field of composer_dag.evals.evaluate.EvalConfig may be set in
    ``extra``). The gate: the RL checkpoint may not be worse than the mid-trained one on pass@1
    beyond ``noise_sigmas`` standard errors, nor raise more cheat flags."""

    samples_per_task: int = 2
    ks: list[int] = [1, 2]
    max_tasks: Optional[int] = 6
    max_turns: int = 2
    max_new_tokens: int = 96
    system_style: str = "compact"
    engine: str = "vllm"
    humaneval_max_tokens: int = 128
    noise_sigmas: float = 2.0
    max_flag_rate_increase: float = 0.0
    required_gain: float = 0.0
    extra: dict = {}


def _summary_for(context, storage, key: str, wd: str, params: EvalParams, cluster: ClusterResource, tasks_dir: str, val_dir: str):
    ckpt_dir = os.path.join(wd, key)
    if not os.path.exists(os.path.join(ckpt_dir, "manifest.json")):
        copy_artifact(storage, latest_uri(context.instance, key), ckpt_dir)
    out_dir = os.path.join(wd, "out", key)
    if os.path.exists(os.path.join(out_dir, "summary.json")):  # a retry resumes: finished candidates stay done
        return json.loads(Path(out_dir, "summary.json").read_text()), out_dir
    cfg = {
        "checkpoint_dir": ckpt_dir, "tasks_dir": tasks_dir, "out_dir": out_dir, "val_dir": val_dir,
        "samples_per_task": params.samples_per_task, "ks": params.ks, "max_tasks": params.max_tasks,
        "max_turns": params.max_turns, "max_new_tokens": params.max_new_tokens, "system_style": params.system_style,
        "engine": params.engine, "humaneval_max_tokens": params.humaneval_max_tokens, **params.extra,
    }
    path = os.path.join(wd, f"eval-{key}.json")
    Path(path).write_text(json.dumps(cfg, indent=2))
    context.log.info(f"evaluating {key}")
    summary = cluster.run(context, "composer_dag.evals.run", ["--config", path], name="composer-eval", launcher="python")
    return summary, out_dir


@dg.asset(
    deps=[*CANDIDATES, "eval_tasks", "token_shards", "deduped_shards"],
    group_name="eval",
    kinds={"python", "parquet", "duckdb"},
    pool="gpu",
    retry_policy=dg.RetryPolicy(max_retries=1, delay=5),
    check_specs=[
        dg.AssetCheckSpec("rl_not_worse_than_midtrained", asset="evaluated_model", blocking=True,
                          description="RL pass@1 within the estimator's noise of the mid-trained checkpoint or better, and no more cheat flags."),
        dg.AssetCheckSpec("eval_tasks_not_in_training_shards", asset="evaluated_model", blocking=True,
                          description="No eval task's text or solution shares a long n-gram with the training shards."),
    ],
)
def evaluated_model(context: dg.AssetExecutionContext, config: EvalParams, artifacts: ArtifactStorage,
                    catalog: CatalogResource, cluster: ClusterResource):
    """Base, mid-trained and RL checkpoints on the held-out tasks: pass@k by source, HumanEval
    pass@1, perplexity, cost; the comparison table and the gate."""
    storage = artifacts.get()
    digests = [str((latest_metadata(context.instance, k) or {}).get("manifest_digest")) for k in (*CANDIDATES, "eval_tasks", "token_shards")]
    wd = work_dir("eval", *digests, json.dumps(config.model_dump(), sort_keys=True))
    tasks_dir, val_dir = os.path.join(wd, "eval_tasks"), os.path.join(wd, "token_shards")
    for d, key in ((tasks_dir, "eval_tasks"), (val_dir, "token_shards")):
        if not os.path.exists(os.path.join(d, "manifest.json")):
            copy_artifact(storage, latest_uri(context.instance, key), d)

    summaries, outs = {}, {}
    for key in CANDIDATES:
        summaries[key], outs[key] = _summary_for(context, storage, key, wd, config, cluster, tasks_dir, val_dir)

    promoted = latest_metadata(context.instance, "promoted_model")
    promoted_summary = json.loads(promoted["summary_json"]) if promoted and promoted.get("summary_json") else None
    gate_kw = {"noise_sigmas": config.noise_sigmas, "max_flag_rate_increase": config.max_flag_rate_increase}
    comparisons = [compare(summaries["rl_checkpoint"], summaries["midtrained_checkpoint"], **gate_kw,
                           candidate_name="rl_checkpoint", baseline_name="midtrained_checkpoint (parent)")]
    comparisons.append(compare(summaries["rl_checkpoint"], summaries["base_model"], **gate_kw,
                               candidate_name="rl_checkpoint", baseline_name="base_model"))
    if promoted_summary:
        comparisons.append(compare(summaries["rl_checkpoint"], promoted_summary, **gate_kw,
                                   candidate_name="rl_checkpoint", baseline_name="last promoted"))
    gate = comparisons[0]
    gain = (summaries["rl_checkpoint"].get("pass@1") or 0.0) - (summaries["midtrained_checkpoint"].get("pass@1") or 0.0)
    gate_passed = gate["passed"] and gain >= config.required_gain
    reasons = gate["reasons"] + ([] if gain >= config.required_gain else [f"pass@1 gain {gain:+.4f} below the required {config.required_gain:+.4f}"])
    report = "# Evaluation report\n\n" + report_markdown(comparisons) + "\n## Gate\n\n" + (
        "passed" if gate_passed else "failed: " + "; ".join(reasons)) + "\n"

    url = storage.url("evaluated_model", context.run.run_id)
    staging = os.path.join(wd, "publish")
    shutil.rmtree(staging, ignore_errors=True)
    for key in CANDIDATES:
        shutil.copytree(outs[key], os.path.join(staging, key))
    Path(staging, "report.md").write_text(report)
    Path(staging, "summaries.json").write_text(json.dumps(summaries, indent=2, default=str))
    digest = publish_dir(storage, staging, url)
    result_urls = [f"{url}/{k}/results.parquet" for k in CANDIDATES if os.path.exists(os.path.join(outs[k], "results.parquet"))]
    if result_urls:
        # appended per run: history and comparisons across checkpoints are one SQL query
        catalog.get().replace_rows("eval_results", result_urls, where={"run_id": context.run.run_id}, exclude=(),
                                   extra={"run_id": context.run.run_id})

    def num(x) -> float:
        return float(x) if isinstance(x, (int, float)) else float("nan")

    catalog.get().insert_records("eval_summaries", [
        {"checkpoint": k, "checkpoint_digest": str(s.get("checkpoint_digest")), "pass_at_1": num(s.get("pass@1")),
         "flag_rate": num(s.get("flag_rate")), "humaneval_pass_at_1": num((s.get("humaneval") or {}).get("pass@1")),
         "val_ppl": num((s.get("perplexity") or {}).get("val_ppl")), "run_id": context.run.run_id}
        for k, s in summaries.items()])

    # Contamination guard: the eval tasks against the training shards.
    shard_base = latest_uri(context.instance, "deduped_shards")
    shard_urls = [u for u in storage.find(shard_base) if u.rsplit("/", 1)[-1].startswith("shard-")]

    def shard_texts():
        for u in shard_urls:
            t = storage.read_parquet(u, columns=["path", "content"])
            yield from zip(t.column("path").to_pylist(), t.column("content").to_pylist())

    leaks = contamination_report(shard_texts(), tasks_dir)

    names = list(CANDIDATES)
    p1 = [summaries[k].get("pass@1") or 0.0 for k in names]
    he = [(summaries[k].get("humaneval") or {}).get("pass@1") or 0.0 for k in names]
    yield dg.MaterializeResult(
        metadata={
            "dagster/uri": url,
            "manifest_digest": digest,
            "comparison": dg.MetadataValue.md(report),
            "pass_at_1": plot_md([("agent pass@1", list(range(3)), p1), ("HumanEval pass@1", list(range(3)), he)],
                                 "0 base, 1 mid-trained, 2 RL", "pass@1", "pass@1 by checkpoint"),
            **{f"{k}.pass@1": float(summaries[k].get("pass@1") or 0.0) for k in names},
            **{f"{k}.cost": dg.MetadataValue.json(summaries[k].get("cost") or {}) for k in names},
            "gate_passed": gate_passed,
            "summary_json": json.dumps(summaries["rl_checkpoint"], default=str),
            "rl_checkpoint_uri": latest_uri(context.instance, "rl_checkpoint"),
        }
    )
    yield dg.AssetCheckResult(check_name="rl_not_worse_than_midtrained", passed=gate_passed,
                              metadata={"reasons": dg.MetadataValue.json(reasons), "pass@1_gain": gain})
    yield dg.AssetCheckResult(check_name="eval_tasks_not_in_training_shards", passed=not leaks,
                              metadata={"leaks": len(leaks), "examples": dg.MetadataValue.json(leaks[:10])})


@dg.asset(deps=[evaluated_model], group_name="eval", kinds={"json"})
def promoted_model(context: dg.AssetExecutionContext, artifacts: ArtifactStorage):
    """A small registry entry pointing at the RL checkpoint that passed the gate."""
    storage = artifacts.get()
    meta = latest_metadata(context.instance, "evaluated_model") or {}
    entry = {
        "checkpoint_uri": meta.get("rl_checkpoint_uri"),
        "checkpoint_digest": (latest_metadata(context.instance, "rl_checkpoint") or {}).get("manifest_digest"),
        "evaluation_uri": meta.get("dagster/uri"),
        "pass@1": meta.get("rl_checkpoint.pass@1"),
        "run_id": context.run.run_id,
    }
    storage.write_json(storage.url("registry", "promoted.json"), entry)
    storage.write_json(storage.url("registry", "history", f"{context.run.run_id}.json"), entry)
    return dg.MaterializeResult(metadata={
        "dagster/uri": storage.url("registry", "promoted.json"),
        "checkpoint_uri": str(entry["checkpoint_uri"]),
        "pass@1": float(entry["pass@1"] or 0.0),
        "summary_json": meta.get("summary_json", ""),
    })
