"""Small on-disk trees for corpus tests: valid code next to every kind of bad input."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

MAX_FILE_BYTES = 1000  # use with CorpusConfig(max_file_bytes=MAX_FILE_BYTES)

VALID_FILES = {
    "app.py": "def main():\n    return 42\n",
    "web/index.js": "export const x = () => 1;\n",
    "Makefile": "all:\n\techo hi\n",
    "scripts/run": "#!/usr/bin/env python3\nprint('hi')\n",
    "scripts/build": "#!/bin/sh\necho build\n",
    "docs/README.md": "# Title\n\ntext\n",
}
VALID_LANGUAGES = {"python": 2, "javascript": 1, "makefile": 1, "shell": 1, "markdown": 1}


def make_hostile_tree(root: Path, outside: Path) -> dict[str, int]:
    """Write valid files and bad input under ``root`` (``outside`` is a directory beside it
    for links that leave the root); return the expected skip counts per reason."""
    root.mkdir(parents=True)
    outside.mkdir(parents=True, exist_ok=True)
    for rel, text in VALID_FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "data").mkdir()
    (root / "data/blob.txt").write_bytes(b"abc\x00def\n")  # NUL byte
    (root / "data/logo.png").write_bytes(b"\x89PNG\r\n")  # binary extension
    (root / "data/latin1.py").write_bytes(b"name = '\xe9t\xe9'\n")
    (root / "data/huge.py").write_text("x = 1\n" * 400)  # 2,400 bytes > MAX_FILE_BYTES
    (root / "data/empty.py").write_bytes(b"")
    (root / "data/notes.xyz").write_text("no language\n")
    (root / "data/model.csv").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 12\n")
    os.symlink("loop_b", root / "data/loop_a")
    os.symlink("loop_a", root / "data/loop_b")
    os.symlink(".", root / "data/self_dir")  # a directory link to its own parent
    (outside / "secret.py").write_text("TOKEN = 'x'\n")
    os.symlink(outside / "secret.py", root / "data/escape.py")
    os.symlink("../app.py", root / "data/alias.py")  # inside the root
    os.symlink("missing.py", root / "data/dangling.py")
    os.mkfifo(root / "data/pipe")
    os.close(os.open(os.fsencode(root / "data") + b"/bad\xffname.py", os.O_CREAT | os.O_WRONLY))
    for pruned in (".git/objects/x.py", "pkg/__pycache__/m.cpython-311.pyc", ".hg/store"):
        (root / pruned).parent.mkdir(parents=True, exist_ok=True)
        (root / pruned).write_text("pruned\n")
    return {
        "binary": 2, "invalid_utf8": 1, "too_large": 1, "empty": 1, "unknown_language": 1,
        "lfs_pointer": 1, "symlink_loop": 3, "symlink_outside_root": 1, "symlink": 1,
        "unreadable": 1, "not_regular_file": 1, "bad_filename": 1,
    }


def git(repo: Path, *args: str) -> str:
    cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com",
           "-c", "init.defaultBranch=main", "-c", "commit.gpgsign=false", *args]
    return subprocess.run(cmd, cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def make_git_repo(repo: Path) -> tuple[str, str]:
    """A repository with two commits; returns (first sha, second sha). The first commit is
    tagged ``v1`` and holds ``src/a.py`` and an LFS pointer; the second adds ``src/b.py``."""
    repo.mkdir(parents=True)
    git(repo, "init", "-q")
    (repo / "src").mkdir()
    (repo / "src/a.py").write_text("A = 1\n")
    (repo / "weights.csv").write_text("version https://git-lfs.github.com/spec/v1\noid x\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "first")
    git(repo, "tag", "v1")
    first = git(repo, "rev-parse", "HEAD")
    (repo / "src/b.py").write_text("B = 2\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "second")
    return first, git(repo, "rev-parse", "HEAD")
