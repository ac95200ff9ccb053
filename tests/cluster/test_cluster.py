"""The cluster resource: the local backend for real (torchrun through Dagster Pipes, cancellation
stops the whole process tree; services with a health check that stop with their step, their run
or their parent process; arrays as a bounded process pool); k8s and Slurm by rendering their
specs (the Slurm backend runs for real in ``test_slurm_jobs.py``)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import dagster as dg
import pytest

from composer_dag.cluster import spec as launch
from resources.cluster import ClusterResource

ROOT = Path(__file__).resolve().parents[2]


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
        from tests.cluster.test_cluster import _asset_for
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
    assert c["command"] == ["python", "-m", "composer_dag.cluster.job", "--spec", "s3://bucket/jobs/r1/midtrain.json"]
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
                 "#SBATCH --output=/scratch/%x-%j.out"):
        assert line in script.splitlines()
    srun = script.rstrip().splitlines()[-1]
    # --label: each output line names the node task that wrote it
    assert srun.startswith("srun --kill-on-bad-exit=1 --label --container-image=nvcr.io/org/composer:1 bash -c ")
    # every node makes (and removes) the job's scratch and its own cache: nodes share no disk
    assert " composer-node /scratch/job1 /scratch/composer-cache " in srun
    assert srun.endswith("-m composer_dag.cluster.job --spec s3://bucket/jobs/r1/midtrain.json --scratch /scratch/job1")
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


# ---- services and arrays on the local backend ------------------------------------------------
def _marked(marker: str) -> list[int]:
    """Pids of live (not zombie) processes with ``marker`` in their argv."""
    import psutil

    return [p.pid for p in psutil.process_iter(["cmdline", "status"])
            if p.info["status"] != psutil.STATUS_ZOMBIE and any(marker in a for a in p.info["cmdline"] or [])]


def _web(marker: Path) -> list[str]:
    """A trivial HTTP service whose argv carries ``marker`` (a directory it serves)."""
    marker.mkdir(parents=True, exist_ok=True)
    (marker / "index.html").write_text("ok")
    return [sys.executable, "-m", "http.server", "{port}", "--bind", "{host}", "--directory", str(marker)]


def _first_line(res) -> str:
    failure = next(e for e in res.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE)
    return failure.event_specific_data.error.message.splitlines()[0].removeprefix("resources.cluster.ClusterError: ")


def test_local_service_answers_and_stop_leaves_no_process(tmp_path):
    import urllib.request

    marker = tmp_path / "www"

    @dg.asset
    def served(context: dg.AssetExecutionContext, cluster: ClusterResource):
        with cluster.services(context) as fleet:
            h = fleet.start(name="web", argv=_web(marker))
            body = urllib.request.urlopen(h.url + "/index.html", timeout=5).read().decode()
            pids = _marked(str(marker))
            fleet.stop(h)
            after = _marked(str(marker))
        return dg.MaterializeResult(metadata={"body": body, "pids": len(pids), "after": len(after), "url": h.url})

    res = dg.materialize([served], resources={"cluster": ClusterResource(scratch_dir=str(tmp_path), grace_seconds=3)})
    meta = res.get_asset_materialization_events()[0].materialization.metadata
    assert meta["body"].value == "ok" and meta["url"].value.startswith("http://127.0.0.1:")
    assert meta["pids"].value == 2  # the supervisor and the server, one process group
    assert meta["after"].value == 0 and not _marked(str(marker))


def test_local_step_that_raises_stops_its_services(tmp_path):
    markers = [tmp_path / "a", tmp_path / "b"]

    @dg.asset
    def failing(context: dg.AssetExecutionContext, cluster: ClusterResource):
        with cluster.services(context) as fleet:
            for i, m in enumerate(markers):
                fleet.start(name=f"web-{i}", argv=_web(m))
            assert all(_marked(str(m)) for m in markers)
            raise ValueError("planted failure while serving")

    res = dg.materialize([failing], resources={"cluster": ClusterResource(scratch_dir=str(tmp_path), grace_seconds=3)},
                         raise_on_error=False)
    failure = next(e for e in res.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE)
    assert not res.success and "planted failure while serving" in str(failure.event_specific_data.error.cause)
    assert not any(_marked(str(m)) for m in markers)


def test_local_start_many_starts_a_fleet_and_a_failure_stops_the_rest(tmp_path):
    """``start_many`` starts services at once from worker threads (they still die only with this
    process, not with those threads); one that fails gives up the others and stops them."""
    import urllib.request

    fleet_dirs = [tmp_path / "w0", tmp_path / "w1"]
    crash = [sys.executable, "-c", "raise RuntimeError('CUDA out of memory')"]

    @dg.asset
    def fleet_ok(context: dg.AssetExecutionContext, cluster: ClusterResource):
        with cluster.services(context) as fleet:
            hs = fleet.start_many([{"name": f"rollout-{i}", "argv": _web(d)} for i, d in enumerate(fleet_dirs)])
            time.sleep(0.5)  # the start threads are gone; the services must not be
            bodies = [urllib.request.urlopen(h.url + "/index.html", timeout=5).read().decode() for h in hs]
        return dg.MaterializeResult(metadata={"bodies": bodies})

    @dg.asset
    def fleet_bad(context: dg.AssetExecutionContext, cluster: ClusterResource):
        with cluster.services(context) as fleet:
            fleet.start_many([{"name": "rollout-0", "argv": _web(fleet_dirs[0])}, {"name": "rollout-1", "argv": crash}])

    cluster = ClusterResource(scratch_dir=str(tmp_path), grace_seconds=2)
    res = dg.materialize([fleet_ok], resources={"cluster": cluster})
    assert res.get_asset_materialization_events()[0].materialization.metadata["bodies"].value == ["ok", "ok"]
    assert not any(_marked(str(d)) for d in fleet_dirs)
    res = dg.materialize([fleet_bad], resources={"cluster": cluster}, raise_on_error=False)
    first = _first_line(res)
    assert first.startswith("service rollout-1 ended before it answered") and "RuntimeError: CUDA out of memory" in first, first
    assert not _marked(str(fleet_dirs[0]))


@pytest.mark.slow
def test_cancelling_the_run_stops_its_services(tmp_path):
    """Interrupt the Dagster run while its step serves: the ``services`` block stops the service."""
    marker = tmp_path / "www"
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        import dagster as dg
        from resources.cluster import ClusterResource
        from tests.cluster.test_cluster import _web

        @dg.asset
        def serving(context: dg.AssetExecutionContext, cluster: ClusterResource):
            with cluster.services(context) as fleet:
                fleet.start(name="web", argv=_web(Path({str(marker)!r})))
                Path({str(tmp_path / "serving")!r}).touch()
                time.sleep(600)

        dg.materialize([serving], resources={{"cluster": ClusterResource(scratch_dir={str(tmp_path)!r}, grace_seconds=2)}},
                       raise_on_error=False)
    """)
    log = tmp_path / "run.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not (tmp_path / "serving").exists():
        assert time.monotonic() < deadline and proc.poll() is None, "the service never started"
        time.sleep(0.2)
    assert len([pid for pid in _marked(str(marker)) if pid != proc.pid]) == 2  # supervisor and server
    proc.send_signal(signal.SIGINT)  # what a run termination delivers to the step
    proc.wait(timeout=60)
    assert "[cluster:local] run cancelled: stopping 1 service(s)" in log.read_text()
    assert not _marked(str(marker))


