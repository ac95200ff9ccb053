"""Bootstrapping and mining as a map over repositories, the dedup map's mechanism.

``map_repos(sources, out_url, ...)`` writes a job spec (``out_url/spec.json``) and runs one
task per repository: ``bootstrap`` into a scratch directory, ``tasks_repo.mine`` from it, then
the environment and the tasks published under ``out_url/envs/<k>/`` and ``out_url/tasks/<k>/``
and the task's result under ``out_url/results/<k>.json``. The tasks run in a local process pool
by default, or through ``run_tasks(spec_url, count)`` (a Slurm job array or a k8s indexed Job:
``python -m composer_dag.tasks.sources.repo_map SPEC_URL [INDEX]``). A repository that fails, however it
fails, is a result with a reason; it never fails the others.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Callable

from composer_dag.cluster.spec import array_task_args
from composer_dag.storage import Storage, open_storage
from composer_dag.repos.bootstrap import bootstrap
from composer_dag.repos.config import BootstrapConfig

RunTasks = Callable[[str, int], None]


def run_one(storage: Storage, spec: dict, index: int) -> dict:
    """Task ``index``: bootstrap and mine one repository; its result, also written to storage."""
    t0 = time.monotonic()
    src = spec["sources"][index]
    out = spec["out"]
    result = {"index": index, "source": src, "ok": False, "reason": None, "tasks": [], "bootstrap_seconds": None,
              "mine_seconds": None}
    try:
        with tempfile.TemporaryDirectory(prefix="cdag-map-") as tmp:
            cfg = BootstrapConfig.load(spec["config"])
            summary = bootstrap(src, Path(tmp) / "env", cfg)
            result.update(bootstrap={k: summary.get(k) for k in ("ok", "reason", "tests_passing", "tests_total",
                                                                 "env_digest", "name", "version", "licence")},
                          bootstrap_seconds=summary["seconds"], reason=summary["reason"],
                          **({"error": summary["error"][:500]} if summary.get("error") else {}))
            if summary["ok"]:
                storage.put_dir(str(Path(tmp) / "env"), f"{out}/envs/{index}")
                if spec.get("mine_max", 0) > 0:
                    from composer_dag.tasks.sources.repo_mined import mine

                    t1 = time.monotonic()
                    mined = mine(Path(tmp) / "env", Path(tmp) / "tasks", max_tasks=spec["mine_max"],
                                 seed=spec.get("seed", 0))
                    result["mine_seconds"] = round(time.monotonic() - t1, 2)
                    result["mine"] = {k: v for k, v in mined.items() if k not in ("out",)}
                    result["tasks"] = mined["tasks"]
                    if mined["tasks"]:
                        storage.put_dir(str(Path(tmp) / "tasks"), f"{out}/tasks/{index}")
                    elif summary["ok"]:
                        result["reason"] = "no_sound_task"
                result["ok"] = summary["ok"] and (spec.get("mine_max", 0) == 0 or bool(result["tasks"]))
    except Exception as exc:  # noqa: BLE001 - one repository's failure is its result, never the map's
        result.update(reason="error", error=f"{type(exc).__name__}: {exc}"[:500],
                      trace=traceback.format_exc()[-1500:])
    result["seconds"] = round(time.monotonic() - t0, 2)
    storage.write_json(f"{out}/results/{index}.json", result)
    return result


def _run(root: str, spec: dict, index: int) -> dict:
    return run_one(open_storage(root), spec, index)


def map_repos(sources: list[str], out_url: str, storage: Storage, config: BootstrapConfig | dict | None = None,
              mine_max: int = 0, seed: int = 0, workers: int = 2, run_tasks: RunTasks | None = None,
              progress=lambda m: None) -> dict:
    """Every source bootstrapped (and mined, ``mine_max`` tasks each); the results in order and
    the count per reason."""
    cfg = BootstrapConfig.load(config)
    t0 = time.monotonic()
    spec = {"root": storage.root, "out": out_url, "sources": list(sources), "config": cfg.to_dict(),
            "mine_max": mine_max, "seed": seed}
    spec_url = f"{out_url}/spec.json"
    storage.write_json(spec_url, spec)
    n = len(sources)
    if run_tasks is not None and n:
        try:
            run_tasks(spec_url, n)
        except Exception as exc:  # noqa: BLE001 - some elements failed outright: their results say so or are missing
            progress(f"map: {type(exc).__name__}: {exc}")
        results = []
        for k in range(n):
            url = f"{out_url}/results/{k}.json"
            results.append(storage.read_json(url) if storage.exists(url) else
                           {"index": k, "source": sources[k], "ok": False, "reason": "error",
                            "error": "the map task left no result"})
    elif workers > 1 and n > 1:
        with ProcessPoolExecutor(min(workers, n), mp_context=get_context("spawn")) as pool:
            futures = [pool.submit(_run, storage.root, spec, k) for k in range(n)]
            results = []
            for k, f in enumerate(futures):
                try:
                    results.append(f.result())
                except Exception as exc:  # noqa: BLE001 - a worker that died
                    results.append({"index": k, "source": sources[k], "ok": False, "reason": "error",
                                    "error": f"{type(exc).__name__}: {exc}"[:500]})
                progress(f"map: {k + 1}/{n} {sources[k]}: {results[-1].get('reason') or 'ok'}")
    else:
        results = []
        for k in range(n):
            results.append(run_one(storage, spec, k))
            progress(f"map: {k + 1}/{n} {sources[k]}: {results[-1].get('reason') or 'ok'}")
    reasons: dict[str, int] = {}
    for r in results:
        if not r["ok"]:
            reasons[r["reason"] or "error"] = reasons.get(r["reason"] or "error", 0) + 1
    return {"repositories": n, "ok": sum(r["ok"] for r in results), "failed_by_reason": dict(sorted(reasons.items())),
            "tasks": sum(len(r.get("tasks") or []) for r in results), "seconds": round(time.monotonic() - t0, 2),
            "results": results, "spec": spec_url}


def main(argv: list[str] | None = None) -> int:
    """``python -m composer_dag.tasks.sources.repo_map SPEC_URL [INDEX]`` (or the index in
    ``$COMPOSER_ARRAY_INDEX``): one repository of a map."""
    got = array_task_args(sys.argv[1:] if argv is None else argv, "composer_dag.tasks.sources.repo_map")
    if got is None:
        return 2
    spec_url, index = got
    try:
        spec = open_storage(spec_url.rsplit("/", 1)[0]).read_json(spec_url)
        r = run_one(open_storage(spec["root"]), spec, index)
    except Exception as exc:  # noqa: BLE001 - one line for the job's log
        print(f"RepoMapError: repository {index} of {spec_url}: {' '.join(str(exc).split())[:500]}", file=sys.stderr)
        return 1
    print(json.dumps({k: r.get(k) for k in ("index", "source", "ok", "reason", "seconds")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
