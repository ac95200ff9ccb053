"""Long-running services and map-style arrays on the cluster (plain Python, no Dagster).

A *service* is a process that serves HTTP until it is stopped (the RL fleet's ``vllm serve``
rollout servers); an *array* runs one command ``count`` times, each with its index in
``COMPOSER_ARRAY_INDEX`` (map-style work: one shard per index).

    cluster = ClusterConfig(backend="slurm", partition="gpu")
    with ServiceGroup(cluster) as fleet:            # every service it started stops on exit,
        h = fleet.start(name="rollout-0",           # an exception or a cancelled step included
                        argv=["python", "-m", "http.server", "{port}"])
        requests.get(h.url)                         # answered: the health check passed
    tasks = run_array(cluster, ArrayConfig(name="shards", argv=[...], count=8))

``{port}`` in a service's argv, env and ``health_url`` becomes its port; ``{host}`` becomes the
address to bind in argv and env (``127.0.0.1`` locally, ``0.0.0.0`` on a cluster node) and the
address to reach it at in ``health_url``.

Backends:

- ``local``: a process group on this machine under ``composer_dag.runtime.supervise`` (dies
  with its parent through ``PR_SET_PDEATHSIG``, stops its whole group); stop = SIGTERM to the
  group, SIGKILL after the grace period. An array is a pool of at most ``parallelism``
  processes.
- ``slurm``: ``sbatch`` of a script that ``srun``s the service (one node); the host comes from
  ``scontrol show job`` (its ``BatchHost``, then that node's ``NodeAddr``); stop = ``scancel``,
  waiting until the job has left ``squeue``. An array is ``sbatch --array=0-(count-1)%parallelism``;
  each task's state and exit code come from ``scontrol``, its error line from its log.
- ``k8s``: a Deployment + Service (ready when the health path answers) and an Indexed Job,
  created with the ``kubernetes`` client; stop deletes them.

A service that does not answer within ``start_timeout_s`` (or ends before) is stopped and fails
with one line naming it and why, then the last lines of its log.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import contextlib
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Literal, Mapping, Optional

import psutil
from pydantic import Field

from .. import launch
from . import supervise
from .config import StageConfig
from .job import error_line

ARRAY_INDEX_ENV = launch.ARRAY_INDEX_ENV
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
    """Where services and arrays run: the cluster resource's settings (same names)."""

    backend: Literal["local", "slurm", "k8s"] = "local"
    scratch_dir: str = "/tmp"                 # node-local: logs of services and array tasks
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
    service_account: Optional[str] = None
    secret_name: Optional[str] = None
    node_selector: dict[str, str] = {}
    tolerations: list[dict[str, str]] = []


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
    host: str
    port: int
    url: str                      # http://host:port
    health_url: str
    pid: Optional[int] = None     # local: the process group's leader
    job_id: Optional[str] = None  # slurm
    log: Optional[str] = None     # its log file (on the node that runs it)
    k8s: Optional[dict] = None    # namespace, deployment, service
    _runner: Any = field(default=None, repr=False, compare=False)

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


