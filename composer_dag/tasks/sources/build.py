"""RL task sets: build them (every registered task source, ``tasks.registry``), split them,
check them.

The task directory format is ``tasks.format``; each source is a module of ``tasks.sources``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from pydantic import Field

from composer_dag.runtime.config import ConfigError, StageConfig
from composer_dag.grading.grade import check_task
from composer_dag.tasks.format import RepoSpec, TaskLimits, task_dirs, task_texts
from composer_dag.tasks.registry import SOURCES, BuildRequest, TaskSource
from composer_dag.tasks.sources import declared
from composer_dag.tasks.sources.stdlib_bugfix import DEFAULT_MODULES


class TaskBuildConfig(StageConfig):
    """What ``build_tasks`` builds: how many tasks of each source, from what, and the split. The
    counts' defaults are the sources' own (``tasks.registry``); a source without a field of its
    own here is counted by ``counts``."""

    seed: int = Field(0, description="picks the mutations and salts the split")
    humaneval_limit: Optional[int] = Field(SOURCES["humaneval"].count,
                                           description="the first N HumanEval problems; None: all 164, 0: none")
    bugfix_count: int = Field(SOURCES["stdlib-bugfix"].count, description="stdlib bug-fix tasks in all")
    learnable_count: int = Field(SOURCES["learnable"].count,
                                 description="tasks of the learnable family (one word each, see tasks.sources.learnable)")
    counts: dict[str, Optional[int]] = Field(
        {}, description="tasks of the sources without a count field of their own, by source name (None: all there "
                        "are, 0: none); a source not named builds its declared default")
    bugfix_modules: tuple[str, ...] = Field(DEFAULT_MODULES, description="stdlib modules to mutate, tried in order")
    max_per_module: int = Field(3, description="bug-fix tasks kept from one module")
    attempts_per_module: int = Field(8, description="mutants run against a module's tests before giving up on it")
    eval_fraction: float = Field(0.2, description="share of source files whose tasks go to eval_tasks")
    eval_fraction_of: dict[str, float] = Field(
        declared("eval_share"), description="sources split on their own: the share of the source's tasks that go to "
                                            "eval_tasks, whole source files at a time (for a source with a few "
                                            "files of many tasks each, such as a repository's, where eval_fraction "
                                            "of the files would hold out too few tasks to gate)")
    workers: int = Field(2, description="modules probed in parallel")
    limits: TaskLimits = TaskLimits()

    def count(self, source: TaskSource) -> Optional[int]:
        """How many tasks of ``source`` to build: its field's value, else ``counts``, else its default."""
        if source.count_field:
            return getattr(self, source.count_field)
        return self.counts.get(source.name, source.count)


def _side(source_file: str, salt: str) -> float:
    return int(hashlib.sha256(f"{salt}:{source_file}".encode()).hexdigest()[:12], 16) / 16 ** 12


def split_tasks(tasks: list[dict], eval_fraction: float = 0.2, salt: str = "0",
                fraction_of: dict[str, float] | None = None) -> dict[str, list[str]]:
    """Deterministic, disjoint split by source file: every task from one source lands on one side.

    ``tasks`` are task.json dicts (``id``, ``source_file``, ``source``). A source file goes to
    eval when its salted hash is below ``eval_fraction``; both sides are non-empty when there are
    at least two source files. A source named in ``fraction_of`` is split on its own by count:
    its files, in salted-hash order, go to eval until eval holds that share of the source's
    tasks (a source of a few large files, such as a repository's modules, would otherwise land
    wholly on one side), keeping a file on each side when it has two.
    """
    fraction_of = fraction_of or {}
    groups: dict[str, list[str]] = {}
    own: dict[str, dict[str, list[str]]] = {}
    for t in tasks:
        src = t.get("source")
        target = own.setdefault(src, {}) if src in fraction_of else groups
        target.setdefault(t["source_file"], []).append(t["id"])
    score = {g: _side(g, salt) for g in groups}
    ev = {g for g in groups if score[g] < eval_fraction}
    if len(groups) >= 2 and eval_fraction > 0 and not ev:
        ev = {min(groups, key=score.get)}
    if len(groups) >= 2 and ev == set(groups):
        ev.discard(max(groups, key=score.get))
    for src, files in own.items():
        want, got = fraction_of[src] * sum(map(len, files.values())), 0
        order = sorted(files, key=lambda g: _side(g, salt))
        if len(order) == 1:  # one file: by its hash, as the other sources' files
            order = order if _side(order[0], salt) < fraction_of[src] else []
        for g in order[:-1] if len(order) >= 2 else order:
            if got >= want:
                break
            ev.add(g)
            got += len(files[g])
        groups.update(files)
    split = {"rl_tasks": [], "eval_tasks": []}
    for g, ids in groups.items():
        split["eval_tasks" if g in ev else "rl_tasks"] += ids
    return {k: sorted(v) for k, v in split.items()}


