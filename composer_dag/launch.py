"""Launch specs for the distributed entry points: a local command, a Kubernetes pod, a Slurm
batch script, a bubblewrap sandbox around a job, and parsers for the Slurm tools' output (to
watch a job).

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


def job_command(spec_url: str, python: str = "python") -> list[str]:
    """The argv of a stage's job on a node: the job runner with the URL of its spec."""
    return [python, "-m", "composer_dag.runtime.job", "--spec", spec_url]


def bwrap_command(argv: list[str], scratch: str, code: list[str], python_prefixes: list[str],
                  env: dict[str, str], writable: list[str] | None = None) -> list[str]:
    """``argv`` isolated from the launching machine's disk with bubblewrap: the system
    directories, the Python environment and the code read-only, ``scratch`` (and ``writable``,
    e.g. a node-local build cache) read-write, a private ``/tmp``, its own pid namespace (the
    job's processes die with it), a clean environment holding only ``env``. The network stays
    (the job reaches object storage)."""
    cmd = ["bwrap", "--die-with-parent", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
           "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    for d in ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/sys"):  # /sys: CPU topology (lscpu)
        cmd += ["--ro-bind-try", d, d]
    for d in [*python_prefixes, *code]:
        cmd += ["--ro-bind", d, d]
    for d in [*(writable or []), scratch]:
        cmd += ["--bind", d, d]
    cmd += ["--chdir", scratch, "--clearenv"]
    for k, v in env.items():
        cmd += ["--setenv", k, str(v)]
    return [*cmd, "--", *argv]


def k8s_pod_spec(spec: LaunchSpec, namespace: str = "default", image: str | None = None,
                 gpu_resource: str = "nvidia.com/gpu", secret_name: str | None = None,
                 env: dict[str, str] | None = None, service_account: str | None = None,
                 node_selector: dict[str, str] | None = None,
                 tolerations: list[dict] | None = None) -> dict:
    """A pod manifest running the spec's entry as one process (a stage's job runner, which
    starts torchrun itself). No volume is shared with anything: inputs and outputs go through
    object storage, whose credentials come from the Secret ``secret_name`` (every key becomes
    an environment variable) and are never written into the manifest."""
    image = image or spec.image
    if not image:
        raise ValueError("k8s_pod_spec needs an image")
    if spec.nnodes > 1:
        raise ValueError("a k8s job runs on one node (one pod); multi-node needs an indexed Job")
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
    container: dict = {
        "name": "job", "image": image, "command": ["python", "-m", spec.entry, *spec.args],
        "env": env_list, "resources": {"limits": limits, "requests": requests},
        # torch.distributed and NCCL need a large /dev/shm; the job's scratch is the pod's own
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                         {"name": "scratch", "mountPath": "/scratch"}],
    }
    container["env"].append({"name": "COMPOSER_SCRATCH", "value": "/scratch"})
    if secret_name:
        container["envFrom"] = [{"secretRef": {"name": secret_name}}]
    pod_spec: dict = {
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}},
                    {"name": "scratch", "emptyDir": {}}],
    }
    if service_account:
        pod_spec["serviceAccountName"] = service_account
    if node_selector:
        pod_spec["nodeSelector"] = dict(node_selector)
    tol = list(tolerations or [])
    if spec.gpus_per_node and not tol:
        tol = [{"key": gpu_resource, "operator": "Exists", "effect": "NoSchedule"}]
    if tol:
        pod_spec["tolerations"] = tol
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": f"{spec.name}-", "namespace": namespace,
                     "labels": {"app.kubernetes.io/name": spec.name,
                                "app.kubernetes.io/part-of": "composer-dag"}},
        "spec": pod_spec,
    }


