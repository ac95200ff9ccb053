"""What a job or a service is, whatever runs it: launch specs and commands, the cluster,
service and array configs, handles, errors, health waiting, the services this process has
started and not stopped, and the backends by name. Plain data and plain functions: nothing here
talks to a cluster."""

from __future__ import annotations

import os
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Literal, Optional

from pydantic import Field, field_validator

from ..runtime.config import StageConfig
from ..runtime.distributed import free_port
from ..runtime.errors import error_line


RDZV_PORT = 29500
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB_ENTRY = "composer_dag.cluster.job"
# what a sandboxed job may see of this process's environment (by reference, never by value)
PASS_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION",
            "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "COMPOSER_S3_ENDPOINT_URL", "HF_TOKEN")
BACKENDS: dict[str, type] = {}
"""The backends by name (``ClusterConfig.backend``): ``composer_dag.cluster.backends`` registers
its own and ``register_backend`` any other."""


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


def cache_dir(cluster: ClusterConfig) -> str:
    """The node-local build cache an isolated job may write (``<scratch_dir>/composer-cache``)."""
    return os.path.join(cluster.scratch_dir, "composer-cache")


def job_env(cluster: ClusterConfig, name: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """The job runner's environment: the cluster's, then ``env``."""
    return {**launch_spec(cluster, JOB_ENTRY, [], name, "python").env, **(env or {})}


def job_argv(cluster: ClusterConfig, spec_url: str, scratch: str, env: dict[str, str],
             node_env: tuple[str, ...] = ()) -> list[str]:
    """The job runner's argv on a node; under bubblewrap when ``isolate`` (``env`` then is all the
    job sees, besides the credentials in ``PASS_ENV`` present here, and ``node_env``: variables
    each node fills in, as ``@NAME@``)."""
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
    inner.update({k: f"@{k}@" for k in node_env})
    code = [os.path.join(REPO_ROOT, p) for p in cluster.job_code]
    return bwrap_command(argv, scratch, code, sorted({sys.prefix, sys.base_prefix}), inner, [cache])


# ---- Kubernetes services and indexed jobs ----------------------------------------------
ARRAY_INDEX_ENV = "COMPOSER_ARRAY_INDEX"


def array_task_args(argv: list[str], prog: str) -> tuple[str, int] | None:
    """An array element's ``SPEC_URL [INDEX]`` arguments as (spec URL, index): without ``INDEX``,
    the index is ``$COMPOSER_ARRAY_INDEX`` (what ``run_array`` sets for each element of a Slurm job
    array or a k8s indexed Job). None, after a usage line on stderr, when they are not that."""
    args = list(argv)
    if len(args) == 1 and os.environ.get(ARRAY_INDEX_ENV, "").strip():
        args.append(os.environ[ARRAY_INDEX_ENV].strip())
    if len(args) != 2 or not args[1].isdigit():
        print(f"usage: python -m {prog} SPEC_URL [INDEX] (or the index in ${ARRAY_INDEX_ENV})", file=sys.stderr)
        return None
    return args[0], int(args[1])


NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"  # a DNS label: a k8s object, a Slurm job name


LOG_LINES = 20


BIND_ALL = "0.0.0.0"  # what ``{host}`` in a service's argv/env is on a cluster node (local: 127.0.0.1)


Log = Callable[[str], None]


class ServiceError(RuntimeError):
    """A service that did not come up; the first line says which and why, the log tail follows."""


class StartAborted(ServiceError):
    """A start given up because another service of the same ``start_many`` failed, or the step ended."""


class SchedulerError(RuntimeError):
    """The scheduler refused a submission (``sbatch`` failed); one line."""


class ArrayError(RuntimeError):
    """An array with failing indexes; the first line names them. ``tasks``: every index's result."""

    def __init__(self, message: str, tasks: list["ArrayTask"]):
        super().__init__(message)
        self.tasks = tasks


# ---- configs -----------------------------------------------------------------------------
class ClusterConfig(StageConfig):
    """Where jobs, services and arrays run. The Dagster resource (``ClusterResource``) is
    generated from this class, so a new option (a k8s field, a Slurm flag) is one field here,
    read where its backend builds its objects."""

    backend: str = Field("local", description="where jobs run: a registered backend (local, slurm, k8s)")
    # a stage's job: what runs on each node
    launcher: Literal["torchrun", "deepspeed", "python"] = "torchrun"
    nproc_per_node: int = Field(1, ge=1)
    nnodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(0, ge=0)
    env: dict[str, str] = {}
    isolate: bool = Field(False, description="run each job under bubblewrap, seeing only its scratch, the code "
                                             "and the Python environment (storage URLs in and out)")
    job_code: list[str] = Field(["composer_dag"], description="what of the checkout an isolated job sees")
    scratch_dir: str = "/tmp"                 # node-local: logs of services and array tasks
    log_uri: Optional[str] = Field(None, description="slurm: a storage URL each service and array task copies its log "
                                                    "to when it ends, read from there by this machine (the nodes share "
                                                    "no disk with it); None: read where Slurm wrote it (scratch_dir)")
    poll_seconds: float = Field(2.0, gt=0)
    grace_seconds: float = Field(10.0, ge=0)  # SIGTERM -> SIGKILL
    array_parallelism: Optional[int] = Field(None, ge=1)
    # slurm
    partition: Optional[str] = None
    account: Optional[str] = None
    time_limit: str = "04:00:00"
    container_image: Optional[str] = None
    # k8s
    image: Optional[str] = None
    namespace: str = "default"
    gpu_resource: str = "nvidia.com/gpu"
    cpu: Optional[str] = Field(None, description="a job pod's CPU request, e.g. '8'")
    memory: Optional[str] = Field(None, description="a job pod's memory request, e.g. '64Gi'")
    service_account: Optional[str] = None
    secret_name: Optional[str] = None
    node_selector: dict[str, str] = {}
    tolerations: list[dict[str, str]] = []

    @field_validator("backend")
    @classmethod
    def registered_backend(cls, name: str) -> str:
        if name not in BACKENDS:
            raise ValueError(f"unknown backend {name!r}; registered: {', '.join(map(repr, sorted(BACKENDS)))}")
        return name


class ServiceConfig(StageConfig):
    """One long-running service."""

    name: str = Field(pattern=NAME_PATTERN, max_length=50)
    argv: list[str] = Field(min_length=1)
    env: dict[str, str] = {}
    port: Optional[int] = Field(None, ge=1, le=65535)  # None: a free port picked on this machine
    health_url: str = "http://{host}:{port}/"         # healthy when it answers 2xx/3xx
    start_timeout_s: float = Field(120.0, gt=0)        # from the process's start to healthy
    queue_timeout_s: Optional[float] = Field(None, gt=0)  # slurm: longest wait in the queue
    cpus: int = Field(1, ge=1)
    gpus: int = Field(0, ge=0)
    memory: Optional[str] = None                       # "64Gi" (k8s) / "64G" (slurm)
    time_limit: Optional[str] = None                   # slurm; default: the cluster's
    node: Optional[str] = Field(None, max_length=255)  # the node to run on (slurm --nodelist, k8s
    #                                                    kubernetes.io/hostname); None: the scheduler's choice


class ArrayConfig(StageConfig):
    """One command run ``count`` times, each with its index in ``COMPOSER_ARRAY_INDEX``."""

    name: str = Field("composer-array", pattern=NAME_PATTERN, max_length=50)
    argv: list[str] = Field(min_length=1)
    count: int = Field(ge=1)
    env: dict[str, str] = {}
    parallelism: Optional[int] = Field(None, ge=1)     # default: the cluster's array_parallelism
    cpus: int = Field(1, ge=1)
    gpus: int = Field(0, ge=0)
    memory: Optional[str] = None
    time_limit: Optional[str] = None                   # slurm, per task
    timeout_s: Optional[float] = Field(None, gt=0)     # the whole array; then it is stopped


# ---- results -----------------------------------------------------------------------------
@dataclass
class ServiceHandle:
    name: str
    backend: str
    host: str                     # slurm: the node's name; k8s: the Service's DNS name
    port: int
    url: str                      # http://host:port
    health_url: str
    pid: Optional[int] = None     # local: the process group's leader
    job_id: Optional[str] = None  # slurm
    log: Optional[str] = None     # its log file (on the node that runs it)
    k8s: Optional[dict] = None    # namespace, deployment, service
    _backend: Any = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}