def build_tasks(out_dir, config=None, environments: dict[str, Path] | None = None) -> dict:
    """Build every registered source's tasks under ``out_dir/{rl_tasks,eval_tasks}/<id>/``; return
    (and write) a summary: counts by source, the split, each source's build seconds and its own
    entries (``bugfix_modules``, ``repositories``), by the sources' names.

    ``environments``: repository name -> a directory ``repo_environment`` wrote (the
    ``repo_environments`` asset's partitions); their tasks are the sources ``repo-mined`` and
    ``swe-instances``."""
    cfg = TaskBuildConfig.load(config)
    unknown = sorted((set(cfg.counts) | set(cfg.eval_fraction_of)) - set(SOURCES))
    if unknown:
        raise ConfigError(f"invalid TaskBuildConfig: unknown task sources {unknown} (known: {sorted(SOURCES)})")
    out = Path(out_dir)
    staging = out / ".staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    t0 = time.monotonic()
    built, extra, seconds = [], {}, {}
    for source in list(SOURCES.values()):
        t = time.monotonic()
        got = source.build(BuildRequest(staging, cfg, cfg.count(source), dict(environments or {})))
        dirs, entries = got if isinstance(got, tuple) else (got, {})
        built += [(source.name, Path(d)) for d in dirs]
        extra.update(entries)
        seconds[source.name] = round(time.monotonic() - t, 2)
    tasks, unchecked = [], {}
    for name, d in built:
        t = json.loads((d / "task.json").read_text())
        if t["source"] != name:
            raise ValueError(f"task {t['id']} of the source {name!r} says its source is {t['source']!r}")
        if behavioural_check(t):
            tasks.append(t)
        else:  # no canary: an in-process forgery of the results would pay, so neither RL nor eval uses it
            unchecked.setdefault(t["source"], []).append(t["id"])
            shutil.rmtree(d)
    split = split_tasks(tasks, cfg.eval_fraction, salt=str(cfg.seed), fraction_of=cfg.eval_fraction_of)
    for side, ids in split.items():
        shutil.rmtree(out / side, ignore_errors=True)
        (out / side).mkdir(parents=True)
        for tid in ids:
            os.rename(staging / tid, out / side / tid)
    shutil.rmtree(staging, ignore_errors=True)
    summary = {
        **extra, "config": cfg.to_dict(), "tasks": len(tasks),
        "rl_tasks": len(split["rl_tasks"]), "eval_tasks": len(split["eval_tasks"]), "split": split,
        "by_source": {s: sum(t["source"] == s for t in tasks) for s in sorted({t["source"] for t in tasks})},
        "left_out_no_behavioural_check": {k: sorted(v) for k, v in sorted(unchecked.items())},
        "seconds": {**seconds, "total": round(time.monotonic() - t0, 2)},
        "split_check": check_split(out),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    return summary


def behavioural_check(task: dict) -> bool:
    """Whether a task has a behavioural check: at least one canary the reference fails
    (``checks.canaries``, recorded when the task was built)."""
    return bool((task.get("checks") or {}).get("canaries"))


def repo_environment(spec: RepoSpec, out: Path, seed: int = 0, workers: int = 2,
                     exclude_licences: tuple[str, ...] = ()) -> dict:
    """``spec`` bootstrapped (``repos.bootstrap``) and mined (``repo_mined.mine``): the tasks under
    ``out/tasks/<id>/``, the environment's report (its ``env.json``: kept tests, tests left out by
    reason, test command, digest) as ``out/env.json`` and the row returned as ``out/environment.json``:
    outcome, reason, licence, tests, tasks, the candidates rejected by reason and a sample task."""
    from composer_dag.repos.bootstrap import bootstrap
    from composer_dag.repos.config import BootstrapConfig
    from composer_dag.tasks.sources.repo_mined import mine

    out = Path(out)
    shutil.rmtree(out, ignore_errors=True)
    (out / "tasks").mkdir(parents=True)
    env_dir = out / ".env"
    b = bootstrap(spec.src, env_dir, BootstrapConfig(test_files=spec.test_files, exclude_licences=exclude_licences))
    row = {k: b.get(k) for k in ("ok", "reason", "tests_passing", "tests_total", "licence", "version", "seconds",
                                 "env_digest", "test_command")}
    row.update(name=spec.name, src=spec.src, tasks=0)
    if b.get("error"):
        row["error"] = b["error"][:300]
    if b["ok"]:
        shutil.copy(env_dir / "env.json", out / "env.json")
        row["left_out"] = json.loads((env_dir / "env.json").read_text())["left_out_counts"]
        if spec.tasks > 0:
            m = mine(env_dir, out / "tasks", max_tasks=spec.tasks, seed=seed, workers=workers)
            dirs = [out / "tasks" / t for t in m["tasks"]]
            row.update(tasks=len(dirs), mine_seconds=m["seconds"], rejected=m["rejected"],
                       sample=json.loads((dirs[0] / "task.json").read_text())["instructions"][:600] if dirs else None)
    shutil.rmtree(env_dir, ignore_errors=True)
    (out / "environment.json").write_text(json.dumps(row, indent=2, sort_keys=True))
    return row


def check_split(out_dir) -> dict:
    """Train and eval of a built set share no task id and no source file."""
    return split_overlap(task_dirs(out_dir, "rl_tasks"), task_dirs(out_dir, "eval_tasks"))


def split_overlap(rl_dirs: list[Path], eval_dirs: list[Path]) -> dict:
    """``{ok, shared_ids, shared_sources, rl_tasks, eval_tasks}`` for two lists of task directories."""
    return split_overlap_meta(*[[json.loads((Path(d) / "task.json").read_text()) for d in dirs]
                                for dirs in (rl_dirs, eval_dirs)])


def split_overlap_meta(rl_meta: list[dict], eval_meta: list[dict]) -> dict:
    """``split_overlap`` on the two sides' ``task.json`` contents."""
    meta = [rl_meta, eval_meta]
    ids = [{t["id"] for t in side} for side in meta]
    srcs = [{t["source_file"] for t in side} for side in meta]
    shared_ids, shared_src = sorted(ids[0] & ids[1]), sorted(srcs[0] & srcs[1])
    return {"ok": not shared_ids and not shared_src, "shared_ids": shared_ids, "shared_sources": shared_src,
            "rl_tasks": len(meta[0]), "eval_tasks": len(meta[1])}


class TaskCheckConfig(StageConfig):
    """How many tasks the soundness checks re-verify (a seeded sample; 0: all, about 1.5 s
    per task on 2 cores)."""

    sample: int = 20
    workers: int = 2
    seed: int = 0


def check_task_set(root, cfg: TaskCheckConfig | dict | None = None) -> dict:
    """``check_tasks`` on a seeded sample of the task directories under ``root``."""
    cfg = TaskCheckConfig.load(cfg)
    dirs = sorted(p.parent for p in Path(root).glob("*/task.json"))
    names = set(sample_task_names([d.name for d in dirs], cfg))
    return {**check_tasks([d for d in dirs if d.name in names], cfg.workers), "tasks": len(dirs)}


def sample_task_names(names: list[str], cfg: TaskCheckConfig | dict | None = None) -> list[str]:
    """The task directory names ``check_task_set`` checks: a seeded sample of ``cfg.sample``
    (all when 0 or more than there are), sorted. A caller with only the names (a listing of
    storage) downloads just these tasks."""
    cfg = TaskCheckConfig.load(cfg)
    names = sorted(names)
    if cfg.sample <= 0 or cfg.sample >= len(names):
        return names
    return sorted(random.Random(cfg.seed).sample(names, cfg.sample))


def heldout_texts(root) -> list[tuple[str, str]]:
    """``(item, text)`` of every task under ``root``, for the decontamination set. The item is
    the task's source file, so all texts of the tasks built from one module count as one item."""
    out = []
    for d in sorted(p.parent for p in Path(root).glob("*/task.json")):
        item = json.loads((d / "task.json").read_text()).get("source_file") or d.name
        out.extend((f"eval_tasks:{item}", text) for text in task_texts(d))
    return out


def check_tasks(dirs: list[Path], workers: int = 2) -> dict:
    """Run ``check_task`` on each task: reference passes, broken fails, reference not flagged."""
    with ThreadPoolExecutor(max(1, workers)) as pool:
        results = list(pool.map(check_task, dirs))
    bad = [r for r in results if not r["ok"]]
    return {"checked": len(results), "ok": not bad, "failed": bad}
