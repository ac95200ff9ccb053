"""The cluster resource: the local backend for real (torchrun through Dagster Pipes, cancellation
stops the whole process tree); k8s and Slurm by rendering their specs (no cluster here)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import dagster as dg
import pytest

from composer_dag import launch
from resources.cluster import ClusterResource

ROOT = Path(__file__).resolve().parent.parent


def _asset_for(pid_dir: str, sleep: float = 0.0, ignore_term: bool = False, fail: str = ""):
    @dg.asset
    def distributed(context: dg.AssetExecutionContext, cluster: ClusterResource):
        args = ["--pid-dir", pid_dir, "--sleep", str(sleep)] + (["--ignore-term"] if ignore_term else [])
        args += ["--fail", fail] if fail else []
        result = cluster.run(context, "tests.cluster_payload", args)
        return dg.MaterializeResult(metadata={"world_size": result["world_size"], "rank": result["rank"]})

    return distributed


@pytest.mark.slow
def test_local_backend_runs_torchrun_and_returns_rank0_result(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    res = dg.materialize([_asset_for(str(tmp_path))], resources={"cluster": ClusterResource(nproc_per_node=2)})
    assert res.success
    meta = res.get_asset_materialization_events()[0].materialization.metadata
    assert meta["world_size"].value == 2 and meta["rank"].value == 0
    assert sorted(p.name for p in tmp_path.glob("rank*.pid")) == ["rank0.pid", "rank1.pid"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("ignore_term", [False, True], ids=["ranks-exit-on-sigterm", "ranks-ignore-sigterm"])
def test_cancelling_the_run_stops_every_process(tmp_path, ignore_term):
    """Interrupt the Dagster run while two torchrun ranks sleep: the launcher and both ranks die,
    also when the ranks ignore SIGTERM (torchrun puts them in sessions of their own, so killing
    the launcher's process group alone would leave them running)."""
    script = textwrap.dedent(f"""
        import dagster as dg
        from resources.cluster import ClusterResource
        from tests.test_cluster import _asset_for
        dg.materialize([_asset_for({str(tmp_path)!r}, sleep=600, ignore_term={ignore_term})],
                       resources={{"cluster": ClusterResource(nproc_per_node=2, grace_seconds=3)}},
                       raise_on_error=False)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    deadline = time.monotonic() + 180
    while len(list(tmp_path.glob("rank*.pid"))) < 2:
        assert time.monotonic() < deadline and proc.poll() is None, "ranks never started"
        time.sleep(0.5)
    pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
    assert all(_alive(p) for p in pids)
    proc.send_signal(signal.SIGINT)  # what a run termination delivers to the step
    proc.wait(timeout=60)
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), "a rank survived the cancellation"


@pytest.mark.slow
def test_a_failing_rank_is_named_in_one_line(tmp_path):
    """A rank that raises fails the step with the rank's own exception in the first line (not
    only an exit code), through torchrun's failure summary."""
    res = dg.materialize([_asset_for(str(tmp_path), fail="planted failure 42")],
                         resources={"cluster": ClusterResource(nproc_per_node=1)}, raise_on_error=False)
    assert not res.success
    failure = next(e for e in res.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE)
    first = failure.event_specific_data.error.message.splitlines()[0]
    assert "exited with code" in first and "ValueError: planted failure 42" in first, first


def test_k8s_pod_spec_requests_gpus_and_shares_no_volume():
    cluster = ClusterResource(backend="k8s", image="registry.example.com/composer:1", nproc_per_node=8,
                              gpus_per_node=8, namespace="ml", memory="200Gi", secret_name="s3-creds",
                              node_selector={"gpu": "h100"})
    pod = cluster.render("s3://bucket/jobs/r1/midtrain.json", "composer-midtrain")
    assert pod["kind"] == "Pod" and pod["metadata"]["namespace"] == "ml"
    c = pod["spec"]["containers"][0]
    assert c["image"] == "registry.example.com/composer:1"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert c["command"] == ["python", "-m", "composer_dag.runtime.job", "--spec", "s3://bucket/jobs/r1/midtrain.json"]
    assert c["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    assert pod["spec"]["nodeSelector"] == {"gpu": "h100"}
    assert {v["name"] for v in pod["spec"]["volumes"]} == {"dshm", "scratch"}  # nothing shared
    assert all("emptyDir" in v for v in pod["spec"]["volumes"])
    assert pod["spec"]["restartPolicy"] == "Never"
    assert "DS_ACCELERATOR" not in {e["name"] for e in c["env"]}  # GPUs: the default accelerator


def test_slurm_script_runs_the_job_runner_once_per_node():
    cluster = ClusterResource(backend="slurm", nnodes=4, nproc_per_node=8, gpus_per_node=8, partition="gpu",
                              account="ml", time_limit="12:00:00", scratch_dir="/scratch",
                              container_image="nvcr.io/org/composer:1")
    script = cluster.render("s3://bucket/jobs/r1/midtrain.json", "composer-midtrain", scratch="/scratch/job1")
    assert script.startswith("#!/bin/bash")
    for line in ("#SBATCH --nodes=4", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu",
                 "#SBATCH --account=ml", "#SBATCH --time=12:00:00", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --output=/scratch/%x-%j.out", "mkdir -p /scratch/job1 /scratch/composer-cache"):
        assert line in script.splitlines()
    srun = script.rstrip().splitlines()[-1]
    assert srun.startswith("srun --kill-on-bad-exit=1 --container-image=nvcr.io/org/composer:1 ")
    assert srun.endswith("-m composer_dag.runtime.job --spec s3://bucket/jobs/r1/midtrain.json --scratch /scratch/job1")
    assert 'export COMPOSER_RDZV_ENDPOINT="$head:29500"' in script


def test_isolated_slurm_job_gets_credentials_by_reference(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "never-in-the-script-123")
    cluster = ClusterResource(backend="slurm", isolate=True, scratch_dir="/scratch")
    script = cluster.render("s3://b/spec.json", "composer-x", scratch="/scratch/j")
    assert "never-in-the-script-123" not in script
    assert '--setenv AWS_SECRET_ACCESS_KEY "${AWS_SECRET_ACCESS_KEY}"' in script
    assert "--bind /scratch/j /scratch/j" in script and "--clearenv" in script
    assert "--bind /scratch/composer-cache /scratch/composer-cache" in script  # node-local build cache


def test_local_command_is_cpu_torchrun():
    cluster = ClusterResource(nproc_per_node=2)
    cmd = launch.local_command(cluster.spec("composer_dag.train.midtrain", ["--config", "c.json"]))
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--nnodes"] and "--nproc-per-node" in cmd
    assert cluster.spec("x", []).env["DS_ACCELERATOR"] == "cpu"


def test_python_launcher_refuses_many_processes():
    with pytest.raises(ValueError, match="one process"):
        ClusterResource(launcher="python", nproc_per_node=2).spec("m", [])
