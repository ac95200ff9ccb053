"""Process sandbox that looks like a developer's laptop: bubblewrap + rlimits + a wall clock.

Layout seen from inside (``Persona`` defaults)::

    /usr, /bin, /lib*, /sbin      host system, read-only
    /usr/local                    the host's Python install (binary, stdlib, a curated
                                  site-packages with pytest and pip), read-only, laid out
                                  like the official python images (/usr/local/bin/python3)
    /etc                          a Debian laptop's /etc with the persona's users, host name,
                                  time zone and locale (``rootfs``)
    /home/sam                     private home (dotfiles, XDG directories, a shell history
                                  that fits the project), writable
    /home/sam/<project>           the workspace, read-write
    /tmp, /var/tmp                private tmpfs, each capped at ``Limits.max_tmp_bytes``, with
                                  the X11/ICE socket directories a desktop session has
    /run, /run/lock, /run/user/N  tmpfs, and the session's runtime directory (writable)
    /proc, /dev, /dev/shm, mqueue fresh, in a new pid namespace
    /sys                          the network namespace's own sysfs, read-only
    /usr/lib/systemd              the host's, with the laptop's init (``laptop_init.c``)

Processes: process 1 is the laptop's init (``/sbin/init``, named ``systemd``), with a booted
GNOME laptop's services and the user's session under it (``laptop_session``: about 45
sleeping processes, at pids a machine up a while has). One sandbox lives for the whole
episode, as a laptop's session does: it starts with the first command, and each command runs
as the user under a ``bash`` of the session's terminal, which the init serves over a control
socket only the host holds. The timeout, the rlimits, the disk cap and the output cap apply to
each command's process tree (its bash is a child subreaper: every orphan of the tree stays
under it, and a kill takes them all); what a command leaves running (a server it started in
the background) runs on until the episode's end, when the init exits and the kernel ends
everything in the namespace. A command returns when its process does, whatever it left
holding its output. ``stop()`` ends the sandbox (the next command starts a fresh one: home and
workspace as they were, /tmp empty, as after a reboot); the sandbox also ends if the session
is killed from inside, or if the host process that holds the control socket dies.

Namespaces: ipc, pid, uts (hostname), cgroup, and net: the sandbox's own network namespace
(``netns.Network``: loopback and a Wi-Fi-like interface with an address and a default route to
a router that never answers; nothing it sends reaches anything), made once per Sandbox; where namespaces cannot be made
(no CAP_NET_ADMIN), bwrap's empty one (loopback only). No user namespace:
bwrap runs as root on the host and the commands run as uid/gid 1000 (with the
installer's groups of a first user: cdrom, sudo, audio, ...) in the init's terminal, so files keep
their real owners (system files ``root``, the workspace
``sam``). Privileges: ``no_new_privs`` is unset, as in a laptop's session (bwrap is started with
``keep_privs.so`` preloaded, which turns its one call that sets it into nothing); every mount
bwrap makes is ``nosuid``, so no set-user-ID or set-group-ID binary and no file capability gains
anything, which is what the flag would have kept. Processes: each sandbox is a pids cgroup of its own, capped at
``Limits.max_processes`` (plus room for its session's 43), where the host lets root make one (the
v1 ``pids`` hierarchy, or cgroup v2's root with the controller on); the user's RLIMIT_NPROC is then
a laptop's (half of ``threads-max``). Without one, RLIMIT_NPROC is the cap; it counts every process
of host uid 1000, so it is shared by the sandboxes alive at the same time, and each holds 15 of
them for its session (``process_cap`` says which holds). The host needs ``/usr/lib/systemd`` (a directory: the init is bound
there; ``make system-deps`` makes it where it is missing).

Disk: the writable host trees (workspace, home, writable binds) live on the host's disk,
so their total is capped too. After each command their usage is measured (bytes, the
larger of allocated and apparent size, and entries, without following links: ``disk_usage.c``,
a walk in C, about 4x Python's); the next command's RLIMIT_FSIZE is lowered to what is left of
``Limits.max_disk_bytes`` (to 0 once over: files can be deleted, not grown). They are measured
before a command too where something else may have changed them since: the host (``touched()``,
which the edit tool calls) or processes an earlier command left running. While a command runs
the usage is measured again every 0.1 s or so: growth past ``max_disk_bytes`` or
``max_disk_files`` kills the tree (``killed_reason`` "disk"); between commands, while processes
a command left run, the same growth ends the sandbox. A command can overshoot by what it
writes in one interval; a directory nested deeper than ``max_disk_depth`` levels (or with a
path over 2,048 characters) also kills the command, and is removed after it: the host-side
tools and the grader walk, copy and delete these trees with recursive code and path-based calls.
The tmpfs mounts hold memory, not disk; their size caps keep them from eating the host's.
Memory is capped per process only (RLIMIT_AS), so the total is at most ``max_processes``
times ``memory_bytes``; a total cap needs a cgroup, which the deployment's pod provides.

The runtime image (system binds, /usr/local, /etc, the home skeleton) is built by
``rootfs``; the persona (user, host, time zone, locale, editor) is the caller's, for a task
``rootfs.task_persona(task)`` (its project's owner), the same in its episode and its grading.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import re
import selectors
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from composer_dag.sandbox import volumes
from composer_dag.sandbox.netns import Network
from composer_dag.sandbox.dressing import INIT_DIR, ROOT, Dressing

BWRAP = shutil.which("bwrap") or "/usr/bin/bwrap"
START_TIMEOUT = 30.0  # seconds for a sandbox's session to come up
KILL_GRACE = 2.0  # seconds a killed command's tree has to go before the whole sandbox is ended


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


@dataclass
class ExecResult:
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False
    seconds: float = 0.0
    killed_reason: str | None = None  # "timeout", "cpu", "file_size", "disk", "signal:N"


@dataclass(frozen=True)
class Bind:
    host: Path
    path: str  # inside
    writable: bool = False
    shared: bool = False  # an immutable tree many sandboxes bind (shown from an image of it)


# ---------------------------------------------------------------- bwrap arguments

def _base_args(d: Dressing) -> list[str]:
    """bwrap's namespaces, the dressing's read-only system, and the sandbox's own /proc, /dev and /run."""
    # no --die-with-parent (it follows the starting thread, and a sandbox outlives it): the
    # session ends when the host's end of the control socket closes, with the process holding it
    a = [BWRAP, "--unshare-ipc", "--unshare-pid", "--unshare-uts",
         "--unshare-cgroup-try", "--new-session", "--as-pid-1", "--hostname", d.hostname, *d.system]
    return a + ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/dev/shm", "--mqueue", "/dev/mqueue",
                "--perms", "0755", "--tmpfs", "/run", "--perms", "1777", "--size", str(5 << 20), "--tmpfs", "/run/lock",
                "--dir", "/run/user"]


