"""Bytecode of a repository's modules, compiled once per machine instead of at every sandboxed run.

A sandboxed test run (bootstrap, mining, grading) gets a fresh copy of the project without its
``__pycache__`` directories (a workspace's own bytecode is never copied: it could hold code its
source does not show), and the sandbox's Python runs with ``-B``, so every run compiled every
module it imported: on a networkx task about half of the run's time. The grader now lays into
that copy bytecode it compiled itself, from trusted trees only (an environment's repository, a
task's ``repo/``; never a workspace's files), kept by the SHA-256 of the source's bytes:

- each ``.pyc`` is a checked-hash one (PEP 552): the interpreter loads it only when the hash of the
  source file beside it still matches, so a file the policy changed is compiled from its source
  in the sandbox as before, and a ``.pyc`` never stands for other bytes than its source's;
- it goes into the copy only under real directories of it (never through a link the workspace
  holds), and only for regular ``.py`` files;
- a ``.pyc`` the sandbox's interpreter cannot use (another version's magic number or cache tag)
  is ignored by it, so the cache can only save time, never change what runs.

The cache lives under ``$COMPOSER_HOME/bytecode`` (files written whole, then renamed).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import py_compile
import sys
import tempfile
from pathlib import Path

_TAG = sys.implementation.cache_tag
MAX_BYTES = 4 << 20  # larger sources are left to the sandbox (hashing them would cost more than it saves)


def cache_dir() -> Path:
    return Path(os.environ.get("COMPOSER_HOME") or Path.home() / ".composer") / "bytecode" / \
        importlib.util.MAGIC_NUMBER.hex()


def _sources(tree: Path):
    """(path, relative path) of the regular ``.py`` files under ``tree``, no link followed."""
    for dirpath, dirnames, filenames in os.walk(tree):
        dirnames[:] = [d for d in dirnames if d not in ("__pycache__", ".git")
                       and not os.path.islink(os.path.join(dirpath, d))]
        for name in filenames:
            p = os.path.join(dirpath, name)
            if name.endswith(".py") and not os.path.islink(p) and os.path.isfile(p) and os.path.getsize(p) <= MAX_BYTES:
                yield p


def _key(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def warm(tree: Path, cache: Path | None = None, keys: dict[str, str] | None = None) -> dict:
    """Compile the ``.py`` files of the trusted ``tree`` that the cache does not hold yet:
    {"files", "compiled", "failed"} (a file that does not compile is left to the sandbox).
    ``keys``, when given, receives each file's key by its path relative to ``tree`` (what
    ``lay`` looks the bytecode of a copy of ``tree`` up by, without hashing it again)."""
    cache = cache or cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    stats = {"files": 0, "compiled": 0, "failed": 0}
    for p in _sources(Path(tree)):
        stats["files"] += 1
        key = _key(p)
        if keys is not None:
            keys[os.path.relpath(p, tree)] = key
        target = cache / f"{key}.pyc"
        if target.exists():
            continue
        fd, tmp = tempfile.mkstemp(dir=cache, suffix=".tmp")
        os.close(fd)
        try:
            py_compile.compile(p, cfile=tmp, doraise=True, invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
            os.chmod(tmp, 0o644)  # readable where ``lay`` links it
            os.replace(tmp, target)
            stats["compiled"] += 1
        except (py_compile.PyCompileError, OSError, ValueError, SyntaxError):
            stats["failed"] += 1
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return stats


def lay(ws: Path, cache: Path | None = None, keys: dict[str, str] | None = None) -> int:
    """Put the cached bytecode of the ``.py`` files of the copy ``ws`` (made by the caller,
    without ``__pycache__``) beside them; the number laid. ``keys`` (from ``warm``): the digest of
    each file's bytes by its path relative to ``ws``, known from the trusted tree it was copied
    from (a file of ``ws`` missing from it is hashed). A cached file on ``ws``'s filesystem is
    hard-linked, read-only (the interpreter checks it against its source's hash either way)."""
    cache = cache or cache_dir()
    if not cache.is_dir():
        return 0
    laid = 0
    ws = Path(ws)
    same_fs = os.stat(cache).st_dev == os.stat(ws).st_dev
    for p in _sources(ws):
        key = (keys or {}).get(os.path.relpath(p, ws)) or _key(p)
        src = cache / f"{key}.pyc"
        if not src.exists():
            continue
        d = os.path.join(os.path.dirname(p), "__pycache__")
        try:
            os.mkdir(d, 0o755)
        except FileExistsError:
            if os.path.islink(d) or not os.path.isdir(d):
                continue
        name = os.path.join(d, f"{os.path.basename(p)[:-3]}.{_TAG}.pyc")
        if same_fs:
            try:
                if os.stat(src).st_mode & 0o777 != 0o644:
                    os.chmod(src, 0o644)  # written by an older version: owner-only
                os.link(src, name)  # fails on an existing name: nothing is written through a link
                laid += 1
                continue
            except OSError:
                pass
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except OSError:
            continue
        with os.fdopen(fd, "wb") as out:
            out.write(src.read_bytes())
        laid += 1
    return laid
