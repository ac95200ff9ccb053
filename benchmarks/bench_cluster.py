"""Fixed cost a cluster backend adds to a stage: a trivial stage (one step, no work) run as a
job through ``ClusterResource.run_job`` on the local backend and on a real one-node Slurm
cluster (bubblewrap-isolated, everything on a moto S3 server), N times each.

Per run: ``launch -> stage start`` (writing the spec and Pipes context, sbatch, scheduling,
the job runner, the stage's Python start), ``stage end -> step end`` (publishing, the last
Pipes chunk, the job's end seen by squeue/scontrol, the session's close) and the total.

    .venv/bin/python benchmarks/bench_cluster.py --runs 5

``--services``: the fixed cost of a long-running service instead: ``start_service`` of a
trivial HTTP server (``python -m http.server``) until its health URL answers, and ``stop``
until none of its processes is left (local: the process group; Slurm: ``scancel`` until the
job has left ``squeue``), N times on each backend.

    .venv/bin/python benchmarks/bench_cluster.py --services --runs 10
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def moto(port: int = 0):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(150):
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1)
            return proc, endpoint
        except Exception:
            time.sleep(0.2)
    raise RuntimeError("moto_server did not start")


def bench_services(runs: int) -> None:
    from composer_dag.cluster import services
    from tests.slurm_cluster import SlurmCluster

    tmp = tempfile.mkdtemp(prefix="composer-bench-")
    os.chmod(tmp, 0o755)
    (Path(tmp) / "slurm").mkdir()
    os.chmod(Path(tmp) / "slurm", 0o755)
    cluster = SlurmCluster(Path(tmp) / "slurm").start()
    os.environ.update(cluster.env)
    argv = [sys.executable, "-m", "http.server", "{port}", "--bind", "{host}", "--directory", tmp]
    rows = {}
    try:
        for backend in ("local", "slurm"):
            cfg = {"backend": backend, "scratch_dir": tmp, "poll_seconds": 0.5, "grace_seconds": 3}
            times = []
            for _ in range(runs):
                t0 = time.perf_counter()
                h = services.start_service(cfg, {"name": "bench-web", "argv": argv})
                t1 = time.perf_counter()
                services.stop(h)
                t2 = time.perf_counter()
                times.append((t1 - t0, t2 - t1))
                print(backend, [round(x, 2) for x in times[-1]], flush=True)
            rows[backend] = times
    finally:
        cluster.stop()
        subprocess.run(["rm", "-rf", tmp])
    print("\n| backend | start -> healthy s (median, max) | stop -> gone s (median, max) |\n|---|---:|---:|")
    for label, times in rows.items():
        a, b = [t[0] for t in times], [t[1] for t in times]
        print(f"| {label} | {statistics.median(a):.2f} ({max(a):.2f}) | {statistics.median(b):.2f} ({max(b):.2f}) |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--services", action="store_true", help="service start/stop instead of jobs")
    args = p.parse_args()
    if args.services:
        return bench_services(args.runs)
    import boto3
    import dagster as dg

    from composer_dag.storage import open_storage
    from resources.cluster import ClusterResource
    from tests.slurm_cluster import SlurmCluster

    proc, endpoint = moto()
    os.environ["PYTHONPATH"] = str(ROOT)  # the payload lives in tests/
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench-secret", COMPOSER_S3_ENDPOINT_URL=endpoint)
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="bench")
    root = "s3://bench/root"
    tmp = tempfile.mkdtemp(prefix="composer-bench-")
    os.chmod(tmp, 0o755)
    cluster = SlurmCluster(Path(tmp) / "slurm")
    (Path(tmp) / "slurm").mkdir()
    os.chmod(Path(tmp) / "slurm", 0o755)
    cluster.start()
    os.environ.update(cluster.env)
    scratch = Path(tmp) / "scratch"
    scratch.mkdir()
    rows = {}
    try:
        backends = {
            "local": ClusterResource(launcher="python", scratch_dir=str(scratch)),
            "slurm (bwrap)": ClusterResource(backend="slurm", launcher="python", isolate=True,
                                             job_code=["composer_dag", "tests"], scratch_dir=str(scratch),
                                             poll_seconds=0.5),
        }
        for label, res in backends.items():
            times = []
            for _ in range(args.runs):
                key = uuid.uuid4().hex[:8]
                job = {"stage": "payload", "entry": "tests.slurm_payload",
                       "config": {"out_dir": "{scratch}/out", "steps": 1, "step_s": 0.0},
                       "outputs": {"payload": {"url": f"{root}/payload/{key}", "files": [["", "hf"]]}}}
                seen = {}

                @dg.asset(name="payload")
                def payload(context: dg.AssetExecutionContext, cluster: ClusterResource):
                    t0 = time.time()
                    result = cluster.run_job(context, open_storage(root), job, name="composer-bench")
                    seen.update(t0=t0, t1=time.time(), **result["summary"])
                    return dg.MaterializeResult()

                assert dg.materialize([payload], resources={"cluster": res}).success
                times.append((seen["started_at"] - seen["t0"], seen["t1"] - seen["finished_at"], seen["t1"] - seen["t0"]))
                print(label, [round(x, 2) for x in times[-1]], flush=True)
            rows[label] = times
    finally:
        cluster.stop()
        proc.terminate()
        subprocess.run(["rm", "-rf", tmp])
    print("\n| backend | launch -> stage start s | stage end -> step end s | total s |\n|---|---:|---:|---:|")
    for label, times in rows.items():
        med = [statistics.median(t[i] for t in times) for i in range(3)]
        print(f"| {label} | {med[0]:.2f} | {med[1]:.2f} | {med[2]:.2f} |")


if __name__ == "__main__":
    main()
