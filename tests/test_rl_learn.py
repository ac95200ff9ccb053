"""Proof that the loop learns: on the learnable task family (real task format, harness and
grader), a tiny policy that only knows the tool-call syntax improves its reward under GRPO."""

import json
import subprocess
import sys

import pytest

from composer_dag.rl.run import LEARNABLE_RUN


@pytest.mark.slow
def test_reward_rises(learnable_warm, tmp_path):
    s = learnable_warm
    # the settings `environment: learnable` runs with, on 10 steps
    cfg = {**LEARNABLE_RUN, "policy_dir": s["policy_dir"], "tasks_dir": s["tasks_dir"],
           "out_dir": str(tmp_path / "run"), "steps": 10, "seed": 0}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    r = subprocess.run([sys.executable, "-m", "composer_dag.rl.run", "--config", str(tmp_path / "cfg.json")],
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "run" / "result.json").read_text())
    curve = [v for _, v in res["reward_curve"]]
    first, last = sum(curve[:4]) / 4, sum(curve[-4:]) / 4
    print("reward curve", curve)
    assert last >= first + 0.15, curve
    assert res["cheat_flag_rate"] == 0 and res["nan_loss_skipped"] == 0 and res["weights_verified"]
    import pyarrow.parquet as pq

    for i in range(10):  # synchronous generation: every batch from the current policy
        t = pq.read_table(tmp_path / "run" / "rollouts" / f"step_{i:04d}.parquet")
        assert set(t.column("policy_version").to_pylist()) == {i}
