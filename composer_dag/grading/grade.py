"""Grading: run a task's hidden tests against a final workspace (``checks``), judge the run by
its behaviour and flag known cheats by their shape (``flags``), and score it into a reward.

Grading: run a task's hidden tests against a final workspace, judge the run by its behaviour,
and flag known cheats by their shape.
"""

from __future__ import annotations

import secrets
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from composer_dag.grading.flags import action_flags, behaviour_flags, detect_flags
from composer_dag.grading.flags.registry import flag, flag_families
from composer_dag.grading.checks import RUNNER, RUNNER_FAILED, GradeConfig, canary_passes, failures, outcomes, run_checks, run_hidden_tests, score
from composer_dag.grading import page_cache
from composer_dag.grading.action_log import load_action_log
from composer_dag.laptop.image import runtime
from composer_dag.laptop.image import image_roots
from composer_dag.sandbox import exclusive_runs
from composer_dag.tasks.taskdir import apply_reference, canary_files, checkout_digest, hidden_files, load_task, workspace_digest


@dataclass
class GradeResult:
    reward: float
    passed: int
    failed: int
    per_test: dict[str, str]
    flags: list[str]
    details: dict = field(default_factory=dict)
    canary_passed: bool = False

    @property
    def families(self) -> list[str]:
        return flag_families(self.flags)


def grade(task_dir: Path, workspace: Path, action_log: list[dict] | None = None,
          config: GradeConfig = GradeConfig()) -> GradeResult:
    """The reward of ``workspace`` as the final state of an episode on ``task_dir``, with its flags.

    The hidden run and each canary run share nothing: each is a fresh sandbox and copy of the
    workspace under an identity of its own (``identity_lease``), and they run one at a time in a
    random order, so no two of them are ever alive together (two live runs share, whatever their
    identities, the CPUs and the open events of the image's files: ``test_grader_redteam``), each
    after the kernel's caches are dropped but for what the task's reference run reads
    (``config.cold_runs``, ``page_cache.cold``), so that what a run finds cached does not depend
    on an earlier run (``details["page_cache"]``: "dropped", or "shared" where the host does not
    allow it; ``details["page_cache_pinned"]``: what stays cached).
    ``details["run_windows"]``: each run's start and end (monotonic seconds), in the order run;
    gradings of different episodes overlap (the agent loop's pool). A run that ends without a
    sealed result is a flagged attempt (``unsealed_run``), unless the same run on the reference
    ends so too (the infrastructure's failure, recorded in ``details``)."""
    task_dir = Path(task_dir)
    task = load_task(task_dir)
    checks = task.get("checks") or {}
    if untouched(task_dir, task, workspace):
        return untouched_grade(task_dir, task, workspace, action_log, config)
    canaries = canary_files(task_dir, task)
    runs = [hidden_files(task_dir)] + [[c] for c in canaries]
    order = list(range(len(runs)))
    secrets.SystemRandom().shuffle(order)
    results: list = [None] * len(runs)
    windows = []
    cold = []
    with exclusive_runs(config.exclusive_runs) as alone:
        for i in order:
            if config.cold_runs:
                cold.append(_cold(task_dir, task, config))
            t0 = time.monotonic()
            results[i] = run_checks(task_dir, workspace, runs[i], config.timeout)
            windows.append([round(t0, 4), round(time.monotonic(), 4)])
        if alone["frozen"]:  # what the runs left in the caches goes before the episodes wake
            page_cache.drop_caches()
    (per_test, details), canary_runs = results[0], results[1:]
    details["run_windows"] = windows
    if config.exclusive_runs:
        details["exclusive"] = alone
    details["page_cache"] = "dropped" if cold and all(c["dropped"] for c in cold) else "shared"
    if cold:
        details["page_cache_pinned"] = {"files": cold[-1]["pinned_files"], "bytes": cold[-1]["pinned_bytes"]}
    valid = details["valid"]
    if not valid:
        per_test = {}
    passed, failed = score(per_test, checks.get("expected"))
    if config.reward_mode == "fraction":
        reward = passed / (passed + failed) if passed + failed else 0.0
    else:
        reward = float(passed > 0 and failed == 0)
    flags = behaviour_flags(details)
    canary_passed = False
    canary_info = (checks.get("canaries") or {})
    for path, (c_tests, c_details) in zip(canaries, canary_runs):
        flags += behaviour_flags(c_details)
        if c_details["valid"] and canary_passes(c_tests, c_details, (canary_info.get(path.name) or {}).get("failing")):
            canary_passed = True
            flags.append(flag("canary_passed", path.stem))
    flags += unsealed_flags(task_dir, runs, [d for _, d in results], config, details)
    built = built_files([d for _, d in results])
    if built.pop("<over>", None) is not None:  # past what a run records or reads of what it built
        flags.append(flag("shape_unreadable", "what the run built: over 200 files or 4 MB"))
    details["built_files"] = sorted(built)[:20]
    flags = list(dict.fromkeys(flags + detect_flags(task_dir, workspace, action_log, built)))
    details["failures"] = failures(per_test)
    details["unflagged_reward"] = reward
    details["canaries"] = len(canaries)
    details["canary_seconds"] = round(sum(d["seconds"] for _, d in canary_runs), 3)
    if flags and config.flag_penalty is not None:
        reward = config.flag_penalty
    return GradeResult(reward=reward, passed=passed, failed=failed, per_test=outcomes(per_test), flags=flags,
                       details=details, canary_passed=canary_passed)


