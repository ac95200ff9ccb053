"""The cluster resource: runs a stage's job where GPU work runs, through Dagster Pipes.

A stage's job shares no disk with Dagster. ``run_job`` writes the job's spec (its config,
input URLs with their manifest digests, output URLs, a resume URL) to artifact storage and
launches ``python -m composer_dag.cluster.job --spec URL``, which pulls and verifies its
inputs into a scratch directory of its own, runs the stage (``torchrun``/``deepspeed``/
``python``), publishes sealed outputs, and reports their URLs and digests. Pipes context and
messages travel through the same storage, so no backend needs a shared filesystem.

Backends (same assets, config only):

- ``local``: a subprocess on this machine; the whole process group is stopped when the run is
  cancelled.
- ``slurm``: an sbatch script (``srun`` of the job runner, one per node), watched with
  ``squeue``/``scontrol`` (``sacct`` only as a last resort: it needs accounting); cancelling the
  run ``scancel``s the job; a job the scheduler ended (scancel, node DOWN, time limit) fails the
  step with one line, and the retry resumes from the last sealed checkpoint on storage.
- ``k8s``: ``dagster_k8s.PipesK8sClient`` with a pod that requests GPUs and mounts nothing
  shared (image, node selector, tolerations, credentials from a Secret by name).

``isolate`` runs the job under bubblewrap with only its scratch directory, the Python
environment and the code (read-only) and a private ``/tmp``: it cannot see this machine's
``COMPOSER_HOME`` or a local artifact root, so it works only through storage URLs.

``run`` runs a bare entry point locally (no job spec) and returns its last custom message.

Services and arrays (``composer_dag.cluster.services``): ``start_service``/``stop`` and the
``services(context)`` block (every service started in it stops with the step, on an exception
or a cancelled run too) run long-running HTTP services with a health check; ``run_array`` runs
one command per index (a local pool, ``sbatch --array``, an Indexed Job). Failures are a
``ClusterError`` whose first line names the service or the failing index.
"""


import collections
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from typing import Any, Optional

import dagster as dg
from dagster_pipes import PIPES_PROTOCOL_VERSION, PIPES_PROTOCOL_VERSION_FIELD
from dagster._core.errors import DagsterExecutionInterruptedError
from dagster._core.pipes.client import PipesContextInjector
from dagster._core.pipes.utils import PipesBlobStoreMessageReader, open_pipes_session

import composer_dag
from composer_dag.cluster import services
from composer_dag.cluster import k8s, slurm, spec as launch
from composer_dag.runtime.errors import error_line
from composer_dag.cluster.local import stop_process_group
from composer_dag.cluster.services import ServiceGroup
from composer_dag.cluster.slurm import slurm_state
from composer_dag.cluster.spec import (ArrayConfig, ArrayError, ArrayTask, ClusterConfig, SchedulerError, ServiceConfig,
                                       ServiceError, ServiceHandle)

__all__ = ["ArrayTask", "ClusterError", "ClusterResource", "ServiceHandle", "slurm_state", "stop_process_group"]
from resources.base import ClearConfigResource
from resources.dagster_config import dagster_config

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(composer_dag.__file__)))
# what a sandboxed job may see of this process's environment (by reference, never by value)
PASS_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION",
            "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "COMPOSER_S3_ENDPOINT_URL", "HF_TOKEN")
SLURM_ENV = ("SLURM_JOB_ID", "SLURM_NODEID", "SLURM_PROCID", "SLURM_NNODES", "COMPOSER_RDZV_ENDPOINT")


class ClusterError(dg.Failure):
    pass


class StorageContextInjector(PipesContextInjector):
    """Pipes context as a JSON object at ``<prefix>/<id>/context.json`` on artifact storage."""

    def __init__(self, storage, prefix: str):
        self.storage, self.prefix = storage, prefix

    @contextlib.contextmanager
    def inject_context(self, context_data):
        url = f"{self.prefix}/{uuid.uuid4().hex}/context.json"
        self.storage.write_json(url, context_data)
        try:
            yield {"url": url}
        finally:
            with contextlib.suppress(Exception):
                self.storage.fs.rm_file(self.storage._path(url))

    def no_messages_debug_text(self) -> str:
        return f"Pipes context was written under {self.prefix}"


