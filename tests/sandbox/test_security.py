"""The sandbox, attacked: escape and abuse attempts run as real commands through an Episode's
tools (the path a policy acts through), each contained, reported, and leaving the host as it was.

Every test runs under ``host_guard``: afterwards no process of that test's sandboxes is left
(found by a tag in their environment or command line), the host canary files and a few system
files are unchanged, the host loopback server still answers, and the episode's host
directories are gone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from composer_dag.laptop import image as rootfs
from composer_dag.sandbox import Limits, cgroups, limits
from composer_dag.harness.episode import MAX_TOOL_FILE_BYTES, Episode, EpisodeConfig

REPO = Path(__file__).resolve().parents[2]
TAG_VAR = "CDAG_PROBE_TAG"


# ---------------------------------------------------------------- fixtures and helpers

@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Path:
    """A small task: a module with a bug, its visible test, a hidden test, the reference fix."""
    d = tmp_path_factory.mktemp("task")
    (d / "repo" / "tests").mkdir(parents=True)
    (d / "hidden_tests").mkdir()
    (d / "reference" / "files").mkdir(parents=True)
    (d / "task.json").write_text(json.dumps({
        "id": "calc-add", "project": "calc", "instructions": "Fix add() in calc.py.",
        "limits": {"max_turns": 50, "command_timeout": 20, "test_timeout": 20}}))
    (d / "repo" / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (d / "repo" / "tests" / "test_calc.py").write_text(
        "from calc import add\n\n\ndef test_zero():\n    assert add(0, 0) == 0\n")
    (d / "hidden_tests" / "test_hidden.py").write_text(
        "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n")
    (d / "reference" / "files" / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    return d


class LoopbackServer:
    """A host TCP server on 127.0.0.1 and a host abstract unix socket; counts connections."""

    def __init__(self):
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.port = self.tcp.getsockname()[1]
        self.abstract = "cdag-probe-" + uuid.uuid4().hex[:8]
        self.unix = socket.socket(socket.AF_UNIX)
        self.unix.bind("\0" + self.abstract)
        self.unix.listen()
        self.accepted = {"tcp": 0, "unix": 0}
        for kind, s in (("tcp", self.tcp), ("unix", self.unix)):
            threading.Thread(target=self._serve, args=(kind, s), daemon=True).start()

    def _serve(self, kind, s):
        while True:
            try:
                c, _ = s.accept()
            except OSError:
                return
            self.accepted[kind] += 1
            with c, contextlib.suppress(OSError):  # a client that hung up does not stop the server
                c.sendall(b"pong")

    def ping(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as c:
            ok = c.recv(4) == b"pong"
        with socket.socket(socket.AF_UNIX) as u:
            u.settimeout(5)
            u.connect("\0" + self.abstract)
            return ok and u.recv(4) == b"pong"

    def close(self):
        self.tcp.close()
        self.unix.close()


@pytest.fixture(scope="module")
def server():
    s = LoopbackServer()
    yield s
    s.close()


@pytest.fixture(scope="module")
def canary(tmp_path_factory) -> Path:
    """A host directory outside every workspace, holding a file the sandbox must not touch."""
    d = tmp_path_factory.mktemp("host-canary")
    (d / "canary.txt").write_text("host-only canary " + uuid.uuid4().hex + "\n")
    return d


def _digest(p: Path):
    try:
        st = p.stat()
        return st.st_size, st.st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest()
    except OSError as e:
        return type(e).__name__


def _uid(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def tagged_processes(tag: str) -> list[tuple[int, bytes]]:
    """(pid, command line) of the host processes whose command line or environment carries
    ``tag``: bwrap, prlimit and everything inside the sandbox."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if tag.encode() in cmdline or tag.encode() in Path(f"/proc/{pid}/environ").read_bytes():
                found.append((int(pid), cmdline))
        except OSError:
            continue
    return found


