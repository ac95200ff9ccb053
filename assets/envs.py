"""repo_environments: one partition per declared repository, made into an environment and mined
for tasks; rl_tasks and eval_tasks: repositories a user would have, with hidden tests, for RL and
evaluation (built here, plus every repository environment's mined tasks)."""


import json
import tempfile
from pathlib import Path

import dagster as dg

from assets.common import RETRY, counts_table, latest_metadata, latest_uri, local_copy, record_provenance
from composer_dag.tasks.sources import build as engine
from composer_dag.laptop.probes import differences_table, open_tells, sandbox_realism
from composer_dag.tasks.format import RepoEnvConfig, RepoSpec, task_dirs
from composer_dag.tasks.sources.build import TaskBuildConfig
from resources import ArtifactStorage, CatalogResource, SourceRegistry
from resources.dagster_config import dagster_config, engine_config
from resources.source_registry import SourceError

TaskParams = dagster_config(TaskBuildConfig, module=__name__)
TaskCheckParams = dagster_config(engine.TaskCheckConfig, module=__name__)
RepoEnvParams = dagster_config(RepoEnvConfig, module=__name__)

repositories_partitions = dg.DynamicPartitionsDefinition(name="repositories")


@dg.asset(
    partitions_def=repositories_partitions,
    group_name="envs",
    kinds={"python", "git"},
    retry_policy=RETRY,
    check_specs=[dg.AssetCheckSpec("bootstrapped", asset="repo_environments",
                                   description="the repository's own tests run in the sandbox, offline, and some "
                                   "pass reliably (else: the reason, such as install_failed or no_tests_found)")],
    description="One declared repository (sources.yaml: environments, or a source with environments: true) made "
    "into an environment (its tests run in the sandbox, offline; vacuous and flaky tests left out) and mined for "
    "tasks: env.json (the environment's report), environment.json (the outcome) and tasks/<id>/.",
)
def repo_environments(context: dg.AssetExecutionContext, config: RepoEnvParams, artifacts: ArtifactStorage,
                      sources: SourceRegistry):
    record_provenance(context)
    name = context.partition_key
    try:
        spec = sources.repository(name)
    except SourceError as exc:
        raise dg.Failure(description=str(exc), allow_retries=False) from None
    cfg = engine_config(RepoEnvConfig, config)
    if cfg.max_tasks is not None:
        spec = RepoSpec.load({**spec.to_dict(), "tasks": cfg.max_tasks})
    storage = artifacts.get()
    with tempfile.TemporaryDirectory(prefix="composer-repo-env-") as tmp:
        context.log.info(f"repository {name}: bootstrapping {spec.src} and mining up to {spec.tasks} tasks")
        row = engine.repo_environment(spec, Path(tmp), seed=cfg.seed, workers=cfg.workers,
                                      exclude_licences=cfg.exclude_licences)
        if row["ok"]:
            context.log.info(f"repository {name}: {row['tests_passing']} of {row['tests_total']} tests kept "
                             f"({row['seconds']} s), {row['tasks']} tasks mined ({row.get('mine_seconds')} s)")
        else:
            context.log.warning(f"repository {name}: refused: {row['reason']}: {row.get('error', '')}")
        url = storage.url("repo_environments", name, context.run.run_id)
        digest = storage.publish_dir(tmp, url)
    return dg.MaterializeResult(
        metadata={
            "dagster/uri": url, "manifest_digest": digest, "ok": bool(row["ok"]), "reason": row["reason"] or "",
            "source": spec.src, "licence": row.get("licence") or "", "version": row.get("version") or "",
            "tests_kept": row.get("tests_passing") or 0, "tests_total": row.get("tests_total") or 0,
            "tests_left_out": dg.MetadataValue.json(row.get("left_out") or {}),
            "test_command": row.get("test_command") or "", "env_digest": row.get("env_digest") or "",
            "tasks": row["tasks"], "candidates_rejected": dg.MetadataValue.json(row.get("rejected") or {}),
            "seconds": dg.MetadataValue.json({"bootstrap": row.get("seconds"), "mine": row.get("mine_seconds")}),
            **({"sample_mined_task": dg.MetadataValue.md(row["sample"])} if row.get("sample") else {}),
        },
        check_results=[dg.AssetCheckResult(
            check_name="bootstrapped", passed=bool(row["ok"]), severity=dg.AssetCheckSeverity.WARN,
            metadata={"reason": row["reason"] or "", **({"error": row["error"]} if row.get("error") else {})})],
    )


