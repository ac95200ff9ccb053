"""cgroups of the sandboxes: a pids cgroup per sandbox (v1's hierarchy or cgroup v2's), the freezer
every episode's sandbox joins, and the machine's lock ``exclusive_runs`` holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

from composer_dag.sandbox.identity import lock_dir


SESSION_PIDS = 64  # room for the init and the laptop's session (43 processes) in a sandbox's pids cgroup
_PIDS: dict = {}


def _pids_root() -> Path | None:
    """Where this host lets us make pids cgroups (the v1 ``pids`` hierarchy, or the v2 root with
    the controller enabled for its children), or None; found once, clearing what dead processes left."""
    if "root" in _PIDS:
        return _PIDS["root"]
    root = None
    v2 = Path("/sys/fs/cgroup/cgroup.subtree_control")
    for cand in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup") if v2.exists() and "pids" in v2.read_text().split() else None):
        if cand is None or not os.access(cand, os.W_OK):
            continue
        probe = cand / f"cdag-{os.getpid()}-probe"
        try:
            probe.mkdir()
            ok = (probe / "pids.max").exists()
            probe.rmdir()
        except OSError:
            continue
        if ok:
            root = cand
            _clear_dead(cand)
            break
    _PIDS["root"], _PIDS["n"] = root, 0
    return root


def _pids_cgroup(max_processes: int, root: Path | None = None, state: dict | None = None) -> Path | None:
    """A new pids cgroup capped at ``max_processes`` (plus the session's room), under ``root``
    (the pids hierarchy's, by default), or None."""
    return _child_cgroup(root or _pids_root(), _PIDS if state is None else state,
                         {"pids.max": str(max_processes + SESSION_PIDS)})


def _child_cgroup(root: Path | None, state: dict, files: dict[str, str] | None = None) -> Path | None:
    """A new cgroup of this process's under ``root`` (``cdag-<pid>-<n>``) with ``files`` written, or None."""
    if root is None:
        return None
    state["n"] += 1
    cg = root / f"cdag-{os.getpid()}-{state['n']}"
    try:
        cg.mkdir()
        for name, value in (files or {}).items():
            (cg / name).write_text(value)
    except OSError:
        return None
    return cg


def _clear_dead(root: Path) -> None:
    """Remove the ``cdag-<pid>-*`` cgroups under ``root`` that processes which died left (once empty);
    never another name (under cgroup v2's root, the pids cgroups sit beside ``cdag-episodes``)."""
    for old in root.glob("cdag-*"):
        pid = old.name.split("-")[1]
        if not pid.isdigit() or os.path.exists(f"/proc/{pid}"):
            continue  # not a process's, or a live one's, maybe made a moment ago and still empty
        with contextlib.suppress(OSError):
            old.rmdir()


def _remove_cgroup(cg: Path) -> None:
    deadline = time.monotonic() + 2
    while True:
        try:
            cg.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # its last processes are still being reaped
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)


FREEZER = Path("/sys/fs/cgroup/freezer")  # the v1 freezer hierarchy
_FREEZER: dict = {}


def _cgroup2_mount() -> Path | None:
    """Where this host mounts cgroup v2 (``/sys/fs/cgroup`` on a v2-only host), or None."""
    with contextlib.suppress(OSError), open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 2 and parts[2] == "cgroup2":
                return Path(parts[1].replace("\\040", " "))
    return None


def _freezer_root() -> Path | None:
    """The freezer cgroup every episode's sandbox on this machine joins (``cdag-episodes``, shared
    by all processes): in the v1 freezer hierarchy, else in cgroup v2's (``cgroup.freeze``); None
    where the host has neither we may write. Found once, clearing what dead processes left."""
    if "root" in _FREEZER:
        return _FREEZER["root"]
    root = None
    for base, knob in ((FREEZER, "freezer.state"), (_cgroup2_mount(), "cgroup.freeze")):
        if base is None or not base.is_dir():
            continue
        try:
            (base / "cdag-episodes").mkdir(exist_ok=True)
            if (base / "cdag-episodes" / knob).exists():
                root = base / "cdag-episodes"
                _clear_dead(root)
                break
        except OSError:
            continue
    _FREEZER["root"], _FREEZER["n"] = root, 0
    return root


def _episode_cgroups(max_processes: int) -> tuple[Path | None, Path | None]:
    """An episode's sandbox's cgroups: (its pids cgroup, its freezer cgroup). Where both are cgroup
    v2's, one hierarchy in which a process has one cgroup, they are one: a pids cgroup under the
    freezer's (the controller enabled for ``cdag-episodes``' children), returned as the first."""
    root, pids = _freezer_root(), _pids_root()
    if root is not None and pids is not None and root.parent == pids and (root / "cgroup.freeze").exists():
        if "pids" not in _FREEZER:
            try:
                (root / "cgroup.subtree_control").write_text("+pids")
                _FREEZER["pids"] = True
            except OSError:
                _FREEZER["pids"] = False
        if _FREEZER["pids"]:
            return _pids_cgroup(max_processes, root, _FREEZER), None
    return _pids_cgroup(max_processes), _child_cgroup(root, _FREEZER)


def _set_frozen(root: Path, frozen: bool, timeout: float = 10.0) -> bool:
    """Freeze (or thaw) everything under ``root`` and wait until it is: v1's ``freezer.state``
    (FREEZING while tasks stop), or v2's ``cgroup.freeze`` and ``cgroup.events``."""
    v1 = (root / "freezer.state").exists()
    knob, want = ("freezer.state", "FROZEN" if frozen else "THAWED") if v1 else ("cgroup.freeze", "1" if frozen else "0")
    (root / knob).write_text(want)
    done = (lambda: (root / knob).read_text().strip() == want) if v1 else \
        (lambda: f"frozen {want}" in (root / "cgroup.events").read_text().splitlines())
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


@contextlib.contextmanager
def exclusive_runs(enabled: bool = True):
    """While the block runs, nothing else sandboxed runs on this machine: it waits for any other
    process's exclusive block (a lock of the machine's), and every episode's sandbox, this
    process's and every other's, is frozen (the freezer, v1's or cgroup v2's: its processes are
    stopped where they stand, background ones included, and cannot run, observe or relay
    anything until the block ends). Grading runs' own sandboxes (an identity's) are not. Yields what holds:
    {"frozen": bool, "waited_s": seconds spent waiting for the machine}. A frozen command's
    wall clock runs on: a long block can time out episodes' commands."""
    if not enabled:
        yield {"frozen": False, "waited_s": 0.0}
        return
    t0 = time.monotonic()
    with _machine_lock(exclusive=True):
        waited = time.monotonic() - t0
        root = _freezer_root()
        frozen = root is not None and _set_frozen(root, True)
        try:
            yield {"frozen": frozen, "waited_s": round(waited, 3)}
        finally:
            if root is not None:
                _set_frozen(root, False)


@contextlib.contextmanager
def _machine_lock(exclusive: bool):
    """The machine's lock between ``exclusive_runs`` (held alone) and episodes' sandbox starts
    (held shared, so that no start is frozen midway)."""
    fd = os.open(lock_dir() / "exclusive-runs", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)
