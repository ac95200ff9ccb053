"""The task directory format, and the configs of tasks from repositories.

A task is a directory::

    task.json       id, source, source_file, project, instructions, limits, reference, sandbox
    repo/           a git repository as the user has it (no trace of the solution)
    hidden_tests/   bound read-only for grading only, never inside an episode's sandbox
    canaries/       canary tests (``grading.canaries``, added by the source): hidden tests with changed expected values
    reference/      files/<path> of the solved state (checks only)
    masks/          files bound over system paths during an episode (stdlib tasks)
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
from pathlib import Path
from typing import Optional

from pydantic import Field

from composer_dag.runtime.config import ConfigError, StageConfig
from composer_dag.tasks.taskdir import TASK_FORMAT

class TaskLimits(StageConfig):
    """An episode's limits, written into each task's ``task.json``."""

    max_turns: int = Field(50, description="tool calls an episode may make")
    command_timeout: float = Field(60.0, description="seconds per shell command in the sandbox")
    test_timeout: float = Field(120.0, description="seconds for a run of the hidden tests when grading")
    observation_chars: int = Field(12_000, description="characters of a tool's output shown to the policy")


class RepoSpec(StageConfig):
    """A repository made into an environment (``repo_env.bootstrap``) and mined for tasks."""

    name: str = Field("", min_length=1, description="a short name: the tasks' source files are <name>:<path>")
    src: str = Field("", min_length=1,
                     description="a directory, git PATH[@REV], sdist file or URL, pypi:NAME==VERSION, installed:NAME")
    test_files: Optional[tuple[str, ...]] = Field(None, description="globs of the test files to keep (None: all)")
    tasks: int = Field(8, description="synthetic-bug tasks mined at most (plus its history's, if it has one)")


# networkx is installed with its tests (torch requires it): mined offline from a few algorithm modules
NETWORKX = RepoSpec(name="networkx", src="installed:networkx", tasks=20, test_files=tuple(
    f"networkx/algorithms/tests/test_{m}.py" for m in ("cycles", "dag", "simple_paths", "cluster")))


def load_repositories(path: str | None = None) -> list[RepoSpec]:
    """The repositories made into environments (``repo_environments``, one partition each),
    declared in the sources file (default ``$COMPOSER_SOURCES`` or ``sources.yaml``): its
    ``environments`` list of ``RepoSpec`` entries, then every source of kind local or git with
    ``environments: true`` (or a mapping of RepoSpec fields). ``[NETWORKX]`` when the file does
    not exist. A bad entry is one ``ValueError`` line."""
    from composer_dag.corpus.sources import NAME_RE, load_sources, read_sources_doc, sources_file

    path = sources_file(path)
    if not os.path.exists(path):
        return [NETWORKX]
    doc = read_sources_doc(path)
    declared = doc.get("environments") if isinstance(doc, dict) else None
    if declared is not None and not isinstance(declared, list):
        raise ValueError(f"{path}: 'environments' must be a list of repositories (name, src, tasks, test_files)")
    out: list[RepoSpec] = []
    for i, e in enumerate(declared or []):
        if not isinstance(e, dict) or "name" not in e or "src" not in e:
            raise ValueError(f"{path}: environment #{i + 1} needs at least 'name' and 'src'")
        try:
            out.append(RepoSpec.load(e))
        except ConfigError as exc:
            raise ValueError(f"{path}: environment #{i + 1}: {exc}") from None
    for s in load_sources(path) if isinstance(doc, dict) and "sources" in doc else []:
        if s.environments:
            src = s.uri + (f"@{s.rev}" if s.kind == "git" and s.rev else "")
            extra = s.environments if isinstance(s.environments, dict) else {}
            try:
                out.append(RepoSpec.load({**extra, "name": s.name, "src": src}))
            except ConfigError as exc:
                raise ValueError(f"{path}: source {s.name!r} as an environment: {exc}") from None
    seen: set[str] = set()
    for r in out:
        if not NAME_RE.match(r.name):
            raise ValueError(f"{path}: environment name {r.name!r} must match {NAME_RE.pattern}")
        if r.name in seen:
            raise ValueError(f"{path}: environment name {r.name!r} is declared twice")
        seen.add(r.name)
    return out


class RepoEnvConfig(StageConfig):
    """How the ``repo_environments`` asset makes one declared repository (``RepoSpec``) into an
    environment and mines it."""

    seed: int = Field(0, description="picks the mutations")
    workers: int = Field(2, description="candidate tasks evaluated in parallel")
    max_tasks: Optional[int] = Field(None, description="tasks mined at most (None: the repository's own 'tasks')")
    exclude_licences: tuple[str, ...] = Field((), description="repositories under these licences are refused")


# ---------------------------------------------------------------- writing a task

_EPOCH = 1_714_000_000  # commit dates are deterministic, spaced like a few working days


def make_repo(repo: Path, commits: list[tuple[str, dict[str, str]]], seed: str,
              author: tuple[str, str] = ("Sam Carter", "sam.carter@fastmail.com")) -> None:
    """Create a fresh repository with the given commits (message, {path: content}), by
    ``author`` (name, email)."""
    repo.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    t = _EPOCH + rng.randrange(0, 90 * 86400)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(repo), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_AUTHOR_NAME": author[0], "GIT_AUTHOR_EMAIL": author[1],
           "GIT_COMMITTER_NAME": author[0], "GIT_COMMITTER_EMAIL": author[1]}
    git = lambda *a: subprocess.run(["git", "-c", "safe.directory=*", *a], cwd=repo, env=env, check=True,
                                    capture_output=True)
    git("init", "-q", "-b", "main")
    for msg, files in commits:
        for rel, text in files.items():
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            (repo / rel).write_text(text)
        t += rng.randrange(1800, 3 * 86400)
        env["GIT_AUTHOR_DATE"] = env["GIT_COMMITTER_DATE"] = f"{t} +0100"
        git("add", "-A")
        git("commit", "-q", "-m", msg)


def write_task(task_dir: Path, task: dict, repo_commits, hidden: dict[str, str], reference: dict[str, str],
               masks: dict[str, str] | None = None, author: tuple[str, str] = ("Sam Carter", "sam.carter@fastmail.com")
               ) -> Path:
    """Write a task directory (replacing any there): ``repo/`` from ``repo_commits`` by ``author``
    (name, email: the persona the task's laptop has), the hidden tests, the reference files and
    the masks, each ``{path: content}``, and ``task.json``. Its canaries come after
    (``tasks.sources.write.write_checked_task``)."""
    if task_dir.exists():
        shutil.rmtree(task_dir)
    make_repo(task_dir / "repo", repo_commits, seed=task["id"], author=author)
    for base, files in (("hidden_tests", hidden), ("reference/files", reference), ("masks", masks or {})):
        for rel, text in files.items():
            p = task_dir / base / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
    (task_dir / "hidden_tests").mkdir(exist_ok=True)
    task = {"format": TASK_FORMAT, **task}
    (task_dir / "task.json").write_text(json.dumps(task, indent=2, sort_keys=True))
    return task_dir


GITIGNORE = "__pycache__/\n*.py[cod]\n.pytest_cache/\n.venv/\n.env\n"


# ---------------------------------------------------------------- reading task sets

def task_dirs(out_dir, side: str) -> list[Path]:
    """The task directories of one side (``rl_tasks`` or ``eval_tasks``) of a built set, by id."""
    return sorted(p for p in (Path(out_dir) / side).iterdir() if (p / "task.json").exists())


def task_texts(task_dir) -> list[str]:
    """Every text of a task (instructions, repo files, hidden tests, reference), for decontamination.
    A repository task (``framework: pytest``) gives what is its own: the instructions, the files
    its reference changes (as they are in the repository and solved) and its FAIL_TO_PASS test
    files, not the rest of the public repository it was cut from."""
    d = Path(task_dir)
    task = json.loads((d / "task.json").read_text())
    texts = [task["instructions"]]
    if task.get("framework") == "pytest":
        own = [d / "repo" / r for r in task["reference"]["files"]] + \
            [d / "hidden_tests" / f for f in sorted({t.split("::", 1)[0] for t in task["tests"]["FAIL_TO_PASS"]})] + \
            sorted(p for p in (d / "reference").rglob("*") if p.is_file())
        for p in own:
            try:
                texts.append(p.read_text())
            except (OSError, UnicodeDecodeError):
                continue
        return texts
    for base in ("repo", "hidden_tests", "reference"):
        for p in sorted((d / base).rglob("*")):
            if p.is_file() and ".git" not in p.relative_to(d / base).parts:
                try:
                    texts.append(p.read_text())
                except UnicodeDecodeError:
                    continue
    return texts
