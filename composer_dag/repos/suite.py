"""A repository's tests run in the sandbox, offline, against the layer: one run (``run_tests``,
its outcomes read from the reporting plugin, ``pytest_report.py``), and the runs that decide
which tests are kept (``reliable_tests``).

The suite runs three times: twice as it is and once with the clock moved years ahead
(Debian's ``faketime``), another ``PYTHONHASHSEED`` and another ``random`` seed. A test is kept
when it passes every time. Then the package's functions are all replaced by
``raise NotImplementedError``: a kept test that still passes tests nothing of the code and is
left out as vacuous."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from composer_dag.repos import bytecode
from composer_dag.laptop.image import Persona
from composer_dag.repos.config import NETWORK_ERRORS, BootstrapConfig, BootstrapError
from composer_dag.repos.layers import repo_sandbox, venv_binds
from composer_dag.repos.layout import Layout, package_files
from composer_dag.sandbox import Bind, share_tree

CHECKS_DIR = "/var/tmp/checks"  # where the recorded test tree sits in every run, here and at grading
REPORT_DIR = "/var/tmp/cdag-report"

PLUGIN = Path(__file__).with_name("pytest_report.py")


def pytest_args(ini: str, paths: list[str]) -> list[str]:
    """The arguments of every run of a repository's tests, here and at grading: the recorded
    settings, the recorded tree as the root, no cache, no conftest or ini file above it."""
    return ["-c", ini, "--rootdir", CHECKS_DIR, "--confcutdir", CHECKS_DIR, "-p", "no:cacheprovider",
            "-o", "addopts=", "-q", "-rN", "--color=no", *[f"{CHECKS_DIR}/{p}" for p in paths]]


def suite_command(layout: Layout) -> str:
    return " ".join([".venv/bin/python", "-m", "pytest", *pytest_args(f"{CHECKS_DIR}/pytest.ini", layout.test_paths[:3]),
                     "..." if len(layout.test_paths) > 3 else ""]).strip()


def run_tests(project: Path, tests_tree: Path, layer: Path, persona: Persona, paths: list[str], timeout: float,
              hash_seed: int = 0, random_seed: int = 0, shifted_time: str | None = None,
              changes: dict[str, str] | None = None) -> tuple[dict, dict]:
    """Run ``paths`` of the recorded test tree against a copy of ``project`` in one sandbox, with
    ``changes`` (path: new text) written into the copy.
    (outcomes by node id, details: seconds, exit code, timed_out, output tail)."""
    with tempfile.TemporaryDirectory(prefix="cdag-rt-") as tmp:
        ws = Path(tmp) / project.name
        # the project's files hard-linked, read-only to the run (it may replace them, never write
        # into them): a copy of networkx's 600 files cost as much as its tests' run
        share_tree(project, ws, persona.uid, persona.gid, skip=frozenset((".git", "__pycache__", ".venv")))
        for rel, text in (changes or {}).items():
            (ws / rel).unlink(missing_ok=True)  # never through the link into the project
            (ws / rel).write_text(text)
            os.lchown(ws / rel, persona.uid, persona.gid)
        keys: dict[str, str] = {}
        bytecode.warm(project, keys=keys)
        bytecode.lay(ws, keys={k: v for k, v in keys.items() if k not in (changes or {})})
        report = Path(tmp) / "report"
        report.mkdir()
        shutil.copy2(PLUGIN, report / "cdag_pytest_report.py")
        binds = venv_binds(ws, layer, f"{persona.home}/{ws.name}") + [Bind(tests_tree, CHECKS_DIR), Bind(report, REPORT_DIR, writable=True)]
        with repo_sandbox(ws, persona, binds, timeout, chown=False) as sb:
            shutil.chown(report, sb.persona.uid, sb.persona.gid)
            argv = [f"{sb.root}/.venv/bin/python", "-B", "-m", "pytest", "-p", "cdag_pytest_report",
                    *pytest_args(f"{CHECKS_DIR}/pytest.ini", paths)]
            if shifted_time:
                argv = ["faketime", shifted_time, *argv]
            env = {"PYTHONHASHSEED": str(hash_seed), "CDAG_RANDOM_SEED": str(random_seed),
                   "CDAG_PYTEST_REPORT": f"{REPORT_DIR}/results.json", "PYTHONPATH": REPORT_DIR,
                   "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}
            r = sb.run(argv, timeout=timeout, cwd=sb.root, env=env)
        try:
            results = json.loads((report / "results.json").read_text())
            messages = json.loads((report / "results.json.messages").read_text())
        except (OSError, ValueError):
            results, messages = {}, {}
    return results, {"seconds": round(r.seconds, 2), "exit_code": r.exit_code, "timed_out": r.timed_out,
                     "output_tail": (r.stdout + r.stderr)[-2000:], "messages": messages}


def stub_functions(source: str) -> str | None:
    """Every function and method body replaced by ``raise NotImplementedError`` (docstrings
    kept); None when the module does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = node.body[:1] if node.body and isinstance(node.body[0], ast.Expr) and isinstance(
                getattr(node.body[0], "value", None), ast.Constant) and isinstance(node.body[0].value.value, str) else []
            node.body = doc + [ast.Raise(exc=ast.Name(id="NotImplementedError", ctx=ast.Load()), cause=None)]
    return ast.unparse(ast.fix_missing_locations(tree))


