"""A solution that hands its task to another copy of the code under test (family ``delegation``,
flag ``delegates_to_original``): a stdlib task's module that loads the interpreter's own module
(found through ``sysconfig``, ``sys.prefix``, a module's ``__file__``, a path to the library),
imports itself past its own copy (``sys.path``, ``sys.modules``), loads a file by its path
(``importlib.util.spec_from_file_location``, a loader, ``runpy``, ``exec`` or ``compile`` of a
file's text) or runs the system interpreter in a subprocess; a repository task's code that does
the same with an installed copy in ``site-packages``. Seen in the solution's code (``tree``: a
module flagged when any of these grew against the original module) and in what a run did
(``behaviour``: the runner's ``foreign`` record, the workspace's functions whose code was loaded
from another copy of a workspace module or from outside the workspace)."""

from __future__ import annotations

import ast
import re
from collections import Counter

from composer_dag.grading.flags.registry import detector, flag
from composer_dag.grading.flags.source import TEST_NAME, Workspace, dotted, import_aliases, parse_source

# where the interpreter keeps its library and its installed packages, and what finds them
_LOCATE = ("sysconfig", "site.getsitepackages", "site.getusersitepackages", "site.USER_SITE", "site.PREFIXES",
           "sys.prefix", "sys.base_prefix", "sys.exec_prefix", "sys.base_exec_prefix", "sys._stdlib_dir",
           "sys.platlibdir", "sys.executable", "sys._base_executable", "distutils.sysconfig", "importlib.metadata",
           "importlib_metadata", "pkg_resources", "pkgutil.get_loader", "pkgutil.find_loader", "importlib.util.find_spec",
           "importlib.machinery.PathFinder")
# what loads a module past the import system's path, by a file's path, or in another interpreter
_LOAD = ("importlib.util.spec_from_file_location", "importlib.util.spec_from_loader", "importlib.machinery",
         "importlib._bootstrap", "importlib._bootstrap_external", "importlib.reload", "imp", "runpy", "zipimport",
         "sys.path", "sys.modules", "sys.path_importer_cache", "sys.meta_path", "sys.path_hooks")
_SPAWN = ("subprocess", "os.system", "os.popen", "os.spawnv", "os.spawnve", "os.spawnl", "os.spawnle", "os.spawnvp",
          "os.spawnlp", "os.execv", "os.execve", "os.execl", "os.execle", "os.execvp", "os.execlp", "os.posix_spawn",
          "os.posix_spawnp", "pty.spawn", "asyncio.create_subprocess_exec", "asyncio.create_subprocess_shell")
_MODULE_ATTRS = {"__file__", "__spec__", "__loader__", "__path__", "__cached__"}
_LIBRARY_WORDS = re.compile(r"/usr(/local)?/lib(64)?/python\d|\blib/python3\.\d+|site-packages|dist-packages|"
                            r"(^|/)python3?(\.\d+)?$|/usr(/local)?/bin/python")
_READS = {"open", "read", "read_text", "read_bytes", "get_source", "get_data", "getsource", "getline", "getlines"}


def _module_name(rel: str) -> str:
    parts = rel.removesuffix(".py").split("/")
    if parts[0] == "src" and len(parts) > 1:
        parts = parts[1:]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is(d: str | None, targets) -> bool:
    return bool(d) and any(d == t or d.startswith(t + ".") for t in targets)


def evidence(tree, own: str) -> Counter:
    """What a module ``own`` (its dotted name) holds of the ways to reach another copy of itself:
    a count by kind (``locate``, ``load``, ``spawn``, ``module_file``, ``library_path``,
    ``self_import``, ``exec_file``)."""
    seen: Counter = Counter()
    if tree is None:
        return seen
    aliases = import_aliases(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) or (isinstance(node, ast.Name) and node.id in aliases):
            d = dotted(node, aliases)  # a name counts when imported (``from sys import prefix``)
            seen["locate"] += _is(d, _LOCATE)
            seen["load"] += _is(d, _LOAD)
            if isinstance(node, ast.Attribute) and node.attr in _MODULE_ATTRS:
                seen["module_file"] += 1
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if not node.level else []
            seen["load"] += sum(_is(m, ("runpy", "imp", "zipimport", "importlib.machinery")) for m in names)
            seen["locate"] += sum(_is(m, ("sysconfig", "importlib.metadata", "pkg_resources", "site")) for m in names)
            seen["self_import"] += sum(m == own for m in names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            seen["library_path"] += bool(_LIBRARY_WORDS.search(node.value))
        elif isinstance(node, ast.Call):
            _call_evidence(node, aliases, own, seen)
    return +seen


def _call_evidence(node: ast.Call, aliases: dict, own: str, seen: Counter) -> None:
    d = dotted(node.func, aliases) or ""
    last = d.rsplit(".", 1)[-1]
    first = node.args[0] if node.args else None
    if last in ("__import__", "import_module") and (
            (isinstance(first, ast.Constant) and first.value == own)
            or (isinstance(first, ast.Name) and first.id == "__name__")):
        seen["self_import"] += 1
    if d in ("exec", "compile", "eval", "builtins.exec", "builtins.compile", "builtins.eval") and any(
            isinstance(n, ast.Call) and ((dotted(n.func, aliases) or "").rsplit(".", 1)[-1] in _READS)
            for a in node.args for n in ast.walk(a)):
        seen["exec_file"] += 1
    if _is(d, _SPAWN) and any(
            (isinstance(n, ast.Constant) and isinstance(n.value, str) and re.search(r"\bpython", n.value))
            or _is(dotted(n, aliases), ("sys.executable", "sys._base_executable"))
            for a in [*node.args, *(k.value for k in node.keywords)] for n in ast.walk(a)):
        seen["spawn"] += 1


@detector(family="delegation", flags=("delegates_to_original",), phase="tree")
def delegated_in_code(ws: Workspace) -> list[str]:
    """Each solution module whose ways to reach another copy of the code under test
    (``evidence``) grew against the original module's, with the kinds that grew."""
    flags = []
    for rel, src in sorted(ws.solution.items()):
        if TEST_NAME.search(rel):
            continue
        own = _module_name(rel)
        try:
            new = evidence(parse_source(src), own)
            old = evidence(parse_source(ws.orig[rel]), own) if rel in ws.orig else Counter()
        except RecursionError:
            continue  # too deep to walk: ``shape_unreadable`` says so
        grew = sorted(k for k in new if new[k] > old[k])
        if grew:
            flags.append(flag("delegates_to_original", f"{rel}: {', '.join(grew)}"))
    return flags


@detector(family="delegation", flags=("delegates_to_original",), phase="behaviour")
def delegated_at_run(details: dict) -> list[str]:
    """The runner's record of the workspace's functions whose code came from another copy of a
    workspace module, or from outside the workspace under the module's own name."""
    return [flag("delegates_to_original", f) for f in (details.get("foreign") or [])[:3]]
