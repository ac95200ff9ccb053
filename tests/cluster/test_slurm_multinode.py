"""Two Slurm nodes for real (``TwoNodeCluster``): each node is a ``slurmd`` in network, UTS, PID
and mount namespaces of its own, with its own hostname, address, ``/tmp`` and scratch; the nodes
share no writable path, and reach each other and the S3 server only over the bridge.

Mid-training runs with ``nnodes=2`` (torchrun's c10d rendezvous at the allocation's first node,
gloo, DeepSpeed ZeRO-2 across the nodes); each node's checkpoint part travels through S3 only.
A node lost mid-run (its namespace's init killed) fails the step in one line; the node comes
back and the retry resumes on two nodes from the newest checkpoint both nodes sealed, and ends
with the weights of an uninterrupted two-node run. The dedup map runs as one job array whose
elements land on both nodes, and its output matches the one-node golden digests."""

import glob
import json
import os
import subprocess
import sys
import threading
import time
import uuid

import dagster as dg
import pytest

from composer_dag.storage import open_storage
from resources.cluster import ClusterResource
from tests.cluster.test_slurm_jobs import _asset as payload_asset, _result
from tests.train.test_midtrain import build_lm_inputs



def _bucket(cluster) -> str:
    import boto3

    name = f"composer-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=cluster.s3_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return f"s3://{name}/root"


def _resource(**kw) -> ClusterResource:
    return ClusterResource(backend="slurm", isolate=True, job_code=["composer_dag", "tests"], scratch_dir="/tmp/composer-scratch",
                           poll_seconds=0.5, grace_seconds=3, **kw)


def _written_outside_scratch(cluster) -> dict[str, list[str]]:
    """Files each node has under its own /tmp outside its scratch directory, and in the scratch
    directory anything but Slurm's job logs and the node's build cache (a job's own scratch
    directory is removed when it ends)."""
    out = {}
    for name in cluster.names:
        tmp = cluster.node_dir(name) / "tmp"
        files = [os.path.relpath(p, tmp) for p in glob.glob(f"{tmp}/**", recursive=True) if os.path.isfile(p)]
        out[name] = sorted(f for f in files if not (f.startswith("composer-scratch/composer-cache/") or (
            f.startswith("composer-scratch/") and f.count("/") == 1 and f.endswith(".out"))))
    return out


@pytest.fixture(scope="module")
def lm_inputs(tmp_path_factory):
    """A tokenizer, packed shards and a tiny two-layer model, built here once."""
    return build_lm_inputs(tmp_path_factory.mktemp("multinode"))


STEPS = 24


def _midtrain_job(root: str, storage, base, key: str, **env) -> dict:
    inputs = {}
    for name in ("model", "data"):
        url = f"{root}/inputs/{name}"
        if not storage.exists(f"{url}/manifest.json"):
            storage.put_dir(str(base / name), url)
            storage.write_manifest(url)
        inputs[name] = {"url": url, "digest": storage.manifest_digest(url)}
    config = dict(model_dir="{scratch}/inputs/model", data_dir="{scratch}/inputs/data", out_dir="{scratch}/out",
                  seq_len=64, micro_batch=4, max_steps=STEPS, warmup_steps=2, lr=3e-3, min_lr=3e-4, eval_every=0,
                  eval_batches=1, save_every=3, keep_checkpoints=2, log_every=1, seed=0, zero_stage=2,
                  sample_tokens=0)
    return {"stage": "midtrain", "entry": "composer_dag.train.midtrain", "config": config, "inputs": inputs,
            "state_url": f"{root}/work/midtrain/{key}",
            "env": {"OMP_NUM_THREADS": "1", **env},
            "outputs": {"ckpt": {"url": f"{root}/ckpt/{key}",
                                 "files": [["", "hf"], ["metrics.jsonl", "metrics.jsonl"]]}}}


def _asset(root: str, job: dict, retries: int = 0):
    return payload_asset(root, job, retries, name="composer-mt2")


