"""Writing a task run by pytest from a repository environment (mined, imported or from
history), and its canaries.

A task directory of this kind (``task_format``, ``format`` 2)::

    repo/          the environment's repository with the task's changes folded into its last
                   commit (nothing of the earlier state left in the object store)
    hidden_tests/  the recorded test tree and ``pytest.ini``: grading runs these
    layer/         the environment's site-packages, bound into the episode's ``.venv``
    reference/     the solved state's files
    canaries/      copies of a FAIL_TO_PASS file with expected values changed, which the
                   reference fails (``checks.canaries[...].replaces`` names the file)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from composer_dag.repos.fetch import pack_objects
from composer_dag.repos.layout import norm_name
from composer_dag.sandbox import share_tree
from composer_dag.tasks.taskdir import TASK_FORMAT, check_name
from composer_dag.tasks.format import TaskLimits


def _git(repo: Path, *args, env=None):
    return subprocess.run(["git", "-c", "safe.directory=*", *args], cwd=repo, capture_output=True, text=True,
                          env=env, check=True)


def write_pytest_task(task_dir: Path, env: dict, env_dir: Path, *, changes: dict[str, str | None],
                      reference: dict[str, bytes], hidden_tree: Path, f2p: list[str], p2p: list[str],
                      instructions: str, source: str, source_file: str, reference_meta: dict,
                      origin_extra: dict) -> Path:
    """Write a task run by pytest (replacing any there), staged beside it and renamed into place:
    ``repo/`` is the environment's repository with ``changes`` ({path: text, or None to delete})
    folded into its last commit, nothing of the earlier state left in the object store;
    ``hidden_tests/`` is ``hidden_tree``; ``reference/files`` is ``reference``."""
    staging = Path(tempfile.mkdtemp(prefix=f".{task_dir.name}.tmp-", dir=task_dir.parent))
    try:
        repo = staging / "repo"
        # the checkout's files hard-linked (a task's tree is never written in place), its git
        # directory copied: git appends to some of its files
        share_tree(env_dir / "repo", repo, os.geteuid(), os.getegid(), skip=frozenset({".git"}))
        if (env_dir / "repo" / ".git").exists():
            shutil.copytree(env_dir / "repo" / ".git", repo / ".git", symlinks=True)
        for rel, text in changes.items():
            if (repo / rel).exists() or (repo / rel).is_symlink():
                (repo / rel).unlink()  # never written through a link
            if text is not None:
                (repo / rel).write_text(text)
        if changes:
            head = _git(repo, "log", "-1", "--format=%an%x00%ae%x00%ad%x00%cd%x00%B", "--date=raw").stdout.split("\0")
            genv = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(repo), "GIT_CONFIG_NOSYSTEM": "1",
                    "GIT_AUTHOR_NAME": head[0], "GIT_AUTHOR_EMAIL": head[1], "GIT_AUTHOR_DATE": head[2],
                    "GIT_COMMITTER_NAME": head[0], "GIT_COMMITTER_EMAIL": head[1], "GIT_COMMITTER_DATE": head[3]}
            _git(repo, "add", "-A", env=genv)
            _git(repo, "commit", "-q", "--amend", "--no-edit", "--allow-empty", env=genv)
            # the pre-amend commit and the files it held must not be reachable or lying around
            _git(repo, "reflog", "expire", "--expire=now", "--all", env=genv)
            pack_objects(repo, genv)
        shutil.copytree(hidden_tree, staging / "hidden_tests")
        shutil.copytree(env_dir / "layer", staging / "layer", symlinks=True)
        for rel, data in reference.items():
            (staging / "reference" / "files" / rel).parent.mkdir(parents=True, exist_ok=True)
            (staging / "reference" / "files" / rel).write_bytes(data)
        task = {"format": TASK_FORMAT, "id": task_dir.name, "source": source, "source_file": source_file,
                "project": project_dir_name(env), "instructions": instructions, "limits": TaskLimits().to_dict(),
                "framework": "pytest", "tests": {"FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p},
                "reference": {"files": sorted(reference), **reference_meta},
                "origin": {"repository": env["name"], "version": env.get("version"), "source": env.get("origin") or {},
                           "commit": _git(env_dir / "repo", "rev-parse", "HEAD").stdout.strip(),
                           "env_digest": env["env_digest"], "licence": env.get("licence"), **origin_extra},
                "sandbox": {"venv": True},
                "checks": {"expected": sorted(f2p + p2p)}}
        (staging / "task.json").write_text(json.dumps(task, indent=2, sort_keys=True))
        if task_dir.exists():
            shutil.rmtree(task_dir)
        staging.rename(task_dir)
        return task_dir
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def environment_tasks(environments: dict[str, Path], out: Path, source: str) -> list[Path]:
    """The tasks of ``source`` that ``repo_environment`` wrote under each of ``environments``
    (``<dir>/tasks/<id>/``), moved to ``out/<id>``, by repository name."""
    moved = []
    for _, env_out in sorted(environments.items()):
        tasks = Path(env_out, "tasks")
        for d in sorted(tasks.iterdir()) if tasks.is_dir() else []:
            if (d / "task.json").is_file() and json.loads((d / "task.json").read_text())["source"] == source:
                shutil.move(str(d), str(out / d.name))
                moved.append(out / d.name)
    return moved


def project_dir_name(env: dict) -> str:
    """The checkout's directory name on the laptop: the distribution's name, as cloned."""
    return norm_name(env["name"])


def add_repo_canaries(task_dir: Path, candidates_per_file: int = 2, keep: int = 1) -> dict:
    """Canaries of a mined task: copies of a FAIL_TO_PASS file with expected values changed (the
    sites not in any file the policy can read), each run against the reference; those the
    reference fails are kept (``checks.canaries``: the file it replaces, the tests it fails)."""
    return verify_canaries([task_dir], 1, candidates_per_file, keep)[Path(task_dir).name]


def _shared_visible(dirs: list[Path], tasks: list[dict]) -> str:
    """The flattened text the tasks ``dirs`` (of one environment, hiding one test file) show
    between them: the first one's visible text, and what each other one shows besides (its
    changed module, the test files it does not hide)."""
    from composer_dag.grading.canaries import flat_file, visible_text

    parts = [visible_text(dirs[0] / "repo", flat=True)]
    for d, task in zip(dirs[1:], tasks[1:]):
        changed = (task.get("origin") or {}).get("file")
        if not changed:
            parts.append(visible_text(d / "repo", flat=True))
            continue
        for rel in sorted({changed} | (set(_hidden(tasks[0])) - set(_hidden(task)))):
            p = d / "repo" / rel
            if p.is_file() and not p.is_symlink():
                parts.append(flat_file(p.read_text(errors="replace")))
    return "".join(parts)


def _batches(by_env: dict[str, list], per_run: int) -> list[list]:
    """The runs of one round: ``(group, canary)`` items of one environment, up to ``per_run`` a
    run, two canaries of one file never in one run."""
    batches = []
    for items in by_env.values():
        while items:
            batch, rels = [], set()
            for item in list(items):
                if item[0][1] not in rels and len(batch) < per_run:
                    batch.append(item)
                    rels.add(item[0][1])
                    items.remove(item)
            batches.append(batch)
    return batches


def verify_canaries(task_dirs: list[Path], workers: int = 2, candidates_per_file: int = 2, keep: int = 1,
                    per_run: int = 8) -> dict[str, dict]:
    """``add_repo_canaries`` for the tasks of one environment at once (task name -> canaries kept).
    The tasks mined from one environment have the same reference tree (the repository as it
    was), and the tasks whose FAIL_TO_PASS lies in one test file hide the same file: they share
    its canaries, made once (seeded by the first task's id, and kept clear of what any of them
    shows: the first one's visible text and the files the others show besides). Candidates are run
    side by side: each run lays up to ``per_run`` canaries, each where the file it replaces lies
    (two canaries of one file never share a run), against the shared reference. A candidate is
    kept when the reference fails some of its tests; a file whose candidate is not kept has its
    next one tried in the next round. A run whose result is void or tampered with is run again one
    canary at a time. Each task takes up to ``keep`` canaries, from its files in order."""
    from composer_dag.grading.canaries import make_canaries
    from composer_dag.grading.checks import outcomes, run_checks
    from composer_dag.tasks.taskdir import apply_reference

    dirs = [Path(d) for d in task_dirs]
    tasks = {d.name: json.loads((d / "task.json").read_text()) for d in dirs}
    by_name = {d.name: d for d in dirs}
    groups, group_of = _canary_groups(dirs, tasks)

    todo = {key: make_canaries((by_name[names[0]] / "hidden_tests" / key[1]).read_text(),
                               seed=f"{tasks[names[0]]['id']}:{key[1]}",
                               visible_flat=_shared_visible([by_name[n] for n in names], [tasks[n] for n in names]),
                               n=candidates_per_file)
            for key, names in groups.items()}
    found: dict[tuple, list] = {key: [] for key in groups}  # key -> [(canary source, failing tests)]
    with tempfile.TemporaryDirectory(prefix="cdag-k-") as tmp:
        refs: dict[str, Path] = {}  # environment digest -> the reference tree its tasks share

        def reference(key: tuple) -> Path:
            if key[0] not in refs:
                refs[key[0]] = apply_reference(by_name[groups[key][0]], Path(tmp) / f"ref-{len(refs)}")
            return refs[key[0]]

        def run(batch: list) -> list:
            """[(group, source, failing or None)] of one sandboxed run of ``batch``."""
            files = {}
            for i, (key, src) in enumerate(batch):  # a group is in one batch at a time
                files[key[1]] = Path(tmp) / f"canary-{id(batch)}-{i}.py"
                files[key[1]].write_text(src)
            res, det = run_checks(by_name[groups[batch[0][0]][0]], reference(batch[0][0]), [], placed=files, trusted=True)
            if (not det["valid"] or det["tamper"]) and len(batch) > 1:
                return [x for item in batch for x in run([item])]
            got = outcomes(res) if det["valid"] and not det["tamper"] else {}
            return [(key, src, sorted(k for k, v in got.items() if k.split("::", 1)[0] == key[1]
                                      and v in ("failed", "error")) or None) for key, src in batch]

        with ThreadPoolExecutor(max(1, workers)) as pool:
            while True:
                # one candidate per file still short of ``keep``, all against the one reference
                by_env: dict[str, list] = {}
                for key, cands in todo.items():
                    if cands and len(found[key]) < keep:
                        by_env.setdefault(key[0], []).append((key, cands.pop(0)))
                if not by_env:
                    break
                for items in by_env.values():  # made before the threads share them
                    reference(items[0][0])
                for results in pool.map(run, _batches(by_env, per_run)):
                    for key, src, failing in results:
                        if failing:
                            found[key].append((src, failing))
    return _record_canaries(dirs, tasks, {name: found[key] for name, key in group_of.items()}, keep)


def _hidden(task: dict) -> list[str]:
    """The test files holding a repository task's FAIL_TO_PASS tests."""
    return sorted({t.split("::", 1)[0] for t in task["tests"]["FAIL_TO_PASS"]})


def _canary_groups(dirs: list[Path], tasks: dict[str, dict]) -> tuple[dict[tuple, list[str]], dict[tuple, tuple]]:
    """(groups, group_of): (environment, file, digest of its hidden source) -> the tasks that
    hide it, in order; (task name, file) -> its group."""
    groups: dict[tuple, list[str]] = {}
    group_of: dict[tuple, tuple] = {}
    for d in dirs:
        env_key = str((tasks[d.name].get("origin") or {}).get("env_digest") or d.name)
        for rel in _hidden(tasks[d.name]):
            text = (d / "hidden_tests" / rel).read_bytes()
            group_of[(d.name, rel)] = key = (env_key, rel, hashlib.sha256(text).hexdigest())
            groups.setdefault(key, []).append(d.name)
    return groups, group_of


def _record_canaries(dirs: list[Path], tasks: dict[str, dict], found: dict[tuple, list], keep: int) -> dict[str, dict]:
    """Each task's first ``keep`` canaries of ``found`` ((task name, file) -> [(canary source,
    failing tests)]) written to ``canaries/`` and ``task.json``; task name -> its canaries."""
    kept: dict[str, dict] = {d.name: {} for d in dirs}
    for d in dirs:
        for rel in _hidden(tasks[d.name]):
            for src, failing in found[(d.name, rel)]:
                if len(kept[d.name]) < keep:
                    kept[d.name][check_name(src.encode()) + ".py"] = (src, {"replaces": rel, "failing": failing})
    out = {}
    for d in dirs:
        task = tasks[d.name]
        shutil.rmtree(d / "canaries", ignore_errors=True)
        if kept[d.name]:
            (d / "canaries").mkdir()
            for fname, (src, _) in kept[d.name].items():
                (d / "canaries" / fname).write_text(src)
            task.setdefault("checks", {})["canaries"] = {k: v for k, (_, v) in kept[d.name].items()}
        else:
            task.get("checks", {}).pop("canaries", None)
        (d / "task.json").write_text(json.dumps(task, indent=2, sort_keys=True))
        out[d.name] = task.get("checks", {}).get("canaries", {})
    return out
