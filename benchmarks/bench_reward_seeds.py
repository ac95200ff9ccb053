"""The learnable family's reward curve across seeds: one warmed-up policy (the setup of
tests/rl/test_rl_learn.py), then `python -m composer_dag.rl.run` once per seed with
LEARNABLE_RUN and the overrides given. Prints each curve, the first and last four steps' means
and their difference against twice its standard error (binomial over the window's episodes).

    .venv/bin/python benchmarks/bench_reward_seeds.py --out /tmp/seeds --seeds 0,1,2,3 \
        --steps 10 --set '{"tasks_per_step": 4}'
"""

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", default="0,1,2,3")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--set", default="{}", help="JSON overrides of LEARNABLE_RUN (nested dicts merge)")
    ap.add_argument("--setup", help="an existing setup directory (default: build one under --out)")
    a = ap.parse_args()
    import torch

    from composer_dag.rl.learnable import make_learnable_setup
    from composer_dag.rl.run import LEARNABLE_RUN

    out = Path(a.out)
    setup = Path(a.setup) if a.setup else out / "setup"
    if (setup / "policy").exists():
        s = {"tasks_dir": str(setup / "tasks"), "policy_dir": str(setup / "policy")}
    else:
        torch.set_num_threads(2)
        s = make_learnable_setup(setup, n_tasks=8, seed=0, words=("red", "blue"), warmup_steps=100)
    extra = json.loads(a.set)
    for seed in (int(x) for x in a.seeds.split(",")):
        cfg = {**LEARNABLE_RUN, "policy_dir": s["policy_dir"], "tasks_dir": s["tasks_dir"],
               "out_dir": str(out / f"run{seed}"), "steps": a.steps, "seed": seed}
        for k, v in extra.items():
            cfg[k] = {**cfg[k], **v} if isinstance(v, dict) else v
        path = out / f"cfg{seed}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cfg))
        r = subprocess.run([sys.executable, "-m", "composer_dag.rl.run", "--config", str(path)],
                           capture_output=True, text=True)
        if r.returncode:
            print(f"seed {seed}: failed\n{r.stderr[-2000:]}")
            continue
        c = [v for _, v in json.loads((out / f"run{seed}" / "result.json").read_text())["reward_curve"]]
        first, last = sum(c[:4]) / 4, sum(c[-4:]) / 4
        n = 4 * cfg["tasks_per_step"] * cfg["group_size"]
        se2 = 2 * math.sqrt(first * (1 - first) / n + last * (1 - last) / n)
        print(f"seed {seed}: first4 {first:.3f} last4 {last:.3f} diff {last - first:+.3f} 2se {se2:.3f} "
              f"curve {[round(x, 3) for x in c]}", flush=True)


if __name__ == "__main__":
    main()
