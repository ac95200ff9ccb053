"""The sandbox, for real: bubblewrap, rlimits, timeouts, isolation, realism."""

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from composer_dag.laptop.realism import fingerprint, realism_diff, tell_tales
from composer_dag.laptop.desktop import dressing
from composer_dag.sandbox import Limits, Sandbox, sandbox_exec
from composer_dag.sandbox.cgroups import _pids_root
from composer_dag.sandbox.limits import _laptop_nproc


@pytest.fixture
def sb(tmp_path):
    ws = tmp_path / "webshop"
    ws.mkdir()
    (ws / "app.py").write_text("print('hello from app')\n")
    with Sandbox(ws, Limits(timeout=20), dressing=dressing()) as s:
        yield s


def test_identity_and_layout(sb):
    r = sb.run("id -un; id -u; hostname; pwd; echo $HOME $USER $SHELL; python3 app.py; "
               "touch new.txt && echo ws-ok; touch /usr/x 2>/dev/null || echo usr-ro; "
               "touch /tmp/t && echo tmp-ok; touch ~/.notes && echo home-ok; git config user.name")
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[:4] == ["sam", "1000", "sam-thinkpad", "/home/sam/webshop"]
    assert lines[4] == "/home/sam sam /bin/bash"
    assert "hello from app" in lines and "ws-ok" in lines and "usr-ro" in lines
    assert "tmp-ok" in lines and "home-ok" in lines and lines[-1] == "Sam Carter"
    assert (sb.workspace / "new.txt").exists()


def test_host_paths_and_network_are_unreachable(sb):
    venv = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
    r = sb.run(f"ls {venv} /work /root/.pyenv 2>&1; python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)\" 2>&1 | tail -1; "
               "cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '")
    assert "No such file" in r.stdout or "Permission denied" in r.stdout
    assert "unreachable" in r.stdout.lower() or "error" in r.stdout.lower()
    # loopback and the persona's Wi-Fi, in a namespace of the sandbox's own (see test_security_sandbox)
    assert r.stdout.strip().splitlines()[-2:] == ["lo", sb.network.wifi.interface]


