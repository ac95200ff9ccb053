"""A stage's job on the cluster (plain Python, no Dagster): its launch spec, the command a node
runs (under bubblewrap when ``isolate``), what each backend launches for it (an argv, an sbatch
script, a pod manifest), and running it to its end on the ``local`` and ``slurm`` backends.

    failure, why = launch(cluster, spec_url, name, env, log)   # (None, None): it completed

The job itself is ``python -m composer_dag.cluster.job --spec URL`` (``cluster/job.py``). The
Dagster resource (``resources/cluster.py``) adds the Pipes session around it and runs the ``k8s``
backend through ``dagster_k8s``; everything that decides what runs where is here.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

from ..runtime.errors import error_line
from . import k8s, slurm
from .local import stop_process_group
from .spec import ClusterConfig, LaunchSpec, Log, bwrap_command

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# what a sandboxed job may see of this process's environment (by reference, never by value)
PASS_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION",
            "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "COMPOSER_S3_ENDPOINT_URL", "HF_TOKEN")
SLURM_ENV = ("SLURM_JOB_ID", "SLURM_NODEID", "SLURM_PROCID", "SLURM_NNODES", "COMPOSER_RDZV_ENDPOINT")
JOB_ENTRY = "composer_dag.cluster.job"
# What a Slurm job's end state means, in the step's one-line failure.
SLURM_ENDS = {"CANCELLED": "was cancelled by the scheduler or an operator (scancel)",
              "NODE_FAIL": "lost its node (node failure or DOWN)", "PREEMPTED": "was preempted",
              "OUT_OF_MEMORY": "ran out of memory"}


def launch_spec(cluster: ClusterConfig, entry: str, args: list[str], name: str = "composer-train",
                launcher: str | None = None) -> LaunchSpec:
    """What runs for ``entry``: ``launcher`` (the cluster's by default) with its processes per
    node and nodes; an entry that must run as one process gets ``launcher="python"``."""
    env = {**cluster.env}
    single = launcher == "python"
    if cluster.gpus_per_node == 0:
        env.setdefault("DS_ACCELERATOR", "cpu")
    return LaunchSpec(entry=entry, args=list(args), nproc_per_node=1 if single else cluster.nproc_per_node,
                      nnodes=1 if single else cluster.nnodes, launcher=launcher or cluster.launcher, env=env,
                      gpus_per_node=cluster.gpus_per_node, image=cluster.image, name=name, cpu=cluster.cpu,
                      memory=cluster.memory)


# What ``srun`` runs on each node of a Slurm job: the job's scratch and the node's cache made,
# the job runner run, the scratch removed when it ends (nodes share no disk: each does its own).
# An argument ``@NAME@`` becomes the value of ``$NAME`` on the node: the per-task variables
# (``SLURM_NODEID``, ``SLURM_PROCID``) differ between nodes, so the batch script, which runs on
# the first node only, must not expand them.
NODE_SETUP = ('scratch=$1 cache=$2; shift 2; mkdir -p "$scratch" "$cache"; '
              'trap \'rm -rf "$scratch"\' EXIT; args=(); '
              'for a in "$@"; do if [[ $a =~ ^@([A-Z_]+)@$ ]]; then n=${BASH_REMATCH[1]}; args+=("${!n}"); '
              'else args+=("$a"); fi; done; "${args[@]}"')


def cache_dir(cluster: ClusterConfig) -> str:
    """The node-local build cache an isolated job may write (``<scratch_dir>/composer-cache``)."""
    return os.path.join(cluster.scratch_dir, "composer-cache")


def job_argv(cluster: ClusterConfig, spec_url: str, scratch: str, env: dict[str, str]) -> list[str]:
    """The job runner's argv on a node; under bubblewrap when ``isolate`` (``env`` then is all the
    job sees, besides the credentials in ``PASS_ENV`` present here)."""
    argv = [sys.executable, "-m", JOB_ENTRY, "--spec", spec_url, "--scratch", scratch]
    if not cluster.isolate:
        return argv
    # compiled kernels (DeepSpeed's ops: ~90 s to build on 2 cores) and the sandboxes' runtime
    # tree (composer_dag.laptop.image) kept across jobs, node-local
    cache = cache_dir(cluster)
    inner = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": scratch, "TMPDIR": "/tmp",
             "PYTHONPATH": REPO_ROOT, "TORCH_EXTENSIONS_DIR": f"{cache}/torch_extensions",
             "TRITON_CACHE_DIR": f"{cache}/triton", "XDG_CACHE_HOME": f"{cache}/xdg", **env}
    inner.update({k: "${%s}" % k for k in PASS_ENV if k in os.environ})
    if cluster.backend == "slurm":
        inner.update({k: f"@{k}@" for k in SLURM_ENV})  # filled in on each node (NODE_SETUP)
    code = [os.path.join(REPO_ROOT, p) for p in cluster.job_code]
    return bwrap_command(argv, scratch, code, sorted({sys.prefix, sys.base_prefix}), inner, [cache])


def job_env(cluster: ClusterConfig, name: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """The job runner's environment: the cluster's, then ``env``."""
    return {**launch_spec(cluster, JOB_ENTRY, [], name, "python").env, **(env or {})}


def render(cluster: ClusterConfig, spec_url: str, name: str = "composer-job", env: dict[str, str] | None = None,
           scratch: str | None = None) -> Any:
    """What the backend launches for the job spec at ``spec_url``: an argv (local), a pod manifest
    (k8s), an sbatch script (slurm)."""
    env = job_env(cluster, name, env)
    scratch = scratch or os.path.join(cluster.scratch_dir, f"{name}-{uuid.uuid4().hex[:8]}")
    if cluster.backend == "local":
        return job_argv(cluster, spec_url, scratch, env)
    if cluster.backend == "k8s":
        spec = launch_spec(cluster, JOB_ENTRY, ["--spec", spec_url], name, "python")
        spec.env.update(env)
        return k8s.k8s_pod_spec(
            spec, namespace=cluster.namespace, image=cluster.image, gpu_resource=cluster.gpu_resource,
            service_account=cluster.service_account, secret_name=cluster.secret_name,
            node_selector=cluster.node_selector, tolerations=cluster.tolerations)
    argv = job_argv(cluster, spec_url, scratch, env)
    if argv[0] == "bwrap":
        env = {}  # the sandbox gets its environment from the command line
    # the scratch directory is the job's, on every node: made before it starts, removed when it ends
    argv = ["bash", "-c", NODE_SETUP, "composer-node", scratch, cache_dir(cluster), *argv]
    return slurm.slurm_script(
        argv, name=name, nodes=cluster.nnodes, gpus_per_node=cluster.gpus_per_node,
        partition=cluster.partition, account=cluster.account, time=cluster.time_limit,
        output=os.path.join(cluster.scratch_dir, "%x-%j.out"), chdir=cluster.scratch_dir,
        container_image=cluster.container_image, env=env)


# ---- the job's spec and its result ----------------------------------------------------------
class JobError(RuntimeError):
    """A stage's job failed, reported nothing, or published something other than it reported
    (one line)."""


def job_spec(cluster: ClusterConfig, job: dict[str, Any], name: str) -> dict[str, Any]:
    """``job`` (entry, args, inputs, outputs, ...) with the cluster's launcher, processes, nodes
    and environment filled in where it does not set them."""
    job = {"launcher": cluster.launcher, "nproc_per_node": cluster.nproc_per_node, "nnodes": cluster.nnodes, **job}
    if job["launcher"] == "python":
        job["nproc_per_node"] = job["nnodes"] = 1
    job["env"] = {**launch_spec(cluster, job["entry"], [], name, job["launcher"]).env, **(job.get("env") or {})}
    return job


def job_result(entry: str, messages: list, failure: str | None, why: str | None, storage) -> dict[str, Any]:
    """The job's verified result from its Pipes messages: ``{"summary", "outputs": {name: {"url",
    "digest"}}}``, each output's manifest on ``storage`` matching the digest the job reported."""
    error = next((m["error"] for m in reversed(messages) if isinstance(m, dict) and m.get("error")), why)
    if failure or error:
        raise JobError(f"{entry} {failure or 'failed'}" + (f": {error}" if error else ""))
    result = next((m for m in reversed(messages) if isinstance(m, dict) and "outputs" in m), None)
    if result is None:
        raise JobError(f"{entry} finished without reporting a result through Pipes")
    for out_name, out in result["outputs"].items():
        if storage.manifest_digest(out["url"]) != out["digest"]:
            raise JobError(f"{out_name} at {out['url']} does not match the digest its job reported")
    return result


