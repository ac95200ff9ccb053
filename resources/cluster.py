"""The cluster resource: runs an engine entry point where GPU work runs, through Dagster Pipes.

Backends (same assets, config only):

- ``local``: a Pipes subprocess on this machine launching ``torchrun``/``deepspeed`` (or plain
  python) with N processes. The whole process group is stopped when the run is cancelled.
- ``k8s``: ``dagster_k8s.PipesK8sClient`` with a pod spec that requests GPUs (image, volumes,
  env, secrets from the launch spec).
- ``slurm``: an sbatch script for multi-node ``torchrun``, submitted with ``sbatch`` and watched
  with ``sacct``; Pipes context and messages travel through files on a shared filesystem.

Rank 0 of the payload reports through Pipes (``composer_dag.pipes.Reporter``); ``run`` returns
the last custom message it sent (its result summary) and forwards its logs to the Dagster run.
"""


import collections
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Literal, Optional

import dagster as dg
import psutil
from dagster._core.errors import DagsterExecutionInterruptedError
from dagster._core.pipes.utils import open_pipes_session

from composer_dag import launch
from resources.base import ClearConfigResource


class ClusterError(dg.Failure):
    pass


class ClusterResource(ClearConfigResource):
    backend: Literal["local", "k8s", "slurm"] = "local"
    launcher: Literal["torchrun", "deepspeed", "python"] = "torchrun"
    nproc_per_node: int = 1
    nnodes: int = 1
    gpus_per_node: int = 0
    env: dict[str, str] = {}
    # k8s
    image: Optional[str] = None
    namespace: str = "default"
    gpu_resource: str = "nvidia.com/gpu"
    service_account: Optional[str] = None
    cpu: Optional[str] = None
    memory: Optional[str] = None
    # slurm
    partition: Optional[str] = None
    account: Optional[str] = None
    time_limit: str = "04:00:00"
    shared_dir: Optional[str] = None
    poll_seconds: float = 10.0
    # all
    grace_seconds: float = 10.0

    # ---- specs -------------------------------------------------------------------------
    def spec(self, entry: str, args: list[str], name: str = "composer-train", launcher: str | None = None) -> launch.LaunchSpec:
        env = {**self.env}
        single = launcher == "python"  # an entry that must run as one process
        if self.gpus_per_node == 0 and self.backend == "local":
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

    def render(self, entry: str, args: list[str], name: str = "composer-train", launcher: str | None = None) -> Any:
        """What the backend would launch: an argv (local), a pod manifest (k8s), an sbatch script."""
        spec = self.spec(entry, args, name, launcher)
        if self.backend == "local":
            return launch.local_command(spec)
        if self.backend == "k8s":
            return launch.k8s_pod_spec(
                spec,
                namespace=self.namespace,
                image=self.image,
                gpu_resource=self.gpu_resource,
                service_account=self.service_account,
            )
        return launch.slurm_script(
            spec, partition=self.partition, nodes=self.nnodes, gpus_per_node=self.gpus_per_node,
            time=self.time_limit, account=self.account,
        )

    # ---- running -----------------------------------------------------------------------
    def run(
        self,
        context: dg.AssetExecutionContext | dg.OpExecutionContext,
        entry: str,
        args: list[str],
        extras: dict[str, Any] | None = None,
        name: str = "composer-train",
        launcher: str | None = None,
    ) -> dict[str, Any]:
        """Run ``entry`` on the cluster; return rank 0's result summary (its last custom message).

        ``launcher`` overrides the configured one for this entry (the RL run is one process that
        starts its own inference engine: ``python``).
        """
        run = {"local": self._run_local, "k8s": self._run_k8s, "slurm": self._run_slurm}[self.backend]
        session_messages = run(context, entry, args, extras, name, launcher)
        if not session_messages:
            raise ClusterError(description=f"{entry} finished without reporting a result through Pipes")
        return session_messages[-1]

    def _run_local(self, context, entry, args, extras, name, launcher) -> list[Any]:
        cmd = self.render(entry, args, name, launcher)
        spec = self.spec(entry, args, name, launcher)
        context.log.info(f"[cluster:local] {' '.join(cmd)}")
        with open_pipes_session(
            context=context,
            context_injector=dg.PipesTempFileContextInjector(),
            message_reader=dg.PipesTempFileMessageReader(),
            extras=extras,
        ) as session:
            env = {**os.environ, **spec.env, **session.get_bootstrap_env_vars()}
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
            if proc.returncode != 0:
                why = tail.error_line()
                raise ClusterError(
                    description=f"{entry} exited with code {proc.returncode}"
                    + (f": {why}" if why else "") + " (the whole output is in the run's stderr)"
                )
        return session.get_custom_messages()

    def _run_k8s(self, context, entry, args, extras, name, launcher) -> list[Any]:
        from dagster_k8s import PipesK8sClient

        manifest = self.render(entry, args, name, launcher)
        container = manifest["spec"]["containers"][0]
        invocation = PipesK8sClient().run(
            context=context,
            extras=extras,
            image=container["image"],
            command=container["command"],
            namespace=self.namespace,
            env={e["name"]: e["value"] for e in container["env"] if "value" in e},
            base_pod_meta=manifest["metadata"],
            base_pod_spec=manifest["spec"],
        )
        return invocation.get_custom_messages()

    def _run_slurm(self, context, entry, args, extras, name, launcher) -> list[Any]:
        if not self.shared_dir:
            raise ClusterError(description="slurm backend needs shared_dir: a directory every node can read and write")
        run_dir = os.path.join(self.shared_dir, context.run.run_id)
        os.makedirs(run_dir, exist_ok=True)
        ctx_path, msg_path = os.path.join(run_dir, "pipes_context.json"), os.path.join(run_dir, "pipes_messages.jsonl")
        with open_pipes_session(
            context=context,
            context_injector=dg.PipesFileContextInjector(ctx_path),
            message_reader=dg.PipesFileMessageReader(msg_path),
            extras=extras,
        ) as session:
            spec = self.spec(entry, args, name, launcher)
            exports = [f"export {k}='{v}'" for k, v in session.get_bootstrap_env_vars().items()]
            script = launch.slurm_script(
                spec, partition=self.partition, nodes=self.nnodes, gpus_per_node=self.gpus_per_node,
                time=self.time_limit, account=self.account, setup=exports,
            )
            path = os.path.join(run_dir, "job.sbatch")
            with open(path, "w") as f:
                f.write(script)
            out = subprocess.run(["sbatch", "--parsable", path], capture_output=True, text=True, check=True)
            job = launch.parse_sbatch_output(out.stdout)
            context.log.info(f"[cluster:slurm] submitted job {job}")
            try:
                while True:
                    time.sleep(self.poll_seconds)
                    acct = subprocess.run(
                        ["sacct", "-j", job, "-P", "-n", "-o", "JobID,State,ExitCode"], capture_output=True, text=True
                    ).stdout
                    state = launch.parse_sacct(acct).get(job, {}).get("state", "PENDING")
                    if launch.is_terminal(state):
                        break
            except (DagsterExecutionInterruptedError, KeyboardInterrupt):
                subprocess.run(["scancel", job], check=False)
                raise
            if state != "COMPLETED":
                raise ClusterError(description=f"slurm job {job} ended {state}")
        return session.get_custom_messages()


