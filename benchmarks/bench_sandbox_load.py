"""Sandbox load benchmark: N episodes at once, for N in 1, 2, 4, ..., 64. Prints a markdown section.

Each episode is a short realistic turn sequence on a tiny repository, through the tools a
policy uses: ``edit_file`` writes a token unique to the episode, ``run_terminal_cmd`` reads it
back, writes it to /tmp and the home directory, runs pytest on the repository and reads both
back, and ``read_file`` reads the token the command copied. An episode counts as lost when a
step fails or pytest does not pass, and as mixed when it sees any token other than its own.

Latency is one episode's wall time (workspace copy, sandbox set-up, the three tool calls,
clean-up). At each N the benchmark runs ``max(N, 16)`` episodes, N at a time.

Rule for "the largest N with bounded latency": the largest N such that at N and at every
smaller N measured the p95 latency is at most 3x the p95 latency at N = 1 (the same unit of
work alone) and nothing is lost or mixed.

    .venv/bin/python benchmarks/bench_sandbox_load.py [N ...]
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from composer_dag.harness.episode import Episode

BOUND = 3.0  # p95 at N may be at most this many times the p95 at N = 1


def make_task(root: Path) -> Path:
    d = root / "task"
    (d / "repo" / "tests").mkdir(parents=True)
    (d / "hidden_tests").mkdir()
    (d / "task.json").write_text(json.dumps({"id": "load", "project": "calc", "instructions": "Load check.",
                                             "limits": {"command_timeout": 120}}))
    (d / "repo" / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    (d / "repo" / "tests" / "test_calc.py").write_text(
        "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
        "def test_zero():\n    assert add(0, 0) == 0\n")
    return d


def episode(task: Path, i: int) -> dict:
    token = f"tok-{i}-{uuid.uuid4().hex[:12]}"
    t0 = time.perf_counter()
    try:
        with Episode(task) as ep:
            obs = [ep.step({"name": "edit_file", "arguments": {"path": "token.txt", "old": "", "new": token + "\n"}})]
            obs.append(ep.step({"name": "run_terminal_cmd", "arguments": {"command":
                                f"cat token.txt; echo {token} > /tmp/t; echo {token} > ~/t; "
                                "python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tail -1; "
                                "cat /tmp/t ~/t; cp token.txt echo.txt"}}))
            obs.append(ep.step({"name": "read_file", "arguments": {"path": "echo.txt"}}))
    except Exception as e:  # counted as lost, with the reason
        return {"seconds": time.perf_counter() - t0, "lost": f"{type(e).__name__}: {e}", "mixed": False}
    seconds = time.perf_counter() - t0
    text = " ".join(o.content for o in obs)
    seen = {w for w in text.split() if w.startswith("tok-")}
    ok = (not any(o.is_error for o in obs) and "exit code: 0" in obs[1].content and "2 passed" in obs[1].content
          and obs[1].content.count(token) == 3 and token in obs[2].content)
    return {"seconds": seconds, "lost": None if ok else text[-300:], "mixed": seen - {token} != set()}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def level(task: Path, n: int) -> dict:
    total = max(n, 16)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        res = list(pool.map(lambda i: episode(task, i), range(total)))
    wall = time.perf_counter() - t0
    lat = [r["seconds"] for r in res]
    return {"n": n, "episodes": total, "p50": pct(lat, 0.5), "p95": pct(lat, 0.95), "max": max(lat),
            "throughput": total / wall, "lost": sum(r["lost"] is not None for r in res),
            "mixed": sum(r["mixed"] for r in res), "why": next((r["lost"] for r in res if r["lost"]), None)}


def main(ns: list[int]) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="cdag-load-"))
    task = make_task(tmp)
    episode(task, -1)  # warm the runtime cache and the page cache
    load0 = os.getloadavg()
    rows = [level(task, n) for n in ns]
    load1 = os.getloadavg()
    base = rows[0]["p95"] if rows[0]["n"] == 1 else None
    best, ok_so_far = None, True
    print("## Sandbox load: concurrent episodes\n")
    print(f"`.venv/bin/python benchmarks/bench_sandbox_load.py` on {datetime.date.today().isoformat()}, "
          f"{os.cpu_count()} cores, {platform.system()} {platform.release()}, Python {platform.python_version()}, "
          f"{subprocess.run(['bwrap', '--version'], capture_output=True, text=True).stdout.strip()}; "
          f"load average {load0[0]:.1f} before, {load1[0]:.1f} after.\n")
    print("| N at once | episodes | p50 s | p95 s | max s | episodes/s | lost | mixed | p95 / p95(N=1) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["p95"] / base if base else float("nan")
        bounded = ratio <= BOUND and not r["lost"] and not r["mixed"]
        ok_so_far = ok_so_far and bounded
        if ok_so_far:
            best = r["n"]
        print(f"| {r['n']} | {r['episodes']} | {r['p50']:.2f} | {r['p95']:.2f} | {r['max']:.2f} | "
              f"{r['throughput']:.2f} | {r['lost']} | {r['mixed']} | {ratio:.1f}{'' if bounded else ' (over)'} |")
    print(f"\nLargest N with bounded latency (p95 <= {BOUND:g}x the p95 at N = 1 there and at every smaller N, "
          "nothing lost or mixed): "
          f"**{best}**.")
    for r in rows:
        if r["why"]:
            print(f"\nFirst loss at N = {r['n']}: {r['why']}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 2, 4, 8, 16, 32, 64])
