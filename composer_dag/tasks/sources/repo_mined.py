"""Tasks mined from a repository environment (``repo_env``): synthetic bugs over the whole
package, each caught by some of the environment's kept tests.

A candidate is one change to one function of the package: an operator, a comparison, a
constant or a condition (``tasks_bugfix.mutation_sites``), a removed statement, or the whole body
removed with its signature and docstring kept ("implement this"). It becomes a task when the
kept tests that now fail (``FAIL_TO_PASS``) are at least one and the rest (``PASS_TO_PASS``)
still pass. The task directory is today's format (``task_format``) with ``format`` 2:

    repo/          the environment's repository with the change folded into its last commit and
                   the test files holding FAIL_TO_PASS tests removed (they are the hidden tests)
    hidden_tests/  the environment's recorded test tree and ``pytest.ini``: grading runs these
    layer/         the environment's site-packages, bound into the episode's ``.venv``
    reference/     the function as it was
    canaries/      a copy of a FAIL_TO_PASS file with expected values changed, which the
                   reference fails (``checks.canaries[...].replaces`` names the file)

``task.json`` records ``framework: pytest``, ``tests.FAIL_TO_PASS`` and ``tests.PASS_TO_PASS``
(pytest node ids), and ``origin`` (repository, commit, environment digest, licence, the change).
The problem statement is what a user sees: the failing call and its wrong result, as pytest
reports it, never a test's file or function name, never the fix.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import re
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from composer_dag.repos.bootstrap import load_env
from composer_dag.repos.layout import norm_name, package_files
from composer_dag.repos.suite import run_tests
from composer_dag.laptop.image import persona_for
from composer_dag.tasks.registry import BuildRequest, task_source
from composer_dag.tasks.sources.repo_task import environment_tasks, verify_canaries, write_pytest_task
from composer_dag.tasks.sources.stdlib_bugfix import _parse, apply_mutation, mutation_sites

SOURCE = "repo-mined"
KINDS = ("comparison", "operator", "boolean", "off_by_one", "constant", "negation", "removed_branch",
         "removed_statement", "implement")


def _functions(tree) -> list[ast.FunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _doc_len(fn) -> int:
    return 1 if fn.body and isinstance(fn.body[0], ast.Expr) and isinstance(
        getattr(fn.body[0], "value", None), ast.Constant) and isinstance(fn.body[0].value.value, str) else 0


def candidates(source: str) -> list[tuple[str, object]]:
    """Every change of this module a task may be made from: (kind, site), in source order."""
    tree = _parse(source)
    out: list[tuple[str, object]] = list(mutation_sites(source))
    for fn in _functions(tree):
        body = fn.body[_doc_len(fn):]
        if len(body) >= 2:
            for stmt in body[:-1]:  # the last statement is often the return: removing it is trivial
                if isinstance(stmt, (ast.Assign, ast.AugAssign, ast.Expr, ast.If, ast.For)) and \
                        not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)):
                    out.append(("removed_statement", stmt))
        if len(body) >= 3 and not fn.name.startswith("__"):
            out.append(("implement", fn))
    return out


def apply_candidate(source: str, kind: str, node) -> str:
    lines = source.splitlines(keepends=True)
    if kind == "removed_statement":
        indent = re.match(r"\s*", lines[node.lineno - 1]).group(0)
        return "".join(lines[:node.lineno - 1] + [f"{indent}pass\n"] + lines[node.end_lineno:])
    if kind == "implement":
        body = node.body[_doc_len(node):]
        first, last = body[0].lineno, node.end_lineno
        indent = re.match(r"\s*", lines[first - 1]).group(0)
        return "".join(lines[:first - 1] + [f"{indent}raise NotImplementedError\n"] + lines[last:])
    return apply_mutation(source, kind, node)


def _enclosing(tree, node) -> str:
    """The qualified name of the function holding ``node``."""
    best = ""
    for parent in ast.walk(tree):
        if isinstance(parent, ast.ClassDef):
            for fn in parent.body:
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.lineno <= node.lineno <= fn.end_lineno:
                    best = f"{parent.name}.{fn.name}"
        elif isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)) and parent.lineno <= node.lineno <= parent.end_lineno:
            best = best or parent.name
    return best


def statement(kind: str, package: str, module: str, function: str, message: str, hidden_names: list[str]) -> str:
    """What a user sees, in at most three sentences: the failing call and its wrong result."""
    if kind == "implement":
        return (f"`{function}` in `{module}` is not implemented yet: it raises NotImplementedError. "
                f"Implement it so that it does what its name, signature and docstring say, consistently with the "
                f"rest of `{package}`.")
    lines = [l for l in message.splitlines() if l.strip() and not any(h in l for h in hidden_names)
             and "/var/tmp/" not in l and not re.search(r"\btest_\w+", l)]
    shown = "\n".join(lines[:6])[:700] or "an exception"
    return (f"Since the last change, `{package}` gives wrong results. Here is what I get:\n\n```\n{shown}\n```\n\n"
            f"Please find the cause and fix it without changing the public API.")


def mine_sites(project: Path, layout: dict, paths: list[str], seed: str) -> tuple[dict[str, list[str]], list]:
    """(targeted, sites): the package modules that have a test module of their own
    (``test_<name>.py``; each is mined against that test module alone, so a large suite stays
    cheap and its tasks are graded by it; when none has, every module against every test), and
    the candidate changes (file, kind, node), shuffled by ``seed`` with the kinds interleaved."""

    class L:  # the layout as package_files wants it
        src_dir, packages = layout["src_dir"], layout["packages"]

    files = package_files(project, L)
    by_stem: dict[str, list[str]] = {}
    for p in paths:
        m = re.match(r"test_(\w+)\.py$", Path(p).name)
        if m:
            by_stem.setdefault(m.group(1), []).append(p)
    targeted = {rel: by_stem[Path(rel).stem] for rel in files if Path(rel).stem in by_stem}
    if targeted:
        files = sorted(targeted)
    sites = []
    for rel in files:
        try:
            src = (project / rel).read_text()
            sites += [(rel, k, n) for k, n in candidates(src)]
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
    random.Random(seed).shuffle(sites)
    by_kind: dict[str, list] = {}  # the n-th candidate of each kind before the (n+1)-th of any
    for s in sites:
        by_kind.setdefault(s[1], []).append(s)
    order = [k for k in KINDS if k in by_kind]
    return targeted, [by_kind[k][i] for i in range(max(map(len, by_kind.values()), default=0))
                      for k in order if i < len(by_kind[k])]


def mine(env_dir: Path, out_dir: Path, max_tasks: int = 10, seed: int = 0, max_attempts: int | None = None,
         canaries: bool = True, history: bool = True, workers: int = 2, log=lambda m: None) -> dict:
    """Tasks from the environment at ``env_dir`` into ``out_dir/<task id>``: up to ``max_tasks``
    synthetic bugs, and (``history``) the tasks of its git history (``swebench.history_instances``,
    none for a repository of one commit); the JSON summary."""
    t0 = time.monotonic()
    env_dir, out_dir = Path(env_dir), Path(out_dir)
    env = load_env(env_dir)
    layout = env["layout"]
    kept = list(env["kept"])
    project = env_dir / "repo"
    tests_tree, layer = env_dir / "tests", env_dir / "layer"
    persona = persona_for(env["persona_seed"])
    paths = sorted({t.split("::", 1)[0] for t in kept})
    out_dir.mkdir(parents=True, exist_ok=True)

    targeted, sites = mine_sites(project, layout, paths, f"{seed}:{env['env_digest']}")
    max_attempts = max_attempts or 4 * max_tasks
    # tried = accepted + rejected (by reason); runs: the candidates run against the tests
    stats = {"candidates": len(sites), "tried": 0, "runs": 0, "accepted": 0, "rejected": {},
             "targeted_modules": len(targeted)}
    seen: set = set()

    def reject(why):
        stats["rejected"][why] = stats["rejected"].get(why, 0) + 1

    def evaluate(rel, kind, node, mutant):
        """(f2p, p2p, messages) of one candidate, or the reason it is not a task."""
        run_paths = targeted.get(rel) or paths
        scope = [t for t in kept if t.split("::", 1)[0] in run_paths]
        # a change can make the suite loop: five times its time at bootstrap, at least 10 s (a
        # looping candidate is one rejection, and at 30 s it held a worker as long as ten others)
        timeout = max(10.0, 5 * float(env.get("suite_seconds") or 12.0))
        res, det = run_tests(project, tests_tree, layer, persona, run_paths, timeout, changes={rel: mutant})
        if det["timed_out"]:
            return "timeout"
        f2p = sorted(t for t in scope if res.get(t) in ("failed", "error") or t not in res)
        p2p = sorted(t for t in scope if res.get(t) == "passed")
        return "survived" if not f2p else "everything_fails" if not p2p else (f2p, p2p, det["messages"])

    def candidates_to_run():
        for rel, kind, node in sites:
            stats["tried"] += 1
            original = (project / rel).read_text()
            try:
                mutant = apply_candidate(original, kind, node)
                if ast.dump(_parse(mutant)) == ast.dump(_parse(original)) or mutant in seen:
                    reject("no_change")
                    continue
            except SyntaxError:
                reject("syntax")
                continue
            seen.add(mutant)
            yield rel, kind, node, mutant

    selected = select_candidates(candidates_to_run(), evaluate, max_tasks, max_attempts, workers, stats, reject)
    with ThreadPoolExecutor(max(1, workers)) as pool:
        built = list(pool.map(lambda item: write_mined(item, env, env_dir, out_dir, log), selected))
    if canaries and built:  # the tasks share the reference: their canaries are verified side by side
        for name, kept in verify_canaries(built, workers).items():
            log(f"{name}: {len(kept)} canary" + ("" if kept else " (none verified)"))
    stats["accepted"] = len(built)
    if history:
        stats["history"], from_history = mine_history(env_dir, out_dir, env, canaries, log)
        built += from_history
    stats["seconds"] = round(time.monotonic() - t0, 2)
    return {"ok": bool(built), "tasks": [p.name for p in built], **stats, "env_digest": env["env_digest"],
            "out": str(out_dir)}


def select_candidates(cands, evaluate, max_tasks: int, max_attempts: int, workers: int, stats: dict,
                      reject) -> list:
    """The first ``max_tasks`` candidates of ``cands`` that ``evaluate`` makes a task of:
    ``[(candidate, (f2p, p2p, messages))]``; a candidate it refuses is ``reject``ed with the reason.
    Candidates run ``workers`` at a time (each a sandboxed pytest run), at most ``max_attempts``
    (``stats["runs"]``), and are taken in their order, so the tasks do not depend on which run
    finished first; four times as many are queued, so a candidate that loops until its timeout
    holds one worker, not the queue behind it."""
    selected = []
    with ThreadPoolExecutor(max(1, workers)) as pool:
        pending: list = []
        while len(selected) < max_tasks:
            while len(pending) < 4 * max(1, workers) and stats["runs"] < max_attempts:
                cand = next(cands, None)
                if cand is None:
                    break
                stats["runs"] += 1
                pending.append((cand, pool.submit(evaluate, *cand)))
            if not pending:
                break
            cand, fut = pending.pop(0)
            out = fut.result()
            if isinstance(out, str):
                reject(out)
            else:
                selected.append((cand, out))
        for cand, fut in pending:  # run past the last task needed: not counted as tried
            fut.cancel()
            stats["tried"] -= 1
            stats["runs"] -= 1
    return selected


def write_mined(item, env: dict, env_dir: Path, out_dir: Path, log) -> Path:
    """One selected candidate (``mine``) written as a task (its canary comes after: ``verify_canaries``)."""
    (rel, kind, node, mutant), (f2p, p2p, messages) = item
    project = env_dir / "repo"
    original = (project / rel).read_text()
    function = node.name if kind == "implement" else _enclosing(_parse(original), node) or "?"
    msg = next((messages.get(t) for t in f2p if messages.get(t)), "")
    names = [Path(h).stem for h in {t.split("::", 1)[0] for t in f2p}] + [t.split("::")[-1].split("[")[0] for t in f2p]
    digest = hashlib.sha256(f"{rel}\0{mutant}".encode()).hexdigest()[:8]
    tid = f"mined-{norm_name(env['name'])}-{digest}"
    d = write_repo_task(out_dir / tid, env, env_dir, rel, original, mutant, kind, function, f2p, p2p,
                        statement(kind, env["name"], rel, function, msg, names))
    log(f"{tid}: {kind} in {rel}:{function}, {len(f2p)} FAIL_TO_PASS, {len(p2p)} PASS_TO_PASS")
    return d


def mine_history(env_dir: Path, out_dir: Path, env: dict, canaries: bool, log) -> tuple[dict, list[Path]]:
    """The tasks of the environment's git history (``swebench.history_instances``), imported with
    the environment's repository as the mirror: (stats, task directories)."""
    from composer_dag.repos.config import BootstrapConfig
    from composer_dag.tasks.sources.swebench import history_instances, import_instances

    hist = history_instances(env_dir)
    stats = {"commits": hist["commits"], "skipped": hist["skipped"], "instances": len(hist["instances"])}
    if not hist["instances"]:
        return stats, []
    with tempfile.TemporaryDirectory(prefix="cdag-hist-") as tmp:
        jsonl = Path(tmp) / "history.jsonl"
        jsonl.write_text("".join(json.dumps(i) + "\n" for i in hist["instances"]))
        (Path(tmp) / "mirrors").mkdir()
        (Path(tmp) / "mirrors" / env["name"]).symlink_to((env_dir / "repo").resolve())
        got = import_instances(jsonl, str(Path(tmp) / "mirrors"), out_dir, BootstrapConfig(), log=log,
                               canaries=canaries)
    stats.update(imported=got["imported"], refused=got["refused"])
    return stats, [out_dir / t for t in got["tasks"]]


