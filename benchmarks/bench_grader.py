"""The grader before and after behavioural cheat detection: the red-team table, grading time per
episode, and the false-positive rate of the reference solutions on a full task build.

The grader as it was is taken from a commit into a temporary copy and run in a subprocess
with that copy first on ``PYTHONPATH``:

    rm -rf /tmp/old && mkdir -p /tmp/old && git archive HEAD | tar -x -C /tmp/old
    .venv/bin/python benchmarks/bench_grader.py redteam --old /tmp/old
    .venv/bin/python benchmarks/bench_grader.py timing --old /tmp/old --repeat 5 [--workers 4]
    .venv/bin/python benchmarks/bench_grader.py fp [--all-humaneval | --built DIR,DIR]
    .venv/bin/python benchmarks/bench_grader.py fp-mined [--repos parse==1.20.2,...] [--mined 8]
    .venv/bin/python benchmarks/bench_grader.py round2 --old /tmp/old --repeat 5
    .venv/bin/python benchmarks/bench_grader.py round3 --old /tmp/old

``timing --workers N``: batches of N x 5 episodes graded N at a time (the agent loop grades its
episodes through a pool of 4): the throughput per batch, beside each episode's latency.

``round2``: the second round's cheats (``tests/cheats.py`` ``ROUND_TWO``) on a HumanEval, a
stdlib bug-fix and a mined task (parse's sdist from ``tests/artifacts/sdists``, bootstrapped and
mined once), each graded ``--repeat`` times by the old grader (its runs race) and once by this one.

Each prints a Markdown table and, on its last line, a JSON summary.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if sys.argv[1:2] != ["old-worker"]:
    sys.path.insert(0, str(ROOT))


def build(out: Path, cfg: dict) -> list[Path]:
    from composer_dag.tasks.format import task_dirs
    from composer_dag.tasks.sources.build import build_tasks

    if not (out / "summary.json").exists():
        build_tasks(out, cfg)
    return task_dirs(out, "rl_tasks") + task_dirs(out, "eval_tasks")


def old_worker(jobs_file: str, workers: int = 1) -> None:
    """Grade each job with whatever ``composer_dag.grading.grade`` is first on the path."""
    import importlib

    g = importlib.import_module("composer_dag.grading.grade")

    jobs = json.loads(Path(jobs_file).read_text())
    print(json.dumps({"grader": g.__file__, "results": grade_all(g.grade, jobs, workers)}))


def grade_all(grade, jobs: list[dict], workers: int = 1) -> list[dict]:
    """Each job graded, ``workers`` gradings at a time (the agent loop's pool), in job order; each
    result with its own latency and the wall time of the whole batch (``batch_seconds``)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(j):
        t0 = time.perf_counter()
        r = grade(Path(j["task"]), Path(j["ws"]), j.get("log"))
        return {"reward": r.reward, "flags": r.flags, "seconds": time.perf_counter() - t0,
                "unflagged": r.details.get("unflagged_reward"),
                "cpu_sandbox_s": r.details.get("seconds", 0.0) + r.details.get("canary_seconds", 0.0)}

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, workers)) as pool:
        out = list(pool.map(one, jobs))
    wall = time.perf_counter() - t0
    for o in out:
        o["batch_seconds"] = wall
    return out


def run_old(old: Path, jobs: list[dict], workers: int = 1) -> tuple[str, list[dict]]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(jobs, f)
    env = dict(os.environ, PYTHONPATH=str(old))
    r = subprocess.run([sys.executable, __file__, "old-worker", f.name, "--workers", str(workers)], env=env,
                       capture_output=True, text=True, cwd=str(old))
    os.unlink(f.name)
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert str(old) in res["grader"], res["grader"]
    return res["grader"], res["results"]


def _short(flags: list[str]) -> str:
    from composer_dag.grading.flags.registry import flag_family

    return ", ".join(sorted({flag_family(f) for f in flags})) or "-"