@pytest.fixture
def host_guard(server, canary):
    """Opens tagged episodes; checks the host is as it was once the test is done."""
    tag = uuid.uuid4().hex
    watched = [canary / "canary.txt", Path("/etc/passwd"), Path("/etc/hostname"), Path("/etc/hosts"),
               REPO / "README.md", REPO / "pyproject.toml"]
    before = {p: _digest(p) for p in watched}
    opened: list[Episode] = []

    def open_episode(task_dir, limits: Limits = Limits(), **config) -> Episode:
        ep = Episode(task_dir, EpisodeConfig(**config), limits=limits)
        ep.sandbox.env[TAG_VAR] = tag
        opened.append(ep)
        return ep

    open_episode.tag = tag
    yield open_episode
    for ep in opened:
        ep.close()
    time.sleep(0.1)
    assert tagged_processes(tag) == [], "sandbox processes outlived their episode"
    assert {p: _digest(p) for p in watched} == before, "host files changed"
    assert server.ping(), "the host loopback services stopped answering"
    for ep in opened:
        assert not ep._tmp.exists() and not ep.sandbox._home.exists(), "episode directories left behind"
        net = ep.sandbox.network
        assert net is None or not os.path.exists(f"/run/netns/{net.name}"), "network namespace left behind"
        assert net is None or not os.path.exists(net.sysfs), "the namespace's sysfs left mounted"


def term(ep: Episode, command: str) -> tuple[str, dict]:
    """Run a command through the terminal tool; return the observation and its log entry."""
    obs = ep.step({"name": "run_terminal_cmd", "arguments": {"command": command}})
    assert not obs.is_error, obs.content
    return obs.content, ep.log[-1]


def tool(ep: Episode, name: str, **args):
    return ep.step({"name": name, "arguments": args})


# ---------------------------------------------------------------- network

def test_network_host_loopback_outside_and_dns_unreachable(task, host_guard, server):
    """Network namespace: the host's loopback TCP server and abstract unix socket, the host's own
    addresses (TCP and UDP), an outside address and DNS are all unreachable: the sandbox's Wi-Fi
    has a default route to a router that never answers, and its far end is in a namespace with
    no address, no route and no forwarding. The host's listeners never see a packet."""
    ep = host_guard(task)
    host_ips = [a for a in subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
                if "." in a and not a.startswith("127.")]
    tcp_any = socket.create_server(("0.0.0.0", 0))
    udp_any = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp_any.bind(("0.0.0.0", 0))
    udp_any.setblocking(False)
    tcp_any.setblocking(False)
    probe = f"""
import json, socket
from concurrent.futures import ThreadPoolExecutor
def tcp(addr):
    try:
        socket.create_connection(addr, timeout=4).close()
        return "connected"
    except OSError as e:
        return type(e).__name__
def udp(addr):
    try:
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", addr)
        return "sent"
    except OSError as e:
        return type(e).__name__
def unix():
    try:
        socket.socket(socket.AF_UNIX).connect("\\0{server.abstract}")
        return "connected"
    except OSError as e:
        return type(e).__name__
def dns():
    try:
        return str(socket.getaddrinfo("example.com", 443)[0][4])
    except OSError as e:
        return type(e).__name__
hosts = {host_ips!r}
with ThreadPoolExecutor(8) as ex:
    out = {{"host_lo": ex.submit(tcp, ("127.0.0.1", {server.port})), "outside": ex.submit(tcp, ("1.1.1.1", 443)),
           "dns": ex.submit(dns), "abstract": ex.submit(unix)}}
    for h in hosts:
        out["host_tcp_" + h] = ex.submit(tcp, (h, {tcp_any.getsockname()[1]}))
        out["host_udp_" + h] = ex.submit(udp, (h, {udp_any.getsockname()[1]}))
    out["udp"] = ex.submit(udp, ("8.8.8.8", 53))
    print(json.dumps({{k: f.result() for k, f in out.items()}}))
"""
    (ep.workspace / "probe.py").write_text(probe)
    before = dict(server.accepted)
    out, entry = term(ep, "python3 probe.py")
    assert entry["exit_code"] == 0, out
    res = json.loads(out.splitlines()[-1])
    unreachable = {"TimeoutError", "OSError"}  # the router never answers: a timeout or "No route to host"
    assert res["host_lo"] == "ConnectionRefusedError" and res["abstract"] == "ConnectionRefusedError", res
    assert res["outside"] in unreachable and res["dns"] == "gaierror" and res["udp"] == "sent", res
    for h in host_ips:
        assert res["host_tcp_" + h] in unreachable and res["host_udp_" + h] == "sent", res
    assert server.accepted == before
    with pytest.raises(BlockingIOError):
        tcp_any.accept()
    with pytest.raises(BlockingIOError):
        udp_any.recvfrom(16)
    tcp_any.close(), udp_any.close()
    # where the packets went: the far end's namespace has no address, no route, no forwarding
    void = ep.sandbox.network and "cdag-void"
    assert void, "the sandbox has no network namespace of its own"
    ip = lambda *a: subprocess.run(["ip", "-n", void, *a], capture_output=True, text=True, check=True).stdout
    assert "inet" not in ip("addr") and ip("route").strip() == "" and ip("-6", "route").strip() == ""
    fwd = subprocess.run(["ip", "netns", "exec", void, "cat", "/proc/sys/net/ipv4/ip_forward"],
                         capture_output=True, text=True).stdout.strip()
    assert fwd == "0"