def slurm_script(command: list[str], name: str = "composer-job", nodes: int = 1,
                 gpus_per_node: int = 0, partition: str | None = None, account: str | None = None,
                 time: str = "04:00:00", output: str = "/tmp/%x-%j.out", chdir: str = "/tmp",
                 container_image: str | None = None, env: dict[str, str] | None = None,
                 setup: list[str] | None = None, sbatch: list[str] | None = None) -> str:
    """An sbatch script: ``srun`` starts ``command`` once per node (the stage's job runner,
    which starts torchrun with c10d rendezvous at the first node of the allocation, exported
    as ``COMPOSER_RDZV_ENDPOINT``). ``container_image`` runs it in a container on sites with
    pyxis/enroot. ``sbatch``: more options (``--array=0-7``, ``--cpus-per-task=4``). The job is
    never requeued by Slurm (``--no-requeue``): a job the scheduler ended fails its step, and the
    step's retry decides what runs again."""
    lines = ["#!/bin/bash", f"#SBATCH --job-name={name}", f"#SBATCH --nodes={nodes}",
             "#SBATCH --ntasks-per-node=1", f"#SBATCH --time={time}",
             f"#SBATCH --output={output}", f"#SBATCH --chdir={chdir}", "#SBATCH --no-requeue"]
    lines += [f"#SBATCH {opt}" for opt in sbatch or []]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if account:
        lines.append(f"#SBATCH --account={account}")
    if gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    lines += ["", "set -euo pipefail"]
    lines += [f"export {k}={shlex.quote(str(v))}" for k, v in (env or {}).items()]
    lines += setup or []
    lines += ['head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              f'export COMPOSER_RDZV_ENDPOINT="$head:{RDZV_PORT}"', ""]
    srun = ["srun", "--kill-on-bad-exit=1"]
    if container_image:
        srun.append(f"--container-image={shlex.quote(container_image)}")
    lines.append(" ".join([*srun, *map(_shell_word, command)]))
    return "\n".join(lines) + "\n"


def _shell_word(arg: str) -> str:
    """``arg`` quoted for bash; ``${NAME}`` alone stays a reference to the job's environment
    (how a credential reaches a sandboxed job without being written into the script)."""
    return f'"{arg}"' if re.fullmatch(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}", arg) else shlex.quote(arg)


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


def parse_scontrol_job(text: str) -> dict[str, str]:
    """``JobState``, ``Reason`` and ``ExitCode`` from ``scontrol show job -o ID`` output (a job
    stays there for ``MinJobAge`` seconds after it ends; accounting is not needed); {} when
    the job is unknown."""
    out = {}
    for key in ("JobState", "Reason", "ExitCode"):
        m = re.search(rf"\b{key}=(\S+)", text)
        if m:
            out[key] = normalize_state(m.group(1)) if key == "JobState" else m.group(1)
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


def parse_scontrol_records(text: str) -> list[dict[str, str]]:
    """Every record of ``scontrol show job -o ID`` / ``scontrol show node -o NAME`` output (one
    line each; an array job gives one line per task) as ``{key: value}`` (``JobState``
    normalized)."""
    out = []
    for line in text.splitlines():
        rec = dict(re.findall(r"(?:^|\s)([A-Za-z][\w/:]*)=(\S*)", line))
        if rec:
            if "JobState" in rec:
                rec["JobState"] = normalize_state(rec["JobState"])
            out.append(rec)
    return out


def parse_exit_code(code: str) -> int:
    """Slurm's ``ExitCode=status:signal`` as one number, as ``subprocess`` gives it: the exit
    status, or minus the signal that ended the process (``0:15`` -> -15)."""
    status, _, sig = (code or "0:0").partition(":")
    return -int(sig) if sig and sig.isdigit() and int(sig) else int(status or 0)


# ---- Kubernetes services and indexed jobs ----------------------------------------------
ARRAY_INDEX_ENV = "COMPOSER_ARRAY_INDEX"
K8S_COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def _k8s_pod_template(spec: LaunchSpec, argv: list[str], labels: dict[str, str], restart: str,
                      **pod_kw) -> dict:
    pod = k8s_pod_spec(spec, **pod_kw)
    container = pod["spec"]["containers"][0]
    container["name"] = spec.name
    container["command"] = list(argv)
    pod["spec"]["restartPolicy"] = restart
    return {"metadata": {"labels": {**pod["metadata"]["labels"], **labels}}, "spec": pod["spec"]}


def k8s_service_manifests(spec: LaunchSpec, argv: list[str], port: int, health_path: str = "/",
                          namespace: str = "default", replicas: int = 1, **pod_kw) -> tuple[dict, dict]:
    """A long-running service: a ``Deployment`` of ``replicas`` pods running ``argv`` (GPUs,
    image, Secret, node selector and tolerations as for a job's pod) that are ready when
    ``health_path`` answers on ``port``, and a ``Service`` in front of them
    (``http://<name>.<namespace>.svc:<port>``). Nothing is shared with other pods."""
    labels = {"app.kubernetes.io/instance": spec.name, "app.kubernetes.io/component": "service"}
    template = _k8s_pod_template(spec, argv, labels, "Always", namespace=namespace, **pod_kw)
    container = template["spec"]["containers"][0]
    container["ports"] = [{"name": "http", "containerPort": port, "protocol": "TCP"}]
    container["readinessProbe"] = {"httpGet": {"path": health_path, "port": port},
                                   "periodSeconds": 5, "failureThreshold": 3}
    meta = {"name": spec.name, "namespace": namespace, "labels": template["metadata"]["labels"]}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
        "spec": {"replicas": replicas, "selector": {"matchLabels": labels}, "template": template},
    }
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": meta,
        "spec": {"selector": labels,
                 "ports": [{"name": "http", "port": port, "targetPort": port, "protocol": "TCP"}]},
    }
    return deployment, service


def k8s_indexed_job(spec: LaunchSpec, argv: list[str], count: int, parallelism: int | None = None,
                    namespace: str = "default", **pod_kw) -> dict:
    """Map-style work: an Indexed ``Job`` of ``count`` pods, at most ``parallelism`` at once,
    each with its index in ``COMPOSER_ARRAY_INDEX`` (from the pod's completion-index
    annotation). A failing index is not retried by Kubernetes (``backoffLimitPerIndex: 0``,
    the step's retry decides), and does not stop the other indexes."""
    if count < 1:
        raise ValueError("an indexed job needs count >= 1")
    labels = {"app.kubernetes.io/instance": spec.name, "app.kubernetes.io/component": "array"}
    template = _k8s_pod_template(spec, argv, labels, "Never", namespace=namespace, **pod_kw)
    template["spec"]["containers"][0]["env"].append(
        {"name": ARRAY_INDEX_ENV, "valueFrom": {"fieldRef": {"fieldPath": K8S_COMPLETION_INDEX}}})
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"generateName": f"{spec.name}-", "namespace": namespace, "labels": template["metadata"]["labels"]},
        "spec": {"completionMode": "Indexed", "completions": count,
                 "parallelism": min(parallelism or count, count),
                 "backoffLimitPerIndex": 0, "maxFailedIndexes": count,
                 "template": template},
    }
