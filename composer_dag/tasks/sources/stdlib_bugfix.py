"""Stdlib bug-fix tasks: a one-site AST mutation of a pure-Python stdlib module that the
module's own test suite catches; the suite is the hidden tests."""

from __future__ import annotations

import ast
import copy
import hashlib
import json
import random
import re
import shutil
import sysconfig
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from composer_dag.grading.checks import failures, outcomes, run_hidden_tests
from composer_dag.laptop.image import PYVER
from composer_dag.tasks.format import GITIGNORE
from composer_dag.tasks.registry import BuildRequest, task_source
from composer_dag.tasks.sources.write import write_checked_task

SOURCE = "stdlib-bugfix"
# pure-Python stdlib modules whose unittest module passes quickly against a local copy
DEFAULT_MODULES = ("colorsys", "textwrap", "fnmatch", "shlex", "difflib", "fractions", "graphlib",
                   "quopri", "netrc", "getopt", "glob", "plistlib", "string", "base64", "configparser",
                   "calendar", "ipaddress", "sched", "filecmp", "fileinput", "timeit", "copy")

_CMP_SWAP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
             ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
_BIN_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult,
             ast.Div: ast.Mult, ast.Mod: ast.FloorDiv, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd,
             ast.LShift: ast.RShift, ast.RShift: ast.LShift}


# CPython 3.11's parser keeps its recursion-depth counter per interpreter, not per thread: modules
# built in parallel threads can fail with "AST constructor recursion depth mismatch". Parse under
# one lock.
_AST_LOCK = threading.Lock()


def _parse(source: str) -> ast.AST:
    with _AST_LOCK:
        return ast.parse(source)


def mutation_sites(source: str) -> list[tuple[str, ast.AST]]:
    """Candidate mutations inside function bodies: (kind, node), in source order."""
    tree = _parse(source)
    lines = source.splitlines()
    sites = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name.startswith("__repr"):
            continue
        body = fn.body[1:] if fn.body and isinstance(fn.body[0], ast.Expr) and isinstance(
            getattr(fn.body[0], "value", None), ast.Constant) else fn.body
        for stmt in body:
            for node in ast.walk(stmt):
                one_line = getattr(node, "lineno", None) and node.lineno == node.end_lineno
                if isinstance(node, ast.Compare) and one_line and len(node.ops) == 1 and type(node.ops[0]) in _CMP_SWAP:
                    sites.append(("comparison", node))
                elif isinstance(node, ast.BinOp) and one_line and type(node.op) in _BIN_SWAP:
                    sites.append(("operator", node))
                elif isinstance(node, ast.BoolOp) and one_line:
                    sites.append(("boolean", node))
                elif isinstance(node, ast.Constant) and one_line and type(node.value) is int and 0 <= node.value <= 1000:
                    sites.append(("off_by_one", node))
                elif isinstance(node, ast.Constant) and one_line and isinstance(node.value, bool):
                    sites.append(("constant", node))
                elif isinstance(node, ast.UnaryOp) and one_line and isinstance(node.op, ast.Not):
                    sites.append(("negation", node))
                elif isinstance(node, ast.If) and not node.orelse and len(node.body) == 1:
                    first, last = lines[node.lineno - 1], lines[node.end_lineno - 1]
                    if first[:node.col_offset].strip() == "" and last[node.end_col_offset:].strip() == "":
                        sites.append(("removed_branch", node))
    sites = [s for s in sites if s[0] != "removed_branch" or _has_siblings(tree, s[1])]
    return sorted(sites, key=lambda s: (s[1].lineno, s[1].col_offset, s[0]))


def _has_siblings(tree, node) -> bool:
    for parent in ast.walk(tree):
        for fld in ("body", "orelse", "finalbody"):
            block = getattr(parent, fld, None)
            if isinstance(block, list) and node in block:
                return len(block) > 1
    return False


