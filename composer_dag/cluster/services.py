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

Backends (``composer_dag.cluster.backends``, one module each, chosen by ``backend_for``):

- ``local``: a process group on this machine (``node`` does not apply) under ``composer_dag.runtime.supervise`` (dies
  with its parent through ``PR_SET_PDEATHSIG``, stops its whole group); stop = SIGTERM to the
  group, SIGKILL after the grace period. An array is a pool of at most ``parallelism``
  processes.
- ``slurm``: ``sbatch`` of a script that ``srun``s the service (one node; ``node`` pins it with
  ``--nodelist``); its URL names the node that runs it (``scontrol show job``'s ``BatchHost``),
  as the cluster's other nodes reach it, and the health check goes to that node's ``NodeAddr``
  (this machine need not resolve the cluster's names); stop = ``scancel``,
  waiting until the job has left ``squeue``. An array is ``sbatch --array=0-(count-1)%parallelism``;
  each task's state and exit code come from ``scontrol``, its error line from its log.
- ``k8s``: a Deployment + Service (ready when the health path answers; ``node`` becomes a
  ``kubernetes.io/hostname`` node selector) and an Indexed Job,
  created with the ``kubernetes`` client; stop deletes them.

A service that does not answer within ``start_timeout_s`` (or ends before) is stopped and fails
with one line naming it and why, then the last lines of its log.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import threading
from typing import Any, Mapping, Optional

from .backends import backend_for
from .spec import (ArrayConfig, ArrayError, ArrayTask, ClusterConfig, Log, ServiceConfig, ServiceError, ServiceHandle,
    StartAborted, live_services)


# ---- the API -------------------------------------------------------------------------------
def start_service(cluster: ClusterConfig | Mapping | None, service: ServiceConfig | Mapping,
                  log: Optional[Log] = None, abort: Optional[threading.Event] = None) -> ServiceHandle:
    """Start ``service`` on the cluster and return once its health URL answers. On failure
    (timeout, the service ended, an exception, a cancelled step, ``abort`` set) it is stopped
    first, and a ``ServiceError`` names it with the last lines of its log."""
    return backend_for(cluster, log).start(ServiceConfig.load(service), abort)


def stop(handle: ServiceHandle) -> None:
    """Stop a service: its whole process group (local), its job (slurm: ``scancel``, then wait
    until it has left the queue), its Deployment and Service (k8s). Stopping twice is harmless."""
    handle._backend.stop(handle)


def run_array(cluster: ClusterConfig | Mapping | None, array: ArrayConfig | Mapping,
              log: Optional[Log] = None, check: bool = True) -> list[ArrayTask]:
    """Run ``array.argv`` once per index ``0..count-1`` (``COMPOSER_ARRAY_INDEX``) and return
    every index's result; with ``check``, an ``ArrayError`` whose first line names each
    failing index, its exit code and its error line."""
    cfg = ArrayConfig.load(array)
    tasks = backend_for(cluster, log).run_array(cfg)
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


@atexit.register
def _stop_all_at_exit() -> None:
    for handle in live_services():
        with contextlib.suppress(Exception):
            stop(handle)