_ERROR_LINE = re.compile(  # "[rank0]: pkg.mod.SomeError: message" (torchrun prefixes rank output)
    r"^(?:\[rank\d+\]:\s*)?(?:[A-Za-z_][\w.]*\.)?([A-Za-z_]\w*(?:Error|Exception|Interrupt|Failure)): ?(.*)$")


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
        """``SomeError: message`` of the last exception printed (launcher wrappers such as
        torchrun's ChildFailedError skipped), or ''."""
        for line in reversed(self._lines):
            m = _ERROR_LINE.match(line.strip())
            if m and m.group(1) not in ("ChildFailedError", "KeyboardInterrupt"):
                return f"{m.group(1)}: {m.group(2)}"[:300].rstrip(": ")
        return ""


def stop_process_group(proc: subprocess.Popen, grace_seconds: float) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left after the grace period: the
    group and every descendant, since torchrun starts its workers in sessions of their own
    (a group kill alone would leave a worker that ignores SIGTERM running on)."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return
    tree = _descendants(proc.pid)
    for sig, wait in ((signal.SIGTERM, grace_seconds), (signal.SIGKILL, 5.0)):
        tree |= _descendants(proc.pid)
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass
        if sig == signal.SIGKILL:
            for p in tree:
                with contextlib.suppress(psutil.Error):
                    p.kill()
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if proc.poll() is not None and not _group_alive(pgid) and not _any_running(tree):
                return
            time.sleep(0.1)


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
        return True
    except ProcessLookupError:
        return False
