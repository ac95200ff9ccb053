"""Two Slurm nodes in network namespaces: the rendezvous, a step on two nodes against one at the
same global batch, and the time to resume after losing a node.

    .venv/bin/python benchmarks/bench_multinode.py [--steps 40] [--repeats 3]

Needs root and the Slurm packages (``make system-deps``). Starts ``tests.slurm_cluster.TwoNodeCluster``
(each node a ``slurmd`` in its own network, UTS, PID and mount namespaces on a bridge, moto's
S3 server on the bridge address) and measures:

- the rendezvous: a two-node job's torchrun (c10d rendezvous at the first node), from the
  worker's start to ``init_process_group`` returning with world size 2 (gloo over the bridge);
- the step time of mid-training (the tiny two-layer model of the tests, ZeRO-2, gloo) with
  ``nnodes=2, nproc_per_node=1`` against ``nnodes=1, nproc_per_node=2``: the same global batch
  (2 ranks x 4 samples). Both nodes share the machine's two cores, so this is the cost of the
  rendezvous and of gloo across the bridge, not scaling;
- the resume: the second node killed (its namespace's init) once both nodes sealed step 6; the
  controller's detection (SlurmdTimeout 10 s), the node back (slurmd restarted, RESUME), and
  the retry's job from submission to its end, resumed from the newest checkpoint both nodes
  sealed.
Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RDZV = textwrap.dedent("""\
    import os, time
    t0 = time.time()
    import torch, torch.distributed as dist
    t1 = time.time()
    dist.init_process_group("gloo")
    t = torch.ones(1); dist.all_reduce(t)
    t2 = time.time()
    print(f"RDZV rank={dist.get_rank()} world={dist.get_world_size()} import_s={t1 - t0:.3f} init_s={t2 - t1:.3f} "
          f"from_srun_s={t2 - float(os.environ['COMPOSER_T0']):.3f}", flush=True)
    dist.destroy_process_group()
""")


def _rendezvous(cluster, repeats: int) -> list[float]:
    script = cluster.root / "rdzv.py"
    script.write_text(RDZV)
    out = []
    for i in range(repeats):
        batch = f"""#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --output=/tmp/composer-scratch/rdzv-%j.out
#SBATCH --chdir=/tmp/composer-scratch
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export COMPOSER_T0=$(date +%s.%N)
srun --label {sys.executable} -m torch.distributed.run --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \
  --rdzv-endpoint $head:29500 --rdzv-id $SLURM_JOB_ID {script}
