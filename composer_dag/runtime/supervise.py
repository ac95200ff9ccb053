"""Run a command that ends with whoever started it.

    python -m composer_dag.runtime.supervise --grace 10 -- ARGV...

The launcher starts this in a session of its own, so this process leads a process group that
holds ``ARGV`` and everything it spawns (vLLM's engine and workers, a pool's children). With
``PR_SET_PDEATHSIG`` it gets SIGTERM when its parent dies, however that parent ends (SIGKILL
included), and on SIGTERM, SIGINT or SIGHUP it stops the whole group: SIGTERM, then SIGKILL to
whatever is left after ``--grace`` seconds. It exits with ``ARGV``'s exit status.

The parent is the *thread* that started it (that is how Linux defines it): start services from
a thread that lives as long as they should.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
PARENT_ENV = "COMPOSER_SUPERVISOR_PARENT"


def command(argv: list[str], grace_s: float, python: str | None = None) -> list[str]:
    """``argv`` wrapped in this supervisor."""
    return [python or sys.executable, "-m", "composer_dag.runtime.supervise", "--grace", str(grace_s), "--", *argv]


def main(args: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if args is None else args)
    grace = 10.0
    if args[:1] == ["--grace"]:
        grace, args = float(args[1]), args[2:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("usage: python -m composer_dag.runtime.supervise [--grace S] -- ARGV...", file=sys.stderr)
        return 2
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    parent = os.environ.pop(PARENT_ENV, "")
    if parent and os.getppid() != int(parent):  # the parent died before prctl took effect
        return 1
    child = subprocess.Popen(args)
    asked: list[int] = []  # the signal handler only records; the loop below acts

    def on_signal(signum, frame) -> None:
        asked.append(signum)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)
    deadline = None
    while (rc := child.poll()) is None:
        if asked and deadline is None:
            for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(s, signal.SIG_IGN)
            os.killpg(0, signal.SIGTERM)
            deadline = time.monotonic() + grace
        if deadline is not None and time.monotonic() > deadline:
            os.killpg(0, signal.SIGKILL)  # what is left of the group, this process last
        time.sleep(0.05)
    # the command is done: nothing it started outlives it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.killpg(0, signal.SIGTERM)
    except ProcessLookupError:
        pass
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main())
