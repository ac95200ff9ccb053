"""Process sandbox: bubblewrap + rlimits + a wall clock, showing the machine its caller's
``Dressing`` describes (``dressing.py``). This module holds a sandbox's lifetime and its
command line, made from the dressing's mount plan and the sandbox's own mounts.

Layout seen from inside, with the laptop's dressing (``laptop.desktop``, a default persona)::

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

The machine (root image, /usr/local, /etc, the home skeleton and history, the init and its
process tree, the environment, the desktop's mount points) is the caller's ``Dressing``; for a
task ``laptop.desktop.dressing(task_persona(task))``, the same in its episode and its grading.
"""


from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
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
from composer_dag.sandbox.cgroups import _episode_cgroups, _freezer_root, _machine_lock, _pids_cgroup
from composer_dag.sandbox.dressing import INIT_DIR, ROOT, Dressing
from composer_dag.sandbox.hygiene import sweep_stale_temporaries
from composer_dag.sandbox.identity import chown_tree
from composer_dag.sandbox.limits import _SIGNAL_REASON, Limits, _disk_usage, _disk_watch, _idle_watch, _laptop_nproc
from composer_dag.sandbox.netns import Network
from composer_dag.sandbox.session import ExecResult, _end, _pump, _text

BWRAP = shutil.which("bwrap") or "/usr/bin/bwrap"
START_TIMEOUT = 30.0  # seconds for a sandbox's session to come up




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