# ---------------------------------------------------------------- file system

def test_filesystem_outside_the_workspace(task, host_guard, canary):
    """Read-only system binds, a private root (no host /root, /work, repo or host /tmp), a
    read-only /sys of the sandbox's own network namespace, a laptop's /dev whose device nodes
    cannot be opened, no hard links across mounts, no write through a user namespace; a symlink planted inside and
    pointing at a host file is neither readable inside nor followed by the host-side file tools."""
    ep = host_guard(task)
    host_file = canary / "canary.txt"
    targets = ["/etc/probe", "/usr/probe", "/usr/local/probe", "/root/probe", f"{REPO}/probe", "/work/probe",
               f"{canary}/probe", "/proc/1/root/etc/probe", "/sbin/probe"]
    cmd = "; ".join(f"(echo x > {t}) 2>/dev/null && echo WROTE {t} || echo denied {t}" for t in targets)
    cmd += "; " + "; ".join(f"ls -d {p} >/dev/null 2>&1 && echo SEEN {p} || echo absent {p}"
                            for p in (REPO / "README.md", host_file, "/work", "/root/.cache",
                                      f"/proc/1/root{host_file}"))
    cmd += (f"; ln /etc/hostname hard 2>&1 | grep -q 'cross-device' && echo no-hardlink"
            f"; ln -s {host_file} leak; cat leak >/dev/null 2>&1 && echo SEEN-leak || echo absent-leak"
            "; unshare -r sh -c 'echo x >> /etc/passwd' 2>/dev/null && echo WROTE-userns || echo denied-userns"
            "; unshare -rm sh -c 'mount -o remount,rw /usr && echo x > /usr/probe' 2>/dev/null"
            " && echo WROTE-remount || echo denied-remount"
            # /sys: the network namespace's own, read-only (its interfaces, not the host's)
            "; (echo 1 > /sys/kernel/mm/ksm/run) 2>/dev/null && echo WROTE-sys || echo denied-sys"
            "; echo NETS $(ls /sys/class/net) END"
            # /dev lists a laptop's devices; none opens (a nodev tmpfs), whatever its mode says
            "; for d in kmsg nvme0n1 video0 fuse dri/renderD128 snd/pcmC0D0p input/event0 mem; do"
            " head -c1 /dev/$d >/dev/null 2>&1 && echo OPENED-$d; { : > /dev/$d; } 2>/dev/null && echo OPENED-w-$d; done"
            "; echo DEVS $(ls -A /dev | wc -l) $(stat -c %F /dev/nvme0n1 /dev/kmsg | tr ' ' _) END")
    out, entry = term(ep, cmd)
    assert "WROTE" not in out and "SEEN" not in out, out
    assert out.count("denied") == len(targets) + 3 and out.count("absent") == 6, out
    assert "OPENED" not in out, out
    devs = out.split("DEVS")[1].split("END")[0].split()
    assert int(devs[0]) >= 150 and devs[1:] == ["block_special_file", "character_special_file"], devs
    nets = out.split("NETS")[1].split("END")[0].split()
    assert nets == sorted(["lo", ep.sandbox.network.wifi.interface]), nets
    assert "no-hardlink" in out
    for t in targets:
        assert not os.path.exists(t.replace("/proc/1/root", "")), t
    # the host-side tools: the planted link is refused by read/edit and not followed by list_dir
    obs = tool(ep, "read_file", path="leak")
    assert obs.is_error and "outside the project" in obs.content
    obs = tool(ep, "edit_file", path="leak", old="host", new="pwned")
    assert obs.is_error and "outside the project" in obs.content
    listing = tool(ep, "list_dir", path=".").content
    assert f"leak -> {host_file}" in listing and "bytes)" not in listing.split("leak ->")[1].splitlines()[0]


