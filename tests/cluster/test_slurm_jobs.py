"""Cluster jobs on the real two-node Slurm cluster (``TwoNodeCluster``: each node its own
network, hostname and ``/tmp``), with a tiny resumable payload (seconds): the job shares no disk
with Dagster (bubblewrap on its node; inputs, outputs, state and Pipes on the cluster's moto S3
server), a failing stage is named in one line, an external ``scancel`` fails the step clearly
and the retry resumes from the last sealed checkpoint (also after its node set DOWN and a time
limit), and cancelling the run ``scancel``s the job and leaves none of its processes. Services
(a trivial HTTP server) answer at their node's name from the other node and leave no job or
process after stop or a failing step; an array job reports every index; the logs of services
and array tasks reach this process through S3 (``log_uri``)."""

import shutil
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

ROOT = Path(__file__).resolve().parents[2]


SCRATCH = "/tmp/composer-scratch"  # every node's own (TwoNodeCluster.scratch)


def _cluster(**kw) -> ClusterResource:
    return ClusterResource(backend="slurm", launcher="python", isolate=True, job_code=["composer_dag", "tests"],
                           scratch_dir=SCRATCH, poll_seconds=0.5, grace_seconds=3, **kw)


def _job(root: str, key: str, **config) -> dict:
    return {"stage": "payload", "entry": "tests.slurm_payload",
            "config": {"out_dir": "{scratch}/out", **config},
            "state_url": f"{root}/work/payload/{key}",
            "outputs": {"payload": {"url": f"{root}/payload/{key}", "files": [["", "hf"], ["metrics.jsonl", "metrics.jsonl"]]}}}


def _asset(root: str, job: dict, retries: int = 0, name: str = "composer-payload"):
    """An asset that runs ``job`` on the cluster resource (``name``: the Slurm job's name)."""
    @dg.asset(retry_policy=dg.RetryPolicy(max_retries=retries) if retries else None)
    def payload(context: dg.AssetExecutionContext, cluster: ClusterResource):
        result = cluster.run_job(context, open_storage(root), job, name=name)
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


def _node_of(job_id: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True).stdout.strip()


def _in_scratch(cluster, pattern: str) -> list[Path]:
    """What matches ``pattern`` in the scratch directory of each node."""
    return [p for n in cluster.names for p in (cluster.node_dir(n) / "tmp" / SCRATCH.split("/")[-1]).glob(pattern)]


@pytest.fixture
def s3_root(cluster_bucket):
    return f"s3://{cluster_bucket['bucket']}/root"


def test_slurm_job_is_isolated_and_exchanges_only_urls(slurm_two_nodes, s3_root, tmp_path, monkeypatch):
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
               probe=[str(home), str(src / "a.txt"), str(ROOT / "README.md"), str(ROOT / "composer_dag" / "cluster" / "spec.py")])
    job["inputs"] = {"data": {"url": f"{s3_root}/data/1", "digest": digest}}
    res = dg.materialize([_asset(s3_root, job)], resources={"cluster": _cluster()})
    assert res.success
    result = _result(res)
    summary = result["summary"]
    assert summary["input_files"] == ["a.txt", "manifest.json"]
    # the code is there read-only; the launching machine's files are not
    assert summary["visible"] == [str(ROOT / "composer_dag" / "cluster" / "spec.py")], summary["visible"]
    out = result["outputs"]["payload"]
    assert storage.manifest_digest(out["url"]) == out["digest"]
    assert set(storage.verify_manifest(out["url"])["files"]) == {"weights.txt", "metrics.jsonl"}
    assert not _in_scratch(slurm_two_nodes, "composer-payload-*/*"), "the job's scratch directory was left behind"


def test_slurm_failing_stage_is_named_in_one_line(slurm_two_nodes, s3_root):
    job = _job(s3_root, uuid.uuid4().hex[:8], steps=3, step_s=0.05, fail_at=2)
    res = dg.materialize([_asset(s3_root, job)], resources={"cluster": _cluster()}, raise_on_error=False)
    assert not res.success
    failure = next(e for e in res.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE)
    first = failure.event_specific_data.error.message.splitlines()[0]
    assert "tests.slurm_payload" in first and "ValueError: planted failure at step 2" in first, first


def _when_step_synced(s3_root: str, key: str, step: int, action) -> tuple[threading.Thread, list[str]]:
    """A thread that waits until the job's checkpoint of ``step`` is on storage, then calls
    ``action(job_id)`` once; the list it returns gets the job id it acted on."""
    storage = open_storage(s3_root)
    acted: list[str] = []

    def watch():
        latest = f"{s3_root}/work/payload/{key}/latest"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if storage.exists(latest) and storage.read_json(latest)["step"] >= step:
                jobs = _squeue("composer-payload")
                if jobs:
                    job_id = next(iter(jobs))
                    action(job_id)
                    acted.append(job_id)
                    return
            time.sleep(0.2)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t, acted