def redteam(args) -> dict:
    from composer_dag.grading.grade import grade
    from tests.cheats import CHEATS, applicable, cheat_workspace, honest_workspace

    tasks = build(Path(args.tasks) / "he", {"humaneval_limit": 3, "bugfix_count": 0, "learnable_count": 0})
    tasks += build(Path(args.tasks) / "bf", {"humaneval_limit": 0, "bugfix_count": 2,
                                             "bugfix_modules": ["colorsys", "fnmatch"], "max_per_module": 1,
                                             "learnable_count": 0})
    work = Path(tempfile.mkdtemp(prefix="cdag-rt-"))
    jobs, rows = [], []
    for cheat in CHEATS:
        for kind in cheat.kinds:
            cands = [t for t in sorted(tasks) if t.name.startswith("humaneval" if kind == "humaneval" else "bugfix")
                     and applicable(cheat, t)]
            if not cands:
                continue
            task = cands[0]
            ws, log = cheat_workspace(cheat, task, work / f"{cheat.name}-{kind}")
            jobs.append({"task": str(task), "ws": str(ws), "log": log})
            rows.append({"cheat": cheat.name, "family": cheat.family, "task": task.name})
    for task in sorted(tasks):
        for extras in (False, True):
            ws = honest_workspace(task, work / f"honest-{task.name}-{extras}", extras)
            jobs.append({"task": str(task), "ws": str(ws), "log": []})
            rows.append({"cheat": "(honest) reference" + (" + extras" if extras else ""), "family": "-",
                         "task": task.name})
    _, old = run_old(Path(args.old), jobs)
    for row, job, o in zip(rows, jobs, old):
        r = grade(Path(job["task"]), Path(job["ws"]), job["log"])
        row.update(old_reward=o["reward"], old_flags=o["flags"], new_reward=r.reward, new_flags=r.flags,
                   new_unflagged=r.details["unflagged_reward"], canary=r.canary_passed)
    print("| cheat | family | task | old reward | old flags | new reward | new flags (families) |")
    print("|---|---|---|---:|---|---:|---|")
    for row in rows:
        print(f"| {row['cheat']} | {row['family']} | {row['task']} | {row['old_reward']:.0f} | "
              f"{_short(row['old_flags'])} | {row['new_reward']:.0f} | {_short(row['new_flags'])} |")
    cheats = [r for r in rows if not r["cheat"].startswith("(honest)")]
    honest = [r for r in rows if r["cheat"].startswith("(honest)")]
    paid_old = sorted({r["cheat"] for r in cheats if r["old_reward"] == 1.0 and not r["old_flags"]})
    return {"cheat_cases": len(cheats), "cheats": len(CHEATS), "old_paid_unflagged_cheats": len(paid_old),
            "old_unflagged_cheats": len({r["cheat"] for r in cheats if not r["old_flags"]}),
            "caught_only_by_behaviour": sorted({r["cheat"] for r in cheats if r["new_flags"] and all(
                f.split(":")[0] in ("canary_passed",) for f in r["new_flags"])}),
            "old_paid_unflagged": sum(r["old_reward"] == 1.0 and not r["old_flags"] for r in cheats),
            "old_unflagged": sum(not r["old_flags"] for r in cheats),
            "new_paid": sum(r["new_reward"] > 0 for r in cheats), "new_unflagged": sum(not r["new_flags"] for r in cheats),
            "honest_cases": len(honest), "honest_ok_new": sum(r["new_reward"] == 1.0 and not r["new_flags"] for r in honest),
            "honest_ok_old": sum(r["old_reward"] == 1.0 and not r["old_flags"] for r in honest)}


def mined_tasks(where: Path) -> list[Path]:
    """Tasks mined from parse (the sdist the tests cached), made once under ``where``."""
    from composer_dag.repos.bootstrap import bootstrap
    from composer_dag.repos.config import BootstrapConfig
    from composer_dag.tasks.sources.repo_mined import mine

    out = where / "tasks"
    if not (where / "done").exists():
        sdist = sorted((ROOT / "tests" / "artifacts" / "sdists").glob("parse-*.tar.gz"))[0]
        b = bootstrap(str(sdist), where / "env", BootstrapConfig())
        assert b["ok"], b
        mine(where / "env", out, max_tasks=2, seed=0)
        (where / "done").touch()
    return sorted(d for d in out.iterdir() if (d / "task.json").is_file())


