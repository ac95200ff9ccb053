"""Sandbox benchmark: start latency vs plain spawn, tool round trip, 64 concurrent sandboxes,
and the sandbox overhead of a 50-action episode. Prints a markdown section.

    .venv/bin/python benchmarks/bench_sandbox.py
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from composer_dag.envs import sandbox as sandbox_mod
from composer_dag.envs.sandbox import HAS_INIT, Sandbox
from composer_dag.envs.task_format import task_dirs
from composer_dag.envs.tasks import build_tasks
from composer_dag.envs.tools import Episode, EpisodeConfig


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


def main(n: int = 200) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="cdag-bench-"))
    rows = []
    ws = tmp / "proj"
    ws.mkdir()
    with Sandbox(ws) as sb:
        sb.run(["/bin/true"])
        plain = timed(lambda: subprocess.run(["/bin/true"]), n)
        boxed = timed(lambda: sb.run(["/bin/true"]), n)
    # the baseline in the same run: the command as process 1, no init and no session (blocks of
    # 20 alternating with the default, so that drift in the machine's load hits both)
    with_init, without = [], []
    for _ in range(max(1, n // 40)):
        for flag, acc in ((True, with_init), (False, without)):
            sandbox_mod.HAS_INIT = flag and HAS_INIT
            sandbox_mod._BASE_ARGS.clear()
            with Sandbox(ws) as sb:
                acc += timed(lambda: sb.run(["/bin/true"]), 20)
    sandbox_mod.HAS_INIT = HAS_INIT
    sandbox_mod._BASE_ARGS.clear()
    rows.append(("sandbox start `/bin/true` p50 / p95", f"{pct(boxed, .5) * 1e3:.1f} / {pct(boxed, .95) * 1e3:.1f} ms"))
    rows.append(("plain subprocess spawn p50 / p95", f"{pct(plain, .5) * 1e3:.1f} / {pct(plain, .95) * 1e3:.1f} ms"))
    rows.append(("ratio (p50)", f"{pct(boxed, .5) / pct(plain, .5):.1f}x"))
    rows.append(("start p50 with the laptop's init and session / with the command as process 1",
                 f"{pct(with_init, .5) * 1e3:.1f} / {pct(without, .5) * 1e3:.1f} ms "
                 f"({pct(with_init, .5) / pct(without, .5):.2f}x)"))

    out = tmp / "tasks"
    build_tasks(out, {"humaneval_limit": 1, "bugfix_count": 0, "eval_fraction": 0.0})
    # the HumanEval task (the learnable family's allow a turn or two), with room for every action
    task = next(t for t in task_dirs(out, "rl_tasks") if t.name.startswith("humaneval"))
    cfg = EpisodeConfig(max_turns=1000)
    with Episode(task, cfg) as ep:
        rt_cmd = timed(lambda: ep.step({"name": "run_terminal_cmd", "arguments": {"command": "echo hi"}}), 50)
        rt_read = timed(lambda: ep.step({"name": "read_file", "arguments": {"path": "README.md"}}), 50)
    rows.append(("tool round trip p50: run_terminal_cmd `echo hi`", f"{pct(rt_cmd, .5) * 1e3:.1f} ms"))
    rows.append(("tool round trip p50: read_file", f"{pct(rt_read, .5) * 1e3:.2f} ms"))

    # 64 sandboxes at once, each writes and reads its own marker (workspace and /tmp)
    def one(i):
        w = tmp / f"c{i}" / "proj"
        w.mkdir(parents=True)
        with Sandbox(w) as s:
            r = s.run(f"echo m{i} > marker; echo t{i} > /tmp/t; sleep 0.5; cat marker /tmp/t; ls /tmp | wc -l")
        return i, r
    t0 = time.perf_counter()
    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(64)))
    wall = time.perf_counter() - t0
    ok = all(r.exit_code == 0 and r.stdout.split() == [f"m{i}", f"t{i}", "1"]
             and (tmp / f"c{i}" / "proj" / "marker").read_text() == f"m{i}\n" for i, r in results)
    rows.append(("64 concurrent sandboxes (each `sleep 0.5`)", f"wall {wall:.2f} s, no cross-talk: {ok}"))

    # a 50-action episode: overhead = wall time minus time spent inside the commands
    with Episode(task, cfg) as ep:
        actions = []
        for k in range(50):
            if k % 5 == 0:
                actions.append({"name": "read_file", "arguments": {"path": "has_close_elements.py"}})
            elif k % 5 == 1:
                actions.append({"name": "search", "arguments": {"pattern": "def "}})
            elif k % 5 == 2:
                actions.append({"name": "edit_file", "arguments": {"path": f"notes{k}.txt", "old": "", "new": "x\n"}})
            else:
                actions.append({"name": "run_terminal_cmd", "arguments": {"command": "s=$(date +%s%N); ls >/dev/null; git status >/dev/null; e=$(date +%s%N); echo inner=$((e-s))"}})
        inner = 0.0
        t0 = time.perf_counter()
        for a in actions:
            obs = ep.step(a)
            if "inner=" in obs.content:
                inner += int(obs.content.split("inner=")[1].split()[0]) / 1e9
        total = time.perf_counter() - t0
    rows.append(("50-action episode: total / in commands / overhead", f"{total:.2f} s / {inner:.2f} s / {total - inner:.2f} s"))

    date = datetime.date.today().isoformat()
    print("## Sandbox\n")
    print(f"`.venv/bin/python benchmarks/bench_sandbox.py` on {date}, {os.cpu_count()} cores, "
          f"{platform.system()} {platform.release()}, Python {platform.python_version()}, "
          f"{subprocess.run(['bwrap', '--version'], capture_output=True, text=True).stdout.strip()}.\n")
    print("| measure | result |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")
    subprocess.run(["rm", "-rf", str(tmp)])


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