def home_volume(limits: Limits, parent: Path | str | None = None) -> volumes.Volume | None:
    """A file system for a sandbox's ``/home`` (the caller makes the workspace in it, at
    ``<path>/<user>/<project>``, and passes it as ``Sandbox(volume=)``), sized past the disk cap
    so that the cap, not the file system, stops a writer; None where volumes are not available."""
    if not volumes.available():
        return None
    return volumes.Volume(2 * limits.max_disk_bytes + (256 << 20), limits.max_disk_files + 65536,
                          parent=str(parent) if parent else None)


def scratch(path: Path, limits: Limits) -> Path:
    """``path`` made as a scratch directory to bind writable at ``/var/tmp`` in place of the
    sandbox's own (mode 1777): a tmpfs of ``limits.max_tmp_bytes`` where the host makes file
    systems, so that the mount's root is its own. The caller unmounts it (``volumes.unmounting``)."""
    path.mkdir()
    if volumes.available():
        volumes.tmpfs(path, limits.max_tmp_bytes, 0o1777, 0, 0)
    else:
        os.chmod(path, 0o1777)
    return path


def volume_workspace(persona, project: str, limits: Limits, parent: Path | str,
                     src: Path | None = None) -> tuple[volumes.Volume | None, Path]:
    """A workspace for ``persona`` (anything with a ``user``: a ``Dressing``) in a sandbox, and the volume that holds it (pass both to ``Sandbox``): where the
    host makes file systems, ``<volume>/<user>/<project>`` in a new ``home_volume``, a plain
    directory of the home inside; elsewhere ``<parent>/<project>``. ``src`` is copied in (links
    kept) if given, else the directory is made empty."""
    vol = home_volume(limits, parent)
    ws = vol.path / persona.user / project if vol is not None else Path(parent) / project
    try:
        if src is not None:
            shutil.copytree(src, ws, symlinks=True)
        else:
            ws.mkdir(parents=True)
    except BaseException:
        if vol is not None:
            vol.close()
        raise
    return vol, ws