# ---- running to the end --------------------------------------------------------------------
# Each backend returns (what went wrong, or None; the error line it saw itself, or None) once the
# job's processes are gone. ``interrupts``: the exceptions that mean "the run was cancelled" (the
# job is stopped either way; they only change the log line).
def launch(cluster: ClusterConfig, spec_url: str, name: str, env: dict[str, str], log: Log,
           interrupts: tuple[type[BaseException], ...] = (KeyboardInterrupt,)) -> tuple[str | None, str | None]:
    """Run the job at ``spec_url`` on the ``local`` or ``slurm`` backend until it ends."""
    if cluster.backend == "local":
        return _launch_local(cluster, spec_url, name, env, log, interrupts)
    if cluster.backend == "slurm":
        return _launch_slurm(cluster, spec_url, name, env, log, interrupts)
    raise ValueError(f"backend {cluster.backend!r} is launched by its client (k8s: dagster_k8s)")


def _launch_local(cluster, spec_url, name, env, log, interrupts) -> tuple[str | None, str | None]:
    scratch = os.path.join(cluster.scratch_dir, f"{name}-{uuid.uuid4().hex[:8]}")
    os.makedirs(scratch)
    os.makedirs(cache_dir(cluster), exist_ok=True)
    try:
        cmd = job_argv(cluster, spec_url, scratch, env)
        log(f"[cluster:local] {' '.join(cmd)}")
        rc, why = run_process(cmd, None if cluster.isolate else {**os.environ, **env}, cluster.grace_seconds, log,
                              interrupts)
    finally:
        subprocess.run(["rm", "-rf", scratch], check=False)
    return (None, None) if rc == 0 else (f"exited with code {rc}", why or None)