def test_local_service_that_fails_or_never_answers_is_named_with_its_log(tmp_path):
    """A service that exits fails the step with its name and exception, then its log's last lines;
    one that runs but never answers fails after ``start_timeout_s`` and is stopped."""
    crash = [sys.executable, "-c", "print('loading weights'); raise FileNotFoundError('no model at /models/x')"]
    hang = [sys.executable, "-c", f"import time; print('loading {tmp_path}'); time.sleep(120)"]

    @dg.asset
    def crashing(context: dg.AssetExecutionContext, cluster: ClusterResource):
        cluster.start_service(context, "rollout-0", crash)

    @dg.asset
    def hanging(context: dg.AssetExecutionContext, cluster: ClusterResource):
        cluster.start_service(context, "rollout-1", hang, start_timeout_s=1.5)

    cluster = ClusterResource(scratch_dir=str(tmp_path), grace_seconds=2)
    res = dg.materialize([crashing], resources={"cluster": cluster}, raise_on_error=False)
    message = next(e for e in res.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE
                   ).event_specific_data.error.message
    first = _first_line(res)
    assert first.startswith("service rollout-0 ended before it answered http://127.0.0.1:"), first
    assert "exited with code 1" in first and "FileNotFoundError: no model at /models/x" in first, first
    assert "last lines of its log" in message and "  loading weights" in message
    res = dg.materialize([hanging], resources={"cluster": cluster}, raise_on_error=False)
    first = _first_line(res)
    assert first.startswith("service rollout-1 did not answer") and "within 1.5 s" in first, first
    assert not _marked(f"loading {tmp_path}")