def apply_mutation(source: str, kind: str, node: ast.AST) -> str:
    lines = source.splitlines(keepends=True)
    if kind == "removed_branch":
        return "".join(lines[:node.lineno - 1] + lines[node.end_lineno:])
    new = copy.deepcopy(node)
    if kind == "comparison":
        new.ops = [_CMP_SWAP[type(node.ops[0])]()]
    elif kind == "operator":
        new.op = _BIN_SWAP[type(node.op)]()
    elif kind == "boolean":
        new.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    elif kind == "off_by_one":
        new.value = node.value + 1
    elif kind == "constant":
        new.value = not node.value
    elif kind == "negation":
        new = node.operand
    text = ast.unparse(new)
    if kind == "negation" and isinstance(new, (ast.BoolOp, ast.Compare, ast.BinOp, ast.IfExp)):
        text = f"({text})"
    i = node.lineno - 1
    line = lines[i]
    b = len(line.encode()[:node.col_offset].decode(errors="ignore"))
    e = len(line.encode()[:node.end_col_offset].decode(errors="ignore"))
    lines[i] = line[:b] + text + line[e:]
    return "".join(lines)


def _preamble(module: str) -> str:
    return (f"# Import the project's {module} (the first entry of sys.path), not the interpreter's.\n"
            "import importlib as _importlib, os as _os, sys as _sys\n"
            f"_sys.modules.pop({module!r}, None)\n"
            f"_local = _importlib.import_module({module!r})\n"
            "assert _os.path.dirname(_os.path.abspath(_local.__file__)) != _os.path.dirname(_os.__file__), _local.__file__\n\n")


def _with_preamble(test_src: str, module: str) -> str:
    tree = _parse(test_src)
    at = 0
    for stmt in tree.body:
        if isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__" or (
                stmt is tree.body[0] and isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)):
            at = stmt.end_lineno
    lines = test_src.splitlines(keepends=True)
    return "".join(lines[:at]) + ("\n" if at else "") + _preamble(module) + "".join(lines[at:])


def _describe(module: str, fails: dict[str, str]) -> str:
    names = list(fails)[:2]
    first = re.sub(r"/var/tmp/checks/", "tests/", fails[names[0]] or "").strip()
    first = "\n".join(first.splitlines()[:8])[:600]
    shown = " and ".join(f"`{n.split('::')[0].rsplit('.', 1)[-1]}.{n.split('::')[1]}`" for n in names)
    more = f" (and {len(fails) - len(names)} more)" if len(fails) > len(names) else ""
    return (f"Our copy of `{module}` (`{module}.py` in this repo) has a regression: in CI, {shown}{more} "
            f"fail{'s' if len(fails) == 1 else ''} with\n\n```\n{first}\n```\n\n"
            f"Can you find the bug in `{module}.py` and fix it? Keep the public API as it is.")


def _module_masks(module: str, mutant_name: str) -> dict[str, str | None]:
    """During an episode the interpreter's own copy of the module is shown as the user's copy
    (nothing to diff against) and the interpreter's test suite is hidden."""
    std = Path(sysconfig.get_paths()["stdlib"])
    masks: dict[str, str | None] = {f"/usr/local/lib/python{PYVER}/test": None}
    for inside, host in ((f"/usr/local/lib/python{PYVER}", std), (f"/usr/lib/python{PYVER}", Path(f"/usr/lib/python{PYVER}"))):
        if (host / f"{module}.py").exists():
            masks[f"{inside}/{module}.py"] = mutant_name
        for pyc in sorted((host / "__pycache__").glob(f"{module}.*.pyc")):
            masks[f"{inside}/__pycache__/{pyc.name}"] = "empty"
    return masks