# ---------------------------------------------------------------- host secrets

def test_host_secrets_invisible(task, host_guard, tmp_path, monkeypatch):
    """``--clearenv`` and a private home: a secret in the host environment and in the host home's
    ~/.aws/credentials shows nowhere inside (env, every /proc/*/environ and cmdline, home, /root,
    a search for credentials files; the session's processes' environments are not readable)."""
    secret = "fakeSecret" + uuid.uuid4().hex
    home = tmp_path / "home"
    (home / ".aws").mkdir(parents=True)
    (home / ".aws" / "credentials").write_text(
        f"[default]\naws_access_key_id = AKIAFAKE0001\naws_secret_access_key = {secret}\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(rootfs.cache_root().parent))  # reuse the runtime
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAFAKE0001")
    assert os.path.expanduser("~/.aws/credentials") == str(home / ".aws" / "credentials")
    ep = host_guard(task)
    (ep.workspace / "look.sh").write_text(  # a script, so that its text is not in any cmdline
        "env; for f in /proc/[0-9]*/environ /proc/[0-9]*/cmdline; do tr '\\0' '\\n' < $f; done 2>/dev/null\n"
        "ls -laR ~ /root 2>&1 | head -200; ls ~/.aws >/dev/null 2>&1 && echo SEEN-aws\n"
        "find / \\( -path /proc -o -path /sys -o -path /usr \\) -prune -o "
        "\\( -name credentials -o -name .aws \\) -print 2>/dev/null; echo END\n")
    out, entry = term(ep, "bash look.sh")
    assert out.rstrip().endswith("END"), out[-500:]
    assert secret not in out and "AKIAFAKE0001" not in out
    assert "AWS_" not in out and "SEEN" not in out
    assert not [line for line in out.splitlines() if line.endswith(("/credentials", "/.aws"))]


# ---------------------------------------------------------------- signals and processes

def test_cannot_signal_or_see_host_processes(task, host_guard):
    """PID namespace: a host ``sleep`` running as the sandbox's own uid (so only the namespace
    protects it) is invisible in /proc inside and survives ``kill -9 <pid>`` and ``kill -9 -1``.
    Inside, /proc lists the laptop's process tree and nothing else; ``kill -9 -1`` ends the
    user's own session (the command with it), as it logs a user out of a laptop."""
    victim = subprocess.Popen(["sleep", "3013.25"], user=1000, group=1000, extra_groups=[])
    try:
        ep = host_guard(task)
        (ep.workspace / "hunt.sh").write_text(  # a script, so that its text is not in any cmdline
            f"kill -9 {victim.pid} 2>&1; echo kill=$?\n"
            f"ls -d /proc/{victim.pid} 2>/dev/null && echo SEEN-pid\n"
            "cat /proc/[0-9]*/cmdline | tr '\\0' ' '; echo; echo NPROC= $(ls /proc | grep -c '^[0-9]')\n"
            "kill -9 -1 2>&1; echo survived\n")
        out, entry = term(ep, "bash hunt.sh")
        assert "kill=1" in out and "No such process" in out, out
        assert "SEEN-pid" not in out and "3013.25" not in out
        assert "nm-dispatcher" in out and entry["exit_code"] == 137  # the session's tree; the session ended
        count = int(out.split("NPROC=")[1].split()[0])
        assert 30 < count < 60, count  # the laptop's tree and the command's own processes
        out, entry = term(ep, "echo next")  # the next command has a session again
        assert entry["exit_code"] == 0 and "next" in out
        time.sleep(0.2)
        assert victim.poll() is None, "the host process was killed from inside"
    finally:
        victim.kill()
        victim.wait()


_SETID_SCAN = r"""
import os, stat
mounts = [(f[4], f[5].split(",")) for f in (line.split() for line in open("/proc/self/mountinfo"))]
def mount_of(p):  # the last-mounted of the longest mount points holding p
    best = max(range(len(mounts)), key=lambda i: (len(mounts[i][0]) if p == mounts[i][0] or p.startswith(mounts[i][0].rstrip("/") + "/") else -1, i))
    return mounts[best]
found, suid_mounts = 0, []
for root, dirs, files in os.walk("/"):
    if root in ("/proc", "/sys", "/dev"):
        dirs[:] = []
        continue
    for name in files:
        p = os.path.join(root, name)
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_mode & 0o6000:
            found += 1
            point, opts = mount_of(p)
            if "nosuid" not in opts:
                suid_mounts.append((p, point))
print("setid-files", found, "on-suid-mounts", suid_mounts)
"""


def test_setuid_and_setgid_binaries_gain_nothing(task, host_guard):
    """With ``no_new_privs`` unset, as on a laptop: a setuid-root and a setgid-root copy of ``id``
    put in the workspace by the host, a copy of ``cat`` given every capability as a file
    capability, and the system's own sudo and su: inside, the effective uid and gid stay the
    user's, the capabilities none, and every setuid or setgid file the sandbox can see sits on
    a nosuid mount."""
    import struct

    ep = host_guard(task, command_timeout=240)  # the scan walks the whole tree: slow on a loaded machine
    for name, mode in (("suid-id", 0o4755), ("sgid-id", 0o2755)):
        shutil.copy("/usr/bin/id", ep.workspace / name)
        os.chown(ep.workspace / name, 0, 0)
        os.chmod(ep.workspace / name, mode)
    assert os.stat(ep.workspace / "suid-id").st_mode & 0o4000  # the bit is really set on the host
    shutil.copy("/usr/bin/cat", ep.workspace / "fcap-cat")
    os.chown(ep.workspace / "fcap-cat", 0, 0)
    # vfs_cap_data, revision 2, effective: every capability of our bounding set permitted
    # (capabilities(7)); run by uid 1000 on the host, this cat holds them all
    bnd = int(re.search(r"^CapBnd:\s+(\w+)", Path("/proc/self/status").read_text(), re.M).group(1), 16)
    os.setxattr(ep.workspace / "fcap-cat", "security.capability",
                struct.pack("<5I", 0x02000001, bnd & 0xFFFFFFFF, 0, bnd >> 32, 0))
    uid, gid = ep.sandbox.persona.uid, ep.sandbox.persona.gid
    out, _ = term(ep, "./fcap-cat /proc/self/status")
    assert re.search(r"^NoNewPrivs:\s+0$", out, re.M) and re.search(r"^CapEff:\s+0{16}$", out, re.M), out
    assert re.search(r"^CapPrm:\s+0{16}$", out, re.M) and re.search(rf"^Uid:\s+{uid}\s+{uid}\s", out, re.M), out
    out, _ = term(ep, "ls -l suid-id sgid-id; ./suid-id -u; ./suid-id -g; ./sgid-id -u; ./sgid-id -g; "
                      "echo sudo; sudo -n id -u </dev/null 2>&1; echo rc=$?; "
                      "echo su; su -c 'id -u' root </dev/null 2>&1; echo rc=$?")
    lines = out.splitlines()[1:]  # after the exit code line; ls lists sgid-id first
    assert lines[0].startswith("-rwxr-sr-x") and lines[1].startswith("-rwsr-xr-x"), out  # seen as set
    assert lines[2:6] == [str(uid), str(gid), str(uid), str(gid)], out
    sudo, su = out.split("\nsudo\n")[1].split("\nsu\n")
    for part in (sudo, su):
        assert "rc=0" not in part and not any(w == "0" for w in part.split()), out
    (ep.workspace / "scan.py").write_text(_SETID_SCAN)
    out, _ = term(ep, "python3 scan.py")
    assert "setid-files" in out, out
    found = int(out.split("setid-files")[1].split()[0])
    assert found >= 4, out  # the two copies, and the system's sudo and su at least
    assert out.rstrip().endswith("on-suid-mounts []"), out


def test_daemons_end_with_the_episode(task, host_guard):
    """One sandbox an episode, as a laptop's session: setsid/nohup/double-forked daemons, one of
    them holding stdout, do not hold the command up (it returns at once), run on through the
    episode's next commands, and end with the episode (none left once it is graded)."""
    ep = host_guard(task, command_timeout=30)
    t0 = time.monotonic()
    out, entry = term(ep, "setsid nohup sleep 3011.5 >/dev/null 2>&1 & disown; (sleep 3012.5 &); "
                          "setsid sleep 3014.5 & "  # keeps stdout open
                          "python3 -c 'import os, time; os.fork() or os.setsid() or time.sleep(3013.5)' & "
                          "sleep 0.3; echo started")
    assert entry["exit_code"] == 0 and "started" in out
    assert time.monotonic() - t0 < 10
    out, _ = term(ep, "ps -e -o args | grep -c '[3]01[1-4][.]5'")
    assert out.split()[-1] == "4", out  # the next command sees them
    assert len([c for _, c in tagged_processes(host_guard.tag) if b"301" in c]) == 4
    ep.grade()  # grading ends the sandbox first: nothing the episode left runs while it is graded
    assert not ep.sandbox.running and ep.result is not None
    time.sleep(0.1)
    assert tagged_processes(host_guard.tag) == []


def test_fork_bomb_is_capped_and_cleaned_up(task, host_guard):
    """RLIMIT_NPROC: a fork bomb never has more processes than ``max_processes`` (counted on the
    host while it runs), it is killed at the timeout with its whole tree, and the next command
    runs normally. The limit counts every process of host uid 1000, other sandboxes' too, so it
    is set above the number running now."""
    limit = 96 + sum(1 for pid in filter(str.isdigit, os.listdir("/proc")) if _uid(pid) == 1000)
    ep = host_guard(task, Limits(max_processes=limit), command_timeout=3)
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], sum(c.startswith(b"/bin/bash\0-c\0bomb") for _, c in tagged_processes(host_guard.tag)))
            time.sleep(0.05)
    th = threading.Thread(target=sample)
    th.start()
    try:
        out, entry = term(ep, "bomb() { bomb | bomb & }; bomb; sleep 60")
    finally:
        stop.set()
        th.join()
    assert entry["exit_code"] == 124 and "killed: timeout" in out
    assert "Resource temporarily unavailable" in out
    # a pids cgroup of its own where the host has one (the cap then holds the session too)
    cgroup = cgroups._pids_root() is not None
    assert ep.sandbox.process_cap == ("cgroup" if cgroup else "rlimit")
    assert 20 < peak[0] <= limit + (cgroups.SESSION_PIDS if cgroup else 0), (peak, limit)
    out, entry = term(ep, "ulimit -u; echo alive")
    nproc = limits._laptop_nproc() if cgroup else limit
    assert entry["exit_code"] == 0 and out.split()[-2:] == [str(nproc), "alive"]


