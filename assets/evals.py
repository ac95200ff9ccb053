"""evaluated_model: every candidate on the held-out tasks, the promotion gate, and the registry.

Each candidate (base model, mid-trained, SFT and RL checkpoints) goes through the same
harness, sandbox and grader as RL, on the cluster resource (``python -m composer_dag.evals.run``).
The blocking check ``rl_not_worse_than_sft`` (RL against its parent) decides whether
``promoted_model`` may materialize.
"""

import datetime
import json
import os

import dagster as dg

from assets.common import GPU_STAGE, blocking_checks, latest_metadata, latest_uri, local_copy, plot_md, run_stage, record_provenance
from composer_dag.evals.contamination import contamination_report
from composer_dag.evals.evaluate import EvalConfig, summary_record
from composer_dag.evals.gate import decide
from composer_dag.evals.run import EvalRunConfig
from composer_dag.traces import registry
from resources import ArtifactStorage, CatalogResource
from resources.cluster import ClusterResource
from resources.dagster_config import dagster_config

CANDIDATES = ("base_model", "midtrained_checkpoint", "sft_checkpoint", "rl_checkpoint")
LABELS = ("base", "mid-trained", "SFT", "RL")

EvalParams = dagster_config(EvalConfig, module=__name__)


def _contamination(context, storage) -> list:
    """Contamination guard: the latest eval tasks against the latest training shards."""
    shard_base = latest_uri(context.instance, "deduped_shards")
    shard_urls = [u for u in storage.find(shard_base) if u.rsplit("/", 1)[-1].startswith("shard-")]

    def shard_texts():
        for u in shard_urls:
            t = storage.read_parquet(u, columns=["path", "content"])
            yield from zip(t.column("path").to_pylist(), t.column("content").to_pylist())

    with local_copy(storage, latest_uri(context.instance, "eval_tasks")) as tasks_dir:
        return contamination_report(shard_texts(), tasks_dir)


def _by_source_table(summaries: dict, names: list[str], sources: list[str], by_source) -> str:
    """pass@1 per task source (rows) and checkpoint (columns), as markdown."""
    return "\n".join(["| source | tasks | " + " | ".join(LABELS) + " |", "|---|---:|" + "---:|" * len(names)] + [
        f"| {src} | {max(((summaries[k].get('by_source') or {}).get(src) or {}).get('tasks') or 0 for k in names)} | "
        + " | ".join("–" if by_source(k, src) is None else f"{by_source(k, src):.3f}" for k in names) + " |"
        for src in sources])


