"""The ``local`` backend: supervised process groups on this machine (``LocalBackend``): a stage's
job as a process group (under bubblewrap when ``isolate``), services under the supervisor, an
array as a bounded process pool."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Optional

import psutil

from ...runtime import supervise
from ...runtime.errors import error_line
from ..spec import (ARRAY_INDEX_ENV, ArrayConfig, ArrayTask, Log, ServiceConfig, ServiceHandle, cache_dir, fill_address,
    free_port, job_argv, log_tail, track, untrack, wait_healthy, why_from_log)
from .base import Backend, Interrupts, register_backend


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


def run_process(cmd: list[str], env: dict | None, grace_seconds: float, log: Log,
                interrupts: Interrupts = (KeyboardInterrupt,)) -> tuple[int, str]:
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


# ---- the backend -------------------------------------------------------------------------
@register_backend
class LocalBackend(Backend):
    """This machine: its disk, its Python, its process pool."""

    name = "local"
    shares_disk = True
    runs_here = True

    def render(self, spec_url: str, name: str, env: dict[str, str], scratch: str) -> list[str]:
        return job_argv(self.cluster, spec_url, scratch, env, self.node_env)

    def launch(self, spec_url: str, name: str, env: dict[str, str],
               interrupts: Interrupts = (KeyboardInterrupt,)) -> tuple[Optional[str], Optional[str]]:
        scratch = self.scratch(name)
        os.makedirs(scratch)
        os.makedirs(cache_dir(self.cluster), exist_ok=True)
        try:
            cmd = self.render(spec_url, name, env, scratch)
            self.log(f"[cluster:local] {' '.join(cmd)}")
            rc, why = run_process(cmd, None if self.cluster.isolate else {**os.environ, **env},
                                  self.cluster.grace_seconds, self.log, interrupts)
        finally:
            subprocess.run(["rm", "-rf", scratch], check=False)
        return (None, None) if rc == 0 else (f"exited with code {rc}", why or None)

    def start(self, cfg: ServiceConfig, abort: Optional[threading.Event] = None) -> ServiceHandle:
        port = cfg.port or free_port()
        host = "127.0.0.1"
        os.makedirs(self.cluster.scratch_dir, exist_ok=True)
        log_path = os.path.join(self.cluster.scratch_dir, f"{cfg.name}-{uuid.uuid4().hex[:8]}.log")
        argv = [fill_address(a, host, port) for a in cfg.argv]
        env = {k: fill_address(v, host, port) for k, v in cfg.env.items()}
        proc = _popen_supervised(argv, env, log_path, self.cluster.grace_seconds)
        handle = ServiceHandle(cfg.name, self.name, host, port, f"http://{host}:{port}",
                               fill_address(cfg.health_url, host, port), pid=proc.pid, log=log_path, _backend=self)
        handle._proc = proc  # type: ignore[attr-defined]
        track(handle)
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
        untrack(handle)

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
                                            "" if rc == 0 else why_from_log(log_tail(log)), log)
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