def test_memory_bombs_are_contained(task, host_guard):
    """RLIMIT_AS stops an endless allocation loop with a MemoryError; the size cap on the /tmp and
    /var/tmp tmpfs (host memory) stops files piling up there with ENOSPC at the cap."""
    cap = 32 << 20
    ep = host_guard(task, Limits(memory_bytes=512 << 20, max_tmp_bytes=cap), command_timeout=20)
    out, entry = term(ep, "python3 -c 'x = []\nwhile True: x.append(bytearray(1 << 24))'")
    assert entry["exit_code"] == 1 and "MemoryError" in out
    out, entry = term(ep, "for d in /tmp /var/tmp; do for i in $(seq 16); do head -c 8M /dev/zero > $d/m$i || break; "
                          "done; du -sb $d | cut -f1; done")
    assert out.count("No space left on device") == 2, out
    sizes = [int(line) for line in out.splitlines() if line.strip().isdigit()]
    assert len(sizes) == 2 and all(cap - (1 << 20) <= s <= cap + (64 << 10) for s in sizes), sizes


def test_endless_output_and_oversleeping(task, host_guard):
    """Output budget and wall clock: endless stdout and stderr (text and binary) are cut to the
    per-stream budget with the dropped bytes counted, the command is killed at the timeout, and
    the observation stays within the episode's budget."""
    ep = host_guard(task, command_timeout=2, observation_chars=2000)
    t0 = time.monotonic()
    out, entry = term(ep, "yes flood & yes err 1>&2 & cat /dev/urandom; sleep 600")
    assert time.monotonic() - t0 < 8
    assert entry["exit_code"] == 124 and "killed: timeout" in out
    assert "bytes truncated ...]" in out and len(out) < 2200
    r = ep.sandbox.run("head -c 200000 /dev/urandom; head -c 100000 /dev/zero >&2")
    assert r.truncated and len(r.stdout.encode()) < 4 * Limits().max_output_bytes
    dropped = int(r.stderr.rsplit("[... ", 1)[1].split()[0])
    assert dropped == 100000 - Limits().max_output_bytes