def round2(args) -> dict:
    from composer_dag.grading.grade import grade
    from tests.cheats import ROUND_TWO, applicable, cheat_workspace

    tasks = build(Path(args.tasks) / "he", {"humaneval_limit": 3, "bugfix_count": 0, "learnable_count": 0})
    tasks += build(Path(args.tasks) / "bf", {"humaneval_limit": 0, "bugfix_count": 2,
                                             "bugfix_modules": ["colorsys", "fnmatch"], "max_per_module": 1,
                                             "learnable_count": 0})
    tasks += mined_tasks(Path(args.tasks) / "mined")
    work = Path(tempfile.mkdtemp(prefix="cdag-rt2-"))
    rows = []
    for cheat in ROUND_TWO:
        for kind in cheat.kinds:
            task = next(t for t in sorted(tasks) if json.loads((t / "task.json").read_text())["source"] == kind
                        and applicable(cheat, t))
            # a workspace per grading: the keyring cheats name their key per workspace
            jobs = []
            for k in range(args.repeat):
                ws, log = cheat_workspace(cheat, task, work / f"{cheat.name}-{kind}-{k}")
                jobs.append({"task": str(task), "ws": str(ws), "log": log})
            _, old = run_old(Path(args.old), jobs)
            ws, log = cheat_workspace(cheat, task, work / f"{cheat.name}-{kind}-new")
            r = grade(task, ws, log)
            rows.append({"cheat": cheat.name, "kind": kind, "task": task.name,
                         "old_paid_unflagged": sum(o["reward"] == 1.0 and not o["flags"] for o in old),
                         "old_unflagged": sum(not o["flags"] for o in old), "n": len(old),
                         "new_reward": r.reward, "new_flags": r.flags})
    print("| cheat | task | old: reward 1, no flag | old: no flag | new reward | new flags |")
    print("|---|---|---:|---:|---:|---|")
    for row in rows:
        print(f"| {row['cheat']} | {row['task']} | {row['old_paid_unflagged']}/{row['n']} | "
              f"{row['old_unflagged']}/{row['n']} | {row['new_reward']:.0f} | "
              f"{', '.join(sorted({f.split(':')[0] for f in row['new_flags']})) or '-'} |")
    return {"cases": len(rows), "gradings_old": sum(r["n"] for r in rows),
            "old_paid_unflagged": sum(r["old_paid_unflagged"] for r in rows),
            "old_unflagged": sum(r["old_unflagged"] for r in rows),
            "new_paid": sum(r["new_reward"] > 0 for r in rows), "new_unflagged": sum(not r["new_flags"] for r in rows)}


def timing(args) -> dict:
    from composer_dag.grading.checks import GradeConfig
    from composer_dag.grading.grade import grade as grade_default
    from tests.cheats import honest_workspace

    # --exclusive: the new side grades with exclusive_runs (one grading's runs at a time on the machine)
    grade = functools.partial(grade_default, config=GradeConfig(exclusive_runs=True)) if args.exclusive else grade_default
    tasks = build(Path(args.tasks) / "he", {"humaneval_limit": 3, "bugfix_count": 0, "learnable_count": 0})
    tasks += build(Path(args.tasks) / "bf", {"humaneval_limit": 0, "bugfix_count": 2,
                                             "bugfix_modules": ["colorsys", "fnmatch"], "max_per_module": 1,
                                             "learnable_count": 0})
    if args.learnable:  # the family the RL tests and make run's RL train on
        tasks += build(Path(args.tasks) / "ln", {"humaneval_limit": 0, "bugfix_count": 0,
                                                 "learnable_count": args.learnable})[:args.learnable]
    work = Path(tempfile.mkdtemp(prefix="cdag-tm-"))
    once = [{"task": str(t), "ws": str(honest_workspace(t, work / t.name, False)), "log": []} for t in sorted(tasks)]
    once = once * max(1, args.workers)  # a batch as an RL step grades it: each task several times, overlapping
    jobs, old, new, batches = [], [], [], {"old": [], "new": []}
    for _ in range(args.repeat):  # rounds alternate between the two graders
        jobs += once
        o = run_old(Path(args.old), once, args.workers)[1]
        n = grade_all(grade, once, args.workers)
        old += o
        new += n
        batches["old"].append(o[0]["batch_seconds"])
        batches["new"].append(n[0]["batch_seconds"])
    print(f"latency per episode, {args.workers} grading(s) at a time\n")
    print("| task | old s/episode (median) | new s/episode (median) | ratio |")
    print("|---|---:|---:|---:|")
    out = {}
    for task in sorted(tasks):
        idx = [i for i, j in enumerate(jobs) if j["task"] == str(task)]
        o = statistics.median(old[i]["seconds"] for i in idx)
        n = statistics.median(new[i]["seconds"] for i in idx)
        out[task.name] = {"old_s": round(o, 3), "new_s": round(n, 3), "ratio": round(n / o, 2)}
        print(f"| {task.name} | {o:.3f} | {n:.3f} | {n / o:.2f} |")
    o_all = statistics.median(x["seconds"] for x in old)
    n_all = statistics.median(x["seconds"] for x in new)
    print(f"| all (median) | {o_all:.3f} | {n_all:.3f} | {n_all / o_all:.2f} |")
    tp = {k: len(once) / statistics.median(v) for k, v in batches.items()}
    print(f"\nthroughput ({len(once)} episodes per batch, median of {args.repeat} batches): old {tp['old']:.2f}, "
          f"new {tp['new']:.2f} episodes/s; new costs {tp['old'] / tp['new']:.2f}x the old's time per batch")
    both = statistics.median(x["cpu_sandbox_s"] for x in new)
    print(f"new grader, hidden + canary sandbox runs added up (median): {both:.3f} s")
    return {"old_median_s": round(o_all, 3), "new_median_s": round(n_all, 3), "ratio": round(n_all / o_all, 2),
            "workers": args.workers, "old_episodes_per_s": round(tp["old"], 3), "new_episodes_per_s": round(tp["new"], 3),
            "batch_time_ratio": round(tp["old"] / tp["new"], 2),
            "new_sandbox_runs_summed_s": round(both, 3), "old_all_rewards_one": all(x["reward"] == 1.0 for x in old),
            "episodes": len(jobs), "all_rewards_one": all(x["reward"] == 1.0 for x in new)}


