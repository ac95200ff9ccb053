"""A running sandbox's session: a command's result, the output pump between the command's pipes
and the control socket the init serves, and the end of a session.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import struct
import subprocess
import time
from dataclasses import dataclass

from composer_dag.sandbox.cgroups import _remove_cgroup


KILL_GRACE = 2.0  # seconds a killed command's tree has to go before the whole sandbox is ended


@dataclass
class ExecResult:
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False
    seconds: float = 0.0
    killed_reason: str | None = None  # "timeout", "cpu", "file_size", "disk", "signal:N"


def _end(live: dict) -> None:
    """End a running sandbox: SIGKILL its process 1 (the kernel then ends the rest of the
    namespace), close the control socket, reap bwrap."""
    proc, ctl, init, cg = live.pop("proc", None), live.pop("ctl", None), live.pop("init", None), live.pop("cgroup", None)
    fz = live.pop("freezer", None)
    live.clear()
    if proc is None:  # not running, or ended by another thread
        return
    if init:
        with contextlib.suppress(ProcessLookupError):
            os.kill(init, signal.SIGKILL)
    ctl.close()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for c in (cg, fz):
        if c is not None:
            _remove_cgroup(c)


def _text(buf: bytes, dropped: int) -> str:
    s = buf.decode("utf-8", errors="replace")
    return s + f"\n[... {dropped} bytes truncated ...]" if dropped else s


def _send_kill(ctl) -> bool:
    """Ask the session to kill the command's tree; False when the session is gone."""
    try:
        ctl.setblocking(True)
        ctl.sendall(struct.pack("I", 2) + b"K\0")
        return True
    except OSError:
        return False
    finally:
        ctl.setblocking(False)


def _take_done(live: dict, msgs: bytearray) -> tuple[int, float] | None:
    """The complete lines in ``msgs`` taken out of it: the command's (wait status, CPU seconds)
    where its shell said it returned ("D STATUS USER_US SYS_US LEFT"), else None."""
    done = None
    while b"\n" in msgs:
        line, _, rest = bytes(msgs).partition(b"\n")
        msgs[:] = rest
        parts = line.split()
        if parts[:1] == [b"D"] and len(parts) == 5:
            done = (int(parts[1]), (int(parts[2]) + int(parts[3])) / 1e6)
            live["left"] = live.get("left") or parts[4] == b"1"
    return done


def _feed(fd: int, view: memoryview) -> memoryview:
    """Write what the pipe takes of ``view``; what is left (nothing once the reader is gone)."""
    try:
        n = os.write(fd, view[:65536])
    except (BrokenPipeError, BlockingIOError):
        n = len(view)
    return view[n:]


def _read_ctl(live: dict, msgs: bytearray) -> tuple[tuple[int, float] | None, bool]:
    """What the session said on the control socket: (the command's result where its shell said it
    returned, whether the session is gone)."""
    try:
        chunk = live["ctl"].recv(4096)
    except BlockingIOError:
        return None, False
    if not chunk:
        return None, True
    msgs += chunk
    return _take_done(live, msgs), False


def _pump(live: dict, r_out: int, r_err: int, w_in: int, stdin: bytes | None, deadline: float, budget: int,
          watch=None):
    """Feed stdin, collect stdout/stderr up to ``budget`` bytes each, until the command's shell
    says it returned ("D ..." on the control socket), the deadline, or ``watch()`` names a reason
    to stop (then the command's tree is killed). Returns (stdout, stderr, (wait status, CPU
    seconds) or None if the session ended, stop reason or None, dropped bytes per stream)."""
    ctl = live["ctl"]
    sel = selectors.DefaultSelector()
    bufs = {r_out: bytearray(), r_err: bytearray()}
    dropped = {r_out: 0, r_err: 0}
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    sel.register(ctl, selectors.EVENT_READ)
    view = memoryview(stdin or b"")
    if w_in >= 0:
        os.set_blocking(w_in, False)
        sel.register(w_in, selectors.EVENT_WRITE)
    stop = done = killed_at = None
    gone = False
    msgs = live["buf"]

    def read_out(fd) -> bool:
        """Read what is there; False at end of file or when nothing is."""
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return False
        if not chunk:
            sel.unregister(fd)
            return False
        buf = bufs[fd]
        room = max(0, budget - len(buf))
        buf += chunk[:room]
        dropped[fd] += len(chunk) - min(room, len(chunk))
        return True

    try:
        while done is None and not gone:
            now = time.monotonic()
            if killed_at is not None and now > killed_at + KILL_GRACE:
                break  # the tree did not go: the caller ends the sandbox
            if stop is None:
                stop = "timeout" if now >= deadline else watch() if watch else None
                if stop:
                    killed_at = now
                    if not _send_kill(ctl):
                        break
                    continue
            wait = killed_at + KILL_GRACE - now if killed_at is not None else min(deadline - now, 0.1)
            for key, _ in sel.select(max(0.0, wait)):
                fd = key.fd
                if fd == w_in:
                    view = _feed(fd, view)
                    if not view:
                        sel.unregister(fd)
                        os.close(w_in)
                        w_in = -1
                elif fd == ctl.fileno():
                    got, gone = _read_ctl(live, msgs)
                    done = got or done
                    if gone:  # the session is gone
                        break
                else:
                    read_out(fd)
        # what the command wrote before it returned is in the pipes: take it, without waiting for
        # whatever it left running (and holding them)
        for fd in (r_out, r_err):
            while fd in sel.get_map() and read_out(fd):
                pass
    finally:
        sel.close()
        for fd in (r_out, r_err):
            os.close(fd)
        if w_in >= 0:
            os.close(w_in)
    return bytes(bufs[r_out]), bytes(bufs[r_err]), done, stop, [dropped[r_out], dropped[r_err]]