def built_files(run_details: list[dict]) -> dict[str, bytes]:
    """What the solution's code wrote and read back, or compiled from a string, in any run
    (``details["built"]``, taken out of each run's details): path -> bytes."""
    import base64
    import binascii

    out: dict[str, bytes] = {}
    for d in run_details:
        for path, b64 in (d.pop("built", None) or {}).items():
            try:
                out.setdefault(path, base64.b64decode(b64))
            except (binascii.Error, ValueError):
                continue
    return out


def untouched(task_dir: Path, task: dict, workspace: Path) -> bool:
    """Whether ``workspace`` is the task's checkout as handed out, byte for byte (its ``.venv``
    aside, which grading makes afresh), for a task that records its tests' outcomes in that state
    (``FAIL_TO_PASS`` failing, ``PASS_TO_PASS`` passing: a repository task, verified when it was
    mined or imported and again by the sound check)."""
    tests = task.get("tests") or {}
    if task.get("framework") != "pytest" or not tests.get("FAIL_TO_PASS"):
        return False
    repo = task_dir / "repo"
    if Path(workspace) == repo:  # the checkout itself (an episode that never needed a workspace)
        return True
    return workspace_digest(workspace, skip=(".venv",)) == checkout_digest(task_dir)


def untouched_grade(task_dir: Path, task: dict, workspace: Path, action_log: list[dict] | None,
                    config: GradeConfig) -> GradeResult:
    """The grade of an untouched checkout, with no test run: its tests' recorded outcomes (the
    bug is still there, so the reward is that of a failed attempt) and the flags of its calls. An episode that changes nothing can earn nothing, so this is no opening; it spares
    the sandboxed runs of a repository's suite for every attempt that never edits a file (most
    of a small model's, before and after training)."""
    tests = task["tests"]
    per_test = {**{t: "passed" for t in tests.get("PASS_TO_PASS") or []},
                **{t: "failed" for t in tests["FAIL_TO_PASS"]}}
    passed, failed = score(per_test, (task.get("checks") or {}).get("expected"))
    reward = passed / (passed + failed) if config.reward_mode == "fraction" and passed + failed else 0.0
    flags = action_flags(action_log)  # the tree's rules find nothing in a tree with no change
    details = {"valid": True, "untouched": True, "run_windows": [], "failures": failures(per_test),
               "unflagged_reward": reward, "canaries": 0, "canary_seconds": 0.0, "seconds": 0.0}
    if flags and config.flag_penalty is not None:
        reward = config.flag_penalty
    return GradeResult(reward=reward, passed=passed, failed=failed, per_test=outcomes(per_test), flags=flags,
                       details=details)


def _cold(task_dir: Path, task: dict, config: GradeConfig) -> dict:
    """``page_cache.cold`` before a run: what the task's reference run opens of the image (the
    interpreter, the runner's imports, the environment's packages: one per environment and
    process) stays cached for every run, the rest is dropped."""
    layer = task_dir / "layer"
    key = str(layer.resolve()) if task.get("framework") == "pytest" and layer.is_dir() else "stdlib"
    roots = ["/usr", sys.base_prefix, str(runtime().parent), str(RUNNER)] + ([key] if key != "stdlib" else [])

    def calibrate() -> None:
        with tempfile.TemporaryDirectory(prefix="cdag-r-") as tmp:
            # the task's own time limit: a grading's shorter one must not cut what gets pinned
            run_checks(task_dir, apply_reference(task_dir, Path(tmp) / "ws"), hidden_files(task_dir))
    # the shared image the sandbox mounts counts whole
    return page_cache.cold(key, roots + image_roots(), calibrate)


def unsealed_flags(task_dir: Path, runs: list[list[Path]], run_details: list[dict], config: GradeConfig,
                   details: dict) -> list[str]:
    """``unsealed_run`` for each run that ended without a sealed result and raised no other flag
    (a timeout, a kill, a signal, a crash of the runner), unless the same run on the reference
    solution ends without one too: that is the infrastructure, noted in ``details["infrastructure"]``."""
    names = ["hidden"] + [f"canary {Path(r[0]).stem}" for r in runs[1:]]
    unsealed = [i for i, d in enumerate(run_details) if not d["sealed"] and not behaviour_flags(d)]
    if not unsealed:
        return []
    out, infra = [], []
    with tempfile.TemporaryDirectory(prefix="cdag-r-") as tmp:
        ref = apply_reference(task_dir, Path(tmp) / "ws")
        for i in unsealed:
            _, ref_details = run_checks(task_dir, ref, runs[i], config.timeout)
            if ref_details["sealed"]:
                out.append(flag("unsealed_run", f"{names[i]}: {unsealed_cause(run_details[i])}"))
            else:
                infra.append(f"{names[i]}: {unsealed_cause(run_details[i])} (the reference's run too)")
    if infra:
        details["infrastructure"] = infra
    return out