def _bwrap_env(preload: str | None) -> dict:
    """bubblewrap's environment: this process's, with the dressing's ``preload`` where we are
    root (the laptop's keeps ``no_new_privs`` unset; every mount bwrap makes is nosuid, which
    keeps what the flag would). The sandbox's own environment is set apart (``--clearenv``), so
    the preload goes no further than bubblewrap."""
    env = dict(os.environ)
    if preload and os.geteuid() == 0:
        env["LD_PRELOAD"] = " ".join(filter(None, [preload, env.get("LD_PRELOAD")]))
    return env


# ---------------------------------------------------------------- sandbox

def _release(tmp: Path, network: Network | None, live: dict, mounts: bool) -> None:
    _end(live)
    if mounts:  # the sandbox's own /home and /run/user (a caller's volume is the caller's to close)
        volumes.unmount_under(str(tmp))
    shutil.rmtree(tmp, ignore_errors=True)
    if network is not None:
        network.close()


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
    import fcntl

    fd = os.open(_lock_dir() / "exclusive-runs", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def _laptop_nproc() -> int:
    """RLIMIT_NPROC as a laptop's kernel sets it for its first process: half of threads-max."""
    try:
        return int(Path("/proc/sys/kernel/threads-max").read_text()) // 2
    except (OSError, ValueError):
        return 63_704


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


_SIGNAL_REASON = {signal.SIGXCPU: "cpu", signal.SIGKILL: "cpu", signal.SIGXFSZ: "file_size"}


def chown_tree(path: Path, uid: int = 1000, gid: int = 1000) -> None:
    """Give a host tree to the sandbox user (files the host writes later need it too)."""
    os.lchown(path, uid, gid)
    for root, dirs, files in os.walk(path):
        for n in dirs + files:
            os.lchown(os.path.join(root, n), uid, gid)


def share_tree(src: Path, dst: Path, uid: int = 1000, gid: int = 1000, skip: frozenset = frozenset()) -> None:
    """``dst`` as a working copy of the trusted tree ``src`` for a sandboxed run, at a fraction of
    a copy's cost: directories made and given to the sandbox user (``uid``); regular files this
    process owns that no one else may write (and no set-id bit) are hard links, so the sandbox
    user can replace or delete them but never write into them (nor into ``src`` through them);
    any other file is copied and given to the user; links are copied; names in ``skip`` are left
    out. Across
    filesystems every file is copied. The host must not write into ``dst``'s files in place
    (unlink, then write)."""
    src, dst = Path(src), Path(dst)
    me = os.geteuid()
    same_fs = None
    for d, dirs, files in os.walk(src):
        dirs[:] = [n for n in dirs if n not in skip]
        rel = Path(d).relative_to(src)
        t = dst / rel
        t.mkdir(exist_ok=rel != Path("."))
        os.chmod(t, os.stat(d).st_mode & 0o7777)
        os.lchown(t, uid, gid)
        if same_fs is None:
            same_fs = os.stat(d).st_dev == os.stat(t).st_dev
        for n in list(dirs) + files:
            if n in skip:
                continue
            s, f = os.path.join(d, n), t / n
            st = os.lstat(s)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(s), f)
                os.lchown(f, uid, gid)
                if n in dirs:
                    dirs.remove(n)
            elif n in files and stat.S_ISREG(st.st_mode):
                if same_fs and st.st_uid == me and not st.st_mode & (0o022 | stat.S_ISUID | stat.S_ISGID):
                    os.link(s, f)
                else:
                    shutil.copy2(s, f)
                    os.lchown(f, uid, gid)


IDENTITY_UIDS = tuple(range(1001, 1033))
"""The uids grading runs take (``identity_lease``): users after a laptop's first (1000, the
episodes'), one per live run, so that no two runs share a kernel object kept per user (the
user's keyrings, its process and inotify counts)."""


def _lock_dir() -> Path:
    for d in (Path(os.environ.get("COMPOSER_IDENTITY_LOCKS", "/run/lock/cdag-identities")),
              Path(tempfile.gettempdir()) / "cdag-identities"):
        try:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            return d
        except OSError:
            continue
    raise OSError("no directory for the identity locks")