def _failed_then_resumed(res, job_id: str) -> tuple[str, dict]:
    """The first line of the failure that sent the step to its retry (it names ``job_id``), and
    the summary of the retry that succeeded."""
    failures = [e for e in res.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    retries = [e for e in res.all_events if e.event_type == dg.DagsterEventType.STEP_UP_FOR_RETRY]
    assert res.success, [e.message for e in failures]
    err = retries[0].event_specific_data.error
    while err.cls_name != "ClusterError" and err.cause is not None:  # the retry request wraps the failure
        err = err.cause
    first = err.message.splitlines()[0]
    assert f"slurm job {job_id}" in first, first
    return first, _result(res)["summary"]


def _resumed_at_most_from_step_3(summary: dict, steps: int = 6) -> None:
    """The retry resumed from the state synced at step 3 or an earlier sealed step (the sync may
    trail the step under load), and every step ran exactly once."""
    assert summary["resumed_from"] in ("step_000001", "step_000002", "step_000003"), summary
    assert summary["metrics_steps"] == list(range(1, steps + 1)), summary["metrics_steps"]


def test_slurm_external_scancel_fails_clearly_and_the_retry_resumes(slurm_two_nodes, s3_root):
    """``scancel`` from outside while the job runs: the step fails with a line that says so; the
    retry submits a new job, which resumes from the last checkpoint synced to S3, and every step
    is in the metrics exactly once."""
    key = uuid.uuid4().hex[:8]
    job = _job(s3_root, key, steps=10, step_s=0.4)
    t, cancelled = _when_step_synced(s3_root, key, 3, lambda job_id: subprocess.run(["scancel", job_id], check=True))
    res = dg.materialize([_asset(s3_root, job, retries=1)], resources={"cluster": _cluster()}, raise_on_error=False)
    t.join(timeout=5)
    assert cancelled, "the job was never cancelled"
    first, summary = _failed_then_resumed(res, cancelled[0])
    assert "CANCELLED" in first, first
    assert summary["resumed_from"] is not None and int(summary["resumed_from"].split("_")[1]) >= 1, summary
    assert summary["metrics_steps"] == list(range(1, 11)), summary["metrics_steps"]


def _scontrol(*args: str) -> None:
    subprocess.run(["scontrol", *args], check=True, capture_output=True, text=True)


def _wait_ended(job_id: str, timeout: float = 60) -> str:
    from composer_dag.cluster.backends.slurm import slurm_state

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = slurm_state(job_id).get("JobState", "UNKNOWN")
        if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return state
        time.sleep(0.2)
    raise AssertionError(f"slurm job {job_id} did not end")


def _resume_node(node: str) -> None:
    """The node back in service (``state=resume``; Slurm refuses it when the node already
    returned by itself), then idle."""
    subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        out = subprocess.run(["sinfo", "-h", "-n", node, "-o", "%t"], capture_output=True, text=True).stdout.strip()
        if out in ("idle", "mix", "alloc"):
            return
        time.sleep(0.2)
    raise AssertionError(f"node {node} did not return to service")


def test_slurm_node_down_fails_clearly_and_the_retry_resumes(slurm_two_nodes, s3_root):
    """The job's node set DOWN while the job holds after step 3 (synced to S3): the job ends
    NODE_FAIL (never requeued by Slurm), the step fails with a line that says its node was lost,
    and the retry, once the node is back, resumes from step 3 with no step lost or repeated."""
    key = uuid.uuid4().hex[:8]
    job = _job(s3_root, key, steps=6, step_s=0.1, hold_after=3, hold_s=60)
    downed_nodes: list[str] = []

    def node_down(job_id: str) -> None:
        node = _node_of(job_id)
        downed_nodes.append(node)
        _scontrol("update", f"nodename={node}", "state=down", "reason=test")
        try:
            _wait_ended(job_id)
        finally:
            _resume_node(node)

    t, downed = _when_step_synced(s3_root, key, 3, node_down)
    try:
        res = dg.materialize([_asset(s3_root, job, retries=1)], resources={"cluster": _cluster()},
                             raise_on_error=False)
        t.join(timeout=30)
    finally:
        for node in downed_nodes:
            _resume_node(node)
    assert downed, "the node was never set down"
    first, summary = _failed_then_resumed(res, downed[0])
    assert "lost its node" in first and "NODE_FAIL" in first, first
    _resumed_at_most_from_step_3(summary)


def test_slurm_time_limit_fails_clearly_and_the_retry_resumes(slurm_two_nodes, s3_root):
    """The job's time limit reached while it holds after step 3: its end time is moved to now
    (``scontrol update EndTime``; Slurm's own limits are whole minutes) and slurmctld ends it
    TIMEOUT at its next time-limit check (every 30 s); the step fails saying so, and the retry
    resumes from step 3 with no step lost or repeated."""
    key = uuid.uuid4().hex[:8]
    job = _job(s3_root, key, steps=6, step_s=0.1, hold_after=3, hold_s=90)

    def end_now(job_id: str) -> None:
        for ahead in (1, 3, 5):  # an end time already past when slurmctld reads it is refused
            if subprocess.run(["scontrol", "update", f"jobid={job_id}", f"EndTime=now+{ahead}"],
                              capture_output=True).returncode == 0:
                return
        raise AssertionError(f"scontrol refused a new end time for job {job_id}")

    t, limited = _when_step_synced(s3_root, key, 3, end_now)
    res = dg.materialize([_asset(s3_root, job, retries=1)], resources={"cluster": _cluster()}, raise_on_error=False)
    t.join(timeout=5)
    assert limited, "the time limit was never set"
    first, summary = _failed_then_resumed(res, limited[0])
    assert "hit its time limit" in first and "TIMEOUT" in first, first
    _resumed_at_most_from_step_3(summary)


def test_slurm_cancelling_the_run_scancels_the_job_and_leaves_no_process(slurm_two_nodes, s3_root):
    """The run's process interrupted (SIGINT) while its job runs on a node: the job is
    ``scancel``led and none of its processes is left on the node (seen from this machine, whose
    PID namespace holds the nodes')."""
    name = f"composer-payload-{uuid.uuid4().hex[:6]}"
    job = _job(s3_root, uuid.uuid4().hex[:8], steps=1000, step_s=1.0)
    script = textwrap.dedent(f"""
        import dagster as dg
        from tests.cluster.test_slurm_jobs import _asset, _cluster
        dg.materialize([_asset({s3_root!r}, {job!r}, name={name!r})], resources={{"cluster": _cluster()}},
                       raise_on_error=False)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    marker = f"{SCRATCH}/{name}-"  # in the argv of every process of the job
    deadline = time.monotonic() + 120
    while not any("tests.slurm_payload" in p.info["cmdline"] for p in _job_processes(marker)):
        assert time.monotonic() < deadline and proc.poll() is None, "the job never started"
        time.sleep(0.3)
    (job_id, state), = _squeue(name).items()
    assert state == "RUNNING"
    proc.send_signal(signal.SIGINT)  # what a run termination delivers to the step
    proc.wait(timeout=90)
    deadline = time.monotonic() + 30
    while (_job_processes(marker) or job_id in _squeue(name)) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert job_id not in _squeue(name)
    assert not _job_processes(marker), [p.info["cmdline"] for p in _job_processes(marker)]
    state = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    assert "JobState=CANCELLED" in state, state


# ---- services and arrays on the cluster ------------------------------------------------------
def _service_cluster(s3_root: str, **kw) -> ClusterResource:
    """Services and arrays on the two nodes, their logs copied to ``<s3_root>/logs`` as they end."""
    return ClusterResource(backend="slurm", scratch_dir=SCRATCH, log_uri=f"{s3_root}/logs", poll_seconds=0.5,
                           grace_seconds=3, **kw)


WEB = ("import http.server, sys\n"
       "class H(http.server.BaseHTTPRequestHandler):\n"
       "    def do_GET(self):\n"
       "        self.send_response(200); self.end_headers(); self.wfile.write(b'ok')\n"
       "    def log_message(self, *a): pass\n"
       "http.server.HTTPServer((sys.argv[2], int(sys.argv[1])), H).serve_forever()\n")


def _web(marker: str) -> list[str]:
    """A trivial HTTP service (answers 'ok') whose argv carries ``marker``."""
    return [sys.executable, "-c", WEB, "{port}", "{host}", marker]


def _job_state(job_id: str) -> str:
    return subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout


FETCH = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"


def test_slurm_service_answers_its_health_url_and_is_gone_after_stop(slurm_two_nodes, s3_root):
    """A service started as a Slurm job on the node it asks for: its URL names that node, and the
    other node reaches it by that name (this machine checks its health at the node's address);
    ``stop`` scancels it and returns once the job has left the queue with none of its processes
    left."""
    cluster = slurm_two_nodes
    marker = f"www-{uuid.uuid4().hex[:6]}"
    seen = {}

    @dg.asset
    def served(context: dg.AssetExecutionContext, cluster_res: ClusterResource):
        with cluster_res.services(context) as fleet:
            h = fleet.start(name="composer-web", argv=_web(marker), start_timeout_s=30, node="node2")
            seen.update(job=h.job_id, url=h.url, health=h.health_url, port=h.port, node=_node_of(h.job_id),
                        state=_squeue("composer-web").get(h.job_id), running=len(_job_processes(marker)),
                        from_node1=cluster.in_node("node1", sys.executable, "-c", FETCH, h.url + "/"))
            fleet.stop(h)
            seen.update(after=_squeue("composer-web").get(h.job_id), left=len(_job_processes(marker)))

    assert dg.materialize([served], resources={"cluster_res": _service_cluster(s3_root)}).success
    assert seen["state"] == "RUNNING" and seen["running"] >= 1 and seen["node"] == "node2", seen
    assert seen["url"] == f"http://node2:{seen['port']}", seen  # named after its node
    assert seen["health"].startswith(f"http://{cluster.addr['node2']}:{seen['port']}/"), seen  # NodeAddr
    assert seen["from_node1"].returncode == 0 and seen["from_node1"].stdout.strip() == "ok", seen["from_node1"]
    assert seen["after"] is None and seen["left"] == 0, seen
    assert "JobState=CANCELLED" in _job_state(seen["job"])


def test_slurm_step_that_raises_while_serving_leaves_no_service(slurm_two_nodes, s3_root):
    marker = f"www-{uuid.uuid4().hex[:6]}"
    jobs: list[str] = []

    @dg.asset
    def failing(context: dg.AssetExecutionContext, cluster: ClusterResource):
        with cluster.services(context) as fleet:
            jobs.append(fleet.start(name="composer-web", argv=_web(marker), start_timeout_s=30).job_id)
            raise ValueError("planted failure while serving")

    res = dg.materialize([failing], resources={"cluster": _service_cluster(s3_root)}, raise_on_error=False)
    assert not res.success and jobs
    assert jobs[0] not in _squeue("composer-web")
    assert not _job_processes(marker), [p.info["cmdline"] for p in _job_processes(marker)]
    assert "JobState=CANCELLED" in _job_state(jobs[0])


def test_slurm_array_runs_every_index_and_names_a_failing_one(slurm_two_nodes, s3_root):
    """``sbatch --array``: each task gets its index in COMPOSER_ARRAY_INDEX and writes in its
    node's scratch; every index's exit code comes back, and a failing index fails the step with
    its index and exception in one line, read from its log on S3 (its node's disk is not this
    machine's)."""
    out = f"{SCRATCH}/out-{uuid.uuid4().hex[:6]}"
    task = ("import os; i = int(os.environ['COMPOSER_ARRAY_INDEX']); "
            f"os.makedirs({out!r}, exist_ok=True); "
            f"open(os.path.join({out!r}, str(i)), 'w').write(os.environ['SLURM_ARRAY_JOB_ID']); "
            "assert i != 2, f'shard {i} is corrupt'")
    codes = {}

    @dg.asset
    def mapped(context: dg.AssetExecutionContext, cluster: ClusterResource):
        try:
            cluster.run_array(context, [sys.executable, "-c", task], 4, name="composer-shards", parallelism=2)
        except dg.Failure as exc:
            codes.update({t["index"]: t["exit_code"] for t in exc.metadata["tasks"].value})
            raise

    res = dg.materialize([mapped], resources={"cluster": _service_cluster(s3_root)}, raise_on_error=False)
    failure = next(e for e in res.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE)
    first = failure.event_specific_data.error.message.splitlines()[0]
    assert first.endswith("array composer-shards: 1 of 4 indexes failed: index 2 failed (exit code 1): "
                          "AssertionError: shard 2 is corrupt"), first
    assert codes == {0: 0, 1: 0, 2: 1, 3: 0}
    written = _in_scratch(slurm_two_nodes, f"{out.rsplit('/', 1)[1]}/*")
    assert sorted(p.name for p in written) == ["0", "1", "2", "3"], written
    assert len({p.read_text() for p in written}) == 1  # one array job
    for d in {p.parent for p in written}:  # the nodes are the session's: leave them as found
        shutil.rmtree(d)
    storage = open_storage(s3_root)
    assert len([u for u in storage.find(f"{s3_root}/logs") if "/composer-shards-" in u]) == 4


def test_slurm_service_that_exits_is_named_with_its_log(slurm_two_nodes, s3_root):
    crash = [sys.executable, "-c", "print('loading weights', flush=True); raise FileNotFoundError('no model at /models/x')"]

    @dg.asset
    def crashing(context: dg.AssetExecutionContext, cluster: ClusterResource):
        cluster.start_service(context, "composer-crash", crash, start_timeout_s=30)

    res = dg.materialize([crashing], resources={"cluster": _service_cluster(s3_root)}, raise_on_error=False)
    failure = next(e for e in res.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE)
    message = failure.event_specific_data.error.message
    first = message.splitlines()[0]
    assert "service composer-crash" in first and "FileNotFoundError: no model at /models/x" in first, first
    assert "slurm job" in first, first
    # the log's last lines, from its copy on S3 (the node's scratch is not this machine's)
    assert "  loading weights" in message and f"({s3_root}/logs/composer-crash-" in message, message
    assert not _squeue("composer-crash")