class StorageMessageReader(PipesBlobStoreMessageReader):
    """Pipes messages as numbered chunks ``<prefix>/<id>/messages/<n>.json`` on artifact
    storage (the layout of Dagster's blob-store readers); each poll reads every chunk there."""

    def __init__(self, storage, prefix: str, interval: float = 1.0):
        super().__init__(interval=interval)
        self.storage, self.prefix = storage, prefix
        self._ended = threading.Event()

    def job_ended(self) -> None:
        """The job's processes are gone: no chunk can come after those on storage now. A job the
        scheduler killed never writes Pipes' ``closed``; without this the reader would wait
        Dagster's 10 s for one before the step could fail."""
        self._ended.set()

    @contextlib.contextmanager
    def get_params(self):
        yield {"url": f"{self.prefix}/{uuid.uuid4().hex}/messages"}

    def messages_are_readable(self, params) -> bool:
        return True

    def download_messages_chunk(self, index: int, params) -> Optional[str]:
        url = f"{params['url']}/{index}.json"
        return self.storage.read_bytes(url).decode() if self.storage.exists(url) else None

    def download_messages(self, cursor, params):
        chunks = []
        while (chunk := self.download_messages_chunk(self.counter, params)) is not None:
            chunks.append(chunk)
            self.counter += 1
        if not chunks and self._ended.is_set():  # end the stream as the job would have
            return self.counter, json.dumps({PIPES_PROTOCOL_VERSION_FIELD: PIPES_PROTOCOL_VERSION,
                                             "method": "closed", "params": None})
        return (self.counter, "\n".join(chunks)) if chunks else None

    def no_messages_debug_text(self) -> str:
        return f"Pipes messages were expected under {self.prefix}"


ClusterSettings = dagster_config(ClusterConfig, base=ClearConfigResource, name="ClusterSettings", module=__name__)
"""Every setting of the cluster resource, generated from the engine's ``ClusterConfig``."""


