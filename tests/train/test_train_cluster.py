import shlex
import sys

import pytest

from composer_dag.cluster.backends.k8s import k8s_pod_spec
from composer_dag.cluster.backends.slurm import (is_terminal, normalize_state, parse_sacct, parse_sbatch_output,
                                                 parse_scontrol_job, parse_squeue, slurm_script)
from composer_dag.cluster.spec import LaunchSpec, local_command


def test_local_command():
    spec = LaunchSpec(entry="composer_dag.train.midtrain", args=["--config", "c.json"],
                      nproc_per_node=2)
    cmd = local_command(spec, port=29511)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2"
    assert cmd[cmd.index("--master-port") + 1] == "29511"
    assert cmd[-4:] == ["-m", "composer_dag.train.midtrain", "--config", "c.json"]
    assert local_command(LaunchSpec(entry="m", launcher="python"))[1:] == ["-m", "m"]
    ds = local_command(LaunchSpec(entry="m", nproc_per_node=4, launcher="deepspeed"))
    assert "deepspeed.launcher.runner" in ds and ds[ds.index("--module") + 1] == "m"
    assert int(local_command(spec)[local_command(spec).index("--master-port") + 1]) > 0
    with pytest.raises(ValueError):
        LaunchSpec(entry="m", launcher="mpirun")
    with pytest.raises(ValueError):
        LaunchSpec(entry="m", launcher="python", nproc_per_node=2)


def api_round_trip(manifest: dict, kind: str) -> dict:
    """``manifest`` through the kubernetes client's model of ``kind`` and back: a key the API
    does not know, a wrong type or a misspelt field makes the result differ."""
    import json

    from kubernetes.client import ApiClient

    class Response:
        data = json.dumps(manifest)

    api = ApiClient()
    return api.sanitize_for_serialization(api.deserialize(Response(), kind))


