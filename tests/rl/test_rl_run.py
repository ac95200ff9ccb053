"""The RL run as a process: the staleness bound of async generation. (Killed and resumed:
tests/graph/test_faults_kill.py.)"""

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(learnable_base):
    return learnable_base


def _config(setup, out, **kw):
    cfg = {"policy_dir": setup["policy_dir"], "tasks_dir": setup["tasks_dir"], "out_dir": str(out),
           "steps": 4, "tasks_per_step": 1, "group_size": 2, "torch_threads": 1, "full_every": 3,
           "async_generation": False, "trainer": {"lr": 1e-3, "micro_batch": 2},
           "orchestrator": {"max_turns": 1, "max_new_tokens": 8, "max_context": 512, "system_style": "compact",
                            "workers": 2},
           "inference": {"engine": "hf"}, **kw}
    path = out.parent / f"{out.name}.json"
    path.write_text(json.dumps(cfg))
    return [sys.executable, "-m", "composer_dag.rl.run", "--config", str(path)]


def _steps(out):
    return [json.loads(x)["step"] for x in open(out / "metrics.jsonl")]


def test_async_staleness_bound(setup, tmp_path):
    out = tmp_path / "async"
    cmd = _config(setup, out, steps=3, async_generation=True, max_staleness=0, queue_size=2)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "result.json").read_text())
    assert res["dropped_stale_rollouts"] > 0 and res["dropped_stale_rollouts"] % 2 == 0
    assert res["staleness"]["max"] == 0 and _steps(out) == [1, 2, 3]
    for i in range(3):  # none of the used rollouts was stale
        t = pq.read_table(out / "rollouts" / f"step_{i:04d}.parquet")
        assert t.column("policy_version").to_pylist() == [i, i] and t.column("staleness").to_pylist() == [0, 0]