def _wait(ready, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.3)


def _squeue_running() -> list[str]:
    out = subprocess.run(["squeue", "-h", "-t", "R,CG", "-o", "%i"], capture_output=True, text=True)
    return out.stdout.split()


def _weights(storage, url: str, dest) -> dict:
    from safetensors.torch import load_file

    storage.fetch_dir(url, str(dest))
    return load_file(str(dest / "model.safetensors"))


def test_slurm_multinode_midtrain_survives_a_lost_node(slurm_two_nodes, lm_inputs, tmp_path):
    import torch

    cluster = slurm_two_nodes
    root = _bucket(cluster)
    storage = open_storage(root)
    resource = _resource(launcher="torchrun", nnodes=2, nproc_per_node=1)
    before = _written_outside_scratch(cluster)  # what earlier tests of the session left on the nodes

    # an uninterrupted two-node run
    t0 = time.monotonic()
    whole = _midtrain_job(root, storage, lm_inputs, "whole")
    res = dg.materialize([_asset(root, whole)], resources={"cluster": resource})
    assert res.success
    whole_s = time.monotonic() - t0
    summary = _result(res)["summary"]
    assert summary["world_size"] == 2 and summary["samples_seen"] == STEPS * 4 * 2
    # each node's part of every checkpoint went through S3: node 1's optimizer partition is there
    part = storage.find(f"{root}/work/midtrain/whole/nodes/1/checkpoints")
    assert any(p.endswith("zero_pp_rank_1_mp_rank_00_optim_states.pt") for p in part), part
    assert not any("zero_pp_rank_1" in p for p in storage.find(f"{root}/work/midtrain/whole/checkpoints"))

    # the same run, its second node lost once both nodes sealed step 6 (each save paused a
    # little, so that the run is still going then)
    job = _midtrain_job(root, storage, lm_inputs, "lost", COMPOSER_SAVE_PAUSE_S="0.7")
    sealed = f"{root}/work/midtrain/lost/nodes/1/checkpoints/step_0000006/manifest.json"
    lost: list[float] = []

    def lose_node() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not storage.exists(sealed):
            time.sleep(0.2)
        if not storage.exists(sealed):
            return
        cluster.kill_node("node2")
        lost.append(time.monotonic())
        # the controller notices on its own (SlurmdTimeout) and ends the job NODE_FAIL; then
        # the node comes back: slurmd started again, set RESUME
        _wait(lambda: cluster.node_state("node2") == "down", 60, "the controller to set node2 DOWN")
        lost.append(time.monotonic())
        _wait(lambda: not _squeue_running(), 60, "the job to end")
        cluster.restart_node("node2")
        lost.append(time.monotonic())

    watcher = threading.Thread(target=lose_node, daemon=True)
    watcher.start()
    res = dg.materialize([_asset(root, job, retries=1)], resources={"cluster": resource}, raise_on_error=False)
    watcher.join(timeout=60)
    assert len(lost) == 3, "the node was never lost, or not brought back"
    assert res.success, [e.event_specific_data for e in res.all_events if e.is_step_failure]
    retried = [e for e in res.all_events if e.event_type == dg.DagsterEventType.STEP_UP_FOR_RETRY]
    assert retried, "the first attempt did not fail"
    err = retried[0].event_specific_data.error
    while err.cls_name != "ClusterError" and err.cause is not None:  # the retry request wraps the failure
        err = err.cause
    first = err.message.splitlines()[0]
    assert "lost its node" in first and "NODE_FAIL" in first, first
    out = _result(res)
    assert out["summary"]["world_size"] == 2
    # the retry trained only what no checkpoint sealed by both nodes held: from step 6 or later
    trained = out["summary"]["tokens_this_run"] // (2 * 4 * 64)
    assert 0 < trained <= STEPS - 6, out["summary"]["tokens_this_run"]
    assert out["summary"]["steps"] == STEPS and out["summary"]["samples_seen"] == STEPS * 4 * 2

    a = _weights(storage, f"{root}/ckpt/whole", tmp_path / "a")
    b = _weights(storage, f"{root}/ckpt/lost", tmp_path / "b")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)
    metrics = [json.loads(x) for x in storage.read_bytes(f"{root}/ckpt/lost/metrics.jsonl").decode().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == list(range(1, STEPS + 1))  # no step lost or repeated
    # nothing written outside each node's scratch (its /tmp holds only its emptied scratch)
    added = {n: sorted(set(files) - set(before[n])) for n, files in _written_outside_scratch(cluster).items()}
    assert added == {n: [] for n in cluster.names}, added
    print(f"two-node mid-training: uninterrupted {whole_s:.1f} s")


def test_slurm_multinode_nodes_are_separate_machines(slurm_two_nodes):
    """Each node has its own hostname and address, resolves the other by name, reaches the S3
    server on the bridge address and nothing of the host's at 127.0.0.1 (its loopback is its
    own), and sees its own /tmp."""
    cluster = slurm_two_nodes
    port = cluster.s3_endpoint.rsplit(":", 1)[1]
    probe = ("import socket, sys, os\n"
             "def reach(h):\n"
             "    try:\n"
             f"        socket.create_connection((h, {port}), timeout=2).close(); return True\n"
             "    except OSError:\n"
             "        return False\n"
             "print(socket.gethostname(), socket.gethostbyname('node1'), socket.gethostbyname('node2'),"
             f" reach('{cluster.host}'), reach('127.0.0.1'), sorted(os.listdir('/tmp')))\n")
    seen = {}
    for name in cluster.names:
        out = cluster.in_node(name, sys.executable, "-c", probe)
        assert out.returncode == 0, out.stderr
        seen[name] = out.stdout.strip().split(maxsplit=5)
    for name, (host, a1, a2, bridge, loopback, tmp) in seen.items():
        assert host == name and (a1, a2) == (cluster.addr["node1"], cluster.addr["node2"])
        assert (bridge, loopback) == ("True", "False"), (name, bridge, loopback)
        # its /tmp is its own directory on the host (a checkout under /tmp is bound back into it)
        tops = {p.split("/")[2] for p in cluster.install_under_tmp}
        assert tmp == repr(sorted({*os.listdir(cluster.node_dir(name) / "tmp"), *tops})), tmp
        assert "composer-scratch" in tmp
    (cluster.node_dir("node1") / "tmp" / "only-on-node1").write_text("x")
    try:
        assert "only-on-node1" not in cluster.in_node("node2", "ls", "/tmp").stdout
    finally:
        (cluster.node_dir("node1") / "tmp" / "only-on-node1").unlink()


def test_slurm_multinode_dedup_array_lands_on_both_nodes(slurm_two_nodes):
    """The dedup map as one job array (each element a whole node's CPUs, so the elements spread
    over both nodes) on the golden stdlib corpus, through S3 only: the output is the one-node
    golden run's, digest for digest."""
    from composer_dag.cluster import services
    from composer_dag.cluster.spec import ArrayConfig
    from composer_dag.dedup import DedupConfig
    from tests import dedup_golden
    from tests.data.test_dedup_golden import EXPECTED

    cluster = slurm_two_nodes
    rows, extra = dedup_golden.corpus()
    assert dedup_golden.input_digest(rows, extra) == EXPECTED["input"], "this Python's stdlib gives another golden input"
    root = _bucket(cluster)
    config = _resource().cluster_config()
    seen: list[str] = []

    def run_tasks(spec_url: str, count: int) -> None:
        cfg = ArrayConfig.load({"name": "dedup-map", "argv": [sys.executable, "-m", "composer_dag.dedup.shards", spec_url],
                                "count": count, "cpus": cluster.cpus,
                                "env": {"COMPOSER_S3_ENDPOINT_URL": cluster.s3_endpoint}})
        tasks = services.run_array(config, cfg, log=seen.append)
        assert all(t.ok for t in tasks), [vars(t) for t in tasks]

    got = dedup_golden.run(root, rows, extra, DedupConfig(**dedup_golden.CONFIGS["parallel"]), run_tasks=run_tasks)
    want = EXPECTED["parallel"]
    assert got["counts"] == want["counts"]
    assert {k: v for k, v in got.items() if k != "progress"} == {k: v for k, v in want.items() if k != "progress"}
    # Slurm wrote each element's log on the node that ran it: both nodes ran some of this one job
    (job,) = [line.split("job ", 1)[1].split(",")[0] for line in seen if "[array:slurm] dedup-map: job " in line]
    ran = {n: sorted(p.name for p in (cluster.node_dir(n) / "tmp" / "composer-scratch").glob(f"dedup-map-{job}_*.out"))
           for n in cluster.names}
    assert all(ran.values()), ran


def _part(storage, url: str, files: dict[str, str], seal: bool = True) -> None:
    for name, text in files.items():
        storage.write_bytes(f"{url}/{name}", text.encode())
    if seal:
        storage.write_manifest(url)


def test_multinode_state_resumes_from_the_newest_checkpoint_every_node_sealed(tmp_path):
    """The job runner's pull of a two-node state (no cluster needed): node 0 sealed steps 6 and 9
    and points ``latest`` at 9; node 1's part of step 9 was cut short on its way up (no manifest)
    and its part of step 6 is whole. Every node gets step 6 with both nodes' partitions, ``latest``
    moved back to it, step 9 gone; a part whose bytes differ from its manifest counts as unsealed."""
    from composer_dag.cluster.job import StateSync
    from composer_dag.runtime.checkpoint import resume_checkpoint
    from composer_dag.storage import Storage

    storage = Storage(str(tmp_path / "store"))
    url = storage.url("state")
    for step in (6, 9):
        _part(storage, f"{url}/checkpoints/step_{step:07d}", {
            "mp_rank_00_model_states.pt": f"model {step}", "zero_pp_rank_0_mp_rank_00_optim_states.pt": f"opt0 {step}",
            "trainer_state.json": json.dumps({"step": step, "samples": step * 8})})
    storage.write_json(f"{url}/latest", {"tag": "step_0000009", "step": 9, "samples": 72})
    _part(storage, f"{url}/nodes/1/checkpoints/step_0000006", {"zero_pp_rank_1_mp_rank_00_optim_states.pt": "opt1 6"})
    _part(storage, f"{url}/nodes/1/checkpoints/step_0000009", {"zero_pp_rank_1_mp_rank_00_optim_states.pt": "opt1 9"},
          seal=False)
    for node in (0, 1):
        out = tmp_path / f"out{node}"
        assert StateSync(storage, str(out), url, node, 2).pull()
        assert json.loads((out / "latest").read_text()) == {"tag": "step_0000006", "step": 6, "samples": 48}
        assert sorted(os.listdir(out / "checkpoints")) == ["step_0000006"] and not (out / "nodes").exists()
        assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                "mp_rank_00_model_states.pt"} <= set(os.listdir(out / "checkpoints" / "step_0000006"))
        assert resume_checkpoint(str(out), str(out / "checkpoints")) == "step_0000006"
    # node 1's part of step 6 changed after it was sealed: nothing both nodes sealed is left
    storage.write_bytes(f"{url}/nodes/1/checkpoints/step_0000006/zero_pp_rank_1_mp_rank_00_optim_states.pt", b"opt1 X")
    out = tmp_path / "out-bad"
    assert not StateSync(storage, str(out), url, 0, 2).pull()
    assert not (out / "latest").exists() and not os.listdir(out / "checkpoints")
    # one node: node 0's state as it is
    out = tmp_path / "out-one"
    assert StateSync(storage, str(out), url).pull()
    assert json.loads((out / "latest").read_text())["tag"] == "step_0000009"