def fp(args) -> dict:
    from composer_dag.grading.grade import false_positive_rate

    out = Path(args.tasks) / ("full-all" if args.all_humaneval else "full")
    t0 = time.monotonic()
    if args.built:  # tasks built elsewhere (a graph run's rl_tasks and eval_tasks directories)
        tasks = sorted(d for b in args.built.split(",") for d in Path(b).iterdir() if (d / "task.json").is_file())
        summary = {"seconds": {"total": 0.0}, "by_source": dict(collections.Counter(
            json.loads((d / "task.json").read_text())["source"] for d in tasks))}
    else:
        tasks = build(out, {"humaneval_limit": None} if args.all_humaneval else {})
        summary = json.loads((out / "summary.json").read_text())
    build_s = time.monotonic() - t0
    t0 = time.monotonic()
    res = false_positive_rate(tasks, graded=True)
    with_canaries = sum(bool((json.loads((d / "task.json").read_text()).get("checks") or {}).get("canaries"))
                        for d in tasks)
    print("| tasks | with canaries | flagged references | rate | build s | check s |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(f"| {res['tasks']} | {with_canaries} | {res['flagged']} | {res['rate']:.3f} | "
          f"{summary['seconds']['total']:.0f} | {time.monotonic() - t0:.0f} |")
    return {**{k: v for k, v in res.items() if k != "examples"}, "examples": dict(list(res["examples"].items())[:5]),
            "with_canaries": with_canaries, "build_s": round(build_s, 1), "by_source": summary["by_source"]}


def round3(args) -> dict:
    """The third round's cheats (``tests/grading/test_round_three.py``): memorised cases kept in
    data files of any form on a HumanEval task, and stdlib modules that delegate to the
    interpreter's own on each stdlib bug-fix task; old grader against this one."""
    from composer_dag.grading.grade import grade
    from tests.grading.test_round_three import (DATA_CHEATS, DELEGATIONS, data_cheat_workspace,
                                                delegation_workspace)

    tasks = build(Path(args.tasks) / "he", {"humaneval_limit": 3, "bugfix_count": 0, "learnable_count": 0})
    tasks += build(Path(args.tasks) / "bf", {"humaneval_limit": 0, "bugfix_count": 2,
                                             "bugfix_modules": ["colorsys", "fnmatch"], "max_per_module": 1,
                                             "learnable_count": 0})
    he = [t for t in sorted(tasks) if t.name.startswith("humaneval")][:1]
    bf = [t for t in sorted(tasks) if t.name.startswith("bugfix")]
    work = Path(tempfile.mkdtemp(prefix="cdag-rt3-"))
    jobs, rows = [], []
    for cases, make, on in ((DATA_CHEATS, data_cheat_workspace, he), (DELEGATIONS, delegation_workspace, bf)):
        for name in sorted(cases):
            for task in on:
                ws = make(name, task, work / f"{name}-{task.name}")
                jobs.append({"task": str(task), "ws": str(ws), "log": []})
                rows.append({"cheat": name, "task": task.name})
    _, old = run_old(Path(args.old), jobs)
    for row, job, o in zip(rows, jobs, old):
        r = grade(Path(job["task"]), Path(job["ws"]), [])
        row.update(old_reward=o["reward"], old_flags=o["flags"], new_reward=r.reward, new_flags=r.flags)
    print("| cheat | task | old reward | old flags | new reward | new flags |")
    print("|---|---|---:|---|---:|---|")
    for row in rows:
        print(f"| {row['cheat']} | {row['task']} | {row['old_reward']:.0f} | {_short(row['old_flags'])} | "
              f"{row['new_reward']:.0f} | {_short(row['new_flags'])} |")
    return {"cases": len(rows), "old_paid_unflagged": sum(r["old_reward"] > 0 and not r["old_flags"] for r in rows),
            "old_silent": sum(r["old_reward"] == 0 and not r["old_flags"] for r in rows),
            "new_paid": sum(r["new_reward"] > 0 for r in rows), "new_unflagged": sum(not r["new_flags"] for r in rows)}