def write_repo_task(task_dir: Path, env: dict, env_dir: Path, rel: str, original: str, mutant: str, kind: str,
                    function: str, f2p: list[str], p2p: list[str], instructions: str) -> Path:
    """One mined task: the change folded into the repository's last commit, the FAIL_TO_PASS
    files taken out of it (they come back with the reference)."""
    hidden = sorted({t.split("::", 1)[0] for t in f2p})
    return write_pytest_task(
        task_dir, env, env_dir, changes={rel: mutant, **{h: None for h in hidden}},
        reference={rel: original.encode(), **{h: (env_dir / "tests" / h).read_bytes() for h in hidden}},
        hidden_tree=env_dir / "tests", f2p=f2p, p2p=p2p, instructions=instructions, source=SOURCE,
        source_file=f"{norm_name(env['name'])}:{rel}", reference_meta={"files": [rel], "kind": "bugfix", "mutation": kind,
                                                             "function": function},
        origin_extra={"change": kind, "file": rel, "function": function})


@task_source(name=SOURCE, count=None, eval_share=0.5, rl=True, eval_every_task=True, eval_samples=2, sft_demos=0)
def build(req: BuildRequest) -> tuple[list[Path], dict]:
    """The synthetic-bug tasks mined from each repository environment (``build.repo_environment``);
    the summary's ``repositories``: each environment's row. Split on their own, half of them held
    out: a repository gives a few modules with many tasks each. Graded by the repository's own
    suite (seconds each), so evaluated with fewer samples; no SFT demonstration (a transcript that
    reads a module of a real package is longer than the tiny model's sequence)."""
    repos = {name: json.loads(Path(env_out, "environment.json").read_text())
             for name, env_out in sorted(req.environments.items())}
    dirs = environment_tasks(req.environments, req.out, SOURCE)
    return dirs[:req.count] if req.count is not None else dirs, {"repositories": repos}
