"""rl_tasks and eval_tasks: repositories a user would have, with hidden tests, for RL and evaluation."""


import json
import random
import tempfile
from pathlib import Path
from typing import Optional

import dagster as dg

from assets._common import RETRY, counts_table, latest_uri, local_copy, publish_dir
from composer_dag.envs import tasks as engine
from composer_dag.envs.grade import check_task
from resources import ArtifactStorage, CatalogResource


class TaskParams(dg.Config):
    """How many tasks to build. ``humaneval_limit`` None means all 164 problems."""

    seed: int = 0
    humaneval_limit: Optional[int] = None
    bugfix_count: int = 30
    eval_fraction: float = 0.2


@dg.multi_asset(
    specs=[
        dg.AssetSpec("rl_tasks", group_name="envs", kinds={"python", "git"},
                     description="Training tasks: task.json, repo/ (a git repository with history up to the task), hidden_tests/."),
        dg.AssetSpec("eval_tasks", group_name="envs", kinds={"python", "git"},
                     description="Held-out tasks; no task or source file shared with rl_tasks. Added to the decontamination set."),
    ],
    retry_policy=RETRY,
)
def task_sets(context: dg.AssetExecutionContext, config: TaskParams, artifacts: ArtifactStorage, catalog: CatalogResource):
    storage = artifacts.get()
    cfg = engine.TaskBuildConfig(
        seed=config.seed, humaneval_limit=config.humaneval_limit, bugfix_count=config.bugfix_count,
        eval_fraction=config.eval_fraction,
    )
    with tempfile.TemporaryDirectory(prefix="composer-tasks-") as tmp:
        context.log.info(f"building tasks: HumanEval ({config.humaneval_limit or 'all'}) + {config.bugfix_count} bug fixes")
        summary = engine.build_tasks(tmp, cfg)
        context.log.info(f"built {summary['tasks']} tasks in {summary['seconds']['total']} s")
        if not summary["split_check"]["ok"]:
            raise dg.Failure(description=f"train/eval split is not disjoint: {summary['split_check']}", allow_retries=False)
        rows = []
        for side in ("rl_tasks", "eval_tasks"):
            for d in engine.task_dirs(tmp, side):
                t = json.loads((d / "task.json").read_text())
                rows.append({"task_id": t["id"], "side": side, "source": t["source"], "source_file": t["source_file"], "run_id": context.run.run_id})
            Path(tmp, side, "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
            url = storage.url(side, context.run.run_id)
            digest = publish_dir(storage, str(Path(tmp, side)), url)
            n = summary[side]
            by_source: dict[str, int] = {}
            for r in rows:
                if r["side"] == side:
                    by_source[r["source"]] = by_source.get(r["source"], 0) + 1
            yield dg.MaterializeResult(
                asset_key=side,
                metadata={
                    "dagster/uri": url,
                    "dagster/row_count": n,
                    "manifest_digest": digest,
                    "tasks": n,
                    "by_source": counts_table(by_source, "source", "tasks"),
                    "build_seconds": dg.MetadataValue.json(summary["seconds"]),
                    "bugfix_modules": dg.MetadataValue.json(summary["bugfix_modules"]),
                },
            )
    catalog.get().insert_records("tasks", rows)


class TaskCheckParams(dg.Config):
    """Tasks re-verified by the check; 0 checks all (about 1.5 s per task on 2 cores)."""

    sample: int = 40


def _check_side(context, storage, side: str, sample: int) -> dg.AssetCheckResult:
    url = latest_uri(context.instance, side)
    with local_copy(storage, url) as path:
        dirs = sorted(p.parent for p in Path(path).glob("*/task.json"))
        chosen = dirs if sample <= 0 or sample >= len(dirs) else sorted(random.Random(0).sample(dirs, sample))
        context.log.info(f"checking {len(chosen)} of {len(dirs)} {side}")
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(check_task, chosen))
    bad = [r for r in results if not r["ok"]]
    return dg.AssetCheckResult(
        passed=not bad,
        metadata={
            "checked": len(results),
            "tasks": len(dirs),
            "failed": dg.MetadataValue.json(bad[:20]),
        },
    )


@dg.asset_check(asset="rl_tasks", blocking=True,
                description="Reference state passes the hidden tests, broken state fails them, reference raises no cheat flag.")
def rl_tasks_sound(context: dg.AssetCheckExecutionContext, config: TaskCheckParams, artifacts: ArtifactStorage):
    return _check_side(context, artifacts.get(), "rl_tasks", config.sample)


@dg.asset_check(asset="eval_tasks", blocking=True,
                description="Reference state passes the hidden tests, broken state fails them, reference raises no cheat flag.")
def eval_tasks_sound(context: dg.AssetCheckExecutionContext, config: TaskCheckParams, artifacts: ArtifactStorage):
    return _check_side(context, artifacts.get(), "eval_tasks", config.sample)


@dg.asset_check(asset="eval_tasks", blocking=True, additional_deps=["rl_tasks"],
                description="Train and eval share no task id and no source file.")
def split_disjoint(context: dg.AssetCheckExecutionContext, artifacts: ArtifactStorage):
    storage = artifacts.get()
    meta = {}
    for side in ("rl_tasks", "eval_tasks"):
        with local_copy(storage, latest_uri(context.instance, side)) as path:
            meta[side] = [json.loads(p.read_text()) for p in sorted(Path(path).glob("*/task.json"))]
    ids = [{t["id"] for t in meta[s]} for s in meta]
    srcs = [{t["source_file"] for t in meta[s]} for s in meta]
    shared_ids, shared_src = sorted(ids[0] & ids[1]), sorted(srcs[0] & srcs[1])
    return dg.AssetCheckResult(
        passed=not shared_ids and not shared_src,
        metadata={"rl_tasks": len(meta["rl_tasks"]), "eval_tasks": len(meta["eval_tasks"]),
                  "shared_ids": dg.MetadataValue.json(shared_ids), "shared_source_files": dg.MetadataValue.json(shared_src)},
    )


def eval_task_texts(context, storage) -> list[tuple[str, str]]:
    """(item, text) pairs of every held-out task, for the decontamination set. The item is the
    task's source file, so every text of the tasks built from one module counts as one item."""
    out = []
    with local_copy(storage, latest_uri(context.instance, "eval_tasks")) as path:
        for d in sorted(p.parent for p in Path(path).glob("*/task.json")):
            item = json.loads((d / "task.json").read_text()).get("source_file") or d.name
            out.extend((f"eval_tasks:{item}", text) for text in engine.task_texts(d))
    return out