def _classify(runs: list[dict]) -> tuple[list[str], dict[str, str]]:
    ids = sorted(set().union(*[set(r) for r in runs]))
    kept, out = [], {}
    for t in ids:
        seen = [r.get(t) for r in runs]
        if all(s == "passed" for s in seen):
            kept.append(t)
        elif "passed" in seen:
            out[t] = "nondeterministic"
        elif any(s == "collect_error" for s in seen):
            out[t] = "collection_error"
        elif all(s in ("skipped", "xfailed") for s in seen):
            out[t] = "skipped"
        else:
            out[t] = "fails_at_base"
    return kept, out


def reliable_tests(project: Path, tests: Path, layer: Path, persona: Persona, layout: Layout, cfg: BootstrapConfig,
                   work: Path, log) -> tuple[list[str], dict[str, str], float]:
    """(kept, left out by reason, the suite's longest run): three runs (the third with the clock
    shifted, another hash seed and random seed), then the hack probe on what passed every time."""
    paths = layout.test_paths[:cfg.max_test_files]
    runs, suite_seconds = [], 0.0

    def suite(shifted):
        return run_tests(project, tests, layer, persona, paths, cfg.test_timeout,
                         hash_seed=cfg.hash_seeds[bool(shifted)], random_seed=cfg.random_seeds[bool(shifted)],
                         shifted_time=shifted)

    # two runs at a time (each one process on one core): the first two, then the third beside the
    # hack probe, which is given five times the first two's time
    pool = ThreadPoolExecutor(2)
    try:
        futures = [pool.submit(suite, shifted) for shifted in (None, None)]
        stubbed_run = None
        for i, shifted in enumerate((None, None, cfg.shifted_time)):
            if i == 2:
                futures.append(pool.submit(suite, shifted))
            res, det = futures[i].result()
            log(f"run {i + 1}/3{' (clock shifted)' if shifted else ''}: {sum(v == 'passed' for v in res.values())} "
                f"of {len(res)} passed in {det['seconds']} s")
            if det["timed_out"]:
                raise BootstrapError("timeout", f"the suite ran over {cfg.test_timeout:.0f} s")
            if not res:
                text = det["output_tail"]
                if re.search(NETWORK_ERRORS, text):
                    raise BootstrapError("needs_network", f"the suite needs the network: {text[-300:]}")
                if det["exit_code"] in (1, 2, 3, 4) and re.search(r"Error|error:", text):
                    # pytest stopped before any test: a conftest or a setting this pytest refuses
                    raise BootstrapError("suite_does_not_start", f"pytest stopped before any test: {text[-400:]}")
                raise BootstrapError("no_tests_found", f"pytest reported no test: {text[-300:]}")
            runs.append(res)
            suite_seconds = max(suite_seconds, det["seconds"])
            if i == 0:
                first_messages = det["messages"]
            if i == 1:
                stubbed_run = pool.submit(_vacuous_run, project, tests, layer, persona, layout, paths, work,
                                          min(cfg.test_timeout, max(30.0, 5 * suite_seconds)))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    kept, left = _classify(runs)
    if not kept and any(re.search(NETWORK_ERRORS, m) for m in first_messages.values()):
        raise BootstrapError("needs_network", "the tests that fail at the base revision fail on the network: "
                                              + next(m for m in first_messages.values() if re.search(NETWORK_ERRORS, m))[-300:])
    if not kept and left and set(left.values()) == {"collection_error"}:
        why = next(iter(first_messages.values()), "")
        raise BootstrapError("suite_does_not_start", f"no test module imports in the sandbox: {why[-400:]}")
    if not kept:
        raise BootstrapError("tests_fail_at_base", f"no test passes reliably at the base revision "
                                                   f"({len(left)} left out: {reason_counts(left.values())})")
    res = stubbed_run.result()
    for t in kept:
        if res.get(t) == "passed":
            left[t] = "vacuous"
    kept = [t for t in kept if left.get(t) != "vacuous"]
    if not kept:
        raise BootstrapError("tests_fail_at_base", "every passing test still passes with the code replaced by "
                                                   "NotImplementedError (vacuous)")
    return kept, left, suite_seconds


def _vacuous_run(project: Path, tests: Path, layer: Path, persona: Persona, layout: Layout, paths: list[str],
                 work: Path, timeout: float) -> dict:
    """The hack probe's outcomes: the suite against the code under test replaced by
    ``NotImplementedError``. Stubs can make a suite loop (a retry loop around a call that now
    raises): ``timeout`` is five times the suite's time; tests that had not passed by then are
    not vacuous."""
    stubbed = work / "stubbed" / project.name
    shutil.copytree(project, stubbed, symlinks=True, ignore=shutil.ignore_patterns(".git"))
    try:
        for rel in package_files(stubbed, layout):
            s = stub_functions((stubbed / rel).read_text(errors="replace"))
            if s is not None:
                (stubbed / rel).write_text(s)
        return run_tests(stubbed, tests, layer, persona, paths, timeout)[0]
    finally:
        shutil.rmtree(work / "stubbed", ignore_errors=True)


def reason_counts(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items()))
