"""The cluster resource: runs a stage's job where GPU work runs, through Dagster Pipes.

A stage's job shares no disk with Dagster. ``run_job`` writes the job's spec (its config,
input URLs with their manifest digests, output URLs, a resume URL) to artifact storage and
launches ``python -m composer_dag.cluster.job --spec URL``, which pulls and verifies its
inputs into a scratch directory of its own, runs the stage (``torchrun``/``deepspeed``/
``python``), publishes sealed outputs, and reports their URLs and digests. Pipes context and
messages travel through the same storage, so no backend needs a shared filesystem.

What runs where (the job's argv under bubblewrap, its sbatch script or pod manifest, submitting
and waiting on Slurm) is the engine's backend (``composer_dag.cluster.backends``, chosen by
``backend_for``), the result's verification ``composer_dag.cluster.stage``; this resource adds the
Pipes session, runs through ``dagster_k8s`` the pod of a backend that does not launch its jobs
itself (``k8s``), and turns the engine's errors into the step's one-line ``ClusterError``.

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


import contextlib
import json
import os
import threading
import uuid
from typing import Any, Optional

import dagster as dg
from dagster import (DagsterExecutionInterruptedError, PipesBlobStoreMessageReader, PipesContextInjector,
                     open_pipes_session)
from dagster_pipes import PIPES_PROTOCOL_VERSION, PIPES_PROTOCOL_VERSION_FIELD

from composer_dag.cluster import services, spec as launch, stage
from composer_dag.cluster.backends import Backend, backend_for
from composer_dag.cluster.backends.local import run_process
from composer_dag.cluster.services import ServiceGroup
from composer_dag.cluster.spec import (ArrayConfig, ArrayError, ArrayTask, ClusterConfig, SchedulerError, ServiceConfig,
                                       ServiceError, ServiceHandle)
from resources.base import ClearConfigResource
from resources.dagster_config import dagster_config

__all__ = ["ArrayTask", "ClusterError", "ClusterResource", "ServiceHandle"]
# what means "the run was cancelled" to the engine's process and job runners
INTERRUPTS = (DagsterExecutionInterruptedError, KeyboardInterrupt)


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
                self.storage.remove(url)

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

    # ---- specs (composer_dag.cluster.stage) ---------------------------------------------------
    def spec(self, entry: str, args: list[str], name: str = "composer-train", launcher: str | None = None) -> launch.LaunchSpec:
        return launch.launch_spec(self.engine_config(), entry, args, name, launcher)

    def render(self, spec_url: str, name: str = "composer-job", env: dict[str, str] | None = None,
               scratch: str | None = None) -> Any:
        """What the backend launches for the job spec at ``spec_url``: an argv (local), a pod
        manifest (k8s), an sbatch script (slurm)."""
        return stage.render(self.engine_config(), spec_url, name, env, scratch)

    def get_backend(self, log=None) -> Backend:
        """The backend object these settings name (``composer_dag.cluster.backends``): what it
        runs, and how (``python``, ``shares_disk``, ``runs_here``, ``launches_jobs``)."""
        return backend_for(self.engine_config(), log)

    # ---- running -----------------------------------------------------------------------
    def run_job(self, context, storage, job: dict[str, Any], name: str = "composer-job") -> dict[str, Any]:
        """Run a stage's job (see ``composer_dag.cluster.job``) and return its verified result:
        ``{"summary": <the stage's result>, "outputs": {name: {"url", "digest"}}}``, each
        output's manifest on storage matching the digest the job reported."""
        job = stage.job_spec(self.engine_config(), job, name)
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
            backend = self.get_backend(context.log.info)
            try:  # each backend returns (or raises) once the job's processes are gone
                if backend.launches_jobs:
                    failure, why = backend.launch(spec_url, name, env, INTERRUPTS)
                else:
                    failure, why = self._launch_pod(context, spec_url, name, env)
            except SchedulerError as exc:
                raise ClusterError(description=str(exc)) from None
            finally:
                reader.job_ended()
        try:
            return stage.job_result(job["entry"], session.get_custom_messages(), failure, why, storage)
        except stage.JobError as exc:
            raise ClusterError(description=str(exc)) from None

    def _launch_pod(self, context, spec_url, name, env) -> tuple[str | None, str | None]:
        """The job's pod (what a backend that does not launch its jobs itself renders), run to
        its end by Dagster's Kubernetes Pipes client."""
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
            rc, why = run_process(cmd, env, self.grace_seconds, context.log.info, INTERRUPTS)
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
