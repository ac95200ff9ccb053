"""Cluster jobs on a real one-node Slurm cluster, with a tiny resumable payload (seconds): the
job shares no disk with Dagster (bubblewrap; inputs, outputs, state and Pipes on a moto S3
server), a failing stage is named in one line, an external ``scancel`` fails the step clearly
and the retry resumes from the last sealed checkpoint, and cancelling the run ``scancel``s the
job and leaves none of its processes."""

import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import dagster as dg
import psutil
import pytest

from composer_dag.storage import open_storage
from resources.cluster import ClusterResource

ROOT = Path(__file__).resolve().parent.parent


def _cluster(scratch: Path, **kw) -> ClusterResource:
    scratch.mkdir(parents=True, exist_ok=True)  # node-local scratch: exists on every node
    return ClusterResource(backend="slurm", launcher="python", isolate=True, job_code=["composer_dag", "tests"],
                           scratch_dir=str(scratch), poll_seconds=0.5, grace_seconds=3, **kw)


def _job(root: str, key: str, **config) -> dict:
    return {"stage": "payload", "entry": "tests.slurm_payload",
            "config": {"out_dir": "{scratch}/out", **config},
            "state_url": f"{root}/work/payload/{key}",
            "outputs": {"payload": {"url": f"{root}/payload/{key}", "files": [["", "hf"], ["metrics.jsonl", "metrics.jsonl"]]}}}


def _asset(root: str, job: dict, retries: int = 0):
    @dg.asset(retry_policy=dg.RetryPolicy(max_retries=retries) if retries else None)
    def payload(context: dg.AssetExecutionContext, cluster: ClusterResource):
        result = cluster.run_job(context, open_storage(root), job, name="composer-payload")
        return dg.MaterializeResult(metadata={"result": dg.MetadataValue.json(result)})

    return payload


def _result(res) -> dict:
    return res.get_asset_materialization_events()[0].materialization.metadata["result"].value