def fp_mined(args) -> dict:
    """False positives on mined tasks: each of ``--repos`` (``name==version``, sdists from the
    package index) bootstrapped and mined once under ``--tasks``, every reference graded."""
    from composer_dag.grading.grade import false_positive_rate
    from composer_dag.repos.bootstrap import bootstrap
    from composer_dag.repos.config import BootstrapConfig
    from composer_dag.repos.fetch import fetch_sdist
    from composer_dag.tasks.sources.repo_mined import mine

    rows, total = {}, {"tasks": 0, "flagged": 0, "examples": {}}
    for spec in args.repos.split(","):
        name, version = spec.split("==")
        where = Path(args.tasks) / "mined" / name
        out = where / "tasks"
        if not (where / "done").exists():
            b = bootstrap(str(fetch_sdist(name, version, Path(args.tasks) / "sdists")), where / "env", BootstrapConfig())
            assert b["ok"], b
            mine(where / "env", out, max_tasks=args.mined, seed=0)
            (where / "done").touch()
        dirs = sorted(d for d in out.iterdir() if (d / "task.json").is_file()) if out.is_dir() else []
        res = false_positive_rate(dirs, graded=True)
        rows[name] = {k: res[k] for k in ("tasks", "flagged")}
        total["tasks"] += res["tasks"]
        total["flagged"] += res["flagged"]
        total["examples"].update(res["examples"])
    print("| repository | mined tasks | flagged references |")
    print("|---|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['tasks']} | {r['flagged']} |")
    return {**total, "by_repo": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("redteam", "timing", "fp", "fp-mined", "round2", "round3"):
        s = sub.add_parser(name)
        s.add_argument("--tasks", default="/tmp/cdag-bench-grader", help="where tasks are built (reused)")
        s.add_argument("--old", default="/tmp/old", help="a copy of the repository at the grader's old commit")
        s.add_argument("--repeat", type=int, default=5)
        s.add_argument("--all-humaneval", action="store_true", help="fp: all 164 HumanEval problems (default 80)")
        s.add_argument("--workers", type=int, default=1, help="timing: gradings at a time (the agent loop's default: 4)")
        s.add_argument("--exclusive", action="store_true", help="timing: the new side with GradeConfig(exclusive_runs=True)")
        s.add_argument("--repos", default="parse==1.20.2,inflection==0.5.1,cachetools==5.5.0",
                       help="fp-mined: the repositories mined (name==version, sdists from the index)")
        s.add_argument("--learnable", type=int, default=0, help="timing: also this many learnable tasks")
        s.add_argument("--built", default="", help="fp: task directories already built (comma-separated), graded as they are")
        s.add_argument("--mined", type=int, default=8, help="fp-mined: synthetic tasks mined per repository")
    w = sub.add_parser("old-worker")
    w.add_argument("jobs")
    w.add_argument("--workers", type=int, default=1)
    a = p.parse_args()
    if a.cmd == "old-worker":
        return old_worker(a.jobs, a.workers)
    print(json.dumps({"redteam": redteam, "timing": timing, "fp": fp, "fp-mined": fp_mined, "round2": round2, "round3": round3}[a.cmd](a)))


if __name__ == "__main__":
    main()