@dataclass
class ArrayTask:
    index: int
    exit_code: int                # minus the signal when a signal ended it
    state: str                    # COMPLETED, FAILED, TIMEOUT, CANCELLED, NODE_FAIL, ...
    error: str = ""               # its exception (or last log line) when it failed
    log: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.state == "COMPLETED"


# ---- logs and health ---------------------------------------------------------------------
def log_tail(path: Optional[str], n: int = LOG_LINES) -> list[str]:
    """The last ``n`` lines of a log file, a path here or a storage URL ([] when it cannot be
    read)."""
    if not path:
        return []
    try:
        if "://" in path:
            from ..storage import open_storage

            data = open_storage(path.rsplit("/", 1)[0]).read_bytes(path)
            lines = data[-64 * 1024:].decode("utf-8", "replace").splitlines()
        else:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                lines = f.read().decode("utf-8", "replace").splitlines()
    except Exception:  # a missing file, an unreachable store: the caller says where the log is
        return []
    return [ln for ln in lines if ln.strip()][-n:]


def why_from_log(lines: list[str]) -> str:
    return error_line(lines) or (lines[-1].strip()[:300] if lines else "")


def _answers(url: str, timeout: float = 2.0) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # cluster hosts: no proxy
    try:
        with opener.open(url, timeout=timeout) as resp:
            return 200 <= resp.status < 400
    except (urllib.error.URLError, OSError, ValueError):
        return False


