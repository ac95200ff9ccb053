"""What the shape rules read from a workspace and its task: the trees as bytes (``snapshot``), a
source's AST (``parse_source``, never run), the dotted names it references however imported or
aliased (``references``), its literals (``literals``), and the ``Workspace`` the ``tree``
detectors are given. What the rules read from one source is memoized by its bytes' digest."""

from __future__ import annotations

import ast
import functools
import hashlib
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path


TEST_NAME = re.compile(r"(^|/)(tests?/|test_[^/]*\.py$|[^/]*_test\.py$|conftest\.py$)")


MAIN_GUARD = "__main__"


def snapshot(root: Path) -> dict[str, bytes]:
    out = {}
    for p in sorted(Path(root).rglob("*")):
        rel = p.relative_to(root).as_posix()
        if rel == ".git" or rel.startswith(".git/") or "__pycache__" in rel.split("/") or p.is_symlink() \
                or not p.is_file():  # a link is never followed: it may point at any host file
            continue
        out[rel] = p.read_bytes()
    return out


def parse_source(src: bytes):
    try:
        return ast.parse(src)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # nor can the interpreter import it
        return None


def import_aliases(tree) -> dict[str, str]:
    """Local name -> dotted name it stands for, from the module's imports anywhere."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def dotted(node, aliases: dict[str, str]) -> str | None:
    if isinstance(node, ast.Name):
        return aliases.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
        base = dotted(node.value, aliases)
        return f"{base}.{node.attr}" if base else None
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
            and isinstance(node.args[0].value, str) and (
                (isinstance(node.func, ast.Name) and node.func.id == "__import__")
                or dotted(node.func, aliases) == "importlib.import_module"):
        return node.args[0].value  # __import__("os"), importlib.import_module("_pytest.python")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
        base = dotted(node.args[0], aliases)
        return f"{base}.{node.args[1].value}" if base else None
    return None


def main_guarded(tree) -> set[int]:
    """ids of nodes under ``if __name__ == "__main__":`` (not on the solution path)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and \
                MAIN_GUARD in {getattr(c, "value", None) for c in [node.test.left, *node.test.comparators]}:
            out |= {id(n) for b in node.body for n in ast.walk(b)}
    return out


def references(tree):
    """(dotted name, node) of every name, attribute, ``getattr`` and ``__import__`` reference."""
    aliases = import_aliases(tree)
    skip = main_guarded(tree)
    inner = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            inner.add(id(node.value))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, (ast.Name, ast.Attribute, ast.Call)):
            d = dotted(node, aliases)
            if d and (id(node) not in inner or isinstance(node, ast.Call)):
                yield d, node



def count_refs(tree, targets=(), attrs=(), words=None) -> int:
    n = 0
    if targets:
        for d, _ in references(tree):
            n += any(d == t or d.startswith(t + ".") for t in targets)
    for node in ast.walk(tree):
        if attrs and isinstance(node, ast.Attribute) and node.attr in attrs:
            n += 1
        if words is not None and isinstance(node, ast.Constant) and isinstance(node.value, str):
            n += bool(words(node.value))
        if targets and isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            n += any(m == t or m.startswith(t + ".") for m in names for t in targets)
    return n


# What the rules read from one source, kept by the digest of its bytes: a task's original tree
# (a repository of a thousand modules) is read at every grading, and its files are the same from
# one grading, and one task of the repository, to the next.
_MEMO: dict[tuple, object] = {}
_MEMO_LOCK = threading.Lock()


def memoized(fn):
    @functools.wraps(fn)
    def wrapper(src: bytes):
        key = (fn.__name__, hashlib.blake2b(src, digest_size=16).digest())
        with _MEMO_LOCK:
            if key in _MEMO:
                return _MEMO[key]
        value = fn(src)
        with _MEMO_LOCK:
            if len(_MEMO) >= 50_000:
                _MEMO.clear()
            _MEMO[key] = value
        return value
    return wrapper



def imported_tops(files: dict[str, bytes]) -> set[str]:
    out = set()
    for src in files.values():
        tree = parse_source(src)
        for node in ast.walk(tree) if tree else ():
            if isinstance(node, ast.Import):
                out |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                out.add(node.module.split(".")[0])
    return out



