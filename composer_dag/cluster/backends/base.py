"""The one interface every backend has, and the registry of backends by name.

    backend = backend_for(cluster)                 # ClusterConfig (or a mapping): its ``backend`` class
    backend.render(spec_url, name, env, scratch)   # what it launches for a stage's job
    backend.launch(spec_url, name, env)            # the job run to its end: (failure, why)
    handle = backend.start(service); backend.stop(handle)
    tasks = backend.run_array(array)

What callers used to decide from a backend's name is an attribute here: ``python`` (which Python
a job's command runs with on a node), ``shares_disk`` (whether the nodes see this machine's files
at the same paths), ``runs_here`` (jobs run on this machine: map work stays in the engine's own
process pool), ``launches_jobs`` (``launch`` runs a stage's job itself; otherwise ``render`` gives a
pod manifest that a Kubernetes Pipes client runs) and ``node_env`` (variables an isolated job
takes from the node it runs on). How a service's address is found is ``start``'s: the handle's
``url`` is where the cluster's other nodes reach it.

A new backend is one module: a ``Backend`` subclass with its ``name``, decorated with
``@register_backend``; ``ClusterConfig(backend=name)`` then selects it.
"""

from __future__ import annotations

import os
import sys
import threading
import uuid
from typing import Any, ClassVar, Mapping, Optional

from ..spec import BACKENDS, ArrayConfig, ArrayTask, ClusterConfig, Log, ServiceConfig, ServiceHandle

Interrupts = tuple[type[BaseException], ...]


class Backend:
    """Where a cluster's stage jobs, services and arrays run. A backend implements what it runs;
    what it does not run raises ``NotImplementedError`` naming it."""

    name: ClassVar[str] = ""
    python: ClassVar[str] = sys.executable   # a job's Python on a node (the shared environment's)
    shares_disk: ClassVar[bool] = False      # the nodes see this machine's files at the same paths
    runs_here: ClassVar[bool] = False        # jobs run on this machine
    launches_jobs: ClassVar[bool] = True     # ``launch`` runs a stage's job; False: ``render`` gives a pod
    node_env: ClassVar[tuple[str, ...]] = ()  # variables an isolated job gets from its node

    def __init__(self, cluster: ClusterConfig, log: Optional[Log] = None):
        self.cluster, self.log = cluster, log or (lambda msg: None)

    def scratch(self, name: str) -> str:
        """A new scratch directory's path for the job ``name`` (node-local, under ``scratch_dir``)."""
        return os.path.join(self.cluster.scratch_dir, f"{name}-{uuid.uuid4().hex[:8]}")

    # ---- a stage's job -----------------------------------------------------------------------
    def render(self, spec_url: str, name: str, env: dict[str, str], scratch: str) -> Any:
        """What this backend launches for the job spec at ``spec_url`` (an argv, an sbatch
        script, a pod manifest), ``env`` its environment, ``scratch`` its working directory."""
        raise self._unsupported("stage jobs")

    def launch(self, spec_url: str, name: str, env: dict[str, str],
               interrupts: Interrupts = (KeyboardInterrupt,)) -> tuple[Optional[str], Optional[str]]:
        """Run the job at ``spec_url`` until its processes are gone: (what went wrong, or None;
        the error line it saw itself, or None). ``interrupts``: the exceptions that mean "the run
        was cancelled" (the job is stopped either way; they only change the log line)."""
        raise self._unsupported("stage jobs to their end (its jobs are launched by their client)")

    # ---- services and arrays ----------------------------------------------------------------
    def start(self, cfg: ServiceConfig, abort: Optional[threading.Event] = None) -> ServiceHandle:
        """Start a service and return its handle once its health URL answers; on any failure it
        is stopped first (``ServiceError``; ``StartAborted`` once ``abort`` is set)."""
        raise self._unsupported("services")

    def stop(self, handle: ServiceHandle) -> None:
        """Stop a service this backend started; stopping twice is harmless."""
        raise self._unsupported("services")

    def run_array(self, cfg: ArrayConfig) -> list[ArrayTask]:
        """Run ``cfg.argv`` once per index (``COMPOSER_ARRAY_INDEX``); every index's result."""
        raise self._unsupported("arrays")

    def _unsupported(self, what: str) -> NotImplementedError:
        return NotImplementedError(f"the {self.name} backend does not run {what}")


def register_backend(cls: type[Backend]) -> type[Backend]:
    """Register a ``Backend`` subclass under its ``name`` (a class decorator)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    BACKENDS[cls.name] = cls
    return cls


def backend_for(cluster: ClusterConfig | Mapping | None = None, log: Optional[Log] = None) -> Backend:
    """The backend that ``cluster.backend`` names, for ``cluster`` (a ``ClusterConfig``, a mapping
    or None: the defaults)."""
    cluster = ClusterConfig.load(cluster)
    return BACKENDS[cluster.backend](cluster, log)