def test_k8s_pod_spec():
    spec = LaunchSpec(entry="composer_dag.cluster.job", args=["--spec", "s3://b/jobs/r/midtrain.json"],
                      launcher="python", gpus_per_node=8, env={"NCCL_DEBUG": "WARN"},
                      secret_env={"HF_TOKEN": ("hf", "token")}, cpu="32", memory="256Gi",
                      image="registry/composer:1")
    tol = [{"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}]
    pod = k8s_pod_spec(spec, namespace="ml", secret_name="s3-creds", node_selector={"pool": "h100"},
                       tolerations=tol, service_account="trainer")
    assert api_round_trip(pod, "V1Pod") == pod
    assert pod["kind"] == "Pod" and pod["metadata"]["namespace"] == "ml"
    podspec = pod["spec"]
    assert podspec["restartPolicy"] == "Never" and podspec["serviceAccountName"] == "trainer"
    assert podspec["nodeSelector"] == {"pool": "h100"} and podspec["tolerations"] == tol
    (c,) = podspec["containers"]
    assert c["image"] == "registry/composer:1"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert c["resources"]["requests"]["nvidia.com/gpu"] == "8"
    assert c["resources"]["requests"]["cpu"] == "32"
    assert c["command"] == ["python", "-m", "composer_dag.cluster.job", "--spec", "s3://b/jobs/r/midtrain.json"]
    env = {e["name"]: e for e in c["env"]}
    assert env["NCCL_DEBUG"]["value"] == "WARN" and env["COMPOSER_SCRATCH"]["value"] == "/scratch"
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    assert c["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]  # storage credentials by Secret name
    # no shared volume: a memory /dev/shm and the pod's own scratch
    assert podspec["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory"}},
                                  {"name": "scratch", "emptyDir": {}}]
    gpu_default = k8s_pod_spec(LaunchSpec(entry="m", launcher="python", gpus_per_node=1), image="img")
    assert gpu_default["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    cpu_pod = k8s_pod_spec(LaunchSpec(entry="m", launcher="python"), image="img", gpu_resource="amd.com/gpu")
    assert api_round_trip(cpu_pod, "V1Pod") == cpu_pod
    assert cpu_pod["spec"]["containers"][0]["resources"]["limits"] == {}
    with pytest.raises(ValueError):
        k8s_pod_spec(LaunchSpec(entry="m"))
    with pytest.raises(ValueError, match="one node"):
        k8s_pod_spec(LaunchSpec(entry="m", nnodes=2), image="img")


def test_k8s_round_trip_catches_what_the_api_does_not_know():
    pod = k8s_pod_spec(LaunchSpec(entry="m", launcher="python"), image="img")
    pod["spec"]["containers"][0]["volumeMount"] = []  # misspelt: the client drops it
    assert api_round_trip(pod, "V1Pod") != pod


def test_slurm_script():
    s = slurm_script(["python", "-m", "composer_dag.cluster.job", "--spec", "s3://b/run 1.json"],
                     name="composer-midtrain", nodes=2, gpus_per_node=8, partition="gpu",
                     account="ml-team", time="12:00:00", env={"NCCL_DEBUG": "WARN"})
    assert s.startswith("#!/bin/bash\n")
    for line in ["#SBATCH --nodes=2", "#SBATCH --partition=gpu", "#SBATCH --account=ml-team",
                 "#SBATCH --gpus-per-node=8", "#SBATCH --time=12:00:00", "#SBATCH --job-name=composer-midtrain",
                 "#SBATCH --ntasks-per-node=1", "export NCCL_DEBUG=WARN"]:
        assert line in s.splitlines()
    srun = [ln for ln in s.splitlines() if ln.startswith("srun ")][0]
    # two nodes: --label names the node task that wrote each line of the job's log
    assert shlex.split(srun) == ["srun", "--kill-on-bad-exit=1", "--label", "python", "-m", "composer_dag.cluster.job",
                                 "--spec", "s3://b/run 1.json"]
    assert "--label" not in slurm_script(["true"])
    assert 'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in s
    assert "--container-image=img:1" in slurm_script(["true"], container_image="img:1")
    # a bare ${NAME} stays a reference to the job's environment; anything else is quoted
    assert slurm_script(["echo", "${AWS_SECRET_ACCESS_KEY}", "$HOME"]).rstrip().endswith(
        "echo \"${AWS_SECRET_ACCESS_KEY}\" '$HOME'")


def test_scontrol_parser():
    text = ("JobId=7 JobName=composer-midtrain UserId=root(0) JobState=CANCELLED Reason=None "
            "Dependency=(null) ExitCode=0:15 RunTime=00:00:04\n")
    assert parse_scontrol_job(text) == {"JobState": "CANCELLED", "Reason": "None", "ExitCode": "0:15"}
    assert parse_scontrol_job("slurm_load_jobs error: Invalid job id specified") == {}


def test_slurm_parsers():
    assert parse_sbatch_output("Submitted batch job 4242\n") == "4242"
    assert parse_sbatch_output("4243;cluster\n") == "4243"
    with pytest.raises(ValueError):
        parse_sbatch_output("sbatch: error: invalid partition")
    assert parse_squeue("4242 RUNNING\n4243 PD\n") == {"4242": "RUNNING", "4243": "PENDING"}
    sacct = ("4242|COMPLETED|0:0\n4242.batch|COMPLETED|0:0\n4243|CANCELLED by 1000|0:15\n"
             "4244|FAILED|1:0\n")
    jobs = parse_sacct(sacct)
    assert jobs == {"4242": {"state": "COMPLETED", "exit_code": "0:0"},
                    "4243": {"state": "CANCELLED", "exit_code": "0:15"},
                    "4244": {"state": "FAILED", "exit_code": "1:0"}}
    assert is_terminal("COMPLETED") and is_terminal("CA") and not is_terminal("R")
    assert normalize_state("") == "UNKNOWN"