def service_failure(handle: ServiceHandle, what: str, log_path: Optional[str]) -> ServiceError:
    lines = log_tail(log_path)
    why = why_from_log(lines)
    msg = f"service {handle.name} {what}" + (f": {why}" if why else "")
    if lines:
        msg += f"\nlast lines of its log ({log_path}):\n" + "\n".join(f"  {ln}" for ln in lines)
    elif log_path:
        msg += f"\nits log: {log_path}" + (f" on {handle.host}" if handle.host else "")
    return ServiceError(msg)


def wait_healthy(handle: ServiceHandle, timeout_s: float, poll_s: float, ended: Callable[[], Optional[str]],
                 abort: Optional[threading.Event] = None) -> None:
    """Poll ``handle.health_url`` until it answers; ``ServiceError`` (naming the service, why,
    and its log's last lines) when ``ended()`` says it is gone or ``timeout_s`` passes;
    ``StartAborted`` once ``abort`` is set."""
    deadline = time.monotonic() + timeout_s
    while True:
        if _answers(handle.health_url):
            return
        check_abort(handle.name, abort)
        gone = ended()
        if gone:
            raise service_failure(handle, f"ended before it answered {handle.health_url} ({gone})", handle.log)
        if time.monotonic() > deadline:
            raise service_failure(handle, f"did not answer {handle.health_url} within {timeout_s:g} s "
                                           "(it is still running; now stopped)", handle.log)
        time.sleep(poll_s)


def check_abort(name: str, abort: Optional[threading.Event]) -> None:
    if abort is not None and abort.is_set():
        raise StartAborted(f"service {name}: start given up (another service failed to start, or the step ended)")


def fill_address(value: str, host: str, port: int) -> str:
    return value.replace("{port}", str(port)).replace("{host}", host)


# ---- what is running, stopped at exit ------------------------------------------------------
_LIVE: dict[int, ServiceHandle] = {}


_LIVE_LOCK = threading.Lock()


def track(handle: ServiceHandle) -> None:
    with _LIVE_LOCK:
        _LIVE[id(handle)] = handle


def untrack(handle: ServiceHandle) -> None:
    with _LIVE_LOCK:
        _LIVE.pop(id(handle), None)


def live_services() -> list[ServiceHandle]:
    """The services this process started and has not stopped."""
    return list(_LIVE.values())
