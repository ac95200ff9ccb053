"""Time to first result: what ``make run`` does (every job on the embedded default), timed per
step from Dagster's own run records, on a fresh ``COMPOSER_HOME`` and ``DAGSTER_HOME``.

    .venv/bin/python benchmarks/bench_make_run.py [--runs 3] [--out /tmp/make_run]

Per run: wall time, each step's duration (Dagster's step stats), which checks passed, and how
many vLLM engines started (each logs its eager-mode warning once, tagged with its process id). The median of the runs' wall times is the figure to quote.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one_run(home: Path) -> dict:
    shutil.rmtree(home, ignore_errors=True)
    dagster_home = home / "dagster_home"
    dagster_home.mkdir(parents=True)
    shutil.copy(ROOT / "deploy" / "dagster.yaml", dagster_home / "dagster.yaml")
    env = {**os.environ, "COMPOSER_HOME": str(home), "DAGSTER_HOME": str(dagster_home)}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "composer_dag.definitions", "materialize"], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    (home / "materialize.log").write_text(proc.stdout + proc.stderr)

    import dagster as dg

    os.environ["DAGSTER_HOME"] = str(dagster_home)
    steps, checks = [], {}
    with dg.DagsterInstance.get() as instance:
        for run in reversed(instance.get_runs()):
            for st in instance.get_run_step_stats(run.run_id):
                if st.start_time and st.end_time:
                    steps.append({"job": run.job_name, "step": st.step_key, "seconds": round(st.end_time - st.start_time, 1),
                                  "status": str(st.status.value if st.status else None)})
            for ev in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION):
                data = ev.dagster_event.event_specific_data
                checks[f"{data.asset_key.to_user_string()}:{data.check_name}"] = bool(data.passed)
    # every vLLM engine start logs its eager-mode warning once from the process that builds it
    # (the engine core runs in that process on CPU, or in a child process of its own)
    starts = len(set(re.findall(r"\(MainProcess pid=(\d+)\) WARNING [^\n]*Enforce eager set", proc.stdout + proc.stderr)))
    return {"rc": proc.returncode, "wall_s": round(wall, 1), "steps": steps, "checks_passed": sum(checks.values()),
            "checks": len(checks), "vllm_engine_starts": starts,
            "loadavg_end": [round(x, 2) for x in os.getloadavg()]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--out", default="/tmp/composer-make-run")
    a = p.parse_args()
    results = []
    for i in range(a.runs):
        r = one_run(Path(a.out) / f"run{i}")
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "steps"}), flush=True)
        for s in r["steps"]:
            print(f"  {s['job']:<14} {s['step']:<40} {s['seconds']:>7.1f} s  {s['status']}", flush=True)
    walls = [r["wall_s"] for r in results]
    print(json.dumps({"runs": len(walls), "wall_s": walls, "median_wall_s": statistics.median(walls)}))
    Path(a.out, "result.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
