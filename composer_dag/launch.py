"""Launch specs for the distributed entry points: a local command, a Kubernetes pod, a Slurm
batch script, and parsers for the Slurm tools' output (to watch a job).

Plain data in, plain data out: nothing here talks to a cluster.
"""

from __future__ import annotations

import re
import shlex
import socket
import sys
from dataclasses import dataclass, field

RDZV_PORT = 29500


@dataclass
class LaunchSpec:
    entry: str                                  # a module, run with -m
    args: list[str] = field(default_factory=list)
    nproc_per_node: int = 1
    nnodes: int = 1
    launcher: str = "torchrun"                  # "torchrun" | "deepspeed" | "python"
    env: dict[str, str] = field(default_factory=dict)
    gpus_per_node: int = 0
    image: str | None = None
    name: str = "composer-train"
    cpu: str | None = None                      # k8s requests, e.g. "8"
    memory: str | None = None                   # e.g. "64Gi"
    secret_env: dict[str, tuple[str, str]] = field(default_factory=dict)  # VAR -> (secret, key)

    def __post_init__(self) -> None:
        if self.launcher not in ("torchrun", "deepspeed", "python"):
            raise ValueError(f"launcher must be torchrun, deepspeed or python: {self.launcher!r}")
        if self.launcher == "python" and (self.nproc_per_node != 1 or self.nnodes != 1):
            raise ValueError("launcher 'python' runs one process; use torchrun or deepspeed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_command(spec: LaunchSpec, python: str | None = None, port: int | None = None) -> list[str]:
    """The argv that runs ``spec`` on this machine (single node)."""
    py = python or sys.executable
    if spec.launcher == "python":
        return [py, "-m", spec.entry, *spec.args]
    port = port or free_port()
    if spec.launcher == "deepspeed":
        return [py, "-m", "deepspeed.launcher.runner", "--num_gpus", str(spec.nproc_per_node),
                "--master_port", str(port), "--module", spec.entry, *spec.args]
    return [py, "-m", "torch.distributed.run", "--nnodes", "1",
            "--nproc-per-node", str(spec.nproc_per_node), "--master-addr", "127.0.0.1",
            "--master-port", str(port), "-m", spec.entry, *spec.args]


def _torchrun_multinode(spec: LaunchSpec, nnodes: str, endpoint: str, job_id: str) -> list[str]:
    """torchrun with c10d rendezvous, without the entry's own args."""
    return ["torchrun", "--nnodes", nnodes, "--nproc-per-node", str(spec.nproc_per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", job_id,
            "-m", spec.entry]


def k8s_pod_spec(spec: LaunchSpec, namespace: str = "default", image: str | None = None,
                 gpu_resource: str = "nvidia.com/gpu", volumes: list[dict] | None = None,
                 env: dict[str, str] | None = None, service_account: str | None = None) -> dict:
    """A pod manifest running the spec under torchrun (or python).

    ``volumes`` items: ``{"name", "mount_path", and one of "pvc" (claim name), "host_path",
    "empty_dir": True}``. ``spec.secret_env`` maps env vars to (secret name, key).
    Multi-node training uses one such pod per node (e.g. an indexed Job) with
    ``--rdzv-endpoint`` pointing at the head pod's service.
    """
    image = image or spec.image
    if not image:
        raise ValueError("k8s_pod_spec needs an image")
    if spec.launcher == "python":
        command = ["python", "-m", spec.entry, *spec.args]
    elif spec.nnodes > 1:
        command = [*_torchrun_multinode(spec, str(spec.nnodes), f"{spec.name}-0:{RDZV_PORT}",
                                        spec.name), *spec.args]
    else:
        command = ["torchrun", "--nnodes", "1", "--nproc-per-node", str(spec.nproc_per_node),
                   "-m", spec.entry, *spec.args]
    env_list = [{"name": k, "value": str(v)} for k, v in {**spec.env, **(env or {})}.items()]
    env_list += [{"name": k, "valueFrom": {"secretKeyRef": {"name": s, "key": key}}}
                 for k, (s, key) in spec.secret_env.items()]
    limits: dict[str, str] = {}
    requests: dict[str, str] = {}
    if spec.gpus_per_node:
        limits[gpu_resource] = requests[gpu_resource] = str(spec.gpus_per_node)
    if spec.cpu:
        requests["cpu"] = spec.cpu
    if spec.memory:
        requests["memory"] = limits["memory"] = spec.memory
    mounts, vols = [], []
    for v in volumes or []:
        mounts.append({"name": v["name"], "mountPath": v["mount_path"]})
        if "pvc" in v:
            vols.append({"name": v["name"], "persistentVolumeClaim": {"claimName": v["pvc"]}})
        elif "host_path" in v:
            vols.append({"name": v["name"], "hostPath": {"path": v["host_path"]}})
        else:
            vols.append({"name": v["name"], "emptyDir": {}})
    # torch.distributed and NCCL need a large /dev/shm
    mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    vols.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    pod_spec: dict = {
        "restartPolicy": "Never",
        "containers": [{
            "name": "trainer", "image": image, "command": command, "env": env_list,
            "resources": {"limits": limits, "requests": requests}, "volumeMounts": mounts,
        }],
        "volumes": vols,
    }
    if service_account:
        pod_spec["serviceAccountName"] = service_account
    if spec.gpus_per_node:
        pod_spec["tolerations"] = [{"key": gpu_resource, "operator": "Exists",
                                    "effect": "NoSchedule"}]
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": f"{spec.name}-", "namespace": namespace,
                     "labels": {"app.kubernetes.io/name": spec.name,
                                "app.kubernetes.io/part-of": "composer-dag"}},
        "spec": pod_spec,
    }