class ClusterResource(ClusterSettings):
    """Where the GPU stages' jobs, the services and the arrays run (its settings: the engine's
    ``ClusterConfig``)."""

    # ---- specs -------------------------------------------------------------------------
    def spec(self, entry: str, args: list[str], name: str = "composer-train", launcher: str | None = None) -> launch.LaunchSpec:
        env = {**self.env}
        single = launcher == "python"  # an entry that must run as one process
        if self.gpus_per_node == 0:
            env.setdefault("DS_ACCELERATOR", "cpu")
        return launch.LaunchSpec(
            entry=entry,
            args=list(args),
            nproc_per_node=1 if single else self.nproc_per_node,
            nnodes=1 if single else self.nnodes,
            launcher=launcher or self.launcher,
            env=env,
            gpus_per_node=self.gpus_per_node,
            image=self.image,
            name=name,
            cpu=self.cpu,
            memory=self.memory,
        )

    def job_argv(self, spec_url: str, scratch: str, env: dict[str, str]) -> list[str]:
        """The job runner's argv on a node; under bubblewrap when ``isolate`` (``env`` then is
        all the job sees, besides the credentials in ``PASS_ENV`` present here)."""
        argv = [sys.executable, "-m", "composer_dag.cluster.job", "--spec", spec_url, "--scratch", scratch]
        if not self.isolate:
            return argv
        # compiled kernels (DeepSpeed's ops: ~90 s to build on 2 cores) and the sandboxes' runtime
        # tree (composer_dag.envs.rootfs) kept across jobs, node-local
        cache = self.cache_dir()
        inner = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": scratch, "TMPDIR": "/tmp",
                 "PYTHONPATH": REPO_ROOT, "TORCH_EXTENSIONS_DIR": f"{cache}/torch_extensions",
                 "TRITON_CACHE_DIR": f"{cache}/triton", "XDG_CACHE_HOME": f"{cache}/xdg", **env}
        inner.update({k: "${%s}" % k for k in PASS_ENV if k in os.environ})
        if self.backend == "slurm":
            inner.update({k: "${%s}" % k for k in SLURM_ENV})
        code = [os.path.join(REPO_ROOT, p) for p in self.job_code]
        return launch.bwrap_command(argv, scratch, code, sorted({sys.prefix, sys.base_prefix}), inner, [cache])

    def cache_dir(self) -> str:
        """The node-local build cache an isolated job may write (``<scratch_dir>/composer-cache``)."""
        return os.path.join(self.scratch_dir, "composer-cache")

    def render(self, spec_url: str, name: str = "composer-job", env: dict[str, str] | None = None,
               scratch: str | None = None) -> Any:
        """What the backend launches for the job spec at ``spec_url``: an argv (local), a pod
        manifest (k8s), an sbatch script (slurm)."""
        env = {**self.spec("composer_dag.cluster.job", [], name, "python").env, **(env or {})}
        scratch = scratch or os.path.join(self.scratch_dir, f"{name}-{uuid.uuid4().hex[:8]}")
        if self.backend == "local":
            return self.job_argv(spec_url, scratch, env)
        if self.backend == "k8s":
            spec = self.spec("composer_dag.cluster.job", ["--spec", spec_url], name, "python")
            spec.env.update(env)
            return k8s.k8s_pod_spec(
                spec, namespace=self.namespace, image=self.image, gpu_resource=self.gpu_resource,
                service_account=self.service_account, secret_name=self.secret_name,
                node_selector=self.node_selector, tolerations=self.tolerations)
        argv = self.job_argv(spec_url, scratch, env)
        if argv[0] == "bwrap":
            env = {}  # the sandbox gets its environment from the command line
        # the scratch directory is the job's: made before it starts, removed when it ends
        setup = [f"mkdir -p {scratch} {self.cache_dir()}", f"trap 'rm -rf {scratch}' EXIT"]
        return slurm.slurm_script(
            argv, name=name, nodes=self.nnodes, gpus_per_node=self.gpus_per_node,
            partition=self.partition, account=self.account, time=self.time_limit,
            output=os.path.join(self.scratch_dir, "%x-%j.out"), chdir=self.scratch_dir,
            container_image=self.container_image, env=env, setup=setup)

    # ---- running -----------------------------------------------------------------------
    def run_job(self, context, storage, job: dict[str, Any], name: str = "composer-job") -> dict[str, Any]:
        """Run a stage's job (see ``composer_dag.cluster.job``) and return its verified result:
        ``{"summary": <the stage's result>, "outputs": {name: {"url", "digest"}}}``, each
        output's manifest on storage matching the digest the job reported."""
        job = {"launcher": self.launcher, "nproc_per_node": self.nproc_per_node, "nnodes": self.nnodes, **job}
        if job["launcher"] == "python":
            job["nproc_per_node"] = job["nnodes"] = 1
        job["env"] = {**self.spec(job["entry"], [], name, job["launcher"]).env, **(job.get("env") or {})}
        run_id = context.run.run_id
        spec_url = storage.url("jobs", run_id, f"{name}-{uuid.uuid4().hex[:8]}.json")
        storage.write_json(spec_url, job)
        prefix = storage.url("jobs", run_id, "pipes")
        with open_pipes_session(
            context=context,
            context_injector=StorageContextInjector(storage, prefix),
            message_reader=(reader := StorageMessageReader(storage, prefix)),
        ) as session:
            env = session.get_bootstrap_env_vars()
            launched = {"local": self._launch_local, "slurm": self._launch_slurm, "k8s": self._launch_k8s}[self.backend]
            try:
                failure, why = launched(context, spec_url, name, env)
            finally:  # each launcher returns (or raises) once the job's processes are gone
                reader.job_ended()
        messages = session.get_custom_messages()
        error = next((m["error"] for m in reversed(messages) if isinstance(m, dict) and m.get("error")), why)
        if failure or error:
            raise ClusterError(description=f"{job['entry']} {failure or 'failed'}" + (f": {error}" if error else ""))
        result = next((m for m in reversed(messages) if isinstance(m, dict) and "outputs" in m), None)
        if result is None:
            raise ClusterError(description=f"{job['entry']} finished without reporting a result through Pipes")
        for out_name, out in result["outputs"].items():
            found = storage.manifest_digest(out["url"])
            if found != out["digest"]:
                raise ClusterError(description=f"{out_name} at {out['url']} does not match the digest its job reported")
        return result

    # Each launcher returns (what went wrong, or None; the error line it saw itself, or None).
    def _launch_local(self, context, spec_url, name, env) -> tuple[str | None, str | None]:
        scratch = os.path.join(self.scratch_dir, f"{name}-{uuid.uuid4().hex[:8]}")
        os.makedirs(scratch)
        os.makedirs(self.cache_dir(), exist_ok=True)
        try:
            cmd = self.job_argv(spec_url, scratch, env)
            full_env = None if self.isolate else {**os.environ, **env}
            context.log.info(f"[cluster:local] {' '.join(cmd)}")
            rc, why = self._popen(context, cmd, full_env)
        finally:
            subprocess.run(["rm", "-rf", scratch], check=False)
        return (None, None) if rc == 0 else (f"exited with code {rc}", why or None)

    def _launch_slurm(self, context, spec_url, name, env) -> tuple[str | None, str | None]:
        script = self.render(spec_url, name, env)
        out = subprocess.run(["sbatch", "--parsable"], input=script, capture_output=True, text=True)
        if out.returncode != 0:
            raise ClusterError(description=f"sbatch failed: {' '.join(out.stderr.split())[:300]}")
        job = slurm.parse_sbatch_output(out.stdout)
        context.log.info(f"[cluster:slurm] submitted job {job}")
        try:
            state = self._wait_slurm(job)
        except BaseException as exc:  # cancelled run, step timeout, anything: the job must not outlive the step
            why = "run cancelled" if isinstance(exc, (DagsterExecutionInterruptedError, KeyboardInterrupt)) else type(exc).__name__
            context.log.warning(f"[cluster:slurm] {why}: scancel {job}")
            subprocess.run(["scancel", job], check=False)
            deadline = time.monotonic() + self.grace_seconds + 30
            while time.monotonic() < deadline and not slurm.is_terminal(slurm_state(job).get("JobState", "UNKNOWN")):
                time.sleep(0.5)
            raise
        context.log.info(f"[cluster:slurm] job {job} ended {state['JobState']}")
        if state["JobState"] == "COMPLETED":
            return None, None
        limit = self.time_limit
        if state["JobState"] == "TIMEOUT":  # the job's own limit (an operator may have changed it)
            sc = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True)
            limit = next(iter(slurm.parse_scontrol_records(sc.stdout)), {}).get("TimeLimit", limit)
        what = {"CANCELLED": "was cancelled by the scheduler or an operator (scancel)",
                "TIMEOUT": f"hit its time limit ({limit})", "NODE_FAIL": "lost its node (node failure or DOWN)",
                "PREEMPTED": "was preempted", "OUT_OF_MEMORY": "ran out of memory"}.get(state["JobState"], "failed")
        return f"in slurm job {job} {what} (state {state['JobState']}, exit code {state.get('ExitCode', '?')})", None

    def _wait_slurm(self, job: str) -> dict[str, str]:
        while True:
            state = slurm_state(job)
            if slurm.is_terminal(state.get("JobState", "PENDING")):
                return state
            time.sleep(self.poll_seconds)

    def _launch_k8s(self, context, spec_url, name, env) -> tuple[str | None, str | None]:
        from dagster_k8s import PipesK8sClient

        manifest = self.render(spec_url, name, env)
        container = manifest["spec"]["containers"][0]
        PipesK8sClient().run(
            context=context, image=container["image"], command=container["command"], namespace=self.namespace,
            env={e["name"]: e["value"] for e in container["env"] if "value" in e},
            base_pod_meta=manifest["metadata"], base_pod_spec=manifest["spec"],
        )
        return None, None

    def run(
        self,
        context: dg.AssetExecutionContext | dg.OpExecutionContext,
        entry: str,
        args: list[str],
        extras: dict[str, Any] | None = None,
        name: str = "composer-train",
        launcher: str | None = None,
    ) -> dict[str, Any]:
        """Run a bare entry point on this machine (``torchrun``/``deepspeed``/``python`` as the
        spec says) and return rank 0's last custom message."""
        cmd = launch.local_command(self.spec(entry, args, name, launcher))
        context.log.info(f"[cluster:local] {' '.join(cmd)}")
        with open_pipes_session(
            context=context,
            context_injector=dg.PipesTempFileContextInjector(),
            message_reader=dg.PipesTempFileMessageReader(),
            extras=extras,
        ) as session:
            env = {**os.environ, **self.spec(entry, args, name, launcher).env, **session.get_bootstrap_env_vars()}
            rc, why = self._popen(context, cmd, env)
            if rc != 0:
                raise ClusterError(description=f"{entry} exited with code {rc}" + (f": {why}" if why else "")
                                   + " (the whole output is in the run's stderr)")
        messages = session.get_custom_messages()
        if not messages:
            raise ClusterError(description=f"{entry} finished without reporting a result through Pipes")
        return messages[-1]

    # ---- services and arrays -------------------------------------------------------------
    def cluster_config(self) -> ClusterConfig:
        """The engine's view of these settings (``composer_dag.cluster.services``)."""
        return self.engine_config()

    def start_service(self, context, name: str, argv: list[str], env: dict[str, str] | None = None,
                      port: int | None = None, health_url: str = "http://{host}:{port}/", **settings: Any) -> ServiceHandle:
        """Start a long-running service (``argv``, ``{port}``/``{host}`` filled in) and return its
        handle once ``health_url`` answers; ``settings``: the other ``ServiceConfig`` fields
        (``start_timeout_s``, ``cpus``, ``gpus``, ``memory``, ``time_limit``, ...). Stop it with
        ``stop``, or start it through ``services(context)`` so that it stops with the step."""
        cfg = _service_config(name, argv, env, port, health_url, settings)
        try:
            return services.start_service(self.cluster_config(), cfg, log=context.log.info)
        except (ServiceError, SchedulerError) as exc:
            raise ClusterError(description=str(exc)) from None

    def stop(self, handle: ServiceHandle) -> None:
        """Stop a service: its process group (local), ``scancel`` of its job (slurm), its
        Deployment and Service (k8s)."""
        services.stop(handle)

    @contextlib.contextmanager
    def services(self, context):
        """Services that stop with the step: every service started through the group this
        yields (``group.start(name=..., argv=..., ...)``) is stopped when the block ends, when
        the step raises, and when the run is cancelled."""
        group = _DagsterServiceGroup(self.cluster_config(), context.log.info)
        try:
            yield group
        except (DagsterExecutionInterruptedError, KeyboardInterrupt):
            context.log.warning(f"[cluster:{self.backend}] run cancelled: stopping {len(group.handles)} service(s)")
            raise
        finally:
            group.stop_all()

    def run_array(self, context, argv: list[str], count: int, env: dict[str, str] | None = None,
                  name: str = "composer-array", parallelism: int | None = None, **settings: Any) -> list[ArrayTask]:
        """Run ``argv`` once per index ``0..count-1`` (in ``COMPOSER_ARRAY_INDEX``): a process
        pool here, ``sbatch --array`` on Slurm, an Indexed Job on k8s. Returns every index's
        ``ArrayTask`` (exit code, state, error line); a failing index fails the step with one
        line naming it."""
        try:
            cfg = ArrayConfig.load({"name": name, "argv": list(argv), "count": count, "env": dict(env or {}),
                                    "parallelism": parallelism, **settings})
            return services.run_array(self.cluster_config(), cfg, log=context.log.info)
        except ArrayError as exc:
            raise ClusterError(description=str(exc), metadata={"tasks": dg.MetadataValue.json(
                [vars(t) for t in exc.tasks])}) from None
        except SchedulerError as exc:
            raise ClusterError(description=f"array {name}: {exc}") from None

    def _popen(self, context, cmd: list[str], env: dict | None) -> tuple[int, str]:
        # A session of its own: cancelling signals the whole tree (launcher and ranks).
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, stderr=subprocess.PIPE)
        tail = _StderrTail(proc.stderr)
        try:
            while proc.poll() is None:
                time.sleep(0.2)
        except (DagsterExecutionInterruptedError, KeyboardInterrupt):
            context.log.warning("[cluster:local] run cancelled: stopping the process group")
            stop_process_group(proc, self.grace_seconds)
            raise
        finally:
            tail.join()
        return proc.returncode, tail.error_line()


def _service_config(name, argv, env, port, health_url, settings) -> ServiceConfig:
    return ServiceConfig.load({"name": name, "argv": list(argv), "env": dict(env or {}), "port": port,
                               "health_url": health_url, **settings})


class _DagsterServiceGroup(ServiceGroup):
    """A ``ServiceGroup`` whose failures are the step's one-line ``ClusterError``."""

    def start(self, service=None, **fields: Any) -> ServiceHandle:
        try:
            return super().start(service, **fields)
        except (ServiceError, SchedulerError) as exc:
            raise ClusterError(description=str(exc)) from None

    def start_many(self, services: list) -> list[ServiceHandle]:
        try:
            return super().start_many(services)
        except (ServiceError, SchedulerError) as exc:
            raise ClusterError(description=str(exc)) from None


class _StderrTail:
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
