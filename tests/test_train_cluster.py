import shlex
import sys

import pytest

from composer_dag.launch import (LaunchSpec, is_terminal, k8s_pod_spec, local_command,
                                  normalize_state, parse_sacct, parse_sbatch_output, parse_squeue,
                                  slurm_script)

SPEC = LaunchSpec(entry="composer_dag.train.midtrain", args=["--config", "/data/run 1.json"],
                  nproc_per_node=8, nnodes=2, gpus_per_node=8, env={"NCCL_DEBUG": "WARN"},
                  secret_env={"AWS_SECRET_ACCESS_KEY": ("s3-creds", "secret")}, cpu="32",
                  memory="256Gi", image="registry/composer:1")


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


def test_k8s_pod_spec():
    pod = k8s_pod_spec(SPEC, namespace="ml", volumes=[
        {"name": "data", "mount_path": "/data", "pvc": "train-data"},
        {"name": "scratch", "mount_path": "/scratch", "empty_dir": True}])
    assert pod["kind"] == "Pod" and pod["metadata"]["namespace"] == "ml"
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never"
    (c,) = spec["containers"]
    assert c["image"] == "registry/composer:1"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert c["resources"]["requests"]["nvidia.com/gpu"] == "8"
    assert c["resources"]["requests"]["cpu"] == "32"
    assert c["command"][0] == "torchrun" and "--nproc-per-node" in c["command"]
    assert c["command"][c["command"].index("--nnodes") + 1] == "2"
    assert c["command"][-2:] == ["--config", "/data/run 1.json"]
    env = {e["name"]: e for e in c["env"]}
    assert env["NCCL_DEBUG"]["value"] == "WARN"
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "s3-creds", "key": "secret"}
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["data"]["persistentVolumeClaim"]["claimName"] == "train-data"
    assert vols["dshm"]["emptyDir"]["medium"] == "Memory"
    assert {m["mountPath"] for m in c["volumeMounts"]} == {"/data", "/scratch", "/dev/shm"}
    cpu_pod = k8s_pod_spec(LaunchSpec(entry="m", launcher="python"), image="img",
                           gpu_resource="amd.com/gpu")
    assert cpu_pod["spec"]["containers"][0]["resources"]["limits"] == {}
    with pytest.raises(ValueError):
        k8s_pod_spec(LaunchSpec(entry="m"))


def test_slurm_script():
    s = slurm_script(SPEC, partition="gpu", account="ml-team", time="12:00:00")
    assert s.startswith("#!/bin/bash\n")
    for line in ["#SBATCH --nodes=2", "#SBATCH --partition=gpu", "#SBATCH --account=ml-team",
                 "#SBATCH --gpus-per-node=8", "#SBATCH --time=12:00:00",
                 "#SBATCH --ntasks-per-node=1", "export NCCL_DEBUG=WARN"]:
        assert line in s.splitlines()
    srun = [ln for ln in s.splitlines() if ln.startswith("srun ")][0]
    assert "torchrun --nnodes $SLURM_NNODES --nproc-per-node 8" in srun
    assert "--rdzv-backend c10d --rdzv-endpoint $head:29500" in srun
    assert shlex.split(srun)[-2:] == ["--config", "/data/run 1.json"]
    assert 'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in s
    assert "#SBATCH --nodes=4" in slurm_script(SPEC, nodes=4)


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