def docstring_ids(tree) -> set[int]:
    """The ids of the docstring constants of ``tree``."""
    docs = set()
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
                docs.add(id(node.body[0].value))
    return docs


def literals(tree) -> set:
    """Distinctive constants: strings of 3+ chars (not docstrings) and numbers outside [-10, 10]."""
    if tree is None:
        return set()
    docs = docstring_ids(tree)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and id(node) not in docs:
            v = node.value
            if isinstance(v, str) and 3 <= len(v) <= 300:
                out.add(v)
            elif isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) > 10:
                out.add(v)
    return out



READ_MAX = (1 << 20) + 1  # bytes read of one file the solution can read besides its code (one more: "over")


def linked_files(root: Path) -> dict[str, bytes]:
    """The links of the tree whose target is a regular file inside ``root`` (the link's path ->
    the target's first ``READ_MAX`` bytes): what the solution reads through them. A link out of
    the tree is never followed (it may point at any host file)."""
    root = Path(root)
    top = os.path.realpath(root)
    out = {}
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__" and not (dirpath == str(root) and d == ".git")]
        for name in files + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                continue
            target = os.path.realpath(p)
            if os.path.commonpath([top, target]) != top or not os.path.isfile(target):
                continue
            with open(target, "rb") as f:
                out[Path(p).relative_to(root).as_posix()] = f.read(READ_MAX)
    return out


def git_files(orig_git: Path, git: Path) -> dict[str, bytes]:
    """The files of the workspace's ``.git`` that the task's own ``.git`` does not hold as they
    are (``.git/<path>`` -> bytes, each up to ``READ_MAX``): a loose object, a note, a stash the
    solution can read back. A file of the same path and size as the original's is the original's
    when it is an object or too large to compare (objects and packs are named by their content)."""
    out = {}
    if not Path(git).is_dir():
        return out
    for p in sorted(Path(git).rglob("*")):
        if p.is_symlink() or not p.is_file():
            continue
        rel = p.relative_to(git).as_posix()
        o = Path(orig_git) / rel
        size = p.stat().st_size
        if o.is_file() and not o.is_symlink() and o.stat().st_size == size and (
                size > READ_MAX or rel.startswith("objects/") or o.read_bytes() == p.read_bytes()):
            continue
        with open(p, "rb") as f:
            out[f".git/{rel}"] = f.read(READ_MAX)
    return out


@dataclass
class Workspace:
    """A grading's trees: the task's original ``repo/`` and the final workspace (path -> bytes,
    no ``.git``, caches or links), the paths the solution changed or added, and the hidden tests
    (file name -> bytes). ``readable``: every file the solution can read besides its code and
    the original tree as it was: the files it added or changed whatever their type (tests' data
    included), the targets of its links inside the workspace, what it left in ``.git``, and the
    files its code opened or wrote while the checks ran (``written``: path -> bytes, from the
    runner's record)."""
    task_dir: Path
    orig: dict[str, bytes]
    final: dict[str, bytes]
    changed: list[str]
    hidden_src: dict[str, bytes]
    extra: dict[str, bytes] = field(default_factory=dict)
    solution: dict[str, bytes] = field(init=False)
    readable: dict[str, bytes] = field(init=False)

    def __post_init__(self):
        # the solution's code: the Python files it changed or added that are not tests
        self.solution = {rel: self.final[rel] for rel in self.changed
                         if rel.endswith(".py") and not TEST_NAME.search(rel)}
        self.readable = {rel: self.final[rel] for rel in self.changed if rel not in self.solution
                         and not (rel.endswith(".py") and TEST_NAME.search(rel))}
        for rel, data in self.extra.items():
            if self.final.get(rel) != data and self.orig.get(rel) != data:
                self.readable.setdefault(rel, data)

    @classmethod
    def read(cls, task_dir: Path, workspace: Path, written: dict[str, bytes] | None = None) -> "Workspace":
        task_dir = Path(task_dir)
        orig, final = snapshot(task_dir / "repo"), snapshot(workspace)
        extra = {**linked_files(workspace), **git_files(task_dir / "repo" / ".git", Path(workspace) / ".git"),
                 **(written or {})}
        return cls(task_dir, orig, final, [rel for rel in final if orig.get(rel) != final[rel]],
                   {p.name: p.read_bytes() for p in (task_dir / "hidden_tests").rglob("*.py")}, extra)