"""
        job = subprocess.run(["sbatch", "--parsable"], input=batch, capture_output=True, text=True, check=True).stdout.strip()
        while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
            time.sleep(0.3)
        log = (cluster.node_dir("node1") / "tmp" / "composer-scratch" / f"rdzv-{job}.out").read_text()
        lines = [x for x in log.splitlines() if "RDZV" in x and "world=2" in x]
        assert len(lines) == 2, log[-2000:]
        out.append((max(float(x.split("from_srun_s=")[1]) for x in lines),
                    max(float(x.split("init_s=")[1].split()[0]) for x in lines)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import dagster as dg

    from composer_dag.storage import open_storage
    from tests import test_slurm_multinode as mn
    from tests.conftest import FAKE_KEY, FAKE_SECRET
    from tests.slurm_cluster import TwoNodeCluster, missing

    if missing():
        sys.exit(f"cannot start the cluster: {missing()}")
    work = Path(tempfile.mkdtemp(prefix="composer-bench-mn-"))
    root = tempfile.mkdtemp(prefix="composer-slurm2-", dir="/var/tmp")
    os.chmod(root, 0o755)
    cluster = TwoNodeCluster(Path(root))
    t0 = time.monotonic()
    cluster.start()
    up_s = time.monotonic() - t0
    os.environ.update({"SLURM_CONF": str(cluster.conf), "AWS_ACCESS_KEY_ID": FAKE_KEY,
                       "AWS_SECRET_ACCESS_KEY": FAKE_SECRET, "COMPOSER_S3_ENDPOINT_URL": cluster.s3_endpoint})
    try:
        mn.STEPS = args.steps
        rdzv = _rendezvous(cluster, args.repeats)

        inputs = mn.build_lm_inputs(work)
        bucket = mn._bucket(cluster)
        storage = open_storage(bucket)
        rows = []
        for label, kw in (("2 nodes x 1 rank", {"nnodes": 2, "nproc_per_node": 1}),
                          ("1 node x 2 ranks", {"nnodes": 1, "nproc_per_node": 2})):
            step_s = []
            for r in range(args.repeats):
                job = mn._midtrain_job(bucket, storage, inputs, f"{kw['nnodes']}n-{r}")
                res = dg.materialize([mn._asset(bucket, job)], resources={"cluster": mn._resource(launcher="torchrun", **kw)})
                s = mn._result(res)["summary"]
                assert s["world_size"] == 2
                step_s.append(s["train_seconds"] / s["steps"])
            rows.append((label, statistics.median(step_s), min(step_s)))

        # the resume after a lost node
        job = mn._midtrain_job(bucket, storage, inputs, "lost", COMPOSER_SAVE_PAUSE_S="0.7")
        sealed = f"{bucket}/work/midtrain/lost/nodes/1/checkpoints/step_0000006/manifest.json"
        marks: dict[str, float] = {}

        def lose() -> None:
            while not storage.exists(sealed):
                time.sleep(0.2)
            cluster.kill_node("node2")
            marks["killed"] = time.monotonic()
            mn._wait(lambda: cluster.node_state("node2") == "down", 60, "DOWN")
            marks["down"] = time.monotonic()
            mn._wait(lambda: not mn._squeue_running(), 60, "the job to end")
            marks["ended"] = time.monotonic()
            cluster.restart_node("node2")
            marks["back"] = time.monotonic()

        th = threading.Thread(target=lose, daemon=True)
        th.start()
        res = dg.materialize([mn._asset(bucket, job, retries=1)],
                             resources={"cluster": mn._resource(launcher="torchrun", nnodes=2, nproc_per_node=1)})
        marks["done"] = time.monotonic()
        th.join(timeout=60)
        s = mn._result(res)["summary"]
        retrained = s["tokens_this_run"] // (2 * 4 * 64)
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)

    print(f"cluster up (bridge, 2 namespaced slurmd, slurmctld, munged, moto): {up_s:.1f} s\n")
    print(f"| rendezvous, torchrun 2 nodes x 1 rank, {args.repeats} jobs | median s | min s | max s |")
    print("|---|---|---|---|")
    for i, what in enumerate(("srun -> both ranks in a world of 2 (torchrun start, c10d rendezvous at the first node, "
                              "gloo init, one all-reduce)", "init_process_group + one all-reduce alone")):
        xs = [r[i] for r in rdzv]
        print(f"| {what} | {statistics.median(xs):.2f} | {min(xs):.2f} | {max(xs):.2f} |")
    print()
    print(f"| mid-training, global batch 8 x 64 tokens, {args.steps} steps | s/step median | s/step min | ratio to 1 node |")
    print("|---|---|---|---|")
    for label, med, lo in rows:
        print(f"| {label} | {med:.3f} | {lo:.3f} | {med / rows[1][1]:.2f}x |")
    print("\n| node lost after step 6 was sealed on both nodes | s |")
    print("|---|---|")
    print(f"| kill -> the controller sets it DOWN (SlurmdTimeout 10 s) | {marks['down'] - marks['killed']:.1f} |")
    print(f"| DOWN -> the job ended (NODE_FAIL) | {marks['ended'] - marks['down']:.1f} |")
    print(f"| job ended -> node back (slurmd restarted, RESUME) | {marks['back'] - marks['ended']:.1f} |")
    print(f"| node back -> the retry's run finished | {marks['done'] - marks['back']:.1f} |")
    print(f"| kill -> finished, all told | {marks['done'] - marks['killed']:.1f} |")
    print(f"| steps trained again by the retry (of {args.steps}) | {retrained} |")


if __name__ == "__main__":
    main()