def environments_in(context, storage, sources: SourceRegistry, into: Path) -> dict[str, Path]:
    """Every declared repository's latest ``repo_environments`` materialization, downloaded
    (verified) under ``into/<name>``; one not materialized yet is a row with reason
    ``not_materialized``, so that it shows among the refused."""
    out = {}
    try:
        declared = sources.repositories()
    except SourceError as exc:
        raise dg.Failure(description=str(exc), allow_retries=False) from None
    for spec in declared:
        local = into / spec.name
        meta = latest_metadata(context.instance, "repo_environments", spec.name)
        if not meta or "dagster/uri" not in meta:
            context.log.warning(f"repository {spec.name}: no repo_environments materialization yet; materialize "
                                "that partition to mine it")
            local.mkdir(parents=True)
            (local / "environment.json").write_text(json.dumps(
                {"ok": False, "reason": "not_materialized", "name": spec.name, "src": spec.src, "tasks": 0}))
        else:
            storage.fetch_dir(str(meta["dagster/uri"]), str(local))
        out[spec.name] = local
    return out


@dg.multi_asset(
    specs=[
        dg.AssetSpec("rl_tasks", group_name="envs", kinds={"python", "git"}, deps=[repo_environments],
                     description="Training tasks: task.json, repo/ (a git repository with history up to the task), hidden_tests/."),
        dg.AssetSpec("eval_tasks", group_name="envs", kinds={"python", "git"}, deps=[repo_environments],
                     description="Held-out tasks; no task or source file shared with rl_tasks. Added to the decontamination set."),
    ],
    retry_policy=RETRY,
)
def task_sets(context: dg.AssetExecutionContext, config: TaskParams, artifacts: ArtifactStorage, catalog: CatalogResource,
              sources: SourceRegistry):
    record_provenance(context)
    storage = artifacts.get()
    cfg = engine_config(TaskBuildConfig, config)
    with tempfile.TemporaryDirectory(prefix="composer-tasks-") as tmp, \
            tempfile.TemporaryDirectory(prefix="composer-envs-") as envs_tmp:
        environments = environments_in(context, storage, sources, Path(envs_tmp))
        context.log.info(f"building tasks: HumanEval ({cfg.humaneval_limit or 'all'}) + {cfg.bugfix_count} bug fixes + "
                         f"{cfg.learnable_count} learnable + mined from {len(environments)} "
                         "repositories")
        summary = engine.build_tasks(tmp, cfg, environments=environments)
        context.log.info(f"built {summary['tasks']} tasks in {summary['seconds']['total']} s")
        repo_meta = repositories_metadata(summary.get("repositories") or {})
        for name, r in (summary.get("repositories") or {}).items():
            context.log.info(f"repository {name}: " + (f"{r.get('tasks', 0)} tasks mined from {r['tests_passing']} kept "
                                                      f"tests in {r['seconds']} + {r.get('mine_seconds')} s" if r["ok"]
                                                      else f"refused: {r['reason']}: {r.get('error', '')}"))
        if not summary["split_check"]["ok"]:
            raise dg.Failure(description=f"train/eval split is not disjoint: {summary['split_check']}", allow_retries=False)
        rows = []
        for side in ("rl_tasks", "eval_tasks"):
            side_rows = [{"task_id": t["id"], "side": side, "source": t["source"], "source_file": t["source_file"],
                          "run_id": context.run.run_id}
                         for t in (json.loads((d / "task.json").read_text()) for d in task_dirs(tmp, side))]
            rows += side_rows
            Path(tmp, side, "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
            url = storage.url(side, context.run.run_id)
            digest = storage.publish_dir(str(Path(tmp, side)), url)
            by_source: dict[str, int] = {}
            for r in side_rows:
                by_source[r["source"]] = by_source.get(r["source"], 0) + 1
            realism = {}
            if side == "rl_tasks":  # what a model sees of its machine, against a laptop's
                report = sandbox_realism()
                realism = {"realism_differences": report["count"], "realism_open_tells": len(open_tells(report)),
                           "realism_report": dg.MetadataValue.md(differences_table(report))}
                context.log.info(f"realism battery: {report['count']} of {len(report['verdicts'])} probes differ "
                                 f"from a laptop, {len(open_tells(report))} not on the allowlist")
            yield dg.MaterializeResult(
                asset_key=side,
                metadata={**realism, **repo_meta,
                    "dagster/uri": url,
                    "dagster/row_count": summary[side],
                    "manifest_digest": digest,
                    "tasks": summary[side],
                    "by_source": counts_table(by_source, "source", "tasks"),
                    "build_seconds": dg.MetadataValue.json(summary["seconds"]),
                    "bugfix_modules": dg.MetadataValue.json(summary["bugfix_modules"]),
                    # tasks with no canary (no behavioural check): used neither for RL nor for eval
                    "left_out_no_behavioural_check": sum(map(len, summary["left_out_no_behavioural_check"].values())),
                    "left_out_no_behavioural_check_by_source": dg.MetadataValue.json(
                        summary["left_out_no_behavioural_check"]),
                },
            )
    catalog.get().insert_records("tasks", rows)


def repositories_metadata(repos: dict) -> dict:
    """The mined source in the UI: a row per repository (outcome, tests, licence, tasks), the
    counts per refusal reason and per licence, and one task's problem statement."""
    if not repos:
        return {}
    rows = ["| repository | environment | tests kept / total | tests left out | licence | tasks | candidates rejected "
            "| seconds |", "|---|---|---:|---|---|---:|---|---:|"]
    reasons: dict[str, int] = {}
    licences: dict[str, int] = {}
    for name, r in sorted(repos.items()):
        licences[r.get("licence") or "unknown"] = licences.get(r.get("licence") or "unknown", 0) + 1
        if not r["ok"]:
            reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
        rows.append(f"| {name} | {'ok' if r['ok'] else 'refused: ' + str(r['reason'])} | {r.get('tests_passing') or 0} / "
                    f"{r.get('tests_total') or 0} | {json.dumps(r.get('left_out') or {})} | {r.get('licence') or ''} | "
                    f"{r.get('tasks', 0)} | "
                    f"{json.dumps(r.get('rejected') or {})} | {round((r.get('seconds') or 0) + (r.get('mine_seconds') or 0), 1)} |")
    sample = next((r["sample"] for r in repos.values() if r.get("sample")), None)
    return {"repositories": dg.MetadataValue.md("\n".join(rows)),
            "repositories_refused_by_reason": dg.MetadataValue.json(reasons),
            "repositories_by_licence": dg.MetadataValue.json(licences),
            **({"sample_mined_task": dg.MetadataValue.md(sample)} if sample else {})}


def _task_files(storage, url: str) -> dict[str, list[str]]:
    """Task name -> its files (relative to ``url``), from the side's manifest."""
    out: dict[str, list[str]] = {}
    for rel in storage.read_manifest(url)["files"]:
        if "/" in rel:
            out.setdefault(rel.split("/", 1)[0], []).append(rel)
    return {k: v for k, v in out.items() if f"{k}/task.json" in v}


def _task_meta(storage, url: str) -> list[dict]:
    """Every task's ``task.json`` of a sealed task set, verified, without its repositories."""
    return [json.loads(b) for b in storage.read_verified(url, [f"{k}/task.json" for k in sorted(_task_files(storage, url))]).values()]


def _check_side(context, storage, side: str, config) -> dg.AssetCheckResult:
    cfg = engine_config(engine.TaskCheckConfig, config)
    url = latest_uri(context.instance, side)
    files = _task_files(storage, url)
    chosen = engine.sample_task_names(list(files), cfg)
    # only the sampled tasks are read, each file verified against the manifest; on local
    # storage they are checked where they are, else from a temporary copy
    with tempfile.TemporaryDirectory(prefix="composer-check-") as tmp:
        verified = storage.read_verified(url, [r for k in chosen for r in files[k]])
        root = storage.local_path(url)
        if root is None:
            root = tmp
            for rel, data in verified.items():
                dest = Path(tmp) / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(data)
        res = {**engine.check_tasks(sorted(Path(root) / k for k in chosen), cfg.workers), "tasks": len(files)}
    context.log.info(f"checked {res['checked']} of {res['tasks']} {side}")
    return dg.AssetCheckResult(
        passed=res["ok"],
        metadata={"checked": res["checked"], "tasks": res["tasks"], "failed": dg.MetadataValue.json(res["failed"][:20])},
    )


@dg.asset_check(asset="rl_tasks", blocking=True,
                description="Reference state passes the hidden tests, broken state fails them, reference raises no cheat flag.")
def rl_tasks_sound(context: dg.AssetCheckExecutionContext, config: TaskCheckParams, artifacts: ArtifactStorage):
    return _check_side(context, artifacts.get(), "rl_tasks", config)


@dg.asset_check(asset="eval_tasks", blocking=True,
                description="Reference state passes the hidden tests, broken state fails them, reference raises no cheat flag.")
def eval_tasks_sound(context: dg.AssetCheckExecutionContext, config: TaskCheckParams, artifacts: ArtifactStorage):
    return _check_side(context, artifacts.get(), "eval_tasks", config)


@dg.asset_check(asset="eval_tasks", blocking=True, additional_deps=["rl_tasks"],
                description="Train and eval share no task id and no source file.")
def split_disjoint(context: dg.AssetCheckExecutionContext, artifacts: ArtifactStorage):
    storage = artifacts.get()
    res = engine.split_overlap_meta(_task_meta(storage, latest_uri(context.instance, "rl_tasks")),
                                    _task_meta(storage, latest_uri(context.instance, "eval_tasks")))
    return dg.AssetCheckResult(
        passed=res["ok"],
        metadata={"rl_tasks": res["rl_tasks"], "eval_tasks": res["eval_tasks"],
                  "shared_ids": dg.MetadataValue.json(res["shared_ids"]),
                  "shared_source_files": dg.MetadataValue.json(res["shared_sources"])},
    )


def eval_task_texts(context, storage) -> list[tuple[str, str]]:
    """(item, text) pairs of every held-out task, for the decontamination set."""
    with local_copy(storage, latest_uri(context.instance, "eval_tasks")) as path:
        return engine.heldout_texts(path)