def _uid_busy(uid: int) -> bool:
    """Whether a process of ``uid`` is alive (one a lock of another mount namespace let through)."""
    want = f"Uid:\t{uid}\t"
    for e in os.scandir("/proc"):
        if e.name.isdigit():
            try:
                with open(f"/proc/{e.name}/status") as f:
                    if any(line.startswith(want) for line in f):
                        return True
            except OSError:
                continue
    return False


@contextlib.contextmanager
def identity_lease(timeout: float = 600.0):
    """A uid of ``IDENTITY_UIDS`` that no other live run on this machine holds (a lock per uid,
    across processes), drawn at random, for as long as the block lasts. What a run of that uid
    left in the user's keyrings is cleared by the grader's runner before any code runs."""
    import fcntl
    import secrets

    locks, rng, deadline = _lock_dir(), secrets.SystemRandom(), time.monotonic() + timeout
    while True:
        for uid in rng.sample(IDENTITY_UIDS, len(IDENTITY_UIDS)):
            fd = os.open(locks / f"uid-{uid}", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                if _uid_busy(uid):
                    continue
                yield uid
                return
            finally:
                os.close(fd)  # releases the lock
        if time.monotonic() > deadline:
            raise TimeoutError(f"no free grading identity among {len(IDENTITY_UIDS)} in {timeout:.0f} s")
        time.sleep(0.05)


STALE_TEMP_S = 86400.0
"""A ``cdag-*`` temporary directory no write has touched for this long was left by a process
that was killed (SIGKILL, the OOM killer) before it could remove it: an episode lasts minutes."""
_TEMP_NAME = re.compile(r"cdag-[a-z]+-[a-z0-9_]{8}")  # tempfile.mkdtemp's names for the prefixes here
_swept: set[str] = set()


def sweep_stale_temporaries(root: str | None = None, max_age: float = STALE_TEMP_S, force: bool = False) -> list[str]:
    """Remove the temporary directories of sandboxes, episodes and gradings (``cdag-h-*``,
    ``cdag-w-*``, ``cdag-g-*``, ...) under ``root`` (the temporary directory) untouched for
    ``max_age`` seconds; once per process and root unless ``force``. Returns the names removed."""
    root = root or tempfile.gettempdir()
    if root in _swept and not force:
        return []
    _swept.add(root)
    gone, now = [], time.time()
    if volumes.available():
        gone += volumes.sweep_images()
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    for e in entries:
        try:
            if _TEMP_NAME.fullmatch(e.name) and e.is_dir(follow_symlinks=False) and \
                    now - e.stat(follow_symlinks=False).st_mtime > max_age:
                if volumes.available():  # a killed sandbox's /home and /run/user
                    volumes.unmount_under(e.path)
                shutil.rmtree(e.path, ignore_errors=True)
                gone.append(e.name)
        except OSError:
            continue
    return gone


class Sandbox:
    """Run commands with ``workspace`` mounted read-write at ``/home/<user>/<project>``.

    One bwrap serves every ``run`` until ``stop()`` or ``close()`` (the module's docstring); the
    home directory and the workspace persist across runs, and across stops, like a user's machine.
    ``masks`` hide paths inside (a host file bound over a file, or None: an empty dir).
    ``identity``: run as this uid (and gid) instead of the persona's, on the same laptop (its
    passwd and group say so): a grading run's own identity (``identity_lease``).
    """

    def __init__(self, workspace: Path, limits: Limits = Limits(), *, dressing: Dressing, project: str | None = None,
                 masks: dict[str, Path | None] | None = None, binds: list[Bind] = (), chown: bool = True,
                 identity: int | None = None, volume: volumes.Volume | None = None):
        self.workspace = Path(workspace).resolve()
        self.limits = limits
        self.dressing = d = dressing
        self.persona = d.persona
        self._kind = "grading" if identity is not None else "episode"
        self.project = project or self.workspace.name
        self.root = f"{d.home}/{self.project}"
        sweep_stale_temporaries()  # what killed processes left (once per process)
        self._dir = Path(tempfile.mkdtemp(prefix="cdag-h-"))
        self.network: Network | None = None
        try:
            self._mounts = volumes.available()
            if volume is None and self._mounts:
                volume = self._own_volume = home_volume(limits, self._dir)
            self._home = (volume.path / d.user) if volume is not None else self._dir / "home"
            # the workspace made in the volume, as a plain directory of the home (no mount of its own)
            inside = volume is not None and self.workspace.parent == self._home.resolve()
            self._make_home(inside)
            if chown:
                chown_tree(self.workspace, d.uid, d.gid)
            self._args = self._system() + self._private(binds) + list(d.mounts) + self._user_trees(volume, inside)
            for path, host in (masks or {}).items():
                self._args += ["--tmpfs", path] if host is None else ["--ro-bind", self._placed(Path(host), path), path]
            for b in binds:
                self._args += ["--bind", str(b.host), b.path] if b.writable else \
                    ["--ro-bind", self._placed(Path(b.host), b.path, b.shared), b.path]
            self._writable = ([volume.path] if volume is not None else [self._dir]) + ([] if inside else [self.workspace]) \
                + [Path(b.host) for b in binds if b.writable]
            self.env = dict(d.env)
            self._pids = d.command_pids(self.project) if d.command_pids else itertools.repeat(0)
            self._live: dict = {}  # the running sandbox: bwrap, the control socket, process 1's host pid
            self._lock = threading.Lock()  # one command at a time; the idle watch waits for it
            self._usage: tuple[int, int] | None = None  # (bytes, entries) after the last command
            self.process_cap: str | None = None  # how max_processes is held once started: "cgroup" or "rlimit"
        except BaseException:  # nothing left mounted or made
            if self.network is not None:
                self.network.close()
            _release(self._dir, None, {}, volumes.available())
            raise
        self._closer = weakref.finalize(self, _release, self._dir, self.network, self._live, self._mounts)

    def _system(self) -> list[str]:
        """The namespaces and the dressing's read-only system: its root image on a loop device of
        the sandbox's own, let go with it (the many machines leave no mounts behind), its overlays."""
        d = self.dressing
        a = _base_args(d)
        if ROOT in a:
            root = self._dir / "root"
            root.mkdir()
            volumes.mount_file(d.root_image, root)
            a[a.index(ROOT)] = str(root)
        for host, inside in d.overlays:
            a += ["--ro-bind", self._placed(host, inside), inside]
        return a

    def _private(self, binds) -> list[str]:
        """The network (its own namespace and sysfs, or bwrap's empty one) and the private /tmp, /var/tmp."""
        try:
            self.network = Network(self.dressing.network)
        except OSError:
            self.network = None
            a = ["--unshare-net"]
        else:
            # /sys's own mount points: the cgroup tree's, and debugfs and tracefs, root's alone
            a = ["--ro-bind", self.network.sysfs, "/sys", "--perms", "0755", "--size", "4096", "--tmpfs", "/sys/fs/cgroup",
                 "--perms", "0700", "--size", "4096", "--tmpfs", "/sys/kernel/debug",
                 "--perms", "0700", "--size", "4096", "--tmpfs", "/sys/kernel/tracing"]
        for tmp in ("/tmp", "/var/tmp"):
            if not any(b.path == tmp for b in binds):  # a caller's scratch (``scratch``) replaces it
                a += ["--perms", "1777", "--size", str(self.limits.max_tmp_bytes), "--tmpfs", tmp]
        return a

    def _user_trees(self, volume, inside: bool) -> list[str]:
        """The user's runtime directory (a tmpfs of the user's, mode 700, as logind makes it), home
        and workspace."""
        d = self.dressing
        run = self._dir / "run"
        run.mkdir(mode=0o700)
        if self._mounts:
            volumes.tmpfs(run, self.limits.max_tmp_bytes, 0o700, d.uid, d.gid)
        else:
            os.lchown(run, d.uid, d.gid)
        a = ["--bind", str(run), f"/run/user/{d.uid}"]
        if volume is None:
            return a + ["--bind", str(self._home), d.home, "--bind", str(self.workspace), self.root]
        a += ["--bind", str(volume.path), "/home"] + ([] if inside else ["--bind", str(self.workspace), self.root])
        if self.network is not None:  # a loop device's backing file shows in sysfs (loop/backing_file): hide the virtual disks
            a += ["--perms", "0755", "--size", "4096", "--tmpfs", "/sys/devices/virtual/block"]
        return a

    def close(self) -> None:
        self._closer()

    def _make_home(self, inside: bool) -> None:
        """The user's home: the dressing's skeleton, its history for the project, the user's own
        (the workspace in it, ``inside``, is given to the user or not by the caller's ``chown``)."""
        d = self.dressing
        self._home.mkdir(exist_ok=True)
        names = []
        if d.skel is not None:
            shutil.copytree(d.skel, self._home, symlinks=True, dirs_exist_ok=True)
            names = [e.name for e in os.scandir(d.skel)]
        (self._home / self.project).mkdir(exist_ok=True)
        if d.history is not None:
            files = sorted(e.name for e in os.scandir(self.workspace) if e.is_file() and not e.name.startswith("."))[:20]
            (self._home / ".bash_history").write_text(d.history(self.project, files))
            os.chmod(self._home / ".bash_history", 0o600)
            names.append(".bash_history")
        os.lchown(self._home, d.uid, d.gid)
        for name in names:
            chown_tree(self._home / name, d.uid, d.gid)
        if not inside:
            os.lchown(self._home / self.project, d.uid, d.gid)

    def _placed(self, host: Path, inside: str, shared: bool = False) -> str:
        """What to bind read-only at ``inside`` for the host tree ``host``, so that the mount's
        root names no host path: an immutable tree (``shared``: a repository's package layer, or
        one of the runtime's cache) from an image of it laid out at ``inside``; any other file
        or tree copied to ``inside`` in a tmpfs of the sandbox's own. ``host`` itself where the
        host makes no file systems."""
        if not self._mounts:
            return str(host)
        real = Path(os.path.realpath(host))
        d = self.dressing
        if real.is_dir() and d.image_at and (shared or any(real.is_relative_to(c) for c in d.immutable)):
            return f"{volumes.image(d.image_at(real, inside))}{inside}"
        over = self._dir / "over"
        if not over.exists():
            over.mkdir()
            volumes.tmpfs(over, self.limits.max_tmp_bytes, 0o755, 0, 0)
        dst = over / inside.lstrip("/")
        dst.parent.mkdir(parents=True, exist_ok=True)
        if real.is_dir():
            shutil.copytree(real, dst, symlinks=True)
        else:
            shutil.copy2(real, dst)
        return str(dst)

    def touched(self, delta: tuple[int, int] | None = None) -> None:
        """The host changed the writable trees (a tool's edit): by ``delta`` (bytes, entries, as
        the disk cap counts them) where the caller knows it, so that the next command takes the
        last command's measure plus it; otherwise the next command measures them before it starts."""
        if delta is None or self._usage is None:
            self._usage = None
        else:
            self._usage = (max(0, self._usage[0] + delta[0]), max(0, self._usage[1] + delta[1]))

    def stop(self) -> None:
        """End the running sandbox and everything in it; the next ``run`` starts a fresh one."""
        with self._lock:
            _end(self._live)

    @property
    def running(self) -> bool:
        return bool(self._live)

    def _start(self) -> None:
        """Start bwrap with the laptop's init as process 1 and wait for its terminal; an episode's
        sandbox not while ``exclusive_runs`` holds the machine (its start would be frozen midway)."""
        if self._kind != "episode" or _freezer_root() is None:
            return self._start_now()
        with _machine_lock(exclusive=False):
            self._start_now()

    def _start_now(self) -> None:
        host, inside = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        r_info, w_info = os.pipe()
        env = self.dressing.init(next(self._pids), inside.fileno())
        argv = self.network.enter() if self.network else []
        argv += self._args + ["--info-fd", str(w_info), "--chdir", "/", "--clearenv"]
        for k, v in dict(env, PATH=INIT_DIR).items():
            argv += ["--setenv", k, v]
        argv += ["--", "systemd"]  # found on PATH: /proc/1/cmdline becomes "/sbin/init"
        # an episode's sandbox (not a grading run's) in a freezer cgroup ``exclusive_runs`` freezes
        cg, fz = _episode_cgroups(self.limits.max_processes) if self._kind == "episode" else \
            (_pids_cgroup(self.limits.max_processes), None)
        procs = [str(c / "cgroup.procs") for c in (cg, fz) if c is not None]
        if procs:  # bwrap joins them before it forks anything
            argv = ["/bin/sh", "-c", 'for f in $CDAG_CGROUPS; do echo $$ > "$f" || exit 1; done; unset CDAG_CGROUPS; exec "$@"',
                    "sh", *argv]
        self.process_cap = "cgroup" if cg is not None else "rlimit"
        log = open(self._dir / "init.log", "wb")
        try:
            env = _bwrap_env(self.dressing.preload)
            if procs:
                env["CDAG_CGROUPS"] = " ".join(procs)
            proc = subprocess.Popen(argv, pass_fds=(w_info, inside.fileno()), stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=log, start_new_session=True, env=env)
        finally:
            os.close(w_info)
            inside.close()
            log.close()
        self._live.update(proc=proc, ctl=host, buf=bytearray(), gen=object(), cgroup=cg, freezer=fz)
        try:
            info = b""
            with os.fdopen(r_info, "rb") as f:  # bwrap writes it and closes it once process 1 runs
                info = f.read()
            with contextlib.suppress(ValueError):
                self._live["init"] = json.loads(info.decode() or "{}").get("child-pid")
            host.settimeout(START_TIMEOUT)
            ready = b""
            while not ready.endswith(b"R\n"):
                chunk = host.recv(64)
                if not chunk:
                    raise OSError("the session ended while starting")
                ready += chunk
            host.setblocking(False)
        except OSError as e:
            _end(self._live)
            why = (self._dir / "init.log").read_text(errors="replace").strip()[-2000:]
            raise RuntimeError(f"the sandbox did not start ({e}): {why or 'no output'}") from None

    def _send(self, fields: list[bytes], fds: list[int]) -> None:
        payload = b"\0".join(fields) + b"\0"
        ctl = self._live["ctl"]
        ctl.setblocking(True)
        try:
            ctl.sendmsg([struct.pack("I", len(payload))], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))] if fds else [])
            ctl.sendall(payload)
        finally:
            ctl.setblocking(False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def disk_usage(self) -> tuple[int, int]:
        """(bytes, entries) in the writable host trees: what the disk cap counts."""
        return _disk_usage(self.dressing.disk_usage, self._writable, self.limits.max_disk_depth)[:2]

    def _prune(self) -> tuple[int, int, bool]:
        """Measure the writable trees and remove what is nested too deep: (bytes, entries, pruned)."""
        size, files, deep = _disk_usage(self.dressing.disk_usage, self._writable, self.limits.max_disk_depth)
        if deep:
            subprocess.run(["rm", "-rf", "--one-file-system", "--", *deep], check=False)
            size, files, _ = _disk_usage(self.dressing.disk_usage, self._writable, self.limits.max_disk_depth)
        return size, files, bool(deep)

    def _request(self, cmd, cwd: str | None, env: dict | None, fsize: int) -> list[bytes]:
        L = self.limits
        wd = self.root if not cwd else (cwd if cwd.startswith("/") else f"{self.root}/{cwd}")
        envd = dict(self.env, PWD=wd, **(env or {}))
        argv = ["/bin/bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        env_list = [f"{k}={v}" for k, v in envd.items()]
        # with a pids cgroup capping the sandbox, the user's RLIMIT_NPROC is a laptop's (it counts
        # every process of host uid 1000, other sandboxes' sessions too); without one it is the cap
        nproc = _laptop_nproc() if self._live.get("cgroup") else L.max_processes
        fields = ["R", L.cpu_seconds, L.cpu_seconds + 1, L.memory_bytes, nproc, fsize, L.max_open_files, wd,
                  len(argv), *argv, len(env_list), *env_list]
        out = [str(f).encode() if not isinstance(f, str) else f.encode("utf-8", "surrogateescape") for f in fields]
        if any(b"\0" in f for f in out):
            raise ValueError("a command's arguments and environment cannot hold NUL bytes")
        return out

    def run(self, cmd: list[str] | str, timeout: float | None = None, stdin: str | bytes | None = None,
            *, cwd: str | None = None, env: dict | None = None) -> ExecResult:
        with self._lock:
            r, after = self._exec(cmd, timeout, stdin, cwd, env)
            live = self._live
            if live.get("left") and not live.get("watch"):  # the command left something running
                live["watch"] = threading.Thread(target=_idle_watch, daemon=True, name="sandbox-idle-watch",
                                                 args=(live, self._lock, self.dressing.disk_usage, self._writable, self.limits, after))
                live["watch"].start()
        return r

    def _exec(self, cmd, timeout, stdin, cwd, env) -> tuple[ExecResult, tuple[int, int]]:
        timeout = self.limits.timeout if timeout is None else timeout
        t0 = time.monotonic()
        if self._usage is None or not self._live or self._live.get("left"):
            used, files, _ = self._prune()
        else:  # as the last command left them: nothing has run in them since
            used, files = self._usage
        self._usage = None
        room = self.limits.max_disk_bytes - used if files <= self.limits.max_disk_files else 0
        fsize = max(0, min(self.limits.max_file_bytes, room))
        pipes = [os.pipe(), os.pipe()]
        r_in, w_in = os.pipe() if stdin is not None else (os.open(os.devnull, os.O_RDONLY), -1)
        try:
            for attempt in (0, 1):  # a sandbox ended from inside is started again, once
                if not self._live:
                    self._start()
                try:
                    self._send(self._request(cmd, cwd, env, fsize), [r_in, pipes[0][1], pipes[1][1]])
                    break
                except OSError:
                    _end(self._live)
                    if attempt:
                        raise
        except BaseException:
            for fd in (pipes[0][0], pipes[1][0], w_in):
                if fd >= 0:
                    os.close(fd)
            raise
        finally:
            for fd in (r_in, pipes[0][1], pipes[1][1]):
                os.close(fd)
        data = stdin.encode() if isinstance(stdin, str) else stdin
        out, err, done, stop, dropped = _pump(self._live, pipes[0][0], pipes[1][0], w_in, data, t0 + timeout,
                                              self.limits.max_output_bytes,
                                              _disk_watch(self.dressing.disk_usage, self._writable, self.limits, (used, files)))
        if done is None:  # the session ended (killed from inside, or the kill took too long)
            _end(self._live)
            status, cpu = None, 0.0
        else:
            status, cpu = done
        seconds = time.monotonic() - t0
        timed_out = stop == "timeout"
        reason = stop
        code = 128 + int(signal.SIGKILL) if status is None else os.waitstatus_to_exitcode(status)
        code = 128 - code if code < 0 else code
        if not stop and status is not None and code > 128 and code - 128 in (9, 24, 25):
            sig = signal.Signals(code - 128)
            # SIGKILL is the CPU limit's hard step only when the commands used that much CPU;
            # otherwise something killed them (``kill -9``, the kernel's OOM killer): a plain
            # signal death, as on any machine
            if sig != signal.SIGKILL or cpu >= self.limits.cpu_seconds:
                reason = _SIGNAL_REASON.get(sig)
        elif not stop and status is None:
            reason = "signal:9"
        used, files, pruned = self._prune()
        self._usage = (used, files)
        if pruned:
            reason = reason or "disk"
        code = 124 if timed_out else 128 + int(signal.SIGKILL) if stop else code
        return ExecResult(exit_code=code, stdout=_text(out, dropped[0]),
                          stderr=_text(err, dropped[1]), timed_out=timed_out, truncated=any(dropped),
                          seconds=seconds, killed_reason=reason), (used, files)


def _text(buf: bytes, dropped: int) -> str:
    s = buf.decode("utf-8", errors="replace")
    return s + f"\n[... {dropped} bytes truncated ...]" if dropped else s


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
                    try:
                        n = os.write(fd, view[:65536])
                    except (BrokenPipeError, BlockingIOError):
                        n = len(view)
                    view = view[n:]
                    if not view:
                        sel.unregister(fd)
                        os.close(w_in)
                        w_in = -1
                elif fd == ctl.fileno():
                    try:
                        chunk = ctl.recv(4096)
                    except BlockingIOError:
                        continue
                    if not chunk:  # the session is gone
                        gone = True
                        break
                    msgs += chunk
                    done = _take_done(live, msgs) or done
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


# ---------------------------------------------------------------- command line helper

def sandbox_exec(workspace_dir, cmd, limits: Limits = Limits(), *, dressing: Dressing) -> int:
    """Run ``cmd`` (list or shell string) in a sandbox on ``workspace_dir``; print its output."""
    with Sandbox(Path(workspace_dir), limits, dressing=dressing) as sb:
        r = sb.run(cmd)
    sys.stdout.write(r.stdout)
    sys.stderr.write(r.stderr)
    if r.timed_out:
        sys.stderr.write(f"\ntimed out after {r.seconds:.1f}s\n")
    return r.exit_code