def _bugfix_module(module: str, out: Path, cfg) -> tuple[list[Path], dict]:
    std = Path(sysconfig.get_paths()["stdlib"])
    src_path, test_path = std / f"{module}.py", std / "test" / f"test_{module}.py"
    stats = {"module": module, "attempts": 0, "accepted": 0, "rejected": {}}
    if not src_path.exists() or not test_path.exists():
        stats["rejected"]["missing"] = 1
        return [], stats
    original, tests = src_path.read_text(), _with_preamble(test_path.read_text(), module)
    stage = Path(tempfile.mkdtemp(prefix="cdag-b-"))
    try:
        probe = stage / "probe"
        (probe / "repo").mkdir(parents=True)
        (probe / "hidden_tests").mkdir()
        (probe / "hidden_tests" / f"test_{module}.py").write_text(tests)
        (probe / "task.json").write_text(json.dumps({"project": f"py{module}", "limits": cfg.limits.to_dict()}))
        ws = probe / "repo"
        (ws / f"{module}.py").write_text(original)
        t0 = time.monotonic()
        res, det = run_hidden_tests(probe, ws)
        stats["original_seconds"] = round(time.monotonic() - t0, 2)
        res_o = outcomes(res)
        if not res_o or any(v in ("failed", "error") for v in res_o.values()):
            stats["rejected"]["original_fails"] = 1
            stats["original_output"] = det["output_tail"][-500:]
            return [], stats
        sites = mutation_sites(original)
        rng = random.Random(f"{cfg.seed}:{module}")
        rng.shuffle(sites)
        built = []
        seen = set()
        for kind, node in sites:
            if len(built) >= cfg.max_per_module or stats["attempts"] >= cfg.attempts_per_module:
                break
            mutant = apply_mutation(original, kind, node)
            try:
                if ast.dump(_parse(mutant)) == ast.dump(_parse(original)) or mutant in seen:
                    stats["rejected"]["no_change"] = stats["rejected"].get("no_change", 0) + 1
                    continue
            except SyntaxError:
                stats["rejected"]["syntax"] = stats["rejected"].get("syntax", 0) + 1
                continue
            seen.add(mutant)
            stats["attempts"] += 1
            (ws / f"{module}.py").write_text(mutant)
            res, det = run_hidden_tests(probe, ws, timeout=max(10.0, 4 * stats["original_seconds"] + 5))
            fails = failures(res)
            if det["timed_out"] or not fails:
                why = "timeout" if det["timed_out"] else "survived"
                stats["rejected"][why] = stats["rejected"].get(why, 0) + 1
                continue
            digest = hashlib.sha256(mutant.encode()).hexdigest()[:8]
            tid = f"bugfix-{module}-{digest}"
            readme = (f"# py{module}\n\nOur patched copy of the `{module}` module. Import it from this directory "
                      f"(`import {module}`) to get our version instead of the interpreter's.\n")
            task = {"id": tid, "source": SOURCE, "source_file": f"stdlib:{module}.py",
                    "project": f"py{module}", "instructions": _describe(module, fails),
                    "limits": cfg.limits.to_dict(),
                    "reference": {"files": [f"{module}.py"], "kind": "bugfix", "mutation": kind,
                                  "failing_tests": sorted(fails)[:20]},
                    "sandbox": {"masks": _module_masks(module, f"{module}.py")}}
            commits = [("Initial commit", {"README.md": readme, ".gitignore": GITIGNORE}),
                       (f"Add {module} module", {f"{module}.py": mutant})]
            d = write_checked_task(out / tid, task, commits, {f"test_{module}.py": tests}, {f"{module}.py": original},
                                   masks={f"{module}.py": mutant, "empty": ""})
            built.append(d)
            stats["accepted"] += 1
        return built, stats
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def build_bugfixes(out: Path, cfg, count: int) -> tuple[list[Path], list[dict]]:
    """Mutants of stdlib modules that their own test suite catches: up to ``max_per_module`` from
    each of ``cfg.bugfix_modules`` in order until ``count`` (``cfg``: a ``TaskBuildConfig``).
    Modules run in parallel; the result depends only on the seed (later modules are skipped once
    the earlier ones give enough)."""
    if count <= 0:
        return [], []
    keep, stats = [], []
    with ThreadPoolExecutor(max(1, cfg.workers)) as pool:
        futures = [pool.submit(_bugfix_module, m, out, cfg) for m in cfg.bugfix_modules]
        for fut in futures:
            if len(keep) >= count:
                fut.cancel()
                continue
            built, st = fut.result()
            stats.append(st)
            take = built[:count - len(keep)]
            keep += take
            for d in built[len(take):]:
                shutil.rmtree(d)
        for fut in futures:  # wait for running ones, discard what they built
            if not fut.cancelled():
                built, _ = fut.result()
                for d in built:
                    if d not in keep:
                        shutil.rmtree(d, ignore_errors=True)
    return keep, stats


@task_source(name=SOURCE, count=10, count_field="bugfix_count", sft_demos=4)
def build(req: BuildRequest) -> tuple[list[Path], dict]:
    """Bug-fix tasks from the stdlib modules; the summary's ``bugfix_modules``: per module, the
    mutants tried, accepted and rejected by reason."""
    dirs, stats = build_bugfixes(req.out, req.config, req.count)
    return dirs, {"bugfix_modules": {s["module"]: {k: v for k, v in s.items() if k != "module"} for s in stats}}
