"""Running a task's hidden tests (and canaries) against a final workspace in sandboxes, reading
their sealed results, and scoring them.

Running the tests. The final workspace is copied to a fresh directory. Each test file is bound
read-only at ``/var/tmp/checks/test_<hash of its content>.py`` (so a file's name says nothing
about what it is) and run by ``check_runner`` (``python3 -I -B``: no cwd, PYTHONPATH or user
site on sys.path, no bytecode, no pytest: no conftest, plugin, ini file or startup hook of the
workspace is ever loaded). The runner imports each test module, runs its ``unittest`` cases and
module-level ``test*`` functions and catches each outcome itself.

Tamper-evident results. The verdict is not what the code under test prints or writes:

* a per-run secret key goes to the runner on standard input and is consumed before any code of
  the workspace is imported; the runner writes one ``results.json`` (created exclusively, links
  not followed) into a report directory, sealed with an HMAC of the key. A missing seal, a bad
  MAC, or any other entry in the report directory (a planted junit file, a FIFO, a link) voids
  the run and raises a ``framework_tamper`` or ``result_file`` flag;
* before importing anything from the workspace the runner records the framework objects the
  verdict rests on (builtins, exits, ``unittest``'s case/result/suite/loader methods, its own
  functions, trace and profile hooks, ``sys.meta_path``) and re-checks them after every test and
  at the end; a change raises ``framework_tamper``;
* with the task's record of which hidden tests the reference passes (``task.json`` ->
  ``checks.expected``), a skipped, xfailed, errored or never-run expected test is a failure;
* canary tests (``canaries``): copies of the hidden tests with expected values changed, which
  the reference fails (verified when the task was built). Each canary runs in its own sandbox
  and copy of the workspace, under the same kind of name and path as the hidden tests, so code
  under test cannot tell a canary run from the real one nor talk to the other run. Whatever makes
  a test pass without a correct solution (a forged result, a patched framework, a value read from
  the caller's frame, an object equal to everything) makes the canary pass too: a passing canary
  zeroes the reward and raises ``canary_passed``. Which files are canaries is recorded only in
  ``task.json`` and under ``canaries/`` of the task directory, neither of which is ever bound
  into a sandbox. Nothing else tells the runs apart: each runs under an identity of its own
  (``sandbox.identity_lease``: no per-user kernel object is shared), they run one at a time in a
  random order (``grade``: two live runs would share the CPUs and the open events of the image's
  files), every file of the checks tree has the same time (``CHECKS_MTIME``), and the episode's
  masks apply (``grading_masks``: a stdlib task's original module and test modules stay hidden,
  so there is no original to compare a canary with).

What remains possible in principle: code under test runs in the runner's process, so a
solution written against this runner could find the key in memory and forge a sealed result;
the forgery is the same in every run, so a canary passes and the episode is zeroed, unless the
solution can tell the canary's expected values from the real ones (that is, already solves the
task). The runs of one grading never overlap, and they follow each other on one kernel whose
caches over the image's read-only files they would all use (a file one run read stays cached for
a later run to time): ``grade`` drops those caches before each run, keeping only what the task's
reference run reads (``page_cache.cold``), so every run starts from the same state. Gradings of
different episodes overlap and share the CPUs.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import shutil
import stat
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Literal, Optional

from pydantic import Field

from composer_dag.runtime.config import StageConfig
from composer_dag.repos import bytecode, pytest_report
from composer_dag.laptop.image import PYVER, task_persona
from composer_dag.laptop.desktop import dressing
from composer_dag.sandbox import Bind, Limits, Sandbox, identity_lease, scratch, share_tree, volume_workspace
from composer_dag.sandbox.volumes import Volume, unmounting as _unmounting
from composer_dag.tasks.taskdir import check_name, hidden_files, load_task, project_name


SCRATCH = "/var/tmp"  # a grading run's: its runner, checks and report directory, on a tmpfs of its own


CHECKS_DIR = "/var/tmp/checks"


REPORT_DIR = "/var/tmp/report"


RUNNER_PATH = "/var/tmp/runner.py"


RUNNER = Path(__file__).with_name("check_runner.py")
PYTEST_REPORT = Path(pytest_report.__file__)  # laid beside the runner for a pytest task


RUNNER_FAILED = 3  # the runner's exit code when it could not write its results


def grading_sandbox(task: dict, workspace: Path, limits: Limits, binds: list[Bind], identity: int | None = None,
                    masks: dict[str, Path | None] | None = None, chown: bool = True,
                    volume: Volume | None = None) -> Sandbox:
    """The sandbox a grading run uses: the task's persona (the episode's laptop), the runner's
    binds, the run's own ``identity`` (a uid no other live run holds) and the episode's ``masks``
    (``grading_masks``)."""
    return Sandbox(workspace, limits, project=workspace.name, binds=binds, dressing=dressing(task_persona(task), identity),
                   identity=identity, masks=masks, chown=chown, volume=volume)


def grading_masks(task_dir: Path, task: dict) -> dict[str, Path | None]:
    """What the episode hid, hidden at grading too (``task.json`` -> ``sandbox.masks``): the
    interpreter's copy of a stdlib task's module stays the broken one; its test suite, hidden
    whole in the episode, shows only ``test.support`` and the data files (the hidden tests import
    them), never an original of a test module."""
    out: dict[str, Path | None] = {}
    for path, name in ((task.get("sandbox") or {}).get("masks") or {}).items():
        if name is None and path == f"/usr/local/lib/python{PYVER}/test":
            from composer_dag.laptop.image import stdlib_test_support

            out[path] = stdlib_test_support()
        else:
            out[path] = Path(task_dir) / "masks" / name if name else None
    return out


CHECKS_MTIME = 1_700_000_000
"""Every file and directory of a run's checks tree carries this time: a canary written into the
tree just before its run must not be newer than the files around it."""


class GradeConfig(StageConfig):
    """How an episode is graded into a reward (reached from a run config as
    ``orchestrator.episode.grade`` for RL and ``agent.episode.grade`` for evaluation)."""

    reward_mode: Literal["binary", "fraction"] = Field(
        "binary", description="binary: 1 if every expected hidden test passes; fraction: the share that passes")
    flag_penalty: Optional[float] = Field(0.0, description="the reward of a flagged episode (None: flags are only recorded)")
    timeout: Optional[float] = Field(None, description="seconds per test run (None: the task's limits.test_timeout)")
    exclusive_runs: bool = Field(False, description="run a grading's runs alone on the machine: one grading's runs at "
                                                    "a time, and every episode's sandbox frozen meanwhile, so that no "
                                                    "live sandbox beside them can relay anything between runs (the "
                                                    "setting for a grading node with episodes beside it; its cost is "
                                                    "the gradings' concurrency)")
    cold_runs: bool = Field(True, description="drop the kernel's page, dentry and inode caches before each run of a "
                                              "grading (the machine's: vm.drop_caches), so that no run can see what "
                                              "an earlier one read, looked up or evicted")


def run_checks(task_dir: Path, workspace: Path, files: list[Path], timeout: float | None = None,
               limits: Limits = Limits(), placed: dict[str, Path] | None = None,
               trusted: bool = False) -> tuple[dict[str, str], dict]:
    """Copy ``workspace`` and run the test ``files`` against it in one sandbox with the runner.
    ``placed`` (a repository task's): more files to run, each laid at its path in the recorded
    test tree (``repo_task.verify_canaries``: the canaries of several tasks, side by side).
    ``trusted``: ``workspace`` is a tree this process made (a task's checkout, its reference), never
    an episode's: its files are hard-linked, read-only to the run (``sandbox.share_tree``).

    Returns (per_test, details): outcomes by ``<file stem>[.<Class>]::<test>`` (plus
    ``<name>#message`` for failures), and ``details`` with ``valid`` (a sealed, verified result
    and nothing else in the report directory), ``tamper`` and ``events`` seen by the runner,
    ``report_extra`` (entries the runner did not write), the exit code, time and output."""
    task_dir = Path(task_dir)
    task = load_task(task_dir)
    timeout = timeout or task.get("limits", {}).get("test_timeout", 120)
    key = secrets.token_hex(32)
    pytest_task = task.get("framework") == "pytest"
    with tempfile.TemporaryDirectory(prefix="cdag-g-") as tmp, identity_lease() as uid, _unmounting(tmp):
        volume = None
        if trusted:
            ws = Path(tmp) / project_name(task)
            share_tree(workspace, ws, uid, uid, skip=frozenset(("__pycache__", ".pytest_cache")))
        else:  # an episode's tree: copied into a /home file system of the run's own, where there is one
            volume, ws = volume_workspace(task_persona(task), project_name(task), limits, tmp)
            shutil.copytree(workspace, ws, symlinks=True, ignore=_skip_in_copy, dirs_exist_ok=True)
        # the runner, the checks and the report directory, in the run's /var/tmp (a tmpfs of its own)
        var = scratch(Path(tmp) / "var", limits)
        shutil.copy2(RUNNER, var / Path(RUNNER_PATH).name)
        os.chmod(var / Path(RUNNER_PATH).name, 0o644)
        report = var / Path(REPORT_DIR).name
        report.mkdir()
        checks = var / Path(CHECKS_DIR).name
        if pytest_task:
            stems, (binds, inside) = {}, _place_pytest_checks(task_dir, task, ws, checks, files, placed)
        else:
            binds, (stems, inside) = [], _place_unittest_checks(checks, files)
        os.chmod(checks, 0o755)
        for p in [*checks.rglob("*"), checks]:
            os.utime(p, (CHECKS_MTIME, CHECKS_MTIME), follow_symlinks=False)
        binds += [Bind(var, SCRATCH, writable=True)]
        with grading_sandbox(task, ws, limits, binds, uid, grading_masks(task_dir, task), chown=not trusted,
                             volume=volume) as sb:
            shutil.chown(report, sb.persona.uid, sb.persona.gid)
            # a repository task: the project's venv python, without site at startup (-S: the runner
            # adds the site directories itself once it holds its key)
            argv = [f"{sb.root}/.venv/bin/python", "-I", "-S", "-B"] if pytest_task else ["python3", "-I", "-B"]
            argv += [RUNNER_PATH, sb.root, REPORT_DIR, *inside]
            r = sb.run(argv, timeout=timeout, stdin=key + "\n", env={"PYTHONDONTWRITEBYTECODE": "1"})
            inside_root = str(sb.root).rstrip("/") + "/"
        payload, extra, problem = _read_results(report, key)
    per_test, details = _run_outcome(r, payload, extra, problem, stems)
    # what the solution's code wrote and read back, or compiled from a string, during the run
    # (base64, by its path in the workspace or inside the sandbox): read as the solution's data
    details["built"] = {k[len(inside_root):] if k.startswith(inside_root) else k: str(v)
                        for k, v in ((payload or {}).get("built") or {}).items()}
    return per_test, details


def _place_pytest_checks(task_dir: Path, task: dict, ws: Path, checks: Path, files: list[Path],
                         placed: dict[str, Path] | None) -> tuple[list[Bind], list[str]]:
    """Lay a repository task's checks: the recorded tree (tests, conftest files, helpers,
    pytest.ini), a canary replacing the one file it was made from, and ``placed``; the
    workspace's virtual environment made afresh, and the bootstrap runs' reporting plugin beside
    the runner (whose outcome mapping it uses). Returns the binds and the runner's arguments."""
    shutil.copytree(task_dir / "hidden_tests", checks)
    shutil.copy2(PYTEST_REPORT, checks.parent / PYTEST_REPORT.name)
    os.chmod(checks.parent / PYTEST_REPORT.name, 0o644)
    canary_info = (task.get("checks") or {}).get("canaries") or {}
    inside = []
    for f in files:
        f = Path(f)
        rel = (canary_info.get(f.name) or {}).get("replaces") if f.parent.name == "canaries" else \
            f.relative_to(task_dir / "hidden_tests").as_posix()
        if f.parent.name == "canaries":
            (checks / rel).write_bytes(f.read_bytes())
        inside.append(rel)
    for rel, f in (placed or {}).items():
        (checks / rel).write_bytes(Path(f).read_bytes())
        inside.append(rel)
    for p in [checks, *checks.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    from composer_dag.repos.layers import venv_binds

    binds = venv_binds(ws, task_dir / "layer", f"{task_persona(task).home}/{ws.name}")
    bytecode.warm(task_dir / "repo")  # the task's own tree, never the workspace's files
    bytecode.lay(ws)
    sites = f"{binds[0].path}:/usr/local/lib/python{PYVER}/site-packages"  # the layer's, the system's
    return binds, ["--pytest", f"{CHECKS_DIR}/pytest.ini", CHECKS_DIR, sites, *[f"{CHECKS_DIR}/{r}" for r in inside]]


def _place_unittest_checks(checks: Path, files: list[Path]) -> tuple[dict[str, str], list[str]]:
    """Lay each test file in ``checks`` under the name its content gives it (``check_name``).
    Returns its stem by that name, and the runner's arguments."""
    checks.mkdir(mode=0o755)
    stems, inside = {}, []
    for f in files:
        data = Path(f).read_bytes()
        mod = check_name(data)
        stems[mod] = Path(f).stem
        inside.append(f"{CHECKS_DIR}/{mod}.py")
        (checks / f"{mod}.py").write_bytes(data)
        os.chmod(checks / f"{mod}.py", 0o644)
    return stems, inside


def _run_outcome(r, payload: dict | None, extra: list, problem, stems: dict[str, str]) -> tuple[dict[str, str], dict]:
    """``run_checks``' result from the sealed payload and the sandbox's run ``r``."""
    per_test: dict[str, str] = {}
    if payload is not None:
        msgs = payload.get("messages") or {}
        for k, v in (payload.get("results") or {}).items():
            name = _rename(k, stems)
            per_test[name] = str(v)
            if k in msgs:
                per_test[name + "#message"] = str(msgs[k])[:500]
    details = {"exit_code": r.exit_code, "timed_out": r.timed_out, "seconds": round(r.seconds, 3),
               "output_tail": (r.stdout + r.stderr)[-3000:], "valid": payload is not None and not extra,
               "sealed": payload is not None, "problem": problem, "report_extra": extra,
               "tamper": list((payload or {}).get("tamper") or []),
               "foreign": [str(x)[:300] for x in (payload or {}).get("foreign") or []][:20],
               "events": [_rename_text(e, stems) for e in (payload or {}).get("events") or []],
               "killed_reason": r.killed_reason}
    return per_test, details

def _rename(key: str, stems: dict[str, str]) -> str:
    mod = key.split("::", 1)[0].split(".", 1)[0]
    return stems[mod] + key[len(mod):] if mod in stems else key


def _rename_text(text: str, stems: dict[str, str]) -> str:
    for mod, stem in stems.items():
        text = text.replace(mod, stem)
    return str(text)


def _read_results(report: Path, key: str) -> tuple[dict | None, list[str], str | None]:
    """(payload, other entries, problem): the payload only when the MAC verifies. Nothing in the
    report directory is followed or opened unless it is a regular file."""
    extra = sorted(n for n in os.listdir(report) if n != "results.json")
    path = report / "results.json"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None, extra, "no results"
    if not stat.S_ISREG(st.st_mode) or st.st_size > 64 << 20:
        return None, extra + ["results.json"], "results.json is not a regular file"
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        data = b""
        while chunk := os.read(fd, 1 << 20):
            data += chunk
    finally:
        os.close(fd)
    mac, _, payload = data.partition(b"\n")
    good = hmac.new(key.encode(), payload, hashlib.sha256).hexdigest().encode()
    if not hmac.compare_digest(mac, good):
        return None, extra, "results not sealed by the runner"
    try:
        return json.loads(payload), extra, None
    except ValueError:
        return None, extra, "results unreadable"


def run_hidden_tests(task_dir: Path, workspace: Path, timeout: float | None = None,
                     limits: Limits = Limits(), trusted: bool = False) -> tuple[dict[str, str], dict]:
    """Run ``task_dir/hidden_tests`` against a copy of ``workspace``; (per_test, details).
    A run whose results are void (see ``run_checks``) has no per-test outcomes."""
    per_test, details = run_checks(task_dir, workspace, hidden_files(task_dir), timeout, limits, trusted=trusted)
    return (per_test if details["valid"] else {}), details


def _skip_in_copy(d: str, names: list[str]) -> set[str]:
    """Caches, and FIFOs, sockets and devices (which cannot be copied and would block a reader)."""
    return {n for n in names if n in ("__pycache__", ".pytest_cache")
            or not stat.S_ISREG(m := os.lstat(os.path.join(d, n)).st_mode) and not stat.S_ISDIR(m)
            and not stat.S_ISLNK(m)}


def parse_junit(path: Path) -> dict[str, str]:
    """Per-test outcomes from a JUnit report; none unless it is a regular file (not a link or a
    FIFO) holding valid XML."""
    if path.is_symlink() or not path.is_file():
        return {}
    out = {}
    try:
        cases = list(ET.parse(path).getroot().iter("testcase"))
    except ET.ParseError:
        return {}
    for case in cases:
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                if child.tag != "skipped":
                    out[name + "#message"] = (child.get("message") or child.text or "")[:500]
                break
        out[name] = outcome
    return out


def failures(per_test: dict[str, str]) -> dict[str, str]:
    """Failed/errored test names -> their message."""
    return {k: per_test.get(k + "#message", "") for k, v in per_test.items()
            if not k.endswith("#message") and v in ("failed", "error")}


def outcomes(per_test: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in per_test.items() if not k.endswith("#message")}


def score(per_test: dict[str, str], expected: list[str] | None) -> tuple[int, int]:
    """(passed, failed) of the hidden tests. With the task's record of the tests the reference
    passes, each of them must pass: skipped, xfailed, errored or missing counts as failed."""
    res = outcomes(per_test)
    if expected is not None:
        passed = sum(res.get(k) == "passed" for k in expected)
        return passed, len(expected) - passed
    return (sum(v == "passed" for v in res.values()),
            sum(v in ("failed", "error", "xfailed", "xpassed") for v in res.values()))


def canary_passes(per_test: dict[str, str], details: dict, failing: list[str]) -> bool:
    """A canary passes when every test of it that the reference fails reports passed."""
    res = outcomes(per_test)
    if failing:
        return all(res.get(k) == "passed" for k in failing)
    return bool(res) and all(v == "passed" for v in res.values())