def _launch_slurm(cluster, spec_url, name, env, log, interrupts) -> tuple[str | None, str | None]:
    job = slurm.sbatch(render(cluster, spec_url, name, env))
    log(f"[cluster:slurm] submitted job {job}")
    try:
        state = wait_slurm(job, cluster.poll_seconds)
    except BaseException as exc:  # cancelled run, step timeout, anything: the job must not outlive the step
        why = "run cancelled" if isinstance(exc, interrupts) else type(exc).__name__
        log(f"[cluster:slurm] {why}: scancel {job}")
        subprocess.run(["scancel", job], check=False)
        deadline = time.monotonic() + cluster.grace_seconds + 30
        while time.monotonic() < deadline and not slurm.is_terminal(slurm.slurm_state(job).get("JobState", "UNKNOWN")):
            time.sleep(0.5)
        raise
    log(f"[cluster:slurm] job {job} ended {state['JobState']}")
    return slurm_failure(job, state, cluster.time_limit), None


def wait_slurm(job: str, poll_seconds: float) -> dict[str, str]:
    """The job's final ``{"JobState", ...}``, polled every ``poll_seconds``."""
    while True:
        state = slurm.slurm_state(job)
        if slurm.is_terminal(state.get("JobState", "PENDING")):
            return state
        time.sleep(poll_seconds)


def slurm_failure(job: str, state: dict[str, str], time_limit: str) -> str | None:
    """None for a completed job, else one line: which job, what ended it, its state and exit code."""
    s = state["JobState"]
    if s == "COMPLETED":
        return None
    if s == "TIMEOUT":  # the job's own limit (an operator may have changed it)
        sc = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True)
        time_limit = next(iter(slurm.parse_scontrol_records(sc.stdout)), {}).get("TimeLimit", time_limit)
    what = f"hit its time limit ({time_limit})" if s == "TIMEOUT" else SLURM_ENDS.get(s, "failed")
    return f"in slurm job {job} {what} (state {s}, exit code {state.get('ExitCode', '?')})"


def run_process(cmd: list[str], env: dict | None, grace_seconds: float, log: Log,
                interrupts: tuple[type[BaseException], ...] = (KeyboardInterrupt,)) -> tuple[int, str]:
    """Run ``cmd`` in a session of its own (cancelling stops the whole tree: launcher and ranks),
    its stderr forwarded to ours; its exit code and the last exception line it printed."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stderr=subprocess.PIPE)
    tail = StderrTail(proc.stderr)
    try:
        while proc.poll() is None:
            time.sleep(0.2)
    except interrupts:
        log("[cluster:local] run cancelled: stopping the process group")
        stop_process_group(proc, grace_seconds)
        raise
    finally:
        tail.join()
    return proc.returncode, tail.error_line()


class StderrTail:
    """Forwards a child's stderr to ours (the step's captured logs) and keeps its last lines, so
    a failure can be named in one line: the last exception the child printed."""

    def __init__(self, stream, keep: int = 200):
        self._lines: collections.deque[str] = collections.deque(maxlen=keep)
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace")
            sys.stderr.write(line)
            self._lines.append(line.rstrip("\n"))
        stream.close()

    def join(self, timeout: float = 10.0) -> None:
        self._thread.join(timeout)

    def error_line(self) -> str:
        """``SomeError: message`` of the last exception printed, or ''."""
        return error_line(self._lines)
