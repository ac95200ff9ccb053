"""The one-process RL step, this checkout's code against an earlier commit's, on the learnable
family (``environment: learnable``'s settings, the warmed-up small policy, vLLM), in one sitting.

    .venv/bin/python benchmarks/bench_rl_step.py --base f453e6b [--steps 8] [--pairs 4] [--out /tmp/bench_rl_step]

The earlier commit is checked out with ``git worktree`` (its own code, this checkout's .venv);
the setup (8 tasks, a policy warmed up 100 steps) is built once and used by both. The two codes
alternate (base, new, new, base, ...). Printed: each run's mean step seconds (``step_s``) and
its parts (``train_s``, ``grade_s``, ... as the run's ``result.json`` names them), its wall time
and its reward curve; the medians and their ratio new / base.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUN = r"""
import json, os, subprocess, sys, time
sys.path.insert(0, os.getcwd())
from composer_dag.rl.run import LEARNABLE_RUN
out, setup, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = {**LEARNABLE_RUN, "policy_dir": os.path.join(setup, "policy"), "tasks_dir": os.path.join(setup, "tasks"),
       "out_dir": os.path.join(out, "run"), "steps": steps, "seed": 0}
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "cfg.json"), "w") as f:
    json.dump(cfg, f)
t0 = time.perf_counter()
r = subprocess.run([sys.executable, "-m", "composer_dag.rl.run", "--config", os.path.join(out, "cfg.json")],
                   capture_output=True, text=True)
if r.returncode:
    raise SystemExit(r.stderr[-2000:])
res = json.load(open(os.path.join(out, "run", "result.json")))
parts = {k: v["mean"] for k, v in res["step_seconds"].items() if isinstance(v, dict) and "mean" in v}
print(json.dumps({"wall_s": time.perf_counter() - t0, "step_s": parts["step_s"], "parts": parts,
                  "reward_curve": [round(v, 3) for _, v in res["reward_curve"]]}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the earlier commit")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "bench_rl_step"))
    args = ap.parse_args()
    py = os.path.join(ROOT, ".venv", "bin", "python")
    base_dir = os.path.join(args.out, "base-tree")
    if not os.path.isdir(base_dir):
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "-f", base_dir, args.base], check=True, capture_output=True)
    setup = os.path.join(args.out, "setup")
    if not os.path.exists(os.path.join(setup, "policy", "config.json")):
        subprocess.run([py, "-c", "import sys, torch; torch.set_num_threads(2); sys.path.insert(0, sys.argv[1]); "
                        "from composer_dag.rl.learnable import make_learnable_setup; make_learnable_setup(sys.argv[2], "
                        "n_tasks=8, seed=0, words=('red', 'blue'), warmup_steps=100)", ROOT, setup], check=True, cwd=ROOT)
    runs: dict[str, list[dict]] = {"base": [], "new": []}
    for i in range(args.pairs):
        for side in (("base", "new") if i % 2 == 0 else ("new", "base")):
            tree = base_dir if side == "base" else ROOT
            p = subprocess.run([py, "-c", RUN, os.path.join(args.out, f"{side}_{i}"), setup, str(args.steps)],
                               cwd=tree, capture_output=True, text=True)
            if p.returncode:
                raise SystemExit(f"{side} run {i}: {p.stderr[-2000:]}")
            r = json.loads(p.stdout.strip().splitlines()[-1])
            runs[side].append(r)
            print(json.dumps({"run": f"{side}_{i}", "wall_s": round(r["wall_s"], 1),
                              **{k: round(v, 3) for k, v in r["parts"].items()}, "reward_curve": r["reward_curve"]}), flush=True)
    med = {s: statistics.median(r["step_s"] for r in rs) for s, rs in runs.items()}
    wall = {s: statistics.median(r["wall_s"] for r in rs) for s, rs in runs.items()}
    parts = {k: {s: round(statistics.median(r["parts"][k] for r in rs), 3) for s, rs in runs.items()}
             for k in runs["new"][0]["parts"] if all(k in r["parts"] for rs in runs.values() for r in rs)}
    same = all(r["reward_curve"] == runs["base"][0]["reward_curve"] for rs in runs.values() for r in rs)
    print(json.dumps({"base": args.base, "steps": args.steps, "pairs": args.pairs,
                      "step_s_median": {s: round(v, 3) for s, v in med.items()}, "ratio_step_s": round(med["new"] / med["base"], 3),
                      "wall_s_median": {s: round(v, 1) for s, v in wall.items()}, "ratio_wall": round(wall["new"] / wall["base"], 3),
                      "part_medians": parts, "same_reward_curves": same}))
    subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base_dir], capture_output=True)


if __name__ == "__main__":
    main()