# ---- processes ---------------------------------------------------------------------------
def stop_process_group(proc: subprocess.Popen, grace_seconds: float) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left after the grace period: the
    group and every descendant, since torchrun starts its workers in sessions of their own
    (a group kill alone would leave a worker that ignores SIGTERM running on)."""
    stop_process_groups([proc], grace_seconds)


def stop_process_groups(procs: list[subprocess.Popen], grace_seconds: float) -> None:
    """``stop_process_group`` for several at once (one grace period for all)."""
    groups = {}
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            groups[proc] = os.getpgid(proc.pid)
    if not groups:
        return
    tree: set = set()
    for sig, wait in ((signal.SIGTERM, grace_seconds), (signal.SIGKILL, 5.0)):
        for proc, pgid in groups.items():
            tree |= _descendants(proc.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)
        if sig == signal.SIGKILL:
            for p in tree:
                with contextlib.suppress(psutil.Error):
                    p.kill()
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if (all(p.poll() is not None for p in groups) and not any(_group_alive(g) for g in groups.values())
                    and not _any_running(tree)):
                return
            time.sleep(0.05)


def _descendants(pid: int) -> set:
    try:
        return set(psutil.Process(pid).children(recursive=True))
    except psutil.Error:
        return set()


def _any_running(procs) -> bool:
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                return True
    return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    for p in psutil.process_iter(["status"]):  # a group of zombies is gone for our purpose
        with contextlib.suppress(psutil.Error):
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                return True
    return False


_SPAWNER: Optional[concurrent.futures.ThreadPoolExecutor] = None
_SPAWNER_LOCK = threading.Lock()


def _popen_supervised(argv: list[str], env: dict[str, str], log_path: str, grace: float) -> subprocess.Popen:
    """Start ``argv`` under the supervisor, from one long-lived thread: Linux sends
    ``PR_SET_PDEATHSIG`` when the *thread* that forked ends, so a service started from a
    short-lived worker thread (``start_many``) must not be forked there."""
    global _SPAWNER

    def spawn() -> subprocess.Popen:
        with open(log_path, "ab") as log:
            return subprocess.Popen(
                supervise.command(argv, grace), env={**os.environ, **env, supervise.PARENT_ENV: str(os.getpid())},
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    with _SPAWNER_LOCK:
        if _SPAWNER is None:
            _SPAWNER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="composer-spawner")
        spawner = _SPAWNER
    return spawner.submit(spawn).result()


# ---- logs and health ---------------------------------------------------------------------
def log_tail(path: Optional[str], n: int = LOG_LINES) -> list[str]:
    """The last ``n`` lines of a log file ([] when it cannot be read here)."""
    if not path:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []
    return [ln for ln in lines if ln.strip()][-n:]


def _why_from_log(lines: list[str]) -> str:
    return error_line(lines) or (lines[-1].strip()[:300] if lines else "")


def _answers(url: str, timeout: float = 2.0) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # cluster hosts: no proxy
    try:
        with opener.open(url, timeout=timeout) as resp:
            return 200 <= resp.status < 400
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _service_failure(handle: ServiceHandle, what: str, log_path: Optional[str]) -> ServiceError:
    lines = log_tail(log_path)
    why = _why_from_log(lines)
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
        _check_abort(handle.name, abort)
        gone = ended()
        if gone:
            raise _service_failure(handle, f"ended before it answered {handle.health_url} ({gone})", handle.log)
        if time.monotonic() > deadline:
            raise _service_failure(handle, f"did not answer {handle.health_url} within {timeout_s:g} s "
                                           "(it is still running; now stopped)", handle.log)
        time.sleep(poll_s)


def _check_abort(name: str, abort: Optional[threading.Event]) -> None:
    if abort is not None and abort.is_set():
        raise StartAborted(f"service {name}: start given up (another service failed to start, or the step ended)")


def _fill(value: str, host: str, port: int) -> str:
    return value.replace("{port}", str(port)).replace("{host}", host)


# ---- what is running, stopped at exit ------------------------------------------------------
_LIVE: dict[int, ServiceHandle] = {}
_LIVE_LOCK = threading.Lock()


def _track(handle: ServiceHandle) -> None:
    with _LIVE_LOCK:
        _LIVE[id(handle)] = handle


def _untrack(handle: ServiceHandle) -> None:
    with _LIVE_LOCK:
        _LIVE.pop(id(handle), None)


@atexit.register
def _stop_all_at_exit() -> None:
    for handle in list(_LIVE.values()):
        with contextlib.suppress(Exception):
            stop(handle)


def live_services() -> list[ServiceHandle]:
    """The services this process started and has not stopped."""
    return list(_LIVE.values())


# ---- backends ----------------------------------------------------------------------------
class LocalRunner:
    def __init__(self, cluster: ClusterConfig, log: Log):
        self.cluster, self.log = cluster, log

    def start(self, cfg: ServiceConfig, abort: Optional[threading.Event] = None) -> ServiceHandle:
        port = cfg.port or launch.free_port()
        host = "127.0.0.1"
        os.makedirs(self.cluster.scratch_dir, exist_ok=True)
        log_path = os.path.join(self.cluster.scratch_dir, f"{cfg.name}-{uuid.uuid4().hex[:8]}.log")
        argv = [_fill(a, host, port) for a in cfg.argv]
        env = {k: _fill(v, host, port) for k, v in cfg.env.items()}
        proc = _popen_supervised(argv, env, log_path, self.cluster.grace_seconds)
        handle = ServiceHandle(cfg.name, "local", host, port, f"http://{host}:{port}",
                               _fill(cfg.health_url, host, port), pid=proc.pid, log=log_path, _runner=self)
        handle._proc = proc  # type: ignore[attr-defined]
        _track(handle)
        self.log(f"[service:local] {cfg.name}: pid {proc.pid}, {' '.join(argv)}")
        try:
            wait_healthy(handle, cfg.start_timeout_s, min(self.cluster.poll_seconds, 0.2),
                         lambda: None if proc.poll() is None else f"it exited with code {proc.returncode}", abort)
        except BaseException:
            self.stop(handle)
            raise
        return handle

    def stop(self, handle: ServiceHandle) -> None:
        stop_process_group(handle._proc, self.cluster.grace_seconds)  # type: ignore[attr-defined]
        _untrack(handle)

    def run_array(self, cfg: ArrayConfig) -> list[ArrayTask]:
        parallelism = cfg.parallelism or self.cluster.array_parallelism or os.cpu_count() or 1
        os.makedirs(self.cluster.scratch_dir, exist_ok=True)
        logdir = tempfile.mkdtemp(prefix=f"{cfg.name}-", dir=self.cluster.scratch_dir)
        pending = collections.deque(range(cfg.count))
        running: dict[int, subprocess.Popen] = {}
        done: dict[int, ArrayTask] = {}
        deadline = time.monotonic() + cfg.timeout_s if cfg.timeout_s else None
        self.log(f"[array:local] {cfg.name}: {cfg.count} tasks, {parallelism} at a time; logs in {logdir}")
        try:
            while pending or running:
                while pending and len(running) < parallelism:
                    i = pending.popleft()
                    running[i] = _popen_supervised(list(cfg.argv), {**cfg.env, ARRAY_INDEX_ENV: str(i)},
                                                   os.path.join(logdir, f"{i}.log"), self.cluster.grace_seconds)
                for i, proc in list(running.items()):
                    if proc.poll() is not None:
                        log = os.path.join(logdir, f"{i}.log")
                        rc = proc.returncode
                        done[i] = ArrayTask(i, rc, "COMPLETED" if rc == 0 else "FAILED",
                                            "" if rc == 0 else _why_from_log(log_tail(log)), log)
                        del running[i]
                if deadline and time.monotonic() > deadline and (running or pending):
                    stop_process_groups(list(running.values()), self.cluster.grace_seconds)
                    for i in [*running, *pending]:
                        done[i] = ArrayTask(i, -signal.SIGTERM, "TIMEOUT", f"array timeout ({cfg.timeout_s:g} s)",
                                            os.path.join(logdir, f"{i}.log"))
                    break
                time.sleep(0.05)
        except BaseException:  # a cancelled step: no task outlives it
            stop_process_groups(list(running.values()), self.cluster.grace_seconds)
            raise
        tasks = [done[i] for i in range(cfg.count)]
        if all(t.ok for t in tasks):
            subprocess.run(["rm", "-rf", logdir], check=False)
            for t in tasks:
                t.log = None
        return tasks


class SlurmRunner:
    def __init__(self, cluster: ClusterConfig, log: Log):
        self.cluster, self.log = cluster, log

    def _script(self, argv, name, env, output, cpus, gpus, memory, time_limit, sbatch=(), setup=()) -> str:
        c = self.cluster
        opts = [f"--cpus-per-task={cpus}", *sbatch]
        if memory:
            opts.append(f"--mem={slurm_memory(memory)}")
        return launch.slurm_script(
            list(argv), name=name, nodes=1, gpus_per_node=gpus, partition=c.partition, account=c.account,
            time=time_limit or c.time_limit, output=output, chdir=c.scratch_dir,
            container_image=c.container_image, env=env, setup=list(setup), sbatch=opts)

    def service_script(self, cfg: ServiceConfig, port: int) -> str:
        """The sbatch script of a service (one node, ``srun`` of its argv, log ``<scratch>/<name>-<job>.out``)."""
        argv = [_fill(a, BIND_ALL, port) for a in cfg.argv]
        env = {k: _fill(v, BIND_ALL, port) for k, v in cfg.env.items()}
        return self._script(argv, cfg.name, env, self._service_log(cfg), cfg.cpus, cfg.gpus, cfg.memory, cfg.time_limit)

    def _service_log(self, cfg: ServiceConfig) -> str:
        return os.path.join(self.cluster.scratch_dir, f"{cfg.name}-%j.out")

    def array_script(self, cfg: ArrayConfig) -> str:
        """The sbatch script of an array (``--array=0-(count-1)%parallelism``, the index exported as
        ``COMPOSER_ARRAY_INDEX``, log ``<scratch>/<name>-<job>_<index>.out``)."""
        parallelism = cfg.parallelism or self.cluster.array_parallelism
        spec = f"--array=0-{cfg.count - 1}" + (f"%{parallelism}" if parallelism else "")
        return self._script(cfg.argv, cfg.name, cfg.env, self._array_log(cfg), cfg.cpus, cfg.gpus, cfg.memory,
                            cfg.time_limit, sbatch=[spec], setup=[f'export {ARRAY_INDEX_ENV}="$SLURM_ARRAY_TASK_ID"'])

    def _array_log(self, cfg: ArrayConfig) -> str:
        return os.path.join(self.cluster.scratch_dir, f"{cfg.name}-%A_%a.out")

    def start(self, cfg: ServiceConfig, abort: Optional[threading.Event] = None) -> ServiceHandle:
        port = cfg.port or launch.free_port()
        out = self._service_log(cfg)
        job = sbatch(self.service_script(cfg, port))
        handle = ServiceHandle(cfg.name, "slurm", "", port, "", "", job_id=job, log=out.replace("%j", job), _runner=self)
        _track(handle)
        self.log(f"[service:slurm] {cfg.name}: submitted job {job}")
        try:
            queued = time.monotonic()
            while True:
                state = slurm_state(job)
                if launch.is_terminal(state.get("JobState", "UNKNOWN")) or state.get("JobState") == "UNKNOWN":
                    raise _service_failure(handle, f"(slurm job {job}) ended {_slurm_what(state)} before it started serving",
                                           handle.log)
                if state.get("JobState") == "RUNNING":
                    break
                _check_abort(cfg.name, abort)
                if cfg.queue_timeout_s and time.monotonic() - queued > cfg.queue_timeout_s:
                    raise ServiceError(f"service {cfg.name} (slurm job {job}) waited in the queue for more than "
                                       f"{cfg.queue_timeout_s:g} s ({state.get('Reason', 'no reason given')}); now cancelled")
                time.sleep(min(self.cluster.poll_seconds, 0.5))
            handle.host = slurm_node_address(job)
            handle.url = f"http://{handle.host}:{port}"
            handle.health_url = _fill(cfg.health_url, handle.host, port)
            self.log(f"[service:slurm] {cfg.name}: job {job} runs on {handle.host}; waiting for {handle.health_url}")

            def ended() -> Optional[str]:
                st = slurm_state(job)
                return f"slurm job {job} ended {_slurm_what(st)}" if launch.is_terminal(st.get("JobState", "RUNNING")) else None

            wait_healthy(handle, cfg.start_timeout_s, min(self.cluster.poll_seconds, 0.5), ended, abort)
        except BaseException:
            self.stop(handle)
            raise
        return handle

    def stop(self, handle: ServiceHandle) -> None:
        scancel_and_wait(handle.job_id, self.cluster.grace_seconds + 30)
        _untrack(handle)
        self.log(f"[service:slurm] {handle.name}: job {handle.job_id} cancelled")

    def run_array(self, cfg: ArrayConfig) -> list[ArrayTask]:
        out = self._array_log(cfg)
        job = sbatch(self.array_script(cfg))
        self.log(f"[array:slurm] {cfg.name}: job {job}, {cfg.count} tasks")
        deadline = time.monotonic() + cfg.timeout_s if cfg.timeout_s else None
        timed_out = False
        try:
            while slurm_queued(job):
                if deadline and time.monotonic() > deadline:
                    timed_out = True
                    scancel_and_wait(job, self.cluster.grace_seconds + 30)
                    break
                time.sleep(self.cluster.poll_seconds)
        except BaseException:
            scancel_and_wait(job, self.cluster.grace_seconds + 30)
            raise
        sc = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True)
        records = {int(r["ArrayTaskId"]): r for r in launch.parse_scontrol_records(sc.stdout)
                   if r.get("ArrayTaskId", "").isdigit()}
        tasks = []
        for i in range(cfg.count):
            r = records.get(i, {})
            state = r.get("JobState", "UNKNOWN")
            code = launch.parse_exit_code(r.get("ExitCode", "0:0")) if r else -1
            log = r.get("StdOut") or out.replace("%A", job).replace("%a", str(i))
            task = ArrayTask(i, code, state, log=log)
            if not task.ok:
                why = _why_from_log(log_tail(log))
                task.error = why or (f"{_slurm_what(r)}" if r else "no record of this task in scontrol")
                if timed_out and state in ("CANCELLED", "UNKNOWN"):
                    task.state, task.error = "TIMEOUT", f"array timeout ({cfg.timeout_s:g} s)"
            tasks.append(task)
        return tasks


class K8sRunner:
    """Deployments, Services and Indexed Jobs through the ``kubernetes`` client (in-cluster
    config, else ``~/.kube/config``). Not run on these machines: the manifests are tested
    against the API models."""

    def __init__(self, cluster: ClusterConfig, log: Log):
        self.cluster, self.log = cluster, log

    def _spec(self, name: str, cpus: int, gpus: int, memory: Optional[str], env: dict) -> launch.LaunchSpec:
        env = dict(env)
        if not gpus:
            env.setdefault("DS_ACCELERATOR", "cpu")
        return launch.LaunchSpec(entry=name, launcher="python", env=env, gpus_per_node=gpus, image=self.cluster.image,
                                 name=name, cpu=str(cpus), memory=memory)

    def _pod_kw(self) -> dict:
        c = self.cluster
        return dict(image=c.image, gpu_resource=c.gpu_resource, service_account=c.service_account,
                    secret_name=c.secret_name, node_selector=c.node_selector, tolerations=c.tolerations)

    def render_service(self, cfg: ServiceConfig, port: int, name: Optional[str] = None) -> tuple[dict, dict]:
        name = name or cfg.name
        host = f"{name}.{self.cluster.namespace}.svc"
        path = "/" + _fill(cfg.health_url, host, port).split("://", 1)[-1].partition("/")[2]
        return launch.k8s_service_manifests(
            self._spec(name, cfg.cpus, cfg.gpus, cfg.memory, {k: _fill(v, BIND_ALL, port) for k, v in cfg.env.items()}),
            [_fill(a, BIND_ALL, port) for a in cfg.argv], port, path, namespace=self.cluster.namespace, **self._pod_kw())

    def render_array(self, cfg: ArrayConfig) -> dict:
        return launch.k8s_indexed_job(
            self._spec(cfg.name, cfg.cpus, cfg.gpus, cfg.memory, cfg.env), list(cfg.argv), cfg.count,
            cfg.parallelism or self.cluster.array_parallelism, namespace=self.cluster.namespace, **self._pod_kw())

    def _api(self):
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return client

    def start(self, cfg: ServiceConfig, abort: Optional[threading.Event] = None) -> ServiceHandle:
        client = self._api()
        port = cfg.port or 8000
        name = f"{cfg.name}-{uuid.uuid4().hex[:6]}"
        ns = self.cluster.namespace
        deployment, service = self.render_service(cfg, port, name)
        host = f"{name}.{ns}.svc"
        handle = ServiceHandle(cfg.name, "k8s", host, port, f"http://{host}:{port}", _fill(cfg.health_url, host, port),
                               k8s={"namespace": ns, "deployment": name, "service": name}, _runner=self)
        apps, core = client.AppsV1Api(), client.CoreV1Api()
        apps.create_namespaced_deployment(ns, deployment)
        _track(handle)
        try:
            core.create_namespaced_service(ns, service)
            deadline = time.monotonic() + cfg.start_timeout_s
            while (apps.read_namespaced_deployment_status(name, ns).status.ready_replicas or 0) < 1:
                _check_abort(cfg.name, abort)
                if time.monotonic() > deadline:
                    raise ServiceError(f"service {cfg.name} (deployment {ns}/{name}) was not ready within "
                                       f"{cfg.start_timeout_s:g} s; now deleted (kubectl -n {ns} logs deploy/{name})")
                time.sleep(self.cluster.poll_seconds)
        except BaseException:
            self.stop(handle)
            raise
        return handle

    def stop(self, handle: ServiceHandle) -> None:
        client = self._api()
        ns, name = handle.k8s["namespace"], handle.k8s["deployment"]
        with contextlib.suppress(client.exceptions.ApiException):
            client.CoreV1Api().delete_namespaced_service(name, ns)
        with contextlib.suppress(client.exceptions.ApiException):
            client.AppsV1Api().delete_namespaced_deployment(name, ns, propagation_policy="Foreground")
        _untrack(handle)

    def run_array(self, cfg: ArrayConfig) -> list[ArrayTask]:
        client = self._api()
        ns = self.cluster.namespace
        batch, core = client.BatchV1Api(), client.CoreV1Api()
        job = batch.create_namespaced_job(ns, self.render_array(cfg))
        name = job.metadata.name
        self.log(f"[array:k8s] {cfg.name}: job {ns}/{name}, {cfg.count} indexes")
        deadline = time.monotonic() + cfg.timeout_s if cfg.timeout_s else None
        done: set[int] = set()
        failed: set[int] = set()
        logs: dict[int, list[str]] = {}
        try:
            while len(done) + len(failed) < cfg.count and not (deadline and time.monotonic() > deadline):
                time.sleep(self.cluster.poll_seconds)
                status = batch.read_namespaced_job_status(name, ns).status
                done, failed = _index_set(status.completed_indexes), _index_set(status.failed_indexes)
            for pod in core.list_namespaced_pod(ns, label_selector=f"job-name={name}").items:
                i = int((pod.metadata.annotations or {}).get("batch.kubernetes.io/job-completion-index", -1))
                if i in failed:
                    with contextlib.suppress(client.exceptions.ApiException):
                        logs[i] = core.read_namespaced_pod_log(pod.metadata.name, ns, tail_lines=LOG_LINES).splitlines()
        finally:  # a cancelled step, a timeout, or done: the Job and its pods go
            with contextlib.suppress(client.exceptions.ApiException):
                batch.delete_namespaced_job(name, ns, propagation_policy="Foreground")
        return [ArrayTask(i, 0, "COMPLETED") if i in done else
                ArrayTask(i, 1 if i in failed else -signal.SIGTERM, "FAILED" if i in failed else "TIMEOUT",
                          _why_from_log(logs.get(i, [])) or f"see the logs of job {ns}/{name}, index {i}")
                for i in range(cfg.count)]


def _index_set(text: Optional[str]) -> set[int]:
    """``"0-2,5"`` (a Job's completed/failed indexes) -> {0, 1, 2, 5}."""
    out: set[int] = set()
    for part in (text or "").split(","):
        if part.strip():
            a, _, b = part.partition("-")
            out.update(range(int(a), int(b or a) + 1))
    return out


RUNNERS = {"local": LocalRunner, "slurm": SlurmRunner, "k8s": K8sRunner}


def runner(cluster: ClusterConfig | Mapping | None = None, log: Optional[Log] = None):
    cluster = ClusterConfig.load(cluster)
    return RUNNERS[cluster.backend](cluster, log or (lambda msg: None))


# ---- the API -------------------------------------------------------------------------------
def start_service(cluster: ClusterConfig | Mapping | None, service: ServiceConfig | Mapping,
                  log: Optional[Log] = None, abort: Optional[threading.Event] = None) -> ServiceHandle:
    """Start ``service`` on the cluster and return once its health URL answers. On failure
    (timeout, the service ended, an exception, a cancelled step, ``abort`` set) it is stopped
    first, and a ``ServiceError`` names it with the last lines of its log."""
    return runner(cluster, log).start(ServiceConfig.load(service), abort)


def stop(handle: ServiceHandle) -> None:
    """Stop a service: its whole process group (local), its job (slurm: ``scancel``, then wait
    until it has left the queue), its Deployment and Service (k8s). Stopping twice is harmless."""
    handle._runner.stop(handle)


def run_array(cluster: ClusterConfig | Mapping | None, array: ArrayConfig | Mapping,
              log: Optional[Log] = None, check: bool = True) -> list[ArrayTask]:
    """Run ``array.argv`` once per index ``0..count-1`` (``COMPOSER_ARRAY_INDEX``) and return
    every index's result; with ``check``, an ``ArrayError`` whose first line names each
    failing index, its exit code and its error line."""
    cfg = ArrayConfig.load(array)
    tasks = runner(cluster, log).run_array(cfg)
    bad = [t for t in tasks if not t.ok]
    if check and bad:
        shown = "; ".join(f"index {t.index} {t.state.lower()} (exit code {t.exit_code})" + (f": {t.error}" if t.error else "")
                          for t in bad[:5])
        more = f"; and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise ArrayError(f"array {cfg.name}: {len(bad)} of {cfg.count} indexes failed: {shown}{more}", tasks)
    return tasks


class ServiceGroup:
    """Services that stop together: leaving the ``with`` block, normally or by any exception
    (a failing step, a cancelled run's interrupt), stops every service started in it."""

    def __init__(self, cluster: ClusterConfig | Mapping | None = None, log: Optional[Log] = None):
        self.cluster = ClusterConfig.load(cluster)
        self.log = log
        self.handles: list[ServiceHandle] = []

    def start(self, service: ServiceConfig | Mapping | None = None, **fields: Any) -> ServiceHandle:
        handle = start_service(self.cluster, ServiceConfig.load(service or {}, fields or None), self.log)
        self.handles.append(handle)
        return handle

    def start_many(self, services: list[ServiceConfig | Mapping]) -> list[ServiceHandle]:
        """Start several services at once (a rollout fleet: each may take minutes to load) and
        return their handles once every one answers. The first failure gives up the others'
        starts, stops every one started, and is raised."""
        cfgs = [ServiceConfig.load(s) for s in services]
        abort = threading.Event()
        pool = concurrent.futures.ThreadPoolExecutor(max(1, len(cfgs)), thread_name_prefix="composer-start")
        futures = [pool.submit(start_service, self.cluster, c, self.log, abort) for c in cfgs]
        try:
            for f in concurrent.futures.as_completed(futures):
                if f.exception() is not None:
                    abort.set()
        except BaseException:  # a cancelled step: the starts give up, and the block's exit stops them
            abort.set()
            raise
        finally:
            pool.shutdown(wait=True)
            self.handles.extend(f.result() for f in futures if f.exception() is None)
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            for f in futures:
                if f.exception() is None:
                    with contextlib.suppress(Exception):
                        self.stop(f.result())
            raise next((e for e in errors if not isinstance(e, StartAborted)), errors[0])
        return [f.result() for f in futures]

    def stop(self, handle: ServiceHandle) -> None:
        stop(handle)
        if handle in self.handles:
            self.handles.remove(handle)

    def stop_all(self) -> None:
        errors = []
        while self.handles:
            handle = self.handles.pop()
            try:
                stop(handle)
            except Exception as exc:  # keep stopping the others
                errors.append(f"{handle.name}: {exc}")
        if errors:
            raise ServiceError("could not stop " + "; ".join(errors))

    def __enter__(self) -> "ServiceGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()


# ---- Slurm -----------------------------------------------------------------------------------
def sbatch(script: str) -> str:
    out = subprocess.run(["sbatch", "--parsable"], input=script, capture_output=True, text=True)
    if out.returncode != 0:
        raise SchedulerError(f"sbatch failed: {' '.join(out.stderr.split())[:300]}")
    return launch.parse_sbatch_output(out.stdout)


def slurm_state(job: str) -> dict[str, str]:
    """``{"JobState", "Reason", "ExitCode"}`` of a Slurm job: ``squeue`` while it is queued or
    running, then ``scontrol`` (kept ``MinJobAge`` seconds), then ``sacct`` when accounting is
    on; ``{"JobState": "UNKNOWN"}`` if none knows it."""
    q = subprocess.run(["squeue", "-h", "-j", job, "-o", "%i %T"], capture_output=True, text=True)
    state = launch.parse_squeue(q.stdout).get(job)
    if state and not launch.is_terminal(state):
        return {"JobState": state}
    sc = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True)
    found = launch.parse_scontrol_job(sc.stdout) if sc.returncode == 0 else {}
    if found.get("JobState"):
        return found
    acct = subprocess.run(["sacct", "-j", job, "-P", "-n", "-o", "JobID,State,ExitCode"], capture_output=True, text=True)
    row = launch.parse_sacct(acct.stdout).get(job) if acct.returncode == 0 else None
    if row:
        return {"JobState": row["state"], "ExitCode": row["exit_code"]}
    return {"JobState": state or "UNKNOWN"}