@dg.asset(
    deps=[*CANDIDATES, "eval_tasks", "token_shards", "deduped_shards"],
    group_name="eval",
    kinds={"python", "parquet", "duckdb"},
    **GPU_STAGE,
    check_specs=blocking_checks("evaluated_model", {
        "rl_not_worse_than_sft": "The promotion gate: every capability row of RL against its parent, the SFT checkpoint "
                                 "(pass@1, each task source's pass@1, HumanEval, perplexity, cheat flags), and its "
                                 "perplexity against the mid-trained checkpoint, each within its tolerance in GateConfig.",
        "eval_tasks_not_in_training_shards": "No eval task's text or solution shares a long n-gram with the training shards."}),
)
def evaluated_model(context: dg.AssetExecutionContext, config: EvalParams, artifacts: ArtifactStorage,
                    catalog: CatalogResource, cluster: ClusterResource):
    """Base, mid-trained, SFT and RL checkpoints on the held-out tasks: pass@k by source,
    HumanEval pass@1, perplexity, cost; the comparison table and the gate (RL against SFT)."""
    record_provenance(context)
    storage = artifacts.get()
    # one job, one inference engine: each next checkpoint's weights load into the running engine
    cfg, job = run_stage(
        context, storage, cluster, "eval", EvalRunConfig, config, [*CANDIDATES, "eval_tasks", "token_shards"],
        lambda d, wd: {"checkpoints": {k: d[k] for k in CANDIDATES}, "tasks_dir": d["eval_tasks"],
                       "val_dir": d["token_shards"], "out_dir": os.path.join(wd, "out")},
        "composer_dag.evals.run", launcher="python", outputs={"evaluated_model": [[k, k] for k in CANDIDATES]},
        # one result per candidate, kept across runs: only a candidate whose digest changed is
        # evaluated again (the gate's settings are applied here, not in the job)
        state_inputs=["eval_tasks", "token_shards"], state_exclude=("gate",))
    summaries = job["summary"]
    url, job_digest = job["outputs"]["evaluated_model"]["url"], job["outputs"]["evaluated_model"]["digest"]

    promoted = latest_metadata(context.instance, "promoted_model")
    promoted_summary = json.loads(promoted["summary_json"]) if promoted and promoted.get("summary_json") else None
    gate = decide(summaries, "rl_checkpoint", "sft_checkpoint", cfg.gate,
                  others={"last promoted": promoted_summary} if promoted_summary else None)
    report = gate["report"]

    # the job's sealed results, plus the gate's report; sealed again with both
    storage.write_bytes(f"{url}/report.md", report.encode())
    storage.write_bytes(f"{url}/summaries.json", json.dumps(summaries, indent=2, default=str).encode())
    digest = storage.write_manifest(url)
    result_urls = [f"{url}/{k}/results.parquet" for k in CANDIDATES if storage.exists(f"{url}/{k}/results.parquet")]
    if result_urls:
        # appended per run: history and comparisons across checkpoints are one SQL query
        catalog.get().replace_rows("eval_results", result_urls, where={"run_id": context.run.run_id}, exclude=(),
                                   extra={"run_id": context.run.run_id})
    catalog.get().insert_records("eval_summaries", [
        {**summary_record(k, s), "run_id": context.run.run_id} for k, s in summaries.items()])

    leaks = _contamination(context, storage)
    names = list(CANDIDATES)
    p1 = [summaries[k].get("pass@1") or 0.0 for k in names]
    he = [(summaries[k].get("humaneval") or {}).get("pass@1") or 0.0 for k in names]
    sources = sorted({src for k in names for src in summaries[k].get("by_source") or {}})
    by_source = lambda k, src: ((summaries[k].get("by_source") or {}).get(src) or {}).get("pass@1")
    source_md = _by_source_table(summaries, names, sources, by_source)
    yield dg.MaterializeResult(
        metadata={
            "dagster/uri": url,
            "manifest_digest": digest,
            "job_manifest_digest": job_digest,
            "comparison": dg.MetadataValue.md(report),
            "pass_at_1": plot_md([("agent pass@1", list(range(len(names))), p1),
                                  ("HumanEval pass@1", list(range(len(names))), he)]
                                 + [(f"{src} pass@1", list(range(len(names))), [by_source(k, src) or 0.0 for k in names])
                                    for src in sources],
                                 ", ".join(f"{i} {label}" for i, label in enumerate(LABELS)), "pass@1", "pass@1 by checkpoint"),
            "pass_at_1_by_source": dg.MetadataValue.md(source_md),
            **{f"{k}.pass@1.{src}": float(by_source(k, src) or 0.0) for k in names for src in sources},
            **{f"{k}.pass@1": float(summaries[k].get("pass@1") or 0.0) for k in names},
            **{f"{k}.harness_pass@1.{h}": float(b.get("pass@1") or 0.0) for k in names
               for h, b in (summaries[k].get("by_harness") or {}).items()},
            **{f"{k}.cost": dg.MetadataValue.json(summaries[k].get("cost") or {}) for k in names},
            "gate_passed": gate["passed"],
            "gate_failed_rows": dg.MetadataValue.json(gate["failed_rows"]),
            **{f"{k}.val_ppl": float((summaries[k].get("perplexity") or {}).get("val_ppl") or float("nan")) for k in names},
            "rl_gain": dg.MetadataValue.json(gate["measured_gain"]),
            "summary_json": json.dumps(summaries["rl_checkpoint"], default=str),
            "rl_checkpoint_uri": latest_uri(context.instance, "rl_checkpoint"),
        }
    )
    yield dg.AssetCheckResult(check_name="rl_not_worse_than_sft", passed=gate["passed"],
                              metadata={"reasons": dg.MetadataValue.json(gate["reasons"]),
                                        "failed_rows": dg.MetadataValue.json(gate["failed_rows"]),
                                        "pass@1_gain": gate["gain"]})
    yield dg.AssetCheckResult(check_name="eval_tasks_not_in_training_shards", passed=not leaks,
                              metadata={"leaks": len(leaks), "examples": dg.MetadataValue.json(leaks[:10])})