def test_private_tmp_between_sandboxes(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    with Sandbox(a, dressing=dressing()) as s1, Sandbox(b, dressing=dressing()) as s2:
        s1.run("echo secret > /tmp/x")
        assert s2.run("cat /tmp/x").exit_code != 0
        assert s1.run("cat /tmp/x").stdout == "secret\n"  # one sandbox an episode: its /tmp stays
        s1.stop()  # a fresh sandbox, as after a reboot: /tmp empty, the home and workspace kept
        assert s1.run("cat /tmp/x").exit_code != 0


def test_timeout_kills_the_whole_tree(sb):
    t0 = time.monotonic()
    r = sb.run("sleep 97.5 & (sleep 98.5 &) ; sleep 99.5", timeout=1)
    assert r.timed_out and r.killed_reason == "timeout" and r.exit_code == 124
    assert time.monotonic() - t0 < 5
    time.sleep(0.2)
    assert not _procs("sleep\x0097.5") + _procs("sleep\x0098.5") + _procs("sleep\x0099.5")
    # a deadline that passes before the command's process exists still ends it (the kill used
    # to find no process yet, and 19 of 30 such commands ran to the end)
    runs = [sb.run("sleep 0.3; echo done", timeout=0.0005) for _ in range(20)]
    assert all(r.timed_out and r.stdout == "" for r in runs), [(r.stdout, r.seconds) for r in runs]
    assert sb.run("echo ok").stdout == "ok\n"


def test_sandbox_ends_with_the_process_holding_it(tmp_path):
    """The session ends when the host's end of its control socket closes: a process that holds a
    sandbox and dies (SIGKILL, no clean-up) leaves nothing running, daemons included."""
    tag = f"{os.getpid()}.{time.monotonic_ns() % 10**6}"
    (tmp_path / "ws").mkdir()
    (tmp_path / "tmp").mkdir()
    script = ("import sys\nfrom pathlib import Path\nfrom composer_dag.sandbox import Sandbox\n"
              "from composer_dag.laptop.desktop import dressing\n"
              f"sb = Sandbox(Path({str(tmp_path / 'ws')!r}), dressing=dressing())\n"
              f"print(sb.run('setsid sleep 4242.{tag} >/dev/null 2>&1 & echo up').stdout, flush=True)\n"
              "sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path / "tmp")})
    try:
        assert proc.stdout.readline().strip() == "up"
        assert _procs(f"4242.{tag}")
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 5
    while _procs(f"4242.{tag}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _procs(f"4242.{tag}")
    # what it mounted for the sandbox (its /home, /run/user, root image) the next process's sweep
    # lets go of, with the directory
    from composer_dag.sandbox import volumes
    from composer_dag.sandbox import sweep_stale_temporaries

    def mounts():
        return [ln for ln in Path("/proc/self/mountinfo").read_text().splitlines() if f" {tmp_path}/tmp/" in ln]
    assert len(mounts()) == (3 if volumes.available() else 0)
    gone = sweep_stale_temporaries(str(tmp_path / "tmp"), max_age=0, force=True)
    # its sandbox's directory, and the empty file system its volumes are copied from
    assert sorted(g[:7] for g in gone) == (["cdag-h-", "cdag-vt"] if volumes.available() else ["cdag-h-"])
    assert not mounts() and not list((tmp_path / "tmp").iterdir())


def test_without_file_systems_of_its_own_the_sandbox_binds_the_host_trees(tmp_path):
    """Where the host makes no file systems for it (no root, no loop devices; here turned off),
    the sandbox binds the runtime's cached trees and the home as before: it still runs the
    interpreter and the tools, and its mount table names the host (the realism battery's tell)."""
    (tmp_path / "ws").mkdir()
    script = ("import json, os\nfrom pathlib import Path\nfrom composer_dag.sandbox import Sandbox\n"
              "from composer_dag.laptop.desktop import dressing\n"
              f"with Sandbox(Path({str(tmp_path / 'ws')!r}), dressing=dressing()) as sb:\n"
              "    r = sb.run('python3 -c \"import json; print(json.__name__)\"; pytest --version; '\n"
              "               'awk \\'$5 == \"/home/sam\" || $5 == \"/\" {print $4}\\' /proc/self/mountinfo')\n"
              "print(json.dumps([r.exit_code, r.stdout]))\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "COMPOSER_SANDBOX_VOLUMES": "0"})
    assert r.returncode == 0, r.stderr[-2000:]
    code, out = json.loads(r.stdout.strip().splitlines()[-1])
    lines = out.split("\n")
    assert code == 0 and lines[0] == "json" and lines[1].startswith("pytest "), out
    assert lines[2].endswith("/root") and "cdag-rt" in lines[2] and "cdag-h-" in lines[3], out


def _procs(marker: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                found.append(pid)
        except OSError:
            continue
    return found


def test_rlimits(tmp_path):
    with Sandbox(tmp_path, Limits(cpu_seconds=1, memory_bytes=512 << 20, max_file_bytes=1 << 20,
                                  max_processes=2000, timeout=20), dressing=dressing()) as s:
        r = s.run("python3 -c 'while True: pass'")
        assert r.killed_reason == "cpu" and not r.timed_out
        # a SIGKILL that is not the CPU limit's (the shell kills itself): a plain signal death
        r = s.run("kill -9 $$")
        assert (r.exit_code, r.killed_reason) == (137, None), (r.exit_code, r.killed_reason)
        r = s.run("python3 -c 'import signal; signal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass'")
        assert (r.exit_code, r.killed_reason) == (137, "cpu"), (r.exit_code, r.killed_reason)  # the hard limit
        r = s.run("head -c 5000000 /dev/zero > big")
        assert r.killed_reason == "file_size"
        assert (tmp_path / "big").stat().st_size <= 1 << 20
        r = s.run("python3 -c 'x = bytearray(1 << 30)'")
        assert r.exit_code != 0 and "MemoryError" in r.stderr
        r = s.run("ulimit -u")  # a laptop's where a pids cgroup holds the cap, the cap otherwise
        assert r.stdout.strip() == (str(_laptop_nproc()) if s.process_cap == "cgroup" else "2000")


def test_a_new_process_clears_only_the_cgroups_of_dead_ones(tmp_path):
    """The first sandbox of a process removes the empty pids cgroups that processes which died left
    behind, and no other: a live process's cgroup is empty for a moment after it is made, and two
    processes starting sandboxes at once (an evaluation beside an RL run) must not take it away; a
    name that is no process's (cgroup v2's ``cdag-episodes``, beside the pids cgroups) stays."""
    root = _pids_root()
    if root is None:
        pytest.skip("no writable pids cgroup on this host: sandboxes cap processes with RLIMIT_NPROC")
    dead = subprocess.Popen(["true"])
    dead.wait()
    live, gone, other = root / f"cdag-{os.getpid()}-test", root / f"cdag-{dead.pid}-test", root / "cdag-shared-test"
    for cg in (live, gone, other):
        cg.mkdir(exist_ok=True)
    try:
        subprocess.run([sys.executable, "-c", "from composer_dag.sandbox.cgroups import _pids_root; _pids_root()"],
                       check=True, timeout=60)
        assert live.is_dir() and other.is_dir() and not gone.exists()
    finally:
        for cg in (live, gone, other):
            if cg.exists():
                cg.rmdir()


def test_live_sessions_do_not_use_up_the_process_cap(tmp_path):
    """Each live sandbox holds 15 processes of the user for its session. Where a pids cgroup caps
    each sandbox, sessions alive at once (an evaluation batch holds hundreds) leave every sandbox
    its own ``max_processes``; with RLIMIT_NPROC alone they share it."""
    boxes = []
    try:
        for i in range(4):
            (tmp_path / f"w{i}").mkdir()
            boxes.append(Sandbox(tmp_path / f"w{i}", Limits(max_processes=40, timeout=20), dressing=dressing()))
            assert boxes[-1].run("true").exit_code == 0
        r = boxes[-1].run("for i in $(seq 8); do sleep 0.2 & done; wait; echo forked")
        assert boxes[-1].process_cap == ("cgroup" if _pids_root() is not None else "rlimit")
        if boxes[-1].process_cap == "rlimit":  # 4 sessions hold 60 of the 40 the user may have
            assert "Resource temporarily unavailable" in r.stderr, r
            return
        assert r.exit_code == 0 and r.stdout.strip() == "forked", r
        r = boxes[-1].run("for i in $(seq 60); do sleep 1 & done 2>&1 | tail -1; wait")
        assert "Resource temporarily unavailable" in r.stdout + r.stderr  # the cap still holds
    finally:
        for b in boxes:
            b.close()


def test_output_truncated_and_stdin(sb):
    r = sb.run("yes 0123456789 | head -c 1000000", stdin=None)
    assert r.truncated and len(r.stdout) < 70_000 and "bytes truncated ...]" in r.stdout
    assert sb.run(["cat"], stdin="piped input").stdout == "piped input"
    assert sb.run(["bash", "-c", "exit 7"]).exit_code == 7


def test_realism_no_tell_tales(sb, capsys):
    host, inside = fingerprint(), fingerprint(sb)
    diff = realism_diff(host, inside)
    with capsys.disabled():
        print("\nrealism diff (host vs sandbox):\n  " + "\n  ".join(d[:200] for d in diff))
    assert tell_tales(inside) == []
    assert inside["uid"] == 1000 and inside["user"] == "sam" and inside["hostname"] == "sam-thinkpad"
    assert {"HOME", "USER", "LOGNAME", "SHELL", "PATH", "LANG", "TERM"} <= set(inside["env"])
    for tool in ("python3", "git", "bash", "ls", "grep", "sed", "pytest"):
        assert "unavailable" not in inside["versions"][tool], tool
    assert inside["versions"]["python3"] == host["versions"]["python3"]
    assert inside["versions"]["git"] == host["versions"]["git"]


def test_start_latency(sb):
    ts = []
    for _ in range(15):
        t = time.perf_counter()
        sb.run(["/bin/true"])
        ts.append(time.perf_counter() - t)
    assert statistics.median(ts) < 0.1  # benchmarks/bench_sandbox.py records the real numbers


def test_sandbox_exec(tmp_path, capfd):
    (tmp_path / "f.txt").write_text("data\n")
    assert sandbox_exec(tmp_path, "cat f.txt; exit 3", dressing=dressing()) == 3
    assert "data" in capfd.readouterr().out


def test_temporaries_a_killed_process_left_are_swept_once_a_day_old(tmp_path):
    """A sandbox's home, an episode's workspace and a grading's tree (``cdag-h-``, ``cdag-w-``,
    ``cdag-g-``) a SIGKILL left behind go once untouched for a day; fresh ones, and other names
    (the identity locks' directory, a user's own), stay."""
    from composer_dag.sandbox import STALE_TEMP_S, sweep_stale_temporaries

    old = time.time() - STALE_TEMP_S - 60
    names = {"cdag-h-ab12cd_3": old, "cdag-w-zz99yy88": old, "cdag-g-q1w2e3r4": time.time() - 3600,
             "cdag-identities": old, "cdag-h-notmine": old, "my-project": old}
    for name, t in names.items():
        (tmp_path / name / "home").mkdir(parents=True)
        (tmp_path / name / "home" / "f").write_text("x")
        os.utime(tmp_path / name, (t, t))
    assert sorted(sweep_stale_temporaries(str(tmp_path))) == ["cdag-h-ab12cd_3", "cdag-w-zz99yy88"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cdag-g-q1w2e3r4", "cdag-h-notmine", "cdag-identities",
                                                          "my-project"]
    os.utime(tmp_path / "cdag-g-q1w2e3r4", (old, old))
    assert sweep_stale_temporaries(str(tmp_path)) == []  # once per process and directory...
    assert sweep_stale_temporaries(str(tmp_path), force=True) == ["cdag-g-q1w2e3r4"]  # ...unless asked