def slurm_queued(job: str) -> bool:
    """Whether any task of the job (an array's included) is still in ``squeue``."""
    while True:
        q = subprocess.run(["squeue", "-h", "-j", job, "-o", "%i %T"], capture_output=True, text=True)
        if q.returncode == 0:
            return bool(q.stdout.strip())
        if "Invalid job id" in q.stderr:
            return False
        time.sleep(1.0)  # the controller is busy: ask again


def scancel_and_wait(job: Optional[str], timeout: float) -> None:
    """``scancel`` the job and wait until it has left ``squeue`` (its processes are gone)."""
    if not job:
        return
    subprocess.run(["scancel", job], check=False, capture_output=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and slurm_queued(job):
        time.sleep(0.3)


def slurm_node_address(job: str) -> str:
    """The address of the node that runs the job: its ``BatchHost``, as that node's ``NodeAddr``."""
    sc = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True)
    rec = next(iter(launch.parse_scontrol_records(sc.stdout)), {})
    node = rec.get("BatchHost") or rec.get("NodeList", "")
    if not node or node == "(null)":
        raise ServiceError(f"slurm job {job} runs on no node that scontrol names")
    sn = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True, text=True)
    addr = next(iter(launch.parse_scontrol_records(sn.stdout)), {}).get("NodeAddr")
    return addr or node


def _slurm_what(state: Mapping[str, str]) -> str:
    s = state.get("JobState", "UNKNOWN")
    what = {"CANCELLED": "cancelled (scancel)", "TIMEOUT": "at its time limit", "NODE_FAIL": "with its node lost (DOWN)",
            "FAILED": "failed", "COMPLETED": "completed", "OUT_OF_MEMORY": "out of memory"}.get(s, s.lower())
    return f"{what} (state {s}, exit code {state.get('ExitCode', '?')})"


def slurm_memory(memory: str) -> str:
    """A k8s-style quantity as Slurm's ``--mem`` ("64Gi" -> "64G", "512Mi" -> "512M")."""
    m = re.fullmatch(r"(\d+)([KMGT])i?B?", memory.strip(), re.I)
    return f"{m.group(1)}{m.group(2).upper()}" if m else memory