def slurm_script(spec: LaunchSpec, partition: str | None = None, nodes: int | None = None,
                 gpus_per_node: int | None = None, time: str = "04:00:00",
                 account: str | None = None, output: str = "%x-%j.out",
                 setup: list[str] | None = None) -> str:
    """An sbatch script: one task per node, each running torchrun with c10d rendezvous at the
    first node of the allocation."""
    nodes = nodes or spec.nnodes
    gpus = spec.gpus_per_node if gpus_per_node is None else gpus_per_node
    lines = ["#!/bin/bash", f"#SBATCH --job-name={spec.name}", f"#SBATCH --nodes={nodes}",
             "#SBATCH --ntasks-per-node=1", f"#SBATCH --time={time}",
             f"#SBATCH --output={output}"]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if account:
        lines.append(f"#SBATCH --account={account}")
    if gpus:
        lines.append(f"#SBATCH --gpus-per-node={gpus}")
    lines += ["", "set -euo pipefail"]
    lines += [f"export {k}={shlex.quote(str(v))}" for k, v in spec.env.items()]
    lines += setup or []
    lines += ['head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)', ""]
    if spec.launcher == "python":
        cmd = ["python", "-m", spec.entry]
    else:
        cmd = _torchrun_multinode(spec, "$SLURM_NNODES", f"$head:{RDZV_PORT}", "$SLURM_JOB_ID")
    lines.append("srun " + " ".join([*cmd, *map(shlex.quote, spec.args)]))
    return "\n".join(lines) + "\n"


# ---- watching a Slurm job --------------------------------------------------------------
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL",
            "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


def parse_sbatch_output(text: str) -> str:
    """The job id from ``sbatch`` output ("Submitted batch job 123" or ``--parsable`` "123;c")."""
    m = re.search(r"Submitted batch job (\d+)", text) or re.match(r"\s*(\d+)(?:;\S+)?\s*$", text)
    if not m:
        raise ValueError(f"no job id in sbatch output: {text!r}")
    return m.group(1)


def normalize_state(state: str) -> str:
    """'CANCELLED by 123' -> 'CANCELLED'; squeue's short codes (R, PD, CG, ...) -> long names."""
    short = {"PD": "PENDING", "R": "RUNNING", "CG": "COMPLETING", "CD": "COMPLETED",
             "F": "FAILED", "CA": "CANCELLED", "TO": "TIMEOUT", "OOM": "OUT_OF_MEMORY",
             "NF": "NODE_FAIL", "PR": "PREEMPTED", "S": "SUSPENDED", "CF": "CONFIGURING"}
    s = state.strip().split()[0].rstrip("+") if state.strip() else "UNKNOWN"
    return short.get(s, s)


def parse_squeue(text: str) -> dict[str, str]:
    """job id -> state from ``squeue -h -o '%i %T'`` (or ``%t``) output."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0][0].isdigit():
            out[parts[0]] = normalize_state(parts[1])
    return out


def parse_sacct(text: str) -> dict[str, dict[str, str]]:
    """job id -> {state, exit_code} from ``sacct -P -n -o JobID,State,ExitCode`` output; job
    steps (``123.batch``, ``123.0``) are skipped."""
    out = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 3 and "." not in parts[0] and parts[0]:
            out[parts[0]] = {"state": normalize_state(parts[1]), "exit_code": parts[2]}
    return out


def is_terminal(state: str) -> bool:
    return normalize_state(state) in TERMINAL