@dg.asset(deps=[evaluated_model], group_name="eval", kinds={"json"},
          freshness_policy=dg.FreshnessPolicy.time_window(warn_window=datetime.timedelta(hours=10),
                                                          fail_window=datetime.timedelta(hours=24)))
def promoted_model(context: dg.AssetExecutionContext, artifacts: ArtifactStorage, catalog: CatalogResource):
    """A small registry entry pointing at the RL checkpoint that passed the gate, with its version
    (the name sessions served by it carry). The UI warns when none was promoted for two cycles
    (10 hours at the default 5-hour cadence)."""
    record_provenance(context)
    storage = artifacts.get()
    meta = latest_metadata(context.instance, "evaluated_model") or {}
    digest = (latest_metadata(context.instance, "rl_checkpoint") or {}).get("manifest_digest")
    entry = {
        "version": registry.new_version(str(digest or "")),
        "checkpoint_uri": meta.get("rl_checkpoint_uri"),
        "checkpoint_digest": digest,
        "evaluation_uri": meta.get("dagster/uri"),
        "pass@1": meta.get("rl_checkpoint.pass@1"),
        "run_id": context.run.run_id,
    }
    registry.promote(storage, entry, context.run.run_id)
    catalog.get().insert_records("checkpoint_inputs", [{
        "checkpoint": "promoted_model", "run_id": context.run.run_id, "uri": storage.url("registry", "promoted.json"),
        "input": "rl_checkpoint", "input_uri": str(entry["checkpoint_uri"])}],
        where={"checkpoint": "promoted_model", "run_id": context.run.run_id})
    return dg.MaterializeResult(metadata={
        "dagster/uri": storage.url("registry", "promoted.json"),
        "version": entry["version"],
        "checkpoint_uri": str(entry["checkpoint_uri"]),
        "pass@1": float(entry["pass@1"] or 0.0),
        "summary_json": meta.get("summary_json", ""),
    })


def terminal_summary(meta: dict) -> str:
    """A few lines for the end of ``make run``, from ``evaluated_model``'s metadata: pass@1 by
    task source and validation perplexity per checkpoint, the gate's verdict, where the report is.
    The full summaries stay in the artifacts and the event log."""
    sources = sorted({k.split(".pass@1.", 1)[1] for k in meta if ".pass@1." in k})
    harnesses = sorted({k.split(".harness_pass@1.", 1)[1] for k in meta if ".harness_pass@1." in k})
    cell = lambda key: f"{float(meta[key]):.3f}" if key in meta else "–"
    head = ["checkpoint", "pass@1", *[f"pass@1 {s}" for s in sources], *[f"harness {h}" for h in harnesses], "val ppl"]
    rows = [[label, f"{float(meta.get(f'{k}.pass@1', 0.0)):.3f}",
             *[f"{float(meta.get(f'{k}.pass@1.{s}', 0.0)):.3f}" for s in sources],
             *[cell(f"{k}.harness_pass@1.{h}") for h in harnesses],
             f"{float(meta.get(f'{k}.val_ppl', float('nan'))):,.1f}"] for k, label in zip(CANDIDATES, LABELS)]
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    fmt = lambda r: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    failed = meta.get("gate_failed_rows") or []
    gain = meta.get("rl_gain") or {}
    lines = [fmt(head), *map(fmt, rows), ""]
    if gain.get("gain") is not None:
        lines.append(f"RL vs SFT on {gain['source']}: {gain['gain']:+.3f} pass@1 "
                     f"({gain['sigmas']:g} se over {gain['samples'][0]} samples: {gain['sigmas'] * gain['se']:.3f}, "
                     f"{'measurable' if gain['measurable'] else 'within the noise'})")
    lines.append("gate: " + ("passed, RL promoted" if meta.get("gate_passed") else
                             "FAILED on " + ", ".join(failed) + ": RL not promoted"))
    uri = str(meta.get("dagster/uri", ""))
    lines.append(f"report: {uri.removeprefix('file://')}/report.md")
    lines.append("open the Dagster UI with: make dev")
    return "\n".join(lines)