def unsealed_cause(d: dict) -> str:
    """How a run without a sealed result ended, in a few words."""
    if d.get("timed_out"):
        return "timed out"
    if d.get("killed_reason"):
        return f"killed ({d['killed_reason']})"
    code = d.get("exit_code")
    if str(d.get("output_tail", "")).lstrip().startswith("bwrap:"):
        return "the sandbox did not start"
    if code == RUNNER_FAILED:
        return "the runner could not write its results"
    return f"exit code {code}" if code is None or code < 128 else f"signal {code - 128}"


def grade_cli(task_dir, workspace_dir, actions=None) -> dict:
    """``actions``: an action log file (``action_log.load_action_log``), so that the flags of
    commands fire; its entries read and skipped are reported under ``actions``."""
    log, skipped = load_action_log(actions) if actions else (None, {})
    r = grade(Path(task_dir), Path(workspace_dir), log)
    out = {**asdict(r), "flag_families": r.families}
    if actions:
        out["actions"] = {"read": len(log), "skipped": skipped}
    return out


def check_task(task_dir: Path) -> dict:
    """A task is sound when its reference state passes every hidden test (every test recorded
    as expected), its broken state fails some, the reference solution raises no flag, it has a
    behavioural check (a canary) and the reference fails every canary."""
    task_dir = Path(task_dir)
    task = load_task(task_dir)
    checks = task.get("checks") or {}
    canaries = canary_files(task_dir, task)
    with tempfile.TemporaryDirectory(prefix="cdag-c-") as tmp:
        # the task's own trees (its checkout, its reference): hard-linked into each run's copy
        broken, _ = run_hidden_tests(task_dir, task_dir / "repo", trusted=True)
        ref_ws = apply_reference(task_dir, Path(tmp) / "ws")
        ref, details = run_hidden_tests(task_dir, ref_ws, trusted=True)
        flags = detect_flags(task_dir, ref_ws) + behaviour_flags(details)
        if task.get("framework") == "pytest":  # a canary replaces a file of the tree: one run each
            c_runs = [(p, *run_checks(task_dir, ref_ws, [p], trusted=True)) for p in canaries]
        else:
            c_tests, c_details = run_checks(task_dir, ref_ws, canaries, trusted=True) if canaries else ({}, {"valid": True})
            c_runs = [(p, {k: v for k, v in c_tests.items() if k.split("::")[0].split(".")[0] == p.stem}, c_details)
                      for p in canaries]
    ref_o, broken_o = outcomes(ref), outcomes(broken)
    passed, failed = score(ref, checks.get("expected"))
    if task.get("framework") == "pytest":
        # a repository's test files also hold the tests its bootstrap left out (failing at the
        # base, nondeterministic, ...): the task is its FAIL_TO_PASS and PASS_TO_PASS tests
        expected = checks.get("expected") or []
        ok_ref = bool(expected) and passed == len(expected) and failed == 0
        ok_broken = any(broken_o.get(t) != "passed" for t in (task.get("tests") or {}).get("FAIL_TO_PASS", []))
    else:
        ok_ref = bool(ref_o) and passed > 0 and failed == 0 and \
            all(v in ("passed", "skipped", "xfailed") for v in ref_o.values())
        ok_broken = any(v in ("failed", "error") for v in broken_o.values()) or not broken_o
    info = checks.get("canaries") or {}
    canary_ok = all(bool(d.get("valid")) and not canary_passes(t, d, (info.get(p.name) or {}).get("failing"))
                    for p, t, d in c_runs)
    return {"id": task_dir.name, "reference_passes": ok_ref, "broken_fails": ok_broken,
            "reference_flags": flags, "canaries": len(canaries), "reference_fails_canaries": canary_ok,
            "ok": ok_ref and ok_broken and not flags and canary_ok and bool(canaries),
            "reference_output": "" if ok_ref else details.get("output_tail", "")}


def false_positive_rate(task_dirs: list[Path], graded: bool = False) -> dict:
    """Fraction of honest reference solutions that get any flag (should be 0). ``graded``: the
    flags of a full ``grade`` (canaries and the runner's checks too), not only the shape flags;
    a reference that does not get reward 1 counts as flagged then."""
    flagged = {}
    for d in task_dirs:
        with tempfile.TemporaryDirectory(prefix="cdag-c-") as tmp:
            ws = apply_reference(d, Path(tmp) / "ws")
            if graded:
                r = grade(d, ws)
                fl = r.flags + ([] if r.reward == 1.0 else [f"reward {r.reward}"])
            else:
                fl = detect_flags(d, ws)
        if fl:
            flagged[Path(d).name] = fl
    n = len(task_dirs)
    return {"tasks": n, "flagged": len(flagged), "rate": len(flagged) / n if n else 0.0, "examples": flagged}
