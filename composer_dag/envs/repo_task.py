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

import json
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .repo_env import _norm, pack_objects
from .task_dir import TASK_FORMAT, check_name
from .task_format import TaskLimits


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
        shutil.copytree(env_dir / "repo", repo, symlinks=True)
        for rel, text in changes.items():
            if text is None:
                if (repo / rel).exists():
                    (repo / rel).unlink()
            else:
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


def project_dir_name(env: dict) -> str:
    """The checkout's directory name on the laptop: the distribution's name, as cloned."""
    return _norm(env["name"])


def add_repo_canaries(task_dir: Path, candidates_per_file: int = 2, keep: int = 1) -> dict:
    """Canaries of a mined task: copies of a FAIL_TO_PASS file with expected values changed (the
    sites not in any file the policy can read), each run against the reference; those the
    reference fails are kept (``checks.canaries``: the file it replaces, the tests it fails)."""
    return verify_canaries([task_dir], 1, candidates_per_file, keep)[Path(task_dir).name]


def verify_canaries(task_dirs: list[Path], workers: int = 2, candidates_per_file: int = 2, keep: int = 1,
                    per_run: int = 8) -> dict[str, dict]:
    """``add_repo_canaries`` for the tasks of one environment at once (task name -> canaries kept).
    The tasks mined from one environment have the same reference tree (the repository as it
    was), so their candidates are run side by side: each run lays up to ``per_run`` canaries, of
    different tasks and each where the file it replaces lies (two canaries of one file never share
    a run), against one task's reference. A candidate is kept when the reference fails some of
    its tests; a task whose candidate is not kept has its next one tried in the next round. A run
    whose result is void or tampered with is run again one canary at a time."""
    from .canaries import _visible_text, make_canaries
    from .checks import outcomes, run_checks
    from .task_dir import apply_reference

    dirs = [Path(d) for d in task_dirs]
    tasks = {d.name: json.loads((d / "task.json").read_text()) for d in dirs}
    todo: dict[str, list] = {}  # task name -> [(file it replaces, canary source)] in the order tried
    for d in dirs:
        task = tasks[d.name]
        visible = _visible_text(d / "repo", flat=True)
        todo[d.name] = [(rel, src) for rel in sorted({t.split("::", 1)[0] for t in task["tests"]["FAIL_TO_PASS"]})
                        for src in make_canaries((d / "hidden_tests" / rel).read_text(), seed=f"{task['id']}:{rel}",
                                                 visible_flat=visible, n=candidates_per_file)]
    kept: dict[str, dict] = {d.name: {} for d in dirs}
    by_name = {d.name: d for d in dirs}
    with tempfile.TemporaryDirectory(prefix="cdag-k-") as tmp:
        refs: dict[str, Path] = {}  # environment digest -> the reference tree its tasks share

        def env_key(name: str) -> str:
            return str((tasks[name].get("origin") or {}).get("env_digest") or name)

        def reference(name: str) -> Path:
            key = env_key(name)
            if key not in refs:
                refs[key] = apply_reference(by_name[name], Path(tmp) / f"ref-{len(refs)}")
            return refs[key]

        def run(batch: list) -> list:
            """[(task name, rel, source, failing or None)] of one sandboxed run of ``batch``."""
            files = {}
            for name, rel, src in batch:  # a task is in one batch at a time
                files[rel] = Path(tmp) / f"{name}.py"
                files[rel].write_text(src)
            res, det = run_checks(by_name[batch[0][0]], reference(batch[0][0]), [], placed=files)
            if (not det["valid"] or det["tamper"]) and len(batch) > 1:
                return [x for item in batch for x in run([item])]
            got = outcomes(res) if det["valid"] and not det["tamper"] else {}
            return [(name, rel, src, sorted(k for k, v in got.items() if k.split("::", 1)[0] == rel
                                            and v in ("failed", "error")) or None) for name, rel, src in batch]

        with ThreadPoolExecutor(max(1, workers)) as pool:
            while True:
                # one candidate per task still short of ``keep``, all against the one reference
                groups: dict[str, list] = {}
                for name, cands in todo.items():
                    if cands and len(kept[name]) < keep:
                        rel, src = cands.pop(0)
                        groups.setdefault(env_key(name), []).append((name, rel, src))
                if not groups:
                    break
                for name in {n for g in groups.values() for n, _, _ in g}:  # made before the threads share them
                    reference(name)
                batches = []
                for items in groups.values():
                    while items:
                        batch, rels = [], set()
                        for item in list(items):
                            if item[1] not in rels and len(batch) < per_run:
                                batch.append(item)
                                rels.add(item[1])
                                items.remove(item)
                        batches.append(batch)
                for results in pool.map(run, batches):
                    for name, rel, src, failing in results:
                        if failing:
                            kept[name][check_name(src.encode()) + ".py"] = (src, {"replaces": rel, "failing": failing})
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