def _job_processes(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and any(marker in a for a in p.info["cmdline"] or []):
            found.append(p)
    return found


def _squeue(name: str) -> dict[str, str]:
    out = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i %T"], capture_output=True, text=True).stdout
    return dict(line.split() for line in out.splitlines() if line.strip())


@pytest.fixture
def s3_root(s3_bucket):
    return f"s3://{s3_bucket['bucket']}/root"


def test_slurm_job_is_isolated_and_exchanges_only_urls(slurm_cluster, s3_root, tmp_path, monkeypatch):
    """The job pulls its verified input from S3, cannot see this process's disk (COMPOSER_HOME,
    the repository beyond the code), publishes a sealed output whose digest is what it reported."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("COMPOSER_HOME", str(home))
    storage = open_storage(s3_root)
    src = tmp_path / "data"
    src.mkdir()
    (src / "a.txt").write_text("hello")
    storage.put_dir(str(src), f"{s3_root}/data/1")
    digest = storage.write_manifest(f"{s3_root}/data/1")
    job = _job(s3_root, uuid.uuid4().hex[:8], steps=3, step_s=0.05, input_dir="{scratch}/inputs/data",
               probe=[str(home), str(src / "a.txt"), str(ROOT / "README.md"), str(ROOT / "composer_dag" / "launch.py")])
    job["inputs"] = {"data": {"url": f"{s3_root}/data/1", "digest": digest}}
    res = dg.materialize([_asset(s3_root, job)], resources={"cluster": _cluster(tmp_path / "scratch")})
    assert res.success
    result = _result(res)
    summary = result["summary"]
    assert summary["input_files"] == ["a.txt", "manifest.json"]
    # the code is there read-only; the launching machine's files are not
    assert summary["visible"] == [str(ROOT / "composer_dag" / "launch.py")], summary["visible"]
    out = result["outputs"]["payload"]
    assert storage.manifest_digest(out["url"]) == out["digest"]
    assert set(storage.verify_manifest(out["url"])["files"]) == {"weights.txt", "metrics.jsonl"}
    assert not list((tmp_path / "scratch").glob("composer-payload-*/*")), "the job's scratch directory was left behind"


def test_slurm_failing_stage_is_named_in_one_line(slurm_cluster, s3_root, tmp_path):
    job = _job(s3_root, uuid.uuid4().hex[:8], steps=3, step_s=0.05, fail_at=2)
    res = dg.materialize([_asset(s3_root, job)], resources={"cluster": _cluster(tmp_path / "scratch")},
                         raise_on_error=False)
    assert not res.success
    failure = next(e for e in res.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE)
    first = failure.event_specific_data.error.message.splitlines()[0]
    assert "tests.slurm_payload" in first and "ValueError: planted failure at step 2" in first, first


def test_slurm_external_scancel_fails_clearly_and_the_retry_resumes(slurm_cluster, s3_root, tmp_path):
    """``scancel`` from outside while the job runs: the step fails with a line that says so; the
    retry submits a new job, which resumes from the last checkpoint synced to S3, and every step
    is in the metrics exactly once."""
    key = uuid.uuid4().hex[:8]
    job = _job(s3_root, key, steps=10, step_s=0.4)
    storage = open_storage(s3_root)
    cancelled: list[str] = []

    def cancel_after_step_3():
        latest = f"{s3_root}/work/payload/{key}/latest"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if storage.exists(latest) and storage.read_json(latest)["step"] >= 3:
                jobs = _squeue("composer-payload")
                if jobs:
                    job_id = next(iter(jobs))
                    subprocess.run(["scancel", job_id], check=True)
                    cancelled.append(job_id)
                    return
            time.sleep(0.2)

    t = threading.Thread(target=cancel_after_step_3, daemon=True)
    t.start()
    res = dg.materialize([_asset(s3_root, job, retries=1)], resources={"cluster": _cluster(tmp_path / "scratch")},
                         raise_on_error=False)
    t.join(timeout=5)
    assert cancelled, "the job was never cancelled"
    failures = [e for e in res.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    retries = [e for e in res.all_events if e.event_type == dg.DagsterEventType.STEP_UP_FOR_RETRY]
    assert res.success, [e.message for e in failures]
    err = retries[0].event_specific_data.error
    while err.cls_name != "ClusterError" and err.cause is not None:  # the retry request wraps the failure
        err = err.cause
    first = err.message.splitlines()[0]
    assert f"slurm job {cancelled[0]}" in first and "CANCELLED" in first, first
    summary = _result(res)["summary"]
    assert summary["resumed_from"] is not None and int(summary["resumed_from"].split("_")[1]) >= 1, summary
    assert summary["metrics_steps"] == list(range(1, 11)), summary["metrics_steps"]


def test_slurm_cancelling_the_run_scancels_the_job_and_leaves_no_process(slurm_cluster, s3_root, tmp_path):
    scratch = tmp_path / f"scratch-{uuid.uuid4().hex[:6]}"
    job = _job(s3_root, uuid.uuid4().hex[:8], steps=1000, step_s=1.0)
    script = textwrap.dedent(f"""
        import dagster as dg
        from tests.test_slurm_jobs import _asset, _cluster
        from pathlib import Path
        dg.materialize([_asset({s3_root!r}, {job!r})], resources={{"cluster": _cluster(Path({str(scratch)!r}))}},
                       raise_on_error=False)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    marker = str(scratch / "composer-payload-")  # in the argv of every process of the job
    deadline = time.monotonic() + 120
    while not any("tests.slurm_payload" in p.info["cmdline"] for p in _job_processes(marker)):
        assert time.monotonic() < deadline and proc.poll() is None, "the job never started"
        time.sleep(0.3)
    (job_id, state), = _squeue("composer-payload").items()
    assert state == "RUNNING"
    proc.send_signal(signal.SIGINT)  # what a run termination delivers to the step
    proc.wait(timeout=90)
    deadline = time.monotonic() + 30
    while (_job_processes(marker) or job_id in _squeue("composer-payload")) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert job_id not in _squeue("composer-payload")
    assert not _job_processes(marker), [p.info["cmdline"] for p in _job_processes(marker)]
    state = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    assert "JobState=CANCELLED" in state, state