def test_local_service_dies_with_its_parent(tmp_path):
    """SIGKILL of the process that started a service (no cleanup can run) still ends the service:
    its supervisor gets PR_SET_PDEATHSIG and stops the whole group."""
    marker = tmp_path / "www"
    script = textwrap.dedent(f"""
        import sys, time
        from composer_dag.cluster.services import start_service
        h = start_service({{"scratch_dir": {str(tmp_path)!r}}}, {{"name": "web", "argv": {_web(marker)!r}}})
        print(h.url, flush=True)
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    url = parent.stdout.readline().strip()
    assert url.startswith("http://127.0.0.1:") and _marked(str(marker))
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 15
    while _marked(str(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _marked(str(marker))


def test_local_array_runs_every_index_bounded_and_names_a_failing_one(tmp_path):
    task = textwrap.dedent(f"""
        import os, time
        i = int(os.environ["COMPOSER_ARRAY_INDEX"])
        open(os.path.join({str(tmp_path)!r}, f"{{i}}.start"), "w").write(repr(time.time()))
        time.sleep(0.3)
        open(os.path.join({str(tmp_path)!r}, f"{{i}}.end"), "w").write(repr(time.time()))
        if i == int(os.environ.get("FAIL_AT", "-1")):
            raise RuntimeError(f"shard {{i}} is corrupt")
    """)
    argv = [sys.executable, "-c", task]

    @dg.asset
    def mapped(context: dg.AssetExecutionContext, cluster: ClusterResource):
        tasks = cluster.run_array(context, argv, 5, name="shards", parallelism=2)
        return dg.MaterializeResult(metadata={"codes": [t.exit_code for t in tasks]})

    @dg.asset
    def mapped_failing(context: dg.AssetExecutionContext, cluster: ClusterResource):
        cluster.run_array(context, argv, 4, env={"FAIL_AT": "2"}, name="shards")

    cluster = ClusterResource(scratch_dir=str(tmp_path), array_parallelism=4)
    res = dg.materialize([mapped], resources={"cluster": cluster})
    assert res.get_asset_materialization_events()[0].materialization.metadata["codes"].value == [0] * 5
    spans = [(float((tmp_path / f"{i}.start").read_text()), float((tmp_path / f"{i}.end").read_text())) for i in range(5)]
    most = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    assert most <= 2, f"{most} tasks ran at once with parallelism 2"
    res = dg.materialize([mapped_failing], resources={"cluster": cluster}, raise_on_error=False)
    first = _first_line(res)
    assert first == "array shards: 1 of 4 indexes failed: index 2 failed (exit code 1): RuntimeError: shard 2 is corrupt", first


# ---- services and arrays rendered for k8s and Slurm ------------------------------------------
def test_k8s_service_and_indexed_job_round_trip_through_the_api_models():
    from composer_dag.cluster.backends import backend_for
    from composer_dag.cluster.services import ArrayConfig, ServiceConfig
    from tests.train.test_train_cluster import api_round_trip

    cluster = ClusterResource(backend="k8s", image="registry.example.com/composer:1", namespace="ml",
                              secret_name="s3-creds", node_selector={"gpu": "h100"})
    k8s = backend_for(cluster.cluster_config())
    svc = ServiceConfig(name="rollout-0", argv=["python", "-m", "vllm.entrypoints.openai.api_server", "--host", "{host}",
                                                "--port", "{port}", "--model", "/models/x"],
                        health_url="http://{host}:{port}/health", gpus=1, memory="64Gi", env={"VLLM_LOGGING_LEVEL": "INFO"})
    deployment, service = k8s.render_service(svc, 8000)
    assert api_round_trip(deployment, "V1Deployment") == deployment
    assert api_round_trip(service, "V1Service") == service
    pod = deployment["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"][-6:] == ["--host", "0.0.0.0", "--port", "8000", "--model", "/models/x"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1" and c["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    assert pod["restartPolicy"] == "Always" and pod["nodeSelector"] == {"gpu": "h100"}
    assert all("emptyDir" in v for v in pod["volumes"])  # nothing shared
    assert deployment["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    assert service["spec"]["ports"][0]["port"] == 8000 and service["metadata"]["namespace"] == "ml"

    job = k8s.render_array(ArrayConfig(name="shards", argv=["python", "-m", "composer_dag.dedup.shards"], count=16,
                                       parallelism=4))
    assert api_round_trip(job, "V1Job") == job
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == 16
    assert job["spec"]["parallelism"] == 4 and job["spec"]["backoffLimitPerIndex"] == 0
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["COMPOSER_ARRAY_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']")
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    pinned, _ = k8s.render_service(svc.model_copy(update={"node": "gpu-node-7"}), 8000)
    assert pinned["spec"]["template"]["spec"]["nodeSelector"] == {"gpu": "h100", "kubernetes.io/hostname": "gpu-node-7"}
    broken = {**job, "spec": {**job["spec"], "completionsMode": "Indexed"}}  # misspelt: the model drops it
    assert api_round_trip(broken, "V1Job") != broken


def test_slurm_service_and_array_scripts():
    from composer_dag.cluster.backends import backend_for
    from composer_dag.cluster.services import ArrayConfig, ServiceConfig

    slurm = backend_for(ClusterResource(backend="slurm", partition="gpu", account="ml", scratch_dir="/scratch",
                                   container_image="nvcr.io/org/composer:1").cluster_config())
    script = slurm.service_script(ServiceConfig(name="rollout-0", argv=["python", "-m", "http.server", "{port}", "--bind", "{host}"],
                                                gpus=1, cpus=8, memory="64Gi", time_limit="2-00:00:00"), 8000)
    lines = script.splitlines()
    for line in ("#SBATCH --job-name=rollout-0", "#SBATCH --nodes=1", "#SBATCH --gpus-per-node=1", "#SBATCH --cpus-per-task=8",
                 "#SBATCH --mem=64G", "#SBATCH --time=2-00:00:00", "#SBATCH --no-requeue", "#SBATCH --partition=gpu",
                 "#SBATCH --output=/scratch/rollout-0-%j.out"):
        assert line in lines, line
    assert lines[-1].endswith("python -m http.server 8000 --bind 0.0.0.0")
    array = slurm.array_script(ArrayConfig(name="shards", argv=["python", "-m", "x"], count=8, parallelism=3))
    assert "#SBATCH --array=0-7%3" in array.splitlines()
    assert 'export COMPOSER_ARRAY_INDEX="$SLURM_ARRAY_TASK_ID"' in array.splitlines()
    assert "#SBATCH --output=/scratch/shards-%A_%a.out" in array.splitlines()
    assert not any(l.startswith("#SBATCH --nodelist") or l.startswith("trap ") for l in lines)
    # a service pinned to a node; with log_uri each script copies its log there when it ends
    shipping = backend_for(ClusterResource(backend="slurm", scratch_dir="/scratch", log_uri="s3://b/logs").cluster_config())
    pinned = shipping.service_script(ServiceConfig(name="rollout-1", argv=["python", "-m", "x"], node="node2"), 8001)
    assert "#SBATCH --nodelist=node2" in pinned.splitlines()
    trap = next(l for l in pinned.splitlines() if l.startswith("trap "))
    assert trap.endswith("|| true' EXIT") and "composer_dag.cluster.backends ship-log /scratch/rollout-1-%j.out s3://b/logs" in trap
    assert shipping._readable_log("/scratch/rollout-1-%j.out", j="42") == "s3://b/logs/rollout-1-42.out"
    assert shipping._readable_log("/scratch/shards-%A_%a.out", A="7", a="3") == "s3://b/logs/shards-7_3.out"


def test_slurm_log_shipping_round_trip(tmp_path, monkeypatch):
    """What an array task's EXIT trap runs: its log (the --output pattern filled from its Slurm
    environment) copied under log_uri, where the submitting side's log tail reads it."""
    from composer_dag.cluster.spec import log_tail

    (tmp_path / "shards-7_3.out").write_text("starting\nTraceback (most recent call last):\nValueError: shard 3 is corrupt\n")
    env = {**os.environ, "SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "3", "SLURM_JOB_ID": "9"}
    r = subprocess.run([sys.executable, "-m", "composer_dag.cluster.backends", "ship-log", f"{tmp_path}/shards-%A_%a.out",
                        f"file://{tmp_path}/logs"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert log_tail(f"file://{tmp_path}/logs/shards-7_3.out")[-1] == "ValueError: shard 3 is corrupt"
    assert log_tail(f"file://{tmp_path}/logs/absent.out") == []  # never an exception
    r = subprocess.run([sys.executable, "-m", "composer_dag.cluster.backends", "ship-log", f"{tmp_path}/gone-%j.out",
                        f"file://{tmp_path}/logs"], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip().startswith(f"could not copy the log to file://{tmp_path}/logs: "), r.stderr


def test_service_and_array_configs_refuse_bad_values_in_one_line():
    from composer_dag.runtime.config import ConfigError
    from composer_dag.cluster.services import ArrayConfig, ServiceConfig

    with pytest.raises(ConfigError, match=r"^invalid ServiceConfig config: name: .*pattern.*; argv: .*at least 1"):
        ServiceConfig.load({"name": "Rollout_0", "argv": []})
    with pytest.raises(ConfigError, match=r"count: .*greater than or equal to 1"):
        ArrayConfig.load({"argv": ["true"], "count": 0})


def test_k8s_runner_drives_the_api_as_rendered(monkeypatch):
    """The k8s calls with a stand-in for the ``kubernetes`` client (no cluster here): the service's
    Deployment and Service are created from the rendered manifests, waited on until ready, and
    deleted by ``stop``; an Indexed Job's failed index is named with its pod's last log line, and
    the Job is deleted."""
    from types import SimpleNamespace as NS

    from composer_dag.cluster import services
    from composer_dag.cluster.backends.k8s import K8sBackend
    from composer_dag.cluster.services import ArrayError

    calls = []

    class ApiException(Exception):
        pass

    class Apps:
        def create_namespaced_deployment(self, ns, body):
            calls.append(("create", body["kind"], body["metadata"]["name"]))

        def read_namespaced_deployment_status(self, name, ns):
            calls.append(("poll", name))
            return NS(status=NS(ready_replicas=1 if sum(c[0] == "poll" for c in calls) > 1 else None))

        def delete_namespaced_deployment(self, name, ns, propagation_policy=None):
            calls.append(("delete", "Deployment", name))

    class Core:
        def create_namespaced_service(self, ns, body):
            calls.append(("create", body["kind"], body["metadata"]["name"]))

        def delete_namespaced_service(self, name, ns):
            calls.append(("delete", "Service", name))

        def list_namespaced_pod(self, ns, label_selector):
            return NS(items=[NS(metadata=NS(name=f"shards-x-{i}", annotations={
                "batch.kubernetes.io/job-completion-index": str(i)})) for i in range(4)])

        def read_namespaced_pod_log(self, name, ns, tail_lines):
            return "reading shard\nValueError: shard 2 has no rows\n"

    class Batch:
        def create_namespaced_job(self, ns, body):
            calls.append(("create", body["kind"], body["spec"]["completions"]))
            return NS(metadata=NS(name="shards-x"))

        def read_namespaced_job_status(self, name, ns):
            return NS(status=NS(completed_indexes="0-1,3", failed_indexes="2"))

        def delete_namespaced_job(self, name, ns, propagation_policy=None):
            calls.append(("delete", "Job", name))

    fake = NS(AppsV1Api=Apps, CoreV1Api=Core, BatchV1Api=Batch, exceptions=NS(ApiException=ApiException))
    monkeypatch.setattr(K8sBackend, "_api", lambda self: fake)
    cluster = {"backend": "k8s", "image": "img:1", "namespace": "ml", "poll_seconds": 0.01}
    h = services.start_service(cluster, {"name": "rollout-0", "argv": ["serve", "--port", "{port}"], "port": 8000})
    name = calls[0][2]
    assert name.startswith("rollout-0-") and calls[:2] == [("create", "Deployment", name), ("create", "Service", name)]
    assert h.url == f"http://{name}.ml.svc:8000" and h.k8s == {"namespace": "ml", "deployment": name, "service": name}
    services.stop(h)
    assert calls[-2:] == [("delete", "Service", name), ("delete", "Deployment", name)]
    with pytest.raises(ArrayError) as err:
        services.run_array(cluster, {"name": "shards", "argv": ["python", "-m", "x"], "count": 4})
    assert str(err.value) == "array shards: 1 of 4 indexes failed: index 2 failed (exit code 1): ValueError: shard 2 has no rows"
    assert [t.exit_code for t in err.value.tasks] == [0, 0, 1, 0]
    assert calls[-1] == ("delete", "Job", "shards-x")
