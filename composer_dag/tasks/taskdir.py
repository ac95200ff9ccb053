"""A task directory as grading reads it: ``task.json``, the hidden tests, the canaries and the
reference solution."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import stat
from pathlib import Path


TASK_FORMAT = 2  # 2: ``format``, ``framework: pytest`` trees, ``tests`` and ``origin``; 1 (no field): before


def load_task(task_dir: Path) -> dict:
    """``task.json``; a task directory written before format versions is format 1 and loads
    as it is; a newer format than this code knows is refused."""
    task = json.loads((Path(task_dir) / "task.json").read_text())
    if int(task.get("format", 1)) > TASK_FORMAT:
        raise ValueError(f"{task_dir}: task format {task['format']} is newer than this code reads ({TASK_FORMAT})")
    return task


def workspace_digest(root, skip: tuple[str, ...] = ()) -> str:
    """sha256 over everything grading can read of a workspace: each path (directories too), its
    type and mode, and a file's bytes or a link's target; symbolic links are not followed.
    ``skip``: top-level names left out (what grading makes afresh, such as a task's ``.venv``)."""
    h = hashlib.sha256()
    root = os.fspath(root)
    for base, dirs, files in os.walk(root):
        dirs.sort()
        if base == root and skip:
            dirs[:] = [d for d in dirs if d not in skip]
            files = [f for f in files if f not in skip]
        for name in [*dirs, *sorted(files)]:
            path = os.path.join(base, name)
            st = os.lstat(path)
            h.update(f"{os.path.relpath(path, root)}\0{st.st_mode}\0".encode("utf-8", "surrogateescape"))
            if stat.S_ISLNK(st.st_mode):
                h.update(os.readlink(path).encode("utf-8", "surrogateescape"))
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    while chunk := f.read(1 << 20):
                        h.update(chunk)
            h.update(b"\n")
    return h.hexdigest()


@functools.lru_cache(maxsize=1024)
def _checkout_digest(repo: str, mtimes: tuple) -> str:
    return workspace_digest(repo, skip=(".venv",))


def checkout_digest(task_dir) -> str:
    """``workspace_digest`` of a task's checkout as handed out (``repo/``; a ``.venv`` aside),
    computed once per process: a task directory is not changed once written. Except by git: a
    ``git status`` in the checkout (an operator's look) refreshes ``.git/index`` by a rename,
    which the git directory's time shows, so that time is part of the key too."""
    repo = Path(task_dir) / "repo"
    git = repo / ".git"
    return _checkout_digest(str(repo), (repo.stat().st_mtime_ns, git.stat().st_mtime_ns if git.is_dir() else 0))



def project_name(task: dict) -> str:
    return task.get("project") or "project"


def check_name(data: bytes) -> str:
    """The module name a test file gets inside the sandbox: ``test_`` and a hash of its content."""
    return "test_" + hashlib.sha256(data).hexdigest()[:12]


def hidden_files(task_dir: Path) -> list[Path]:
    """The test files a grading runs: every ``hidden_tests/*.py``, or for a repository task (a
    recorded tree run by pytest) the files holding its ``FAIL_TO_PASS`` and ``PASS_TO_PASS`` tests."""
    d = Path(task_dir) / "hidden_tests"
    task = load_task(task_dir)
    if task.get("framework") == "pytest":
        ids = (task.get("tests") or {}).get("FAIL_TO_PASS", []) + (task.get("tests") or {}).get("PASS_TO_PASS", [])
        return [d / rel for rel in sorted({i.split("::", 1)[0] for i in ids}) if (d / rel).is_file()]
    return sorted(p for p in d.glob("*.py") if p.is_file()) if d.is_dir() else []


def canary_files(task_dir: Path, task: dict | None = None) -> list[Path]:
    task = load_task(task_dir) if task is None else task
    names = sorted(((task.get("checks") or {}).get("canaries") or {}))
    return [Path(task_dir) / "canaries" / n for n in names if (Path(task_dir) / "canaries" / n).is_file()]


def reference_files(task_dir: Path) -> dict[str, bytes]:
    ref = Path(task_dir) / "reference" / "files"
    return {p.relative_to(ref).as_posix(): p.read_bytes() for p in ref.rglob("*") if p.is_file()} if ref.exists() else {}


def apply_reference(task_dir: Path, dest: Path) -> Path:
    """Materialize the task's reference state (repo + reference files) at ``dest``."""
    shutil.copytree(Path(task_dir) / "repo", dest, symlinks=True)
    for rel, data in reference_files(task_dir).items():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_bytes(data)
    return dest
