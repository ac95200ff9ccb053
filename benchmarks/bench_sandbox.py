"""Sandbox benchmark: the start of an episode's sandbox against a plain spawn, a command in a
running sandbox, the tool round trip, 64 concurrent sandboxes, and the sandbox overhead of a
50-action episode on the HumanEval repository and on a repository with thousands of files.
Prints a markdown section.

    .venv/bin/python benchmarks/bench_sandbox.py [N]
    .venv/bin/python benchmarks/bench_sandbox.py --baseline OLD_TREE [--rounds K] [N]

``--baseline`` runs the measures of this tree's code and of ``OLD_TREE`` (a checkout of an earlier
commit: ``git worktree add /tmp/old <commit>``), each in its own process, alternating ``K`` rounds,
and prints both with their ratios (p50s and overheads are medians over the rounds).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def timed(fn, n):
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def big_repo(task: Path, dest: Path) -> Path:
    """The HumanEval task with the interpreter's standard library (its tests too, no caches or
    site-packages) added to its repository: a project of a few thousand files."""
    shutil.copytree(task, dest, symlinks=True)
    lib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    shutil.copytree(lib, dest / "repo" / "vendor" / "stdlib", symlinks=True,
                    ignore=shutil.ignore_patterns("site-packages", "__pycache__", "*.pyc", "lib-dynload", "config-*"))
    return dest


def episode_overhead(task: Path, cfg) -> tuple[float, float, float]:
    """(total, inside the commands, set-up) of a 50-action episode: reads, searches, edits,
    commands; the set-up (the workspace copied from the task's checkout, the sandbox's host side,
    which the episode makes on its first call) is timed apart, before the actions."""
    from composer_dag.harness.episode import Episode

    with Episode(task, cfg) as ep:
        t0 = time.perf_counter()
        ep.workspace  # noqa: B018 (made on first use)
        setup = time.perf_counter() - t0
        actions = []
        for k in range(50):
            if k % 5 == 0:
                actions.append({"name": "read_file", "arguments": {"path": "has_close_elements.py"}})
            elif k % 5 == 1:
                actions.append({"name": "search", "arguments": {"pattern": "def has_close", "path": "has_close_elements.py"}})
            elif k % 5 == 2:
                actions.append({"name": "edit_file", "arguments": {"path": f"notes{k}.txt", "old": "", "new": "x\n"}})
            else:
                actions.append({"name": "run_terminal_cmd", "arguments": {"command": "s=$(date +%s%N); ls >/dev/null; git status >/dev/null; e=$(date +%s%N); echo inner=$((e-s))"}})
        inner = 0.0
        t0 = time.perf_counter()
        for a in actions:
            obs = ep.step(a)
            assert not obs.is_error, obs.content
            if "inner=" in obs.content:
                inner += int(obs.content.split("inner=")[1].split()[0]) / 1e9
        total = time.perf_counter() - t0
    return total, inner, setup


def measure(n: int) -> dict:
    from composer_dag.laptop.desktop import dressing
    from composer_dag.sandbox import Sandbox
    from composer_dag.tasks.format import task_dirs
    from composer_dag.tasks.sources.build import build_tasks
    from composer_dag.harness.episode import Episode, EpisodeConfig

    tmp = Path(tempfile.mkdtemp(prefix="cdag-bench-"))
    res: dict = {}
    ws = tmp / "proj"
    ws.mkdir()
    with Sandbox(ws, dressing=dressing()) as sb:
        sb.run(["/bin/true"])
        res["plain"] = timed(lambda: subprocess.run(["/bin/true"]), n)
        res["command"] = timed(lambda: sb.run(["/bin/true"]), n)

    res["start"], res["setup"] = [], []
    for _ in range(max(10, n // 5)):  # a new sandbox's first command (the sandbox starts with it)
        t0 = time.perf_counter()
        sb = Sandbox(ws, dressing=dressing())
        t1 = time.perf_counter()
        sb.run(["/bin/true"])
        t2 = time.perf_counter()
        sb.close()
        res["start"].append(t2 - t1)
        res["setup"].append(time.perf_counter() - t2 + t1 - t0)

    out = tmp / "tasks"
    build_tasks(out, {"humaneval_limit": 1, "bugfix_count": 0, "eval_fraction": 0.0})
    # the HumanEval task (the learnable family's allow a turn or two), with room for every action
    task = next(t for t in task_dirs(out, "rl_tasks") if t.name.startswith("humaneval"))
    cfg = EpisodeConfig(max_turns=1000)
    with Episode(task, cfg) as ep:
        res["rt_cmd"] = timed(lambda: ep.step({"name": "run_terminal_cmd", "arguments": {"command": "echo hi"}}), 50)
        res["rt_read"] = timed(lambda: ep.step({"name": "read_file", "arguments": {"path": "README.md"}}), 50)

    # 64 sandboxes at once, each writes and reads its own marker (workspace and /tmp)
    def one(i):
        w = tmp / f"c{i}" / "proj"
        w.mkdir(parents=True)
        with Sandbox(w, dressing=dressing()) as s:
            r = s.run(f"echo m{i} > marker; echo t{i} > /tmp/t; sleep 0.5; cat marker /tmp/t; ls /tmp | wc -l")
        return i, r
    t0 = time.perf_counter()
    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(64)))
    res["concurrent_wall"] = time.perf_counter() - t0
    res["concurrent_ok"] = all(r.exit_code == 0 and r.stdout.split()[:2] == [f"m{i}", f"t{i}"]
                               and (tmp / f"c{i}" / "proj" / "marker").read_text() == f"m{i}\n" for i, r in results)

    res["episode"] = episode_overhead(task, cfg)
    big = big_repo(task, tmp / "big-task")
    res["big_files"] = sum(len(f) for _, _, f in os.walk(big / "repo"))
    res["episode_big"] = episode_overhead(big, cfg)
    subprocess.run(["rm", "-rf", str(tmp)])
    return res


def table(runs: list[dict], label: str) -> dict:
    """The medians over rounds of each measure, in the units of the table."""
    med = lambda key, f: statistics.median(f(r) for r in runs)
    return {
        "label": label,
        "start_p50": med("start", lambda r: pct(r["start"], .5) * 1e3),
        "start_p95": med("start", lambda r: pct(r["start"], .95) * 1e3),
        "setup_p50": med("setup", lambda r: pct(r["setup"], .5) * 1e3),
        "plain_p50": med("plain", lambda r: pct(r["plain"], .5) * 1e3),
        "command_p50": med("command", lambda r: pct(r["command"], .5) * 1e3),
        "rt_cmd": med("rt_cmd", lambda r: pct(r["rt_cmd"], .5) * 1e3),
        "rt_read": med("rt_read", lambda r: pct(r["rt_read"], .5) * 1e3),
        "concurrent": med("c", lambda r: r["concurrent_wall"]),
        "concurrent_ok": all(r["concurrent_ok"] for r in runs),
        "ep_total": med("e", lambda r: r["episode"][0]), "ep_inner": med("e", lambda r: r["episode"][1]),
        "ep_over": med("e", lambda r: r["episode"][0] - r["episode"][1]),
        "big_total": med("b", lambda r: r["episode_big"][0]), "big_inner": med("b", lambda r: r["episode_big"][1]),
        "big_over": med("b", lambda r: r["episode_big"][0] - r["episode_big"][1]),
        "big_files": runs[0]["big_files"],
        "ep_setup": med("e", lambda r: r["episode"][2] if len(r["episode"]) > 2 else float("nan")),
        "big_setup": med("b", lambda r: r["episode_big"][2] if len(r["episode_big"]) > 2 else float("nan")),
    }


ROWS = (
    ("sandbox start: a new sandbox's first command (`/bin/true`), p50 / p95", lambda t: f"{t['start_p50']:.1f} / {t['start_p95']:.1f} ms", "start_p50"),
    ("a sandbox's set-up and tear-down (home, network namespace), p50", lambda t: f"{t['setup_p50']:.1f} ms", "setup_p50"),
    ("a command in a running sandbox (`/bin/true`), p50", lambda t: f"{t['command_p50']:.2f} ms", "command_p50"),
    ("plain subprocess spawn p50", lambda t: f"{t['plain_p50']:.2f} ms", None),
    ("tool round trip p50: run_terminal_cmd `echo hi`", lambda t: f"{t['rt_cmd']:.1f} ms", "rt_cmd"),
    ("tool round trip p50: read_file", lambda t: f"{t['rt_read']:.2f} ms", None),
    ("64 concurrent sandboxes (each `sleep 0.5`)", lambda t: f"wall {t['concurrent']:.2f} s, no cross-talk: {t['concurrent_ok']}", "concurrent"),
    ("50-action episode, HumanEval repository: total / in commands / overhead",
     lambda t: f"{t['ep_total']:.2f} / {t['ep_inner']:.2f} / {t['ep_over']:.2f} s", "ep_over"),
    ("50-action episode, the same with the standard library added: total / in commands / overhead",
     lambda t: f"{t['big_total']:.2f} / {t['big_inner']:.2f} / {t['big_over']:.2f} s", "big_over"),
    ("an episode's set-up before its actions (the checkout's copy, the sandbox's host side): HumanEval / the large one",
     lambda t: f"{t['ep_setup']:.3f} / {t['big_setup']:.3f} s", "big_setup"),
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("n", nargs="?", type=int, default=200)
    ap.add_argument("--baseline", help="a checkout of an earlier commit, measured in the same run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="(internal) measure once, print JSON")
    a = ap.parse_args()
    if a.json:
        print(json.dumps(measure(a.n)))
        return
    trees = [("this tree", HERE)] + ([("baseline", Path(a.baseline).resolve())] if a.baseline else [])
    runs: dict[str, list] = {name: [] for name, _ in trees}
    for k in range(a.rounds if a.baseline else 1):
        for name, tree in trees:
            env = dict(os.environ, PYTHONPATH=str(tree))
            r = subprocess.run([sys.executable, str(HERE / "benchmarks" / "bench_sandbox.py"), "--json", str(a.n)],
                               cwd=tree, env=env, capture_output=True, text=True)
            if r.returncode:
                sys.exit(f"{name} failed:\n{r.stderr[-3000:]}")
            runs[name].append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(f"round {k + 1}: {name} done", file=sys.stderr)
    tabs = [table(runs[name], name) for name, _ in trees]
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    bw = subprocess.run(["bwrap", "--version"], capture_output=True, text=True).stdout.strip()
    print(f"`.venv/bin/python benchmarks/bench_sandbox.py {' '.join(sys.argv[1:])}` on {date}, {os.cpu_count()} cores, "
          f"{platform.system()} {platform.release()}, Python {platform.python_version()}, {bw}; "
          f"the large repository has {tabs[0]['big_files']:,} files.\n")
    if len(tabs) == 1:
        print("| measure | result |\n|---|---|")
        for label, fmt, _ in ROWS:
            print(f"| {label} | {fmt(tabs[0])} |")
        return
    print(f"| measure | this tree | baseline | ratio |\n|---|---|---|---|")
    for label, fmt, key in ROWS:
        ratio = f"{tabs[0][key] / tabs[1][key]:.2f}x" if key and tabs[1][key] else ""
        print(f"| {label} | {fmt(tabs[0])} | {fmt(tabs[1])} | {ratio} |")


if __name__ == "__main__":
    main()
