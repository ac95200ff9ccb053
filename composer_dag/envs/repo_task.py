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
    sites not in any file the policy can read), each run alone against the reference; those the
    reference fails are kept (``checks.canaries``: the file it replaces, the tests it fails)."""
    from .canaries import _visible_text, make_canaries
    from .checks import outcomes, run_checks
    from .task_dir import apply_reference

    task_dir = Path(task_dir)
    task = json.loads((task_dir / "task.json").read_text())
    f2p = task["tests"]["FAIL_TO_PASS"]
    files = sorted({t.split("::", 1)[0] for t in f2p})
    visible = _visible_text(task_dir / "repo")
    kept: dict = {}
    (task_dir / "canaries").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cdag-k-") as tmp:
        ref_ws = apply_reference(task_dir, Path(tmp) / "ws")
        for rel in files:
            text = (task_dir / "hidden_tests" / rel).read_text()
            for src in make_canaries(text, seed=f"{task['id']}:{rel}", visible=visible, n=candidates_per_file):
                if len(kept) >= keep:
                    break
                name = check_name(src.encode()) + ".py"
                path = task_dir / "canaries" / name
                path.write_text(src)
                task.setdefault("checks", {}).setdefault("canaries", {})[name] = {"replaces": rel, "failing": []}
                (task_dir / "task.json").write_text(json.dumps(task, indent=2, sort_keys=True))
                res, det = run_checks(task_dir, ref_ws, [path])
                failing = sorted(k for k, v in outcomes(res).items() if v in ("failed", "error"))
                if det["valid"] and not det["tamper"] and failing:
                    task["checks"]["canaries"][name]["failing"] = failing
                    kept[name] = task["checks"]["canaries"][name]
                else:
                    del task["checks"]["canaries"][name]
                    path.unlink()
    if kept:
        task["checks"]["canaries"] = kept
    else:
        task.get("checks", {}).pop("canaries", None)
        shutil.rmtree(task_dir / "canaries", ignore_errors=True)
    (task_dir / "task.json").write_text(json.dumps(task, indent=2, sort_keys=True))
    return kept