# ---------------------------------------------------------------- disk

def test_disk_filling_loop_is_stopped(task, host_guard):
    """Disk cap on the workspace and home: a loop writing files is killed ("disk") shortly after
    the cap, files can still be deleted once over it but not grown, a file-count flood is killed
    the same way, a writer left running between commands ends the sandbox, and the host's free
    space comes back."""
    cap = 48 << 20
    free0 = shutil.disk_usage(tempfile.gettempdir()).free
    ep = host_guard(task, Limits(max_disk_bytes=cap, max_file_bytes=16 << 20, max_disk_files=3000),
                    command_timeout=20)
    out, entry = term(ep, "for i in $(seq 100); do head -c 8M /dev/zero > fill$i || break; done; echo finished")
    assert "killed: disk" in out and "finished" not in out and entry["exit_code"] == 137, out
    used = ep.sandbox.disk_usage()[0]
    assert cap < used < cap + (400 << 20), used  # stopped within one check interval
    out, entry = term(ep, "echo more > more.txt")
    assert entry["exit_code"] == 153 and "killed: file_size" in out  # over the cap: nothing grows (SIGXFSZ)
    out, entry = term(ep, "rm -f fill* more.txt")
    assert entry["exit_code"] == 0  # deleting works over the cap ...
    out, entry = term(ep, "echo small > more.txt && cat more.txt")
    assert entry["exit_code"] == 0 and "small" in out  # ... and brings the room back
    # the edit tool's writes are counted as they are made, not by a walk before the next command:
    # the count it keeps is the walk's
    assert not tool(ep, "edit_file", path="notes/a/b.txt", old="", new="x" * 50000).is_error
    counted, walked = ep.sandbox._usage, ep.sandbox.disk_usage()
    assert counted is not None and counted[1] == walked[1] and abs(counted[0] - walked[0]) <= 8192, (counted, walked)
    out, entry = term(ep, "python3 -c 'import os\nos.mkdir(\"many\")\nfor i in range(100000): "
                          "open(f\"many/{i}\", \"w\").close()'")
    assert "killed: disk" in out
    assert ep.sandbox.disk_usage()[1] < 100000
    # a writer left running in the background, filling the disk between commands: the sandbox
    # is ended once it passes the cap (the next command gets a fresh one, over the cap: no room)
    term(ep, "rm -rf many")
    out, entry = term(ep, "(for i in $(seq 100); do head -c 8M /dev/zero > bg$i; sleep 0.05; done) "
                          ">/dev/null 2>&1 & echo started")
    assert entry["exit_code"] == 0 and "started" in out and ep.sandbox.running
    deadline = time.monotonic() + 30
    while ep.sandbox.running and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not ep.sandbox.running
    used = ep.sandbox.disk_usage()[0]
    assert cap < used < cap + (400 << 20), used
    out, entry = term(ep, "ls bg* | wc -l; echo more > more.txt")
    assert "killed: file_size" in out, out
    ep.close()
    assert shutil.disk_usage(tempfile.gettempdir()).free > free0 - (256 << 20)


