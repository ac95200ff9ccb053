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
sleeping processes, at pids a machine up a while has); the command runs as the user in the
session's terminal, so ``ps`` and ``/proc`` read like a laptop's, and when it returns the init
exits and the kernel ends everything else in the namespace. Where the host has no
/usr/lib/systemd to bind the init at, the command itself is process 1.

Namespaces: ipc, pid, uts (hostname), cgroup, and net: the sandbox's own network namespace
(``netns.Network``: loopback and a Wi-Fi-like interface with an address and a default route to
a router that never answers; nothing it sends reaches anything), made once per Sandbox, so
that one episode's commands share it like a laptop's session; where namespaces cannot be made
(no CAP_NET_ADMIN), bwrap's empty one (loopback only). No user namespace:
bwrap runs as root on the host and the command then drops to uid/gid 1000 (with the
installer's groups of a first user: cdrom, sudo, audio, ...) in the init's terminal, so files keep
their real owners (system files ``root``, the workspace
``sam``) and RLIMIT_NPROC is enforced (it is not for root). RLIMIT_NPROC counts every
process of host uid 1000, so it is shared by sandboxes running at the same time (each
running command's session holds 15 of them); the default leaves room for many sandboxes and
still stops a fork bomb.

Disk: the writable host trees (workspace, home, writable binds) live on the host's disk,
so their total is capped too. Before each command their usage is measured (bytes, the
larger of allocated and apparent size, and entries, without following links); the
command's RLIMIT_FSIZE is lowered to what is left of ``Limits.max_disk_bytes`` (to 0 once
over: files can be deleted, not grown), and while it runs the usage is measured again
every 0.25 s or so: growth past ``max_disk_bytes`` or ``max_disk_files`` kills the tree
(``killed_reason`` "disk"). A command can overshoot by what it writes in one interval; a
directory nested deeper than ``max_disk_depth`` levels (or with a path over 2,048
characters) also kills the command, and is removed after it: the host-side tools and the
grader walk, copy and delete these trees with recursive code and path-based calls.
The tmpfs mounts hold memory, not disk; their size caps keep them from eating the host's.
Memory is capped per process only (RLIMIT_AS), so the total is at most ``max_processes``
times ``memory_bytes``; a total cap needs a cgroup, which the deployment's pod provides.

The runtime image (system binds, /usr/local, /etc, the home skeleton) is built by
``rootfs``; the persona (user, host, time zone, locale, editor) is the caller's, for a task
``rootfs.task_persona(task)`` (its project's owner), the same in its episode and its grading.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, replace
from pathlib import Path

from .netns import Network
from .laptop_session import INIT_DIR, init_env
from .rootfs import (PYVER, Persona, _libpython_binds, _system_binds, identity_runtime, persona_runtime, runtime,
                     shell_history)

BWRAP = shutil.which("bwrap") or "/usr/bin/bwrap"
PRLIMIT = shutil.which("prlimit") or "/usr/bin/prlimit"
HAS_INIT = Path(INIT_DIR).is_dir()  # where process 1 is bound; without it the command is process 1


@dataclass(frozen=True)
class Limits:
    timeout: float = 60.0  # wall clock, seconds; the whole process tree is killed
    cpu_seconds: int = 120  # RLIMIT_CPU per process
    memory_bytes: int = 4 << 30  # RLIMIT_AS per process
    max_processes: int = 2048  # RLIMIT_NPROC (host uid 1000, shared by live sandboxes)
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


# ---------------------------------------------------------------- bwrap arguments (computed once)

_BASE_ARGS: dict = {}


def _base_args(persona: Persona, prt: Path) -> list[str]:
    """bwrap arguments shared by every sandbox with this persona and runtime ``prt`` (computed once)."""
    if (persona, prt) in _BASE_ARGS:
        return _BASE_ARGS[(persona, prt)]
    rt = runtime()
    prefix = Path(sys.base_prefix)
    exe = prefix / "bin" / f"python{PYVER}"
    a = [BWRAP, "--unshare-ipc", "--unshare-pid", "--unshare-uts",
         "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--as-pid-1",
         "--hostname", persona.hostname]
    a += ["--ro-bind", str(prt / "root"), "/"] + _system_binds()
    a += ["--ro-bind", str(rt / "usr-local"), "/usr/local",
          "--ro-bind", str(prefix / "lib"), "/usr/local/lib",
          "--ro-bind", str(exe), f"/usr/local/bin/python{PYVER}",
          "--ro-bind", str(rt / "site-packages"), f"/usr/local/lib/python{PYVER}/site-packages"]
    a += _libpython_binds()
    if HAS_INIT:
        a += ["--ro-bind", str(rt / "systemd-lib"), INIT_DIR]
    a += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/dev/shm", "--mqueue", "/dev/mqueue",
          "--perms", "0755", "--tmpfs", "/run", "--perms", "1777", "--size", str(5 << 20), "--tmpfs", "/run/lock", "--dir", "/run/user"]
    # a laptop's other mount points, as its user sees them: /dev/hugepages empty, the EFI
    # partition root's alone (Debian mounts it umask=0077)
    a += ["--perms", "0755", "--size", "4096", "--tmpfs", "/dev/hugepages", "--perms", "0700", "--size", "4096",
          "--tmpfs", "/boot/efi"]
    _BASE_ARGS[(persona, prt)] = a
    return a


# ---------------------------------------------------------------- sandbox

def _release(tmp: Path, network: Network | None) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    if network is not None:
        network.close()


def _user_groups(persona: Persona, prt: Path) -> str:
    """The persona's supplementary group ids, from its /etc/group ("24,25,27,..."). They
    give nothing on the host: every host path inside is read-only and /dev holds no device
    of those groups."""
    etc = prt / "root" / "etc" / "group"
    gids = [x.split(":")[2] for x in etc.read_text().splitlines()
            if persona.user in x.split(":")[3].split(",") and x.split(":")[2] != str(persona.gid)]
    return ",".join(gids)


_SIGNAL_REASON = {signal.SIGXCPU: "cpu", signal.SIGKILL: "cpu", signal.SIGXFSZ: "file_size"}


def _reap(proc: subprocess.Popen, block: bool = False) -> int | None:
    """``proc.poll()`` (``proc.wait()`` with ``block``) that keeps, as ``proc.rusage``, the CPU
    time of the process and of every descendant it reaped (``wait4``)."""
    if proc.returncode is None:
        try:
            pid, status, usage = os.wait4(proc.pid, 0 if block else os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere: what Popen knows, without the CPU time
            return proc.wait() if block else proc.poll()
        if pid:
            proc.returncode, proc.rusage = os.waitstatus_to_exitcode(status), usage
    return proc.returncode


def chown_tree(path: Path, uid: int = 1000, gid: int = 1000) -> None:
    """Give a host tree to the sandbox user (files the host writes later need it too)."""
    os.lchown(path, uid, gid)
    for root, dirs, files in os.walk(path):
        for n in dirs + files:
            os.lchown(os.path.join(root, n), uid, gid)


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


class Sandbox:
    """Run commands with ``workspace`` mounted read-write at ``/home/<user>/<project>``.

    Each ``run`` is a fresh bwrap (processes do not outlive it); the home directory and
    the workspace persist across runs of one Sandbox, like a user's machine.
    ``masks`` hide paths inside (a host file bound over a file, or None: an empty dir).
    ``identity``: run as this uid (and gid) instead of the persona's, on the same laptop (its
    passwd and group say so): a grading run's own identity (``identity_lease``).
    """

    def __init__(self, workspace: Path, limits: Limits = Limits(), *, project: str | None = None,
                 persona: Persona = Persona(), masks: dict[str, Path | None] | None = None,
                 binds: list[Bind] = (), chown: bool = True, identity: int | None = None):
        self.workspace = Path(workspace).resolve()
        self.limits = limits
        base = persona
        prt = identity_runtime(base, identity) if identity is not None else persona_runtime(base)
        if identity is not None:
            persona = replace(base, uid=identity, gid=identity)
        self.persona = persona
        self.project = project or self.workspace.name
        self.root = f"{persona.home}/{self.project}"
        self._dir = Path(tempfile.mkdtemp(prefix="cdag-h-"))
        self._home, self._run = self._dir / "home", self._dir / "run"
        shutil.copytree(prt / "skel", self._home, symlinks=True)
        (self._home / self.project).mkdir(exist_ok=True)
        files = sorted(e.name for e in os.scandir(self.workspace) if e.is_file() and not e.name.startswith("."))[:20]
        (self._home / ".bash_history").write_text(shell_history(persona, self.project, files))
        os.chmod(self._home / ".bash_history", 0o600)
        self._run.mkdir(mode=0o700)
        chown_tree(self._dir, persona.uid, persona.gid)
        if chown:
            chown_tree(self.workspace, persona.uid, persona.gid)
        a = list(_base_args(base, prt))
        try:
            self.network: Network | None = Network(base)
        except OSError:
            self.network = None
            a.append("--unshare-net")
        else:
            # /sys's own mount points: the cgroup tree's, and debugfs and tracefs, root's alone
            a += ["--ro-bind", self.network.sysfs, "/sys", "--perms", "0755", "--size", "4096", "--tmpfs", "/sys/fs/cgroup",
                  "--perms", "0700", "--size", "4096", "--tmpfs", "/sys/kernel/debug",
                  "--perms", "0700", "--size", "4096", "--tmpfs", "/sys/kernel/tracing"]
        for tmp in ("/tmp", "/var/tmp"):
            a += ["--perms", "1777", "--size", str(limits.max_tmp_bytes), "--tmpfs", tmp]
        for d in (".ICE-unix", ".X11-unix", ".XIM-unix", ".font-unix"):
            a += ["--perms", "1777", "--dir", f"/tmp/{d}"]
        a += ["--bind", str(self._run), f"/run/user/{persona.uid}"]
        a += ["--bind", str(self._home), persona.home, "--bind", str(self.workspace), self.root]
        for path, host in (masks or {}).items():
            a += ["--tmpfs", path] if host is None else ["--ro-bind", str(host), path]
        for b in binds:
            a += ["--bind" if b.writable else "--ro-bind", str(b.host), b.path]
        self._args = a
        self._writable = [self._dir, self.workspace] + [Path(b.host) for b in binds if b.writable]
        p = persona
        self.env = {"HOME": p.home, "USER": p.user, "LOGNAME": p.user, "SHELL": "/bin/bash",
                    "PATH": f"{p.home}/.local/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    "LANG": p.locale, "TERM": "xterm-256color", "EDITOR": p.editor,
                    "XDG_RUNTIME_DIR": f"/run/user/{p.uid}", "XDG_SESSION_ID": str(p.session),
                    "XDG_SESSION_TYPE": "wayland", "XDG_SESSION_CLASS": "user", "XDG_CURRENT_DESKTOP": "GNOME",
                    "DBUS_SESSION_BUS_ADDRESS": f"unix:path=/run/user/{p.uid}/bus"}
        self._groups = _user_groups(persona, prt)
        self._etc = prt / "root" / "etc"
        self._pids = random.Random(f"{persona!r}:{self.project}")
        self._pid = 4000 + self._pids.randrange(20000)
        self._closer = weakref.finalize(self, _release, self._dir, self.network)

    def close(self) -> None:
        self._closer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def disk_usage(self) -> tuple[int, int]:
        """(bytes, entries) in the writable host trees: what the disk cap counts."""
        return _disk_usage(self._writable, self.limits.max_disk_depth)[:2]

    def _prune(self) -> tuple[int, int, bool]:
        """Measure the writable trees and remove what is nested too deep: (bytes, entries, pruned)."""
        size, files, deep = _disk_usage(self._writable, self.limits.max_disk_depth)
        if deep:
            subprocess.run(["rm", "-rf", "--one-file-system", "--", *deep], check=False)
            size, files, _ = _disk_usage(self._writable, self.limits.max_disk_depth)
        return size, files, bool(deep)

    def _disk_watch(self, start: tuple[int, int]):
        """A check for ``_pump``: "disk" once the trees grew past a cap (measured at most every
        0.25 s, and no more than a tenth of the time)."""
        L, nxt = self.limits, [time.monotonic() + 0.25]

        def check() -> str | None:
            now = time.monotonic()
            if now < nxt[0]:
                return None
            size, files, deep = _disk_usage(self._writable, L.max_disk_depth)
            nxt[0] = time.monotonic() + max(0.25, 10 * (time.monotonic() - now))
            over = (size > L.max_disk_bytes and size > start[0]) or (files > L.max_disk_files and files > start[1])
            over = over or bool(deep)
            return "disk" if over else None
        return check

    def _argv(self, cmd, cwd: str | None, env: dict | None, info_fd: int, fsize: int) -> list[str]:
        L = self.limits
        wd = self.root if not cwd else (cwd if cwd.startswith("/") else f"{self.root}/{cwd}")
        envd = dict(self.env, PWD=wd, **(env or {}))
        argv = self.network.enter() if self.network else []
        argv += [PRLIMIT, f"--cpu={L.cpu_seconds}:{L.cpu_seconds + 1}", f"--as={L.memory_bytes}",
                f"--nproc={L.max_processes}", f"--fsize={fsize}",
                f"--nofile={L.max_open_files}", "--core=0", "--"]
        argv += self._args + ["--info-fd", str(info_fd), "--chdir", wd, "--clearenv"]
        command = ["/bin/bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        if HAS_INIT:  # process 1 is the laptop's init; the command runs in its terminal, as the user
            self._pid = self._pid + 3 + self._pids.randrange(60) if self._pid < 30000 else 2000
            envd.update(init_env(self.persona, self._etc, self._groups, command, self._pid),
                        LAPTOP_INIT_PATH=envd["PATH"], PATH=INIT_DIR)
        for k, v in envd.items():
            argv += ["--setenv", k, v]
        if HAS_INIT:
            return argv + ["--", "systemd"]  # found on PATH: /proc/1/cmdline becomes "/sbin/init"
        argv += ["--", "/usr/bin/setpriv", f"--reuid={self.persona.uid}", f"--regid={self.persona.gid}",
                 f"--groups={self._groups}" if self._groups else "--clear-groups", "--"]
        return argv + command

    def run(self, cmd: list[str] | str, timeout: float | None = None, stdin: str | bytes | None = None,
            *, cwd: str | None = None, env: dict | None = None) -> ExecResult:
        timeout = self.limits.timeout if timeout is None else timeout
        t0 = time.monotonic()
        used, files, _ = self._prune()
        room = self.limits.max_disk_bytes - used if files <= self.limits.max_disk_files else 0
        fsize = max(0, min(self.limits.max_file_bytes, room))
        r_info, w_info = os.pipe()
        try:
            proc = subprocess.Popen(self._argv(cmd, cwd, env, w_info, fsize), pass_fds=(w_info,),
                                    stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        finally:
            os.close(w_info)
        data = stdin.encode() if isinstance(stdin, str) else stdin
        out, err, info, stop, dropped = _pump(proc, data, r_info, t0 + timeout, self.limits.max_output_bytes,
                                              self._disk_watch((used, files)))
        if stop:
            _kill(proc, info)
        code = _reap(proc, block=True)
        usage = getattr(proc, "rusage", None)
        seconds = time.monotonic() - t0
        timed_out = stop == "timeout"
        reason = stop
        if not stop and code > 128 and code - 128 in (9, 24, 25):
            sig = signal.Signals(code - 128)
            # SIGKILL is the CPU limit's hard step only when the commands used that much CPU;
            # otherwise something killed them (``kill -9``, the kernel's OOM killer): a plain
            # signal death, as on any machine
            if sig != signal.SIGKILL or usage is None or usage.ru_utime + usage.ru_stime >= self.limits.cpu_seconds:
                reason = _SIGNAL_REASON.get(sig)
        elif not stop and code < 0:
            reason = f"signal:{-code}"
        if self._prune()[2]:
            reason = reason or "disk"
        code = 124 if timed_out else 128 + int(signal.SIGKILL) if stop else code
        return ExecResult(exit_code=code, stdout=_text(out, dropped[0]),
                          stderr=_text(err, dropped[1]), timed_out=timed_out, truncated=any(dropped),
                          seconds=seconds, killed_reason=reason)


def _text(buf: bytes, dropped: int) -> str:
    s = buf.decode("utf-8", errors="replace")
    return s + f"\n[... {dropped} bytes truncated ...]" if dropped else s


def _disk_usage(roots, max_depth: int) -> tuple[int, int, list[str]]:
    """Bytes (per file the larger of allocated and apparent size) and entries under ``roots``,
    links not followed, and the directories nested deeper than ``max_depth`` levels or with an
    over-long path (not descended into)."""
    size = n = 0
    deep = []
    todo = [(str(r), 0) for r in roots]
    while todo:
        d, depth = todo.pop()
        try:
            it = os.scandir(d)
        except OSError:
            continue
        with it:
            for e in it:
                n += 1
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                size += max(st.st_blocks * 512, st.st_size if stat.S_ISREG(st.st_mode) else 0)
                if stat.S_ISDIR(st.st_mode):
                    if depth >= max_depth or len(e.path) > 2048:
                        deep.append(e.path)
                    else:
                        todo.append((e.path, depth + 1))
    return size, n, deep


def _pump(proc, stdin: bytes | None, r_info: int, deadline: float, budget: int, watch=None):
    """Feed stdin, collect stdout/stderr up to ``budget`` bytes each, until exit, deadline or
    ``watch()`` names a reason to stop; returns the stop reason ("timeout", ...) or None."""
    sel = selectors.DefaultSelector()
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray(), r_info: bytearray()}
    dropped = {proc.stdout.fileno(): 0, proc.stderr.fileno(): 0}
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    view = memoryview(stdin or b"")
    fin = proc.stdin.fileno() if stdin is not None else -1
    if stdin is not None:
        os.set_blocking(fin, False)
        sel.register(fin, selectors.EVENT_WRITE)
    stop = None
    try:
        while len(sel.get_map()) > (0 if _reap(proc) is None else 1 if r_info in sel.get_map() else 0):
            left = deadline - time.monotonic()
            if left <= 0:
                stop = "timeout"
                break
            if watch and (stop := watch()):
                break
            for key, _ in sel.select(min(left, 0.25)):
                fd = key.fd
                if fd == fin:
                    try:
                        n = os.write(fd, view[:65536])
                    except (BrokenPipeError, BlockingIOError):
                        n = len(view)
                    view = view[n:]
                    if not view:
                        sel.unregister(fd)
                        proc.stdin.close()
                    continue
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(fd)
                    continue
                buf = bufs[fd]
                if fd == r_info:
                    buf += chunk
                    continue
                room = max(0, budget - len(buf))
                buf += chunk[:room]
                dropped[fd] += len(chunk) - min(room, len(chunk))
        if not stop:
            while _reap(proc) is None:  # pipes closed but the tree is still running
                if time.monotonic() >= deadline:
                    stop = "timeout"
                    break
                if watch and (stop := watch()):
                    break
                time.sleep(0.002)
    finally:
        sel.close()
        with contextlib.suppress(OSError):
            bufs[r_info] += os.read(r_info, 65536)
        os.close(r_info)
        proc.stdout.close()
        proc.stderr.close()
    info = {}
    with contextlib.suppress(ValueError):
        info = json.loads(bytes(bufs[r_info]).decode() or "{}")
    fo, fe = list(dropped)
    return bytes(bufs[fo]), bytes(bufs[fe]), info, stop, [dropped[fo], dropped[fe]]


def _kill(proc, info: dict) -> None:
    """SIGKILL the pid-1 of the sandbox's pid namespace (the kernel then kills the rest) and bwrap."""
    pid = info.get("child-pid")
    if pid:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)

# ---------------------------------------------------------------- command line helper

def sandbox_exec(workspace_dir, cmd, limits: Limits = Limits()) -> int:
    """Run ``cmd`` (list or shell string) in a sandbox on ``workspace_dir``; print its output."""
    with Sandbox(Path(workspace_dir), limits) as sb:
        r = sb.run(cmd)
    sys.stdout.write(r.stdout)
    sys.stderr.write(r.stderr)
    if r.timed_out:
        sys.stderr.write(f"\ntimed out after {r.seconds:.1f}s\n")
    return r.exit_code
