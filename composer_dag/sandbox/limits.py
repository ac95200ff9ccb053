"""Limits on a sandbox's commands: the rlimits, the disk cap's walk and its watches (during a
command, and between commands while what a command left runs), the signals that name a limit.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from composer_dag.sandbox.session import _end


@dataclass(frozen=True)
class Limits:
    timeout: float = 60.0  # wall clock, seconds; the whole process tree is killed
    cpu_seconds: int = 120  # RLIMIT_CPU per process
    memory_bytes: int = 4 << 30  # RLIMIT_AS per process
    max_processes: int = 2048  # per sandbox (a pids cgroup), or RLIMIT_NPROC (host uid 1000, shared) without one
    max_file_bytes: int = 256 << 20  # RLIMIT_FSIZE
    max_open_files: int = 1024  # RLIMIT_NOFILE
    max_output_bytes: int = 64 << 10  # kept per stream; the rest is counted and dropped
    max_tmp_bytes: int = 512 << 20  # size of each private tmpfs (/tmp, /var/tmp)
    max_disk_bytes: int = 2 << 30  # workspace + home + writable binds, on the host's disk
    max_disk_files: int = 200_000  # entries in the same trees
    max_disk_depth: int = 100  # directory levels in the same trees; deeper ones are removed



def _disk_watch(tool: Path, writable, L: Limits, start: tuple[int, int], every: float = 0.1):
    """A check for ``_pump``: "disk" once the trees grew past a cap (measured at most every
    ``every`` s, and no more than a tenth of the time). A writer overshoots by what it writes in
    one interval: page-cache writes of 1-2 GB/s, 100-200 MB here."""
    nxt = [time.monotonic() + every]

    def check() -> str | None:
        now = time.monotonic()
        if now < nxt[0]:
            return None
        size, files, deep = _disk_usage(tool, writable, L.max_disk_depth)
        nxt[0] = time.monotonic() + max(every, 10 * (time.monotonic() - now))
        over = (size > L.max_disk_bytes and size > start[0]) or (files > L.max_disk_files and files > start[1])
        over = over or bool(deep)
        return "disk" if over else None
    return check


def _idle_watch(live: dict, lock: threading.Lock, tool: Path, writable, L: Limits, start: tuple[int, int]) -> None:
    """Between commands, while processes a command left run: the disk cap holds for them too
    (growth past it ends the sandbox, as a kill during a command would end the command)."""
    check, gen = _disk_watch(tool, writable, L, start, every=0.25), live.get("gen")
    while live.get("gen") is gen:  # until this sandbox ends
        time.sleep(0.25)
        if not lock.acquire(blocking=False):
            continue  # a command runs: its own watch counts
        try:
            if live.get("gen") is gen and check() == "disk":
                _end(live)
        finally:
            lock.release()


def _laptop_nproc() -> int:
    """RLIMIT_NPROC as a laptop's kernel sets it for its first process: half of threads-max."""
    try:
        return int(Path("/proc/sys/kernel/threads-max").read_text()) // 2
    except (OSError, ValueError):
        return 63_704


_SIGNAL_REASON = {signal.SIGXCPU: "cpu", signal.SIGKILL: "cpu", signal.SIGXFSZ: "file_size"}



def entry_disk_bytes(p: Path) -> int:
    """What the disk cap counts for one entry, as ``_disk_usage`` does for every entry (the larger
    of its allocated and, for a regular file, its apparent size); 0 when it is not there: for a
    host-side writer that tells the sandbox what it changed (``Sandbox.touched``)."""
    try:
        st = os.lstat(p)
    except OSError:
        return 0
    return max(st.st_blocks * 512, st.st_size if stat.S_ISREG(st.st_mode) else 0)


def _disk_usage(tool: Path, roots, max_depth: int) -> tuple[int, int, list[str]]:
    """Bytes (per file the larger of allocated and apparent size) and entries under ``roots``,
    links not followed, and the directories nested deeper than ``max_depth`` levels or with an
    over-long path (not descended into): ``tool``, ``disk_usage.c`` built."""
    r = subprocess.run([str(tool), str(max_depth), *map(str, roots)],
                       capture_output=True, check=True)
    head, _, rest = r.stdout.partition(b"\n")
    size, n = map(int, head.split())
    return size, n, [os.fsdecode(p) for p in rest.split(b"\0")[:-1]]