def test_deeply_nested_tree_is_pruned(task, host_guard):
    """Depth cap on the writable trees: a directory chain deeper than ``max_disk_depth`` made
    inside is removed after the command (reported as "disk"), so the host-side search, grading
    (copy, walk) and clean-up, which recurse per level, still work."""
    ep = host_guard(task, Limits(max_disk_depth=40))
    term(ep, "mkdir -p d/d && touch d/d/keep")
    out, entry = term(ep, "mkdir -p $(printf 'd/%.0s' $(seq 1200)); echo made")
    assert "killed: disk" in out, out  # killed while it runs, or (if it was quick) reported after
    depth = max(len(Path(r).relative_to(ep.workspace).parts) for r, _, _ in os.walk(ep.workspace))
    assert depth <= 40 and (ep.workspace / "d" / "d" / "keep").exists()
    assert not tool(ep, "search", pattern="zzz").is_error
    r = ep.grade()
    assert r.passed == 0 and r.failed == 1  # graded normally: the bug is still there
    out, entry = term(ep, "echo fine")
    assert entry["exit_code"] == 0 and "killed" not in out


# ---------------------------------------------------------------- host-side tools and grading

def test_host_side_tools_refuse_hostile_files(task, host_guard):
    """The file tools hold files in host memory: one over the size limit is refused with a clear
    error, a binary file given to edit_file is an error observation, not an exception."""
    ep = host_guard(task)
    out, entry = term(ep, f"head -c {MAX_TOOL_FILE_BYTES + 1} /dev/zero | tr '\\0' '\\n' > big.txt; "
                          "head -c 300 /dev/urandom > blob.bin; printf '\\xff\\xfe' >> blob.bin")
    assert entry["exit_code"] == 0
    obs = tool(ep, "read_file", path="big.txt", start_line=1, end_line=2)
    assert obs.is_error and f"{MAX_TOOL_FILE_BYTES + 1} bytes" in obs.content and "terminal" in obs.content
    obs = tool(ep, "edit_file", path="big.txt", old="\n", new="x")
    assert obs.is_error and "limit" in obs.content
    obs = tool(ep, "edit_file", path="blob.bin", old="a", new="b")
    assert obs.is_error and "binary file" in obs.content


def test_grading_survives_planted_files(task, host_guard, canary):
    """The grader runs on the host over what the sandbox left: FIFOs and sockets in the
    workspace do not break the copy, a workspace symlink to a host file is not read by the cheat
    detection, and a report replaced by a FIFO or a link to a host file at exit yields no tests
    (reward 0) instead of a hang or an exception."""
    evil_src = canary / "evil.py"
    evil_src.write_text("import sys\nsys.exit(0)\n")
    ep = host_guard(task)
    out, entry = term(ep, "mkfifo pipe; python3 -c 'import socket; socket.socket(socket.AF_UNIX).bind(\"sock\")'; "
                          f"ln -s {evil_src} helper.py; sed -i 's/a - b/a + b/' calc.py; ls -l")
    assert entry["exit_code"] == 0 and "pipe" in out and "sock" in out
    r = ep.grade()
    assert r.reward == 1.0 and r.passed == 1 and r.flags == [], (r.flags, r.details.get("output_tail"))

    for plant in ("os.mkfifo(R)", f"os.symlink({str(canary / 'canary.txt')!r}, R)"):
        ep2 = host_guard(task)
        (ep2.workspace / "calc.py").write_text(
            "import atexit, os\nR = '/var/tmp/report/junit.xml'\n"
            f"atexit.register(lambda: (os.path.exists(R) and os.remove(R), {plant}))\n"
            "def add(a, b):\n    return a + b\n")
        done = {}
        th = threading.Thread(target=lambda: done.setdefault("r", ep2.grade()), daemon=True)
        th.start()
        th.join(60)
        assert "r" in done, f"grading hung on a planted report ({plant})"
        assert done["r"].reward == 0.0 and done["r"].passed == 0


# ---------------------------------------------------------------- concurrency

def _episode_with_token(task_dir: Path, open_episode, i: int) -> dict:
    token = f"tok-{i}-{uuid.uuid4().hex[:10]}"
    ep = open_episode(task_dir)
    tool(ep, "edit_file", path="token.txt", old="", new=token + "\n")
    out, entry = term(ep, f"cat token.txt; echo {token} > /tmp/t; echo {token} > ~/t; sleep 0.2; "
                          "python3 -m pytest -q tests 2>&1 | tail -1; cat /tmp/t ~/t; cat token.txt > echo.txt")
    back = tool(ep, "read_file", path="echo.txt").content
    return {"token": token, "out": out, "exit": entry["exit_code"], "back": back}


def test_concurrent_episodes_do_not_mix(task, host_guard):
    """Private workspace, home and /tmp per episode: 8 episodes at once each write and read back
    their own token (host tool, sandbox workspace, /tmp, home) and run pytest; every one sees
    exactly its own token and nothing is lost."""
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: _episode_with_token(task, host_guard, i), range(8)))
    tokens = {r["token"] for r in results}
    assert len(tokens) == 8
    for r in results:
        seen = {w for w in r["out"].split() + r["back"].split() if w.startswith("tok-")}
        assert r["exit"] == 0 and seen == {r["token"]}, r
        assert r["out"].count(r["token"]) == 3 and "1 passed" in r["out"], r["out"]
