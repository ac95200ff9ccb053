"""Real Slurm clusters for the tests and benchmarks: munged, slurmctld and slurmd started as
processes of this session with a generated ``slurm.conf`` in a temporary directory, on free
ports, declaring more CPUs than the machine has (so a trainer and services run at once), and
stopped by process id at the end. ``SlurmCluster`` is one node on this host's network (the
cluster benchmarks); ``TwoNodeCluster``, every Slurm test's, runs each node in namespaces of
its own. Needs root and the Debian packages slurmctld, slurmd, slurm-client and munge
(``make system-deps``)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")


NODE_BINARIES = ("ip", "nsenter", "unshare", "pgrep")  # the two-node cluster's namespaces


def missing(extra: tuple[str, ...] = ()) -> str:
    """Why this machine cannot run the cluster, or ''."""
    gone = [b for b in (*BINARIES, *extra) if shutil.which(b) is None]
    if gone:
        return f"not installed: {', '.join(gone)} (make system-deps installs them)"
    if os.geteuid() != 0:
        return "the Slurm test clusters run as root"
    return ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    slurmd_timeout = 30  # seconds before the controller sets a silent node DOWN

    def __init__(self, root: Path, cpus: int = 8):
        self.root, self.cpus = Path(root), cpus
        self.procs: list[subprocess.Popen] = []
        self.conf = self.root / "slurm.conf"
        self.node = socket.gethostname().split(".")[0]

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def _write_conf(self) -> None:
        r = self.root
        for d in ("state", "spool", "log"):
            (r / d).mkdir(exist_ok=True)
        self.conf.write_text(f"""\
ClusterName=composer
SlurmctldHost={self.controller}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={r}/munge/munge.sock
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={self.slurmd_dir}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={self.slurmd_dir}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={self.slurmd_dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SlurmdParameters=config_overrides
SlurmctldTimeout=30
SlurmdTimeout={self.slurmd_timeout}
InactiveLimit=0
KillWait=5
MinJobAge=600
{self.node_lines()}PartitionName=debug Nodes={",".join(self.node_names)} Default=YES MaxTime=INFINITE State=UP
""")

    @property
    def controller(self) -> str:
        return f"{self.node}(127.0.0.1)"

    @property
    def slurmd_dir(self) -> str:
        return str(self.root)

    @property
    def node_names(self) -> tuple[str, ...]:
        return (self.node,)

    def node_lines(self) -> str:
        return f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN\n"

    def _start_munge(self) -> None:
        import pwd

        m = self.root / "munge"
        m.mkdir(mode=0o755)
        key = m / "munge.key"
        key.write_bytes(os.urandom(1024))
        user = pwd.getpwnam("munge")
        for p in (m, key):
            os.chown(p, user.pw_uid, user.pw_gid)
        key.chmod(0o400)
        self.procs.append(subprocess.Popen(
            ["munged", "-F", f"--key-file={key}", f"--socket={m}/munge.sock", f"--pid-file={m}/munged.pid",
             f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed"],
            user=user.pw_uid, group=user.pw_gid, extra_groups=[], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self._wait(lambda: (m / "munge.sock").exists(), "munged")

    def start(self, timeout: float = 60) -> "SlurmCluster":
        self._start_munge()
        self._write_conf()
        log = open(self.root / "daemons.log", "ab")
        for cmd in (["slurmctld", "-D", "-i", "-f", str(self.conf)], ["slurmd", "-D", "-f", str(self.conf)]):
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=log, env={**os.environ, **self.env}))

        def idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env={**os.environ, **self.env})
            return out.stdout.strip() == "idle"

        self._wait(idle, "the Slurm node", timeout)
        return self

    def _wait(self, ready, what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{what} did not start ({', '.join(dead) or 'timeout'}); logs in {self.root}")
            time.sleep(0.2)

    def cancel_all(self, timeout: float = 30) -> None:
        """scancel every job and wait until none is left (slurmstepd outlives the daemons)."""
        env = {**os.environ, **self.env}
        subprocess.run(["scancel", "--full", "--partition=debug"], env=env, capture_output=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True)
            if out.returncode != 0 or not out.stdout.strip():
                return
            time.sleep(0.5)

    def stop(self) -> None:
        if any(p.poll() is None for p in self.procs):
            self.cancel_all()
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.procs = []


# ---- two nodes -------------------------------------------------------------------------------
def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out


SCRATCH_NAME = "composer-scratch"  # each node's scratch directory: /tmp/composer-scratch


class TwoNodeCluster(SlurmCluster):
    """A Slurm cluster of ``len(names)`` compute nodes on one host, each a ``slurmd`` in network,
    UTS, PID and mount namespaces of its own: its own hostname, its own address on a bridge this
    class creates (``<prefix>.1`` is the host: slurmctld, the S3 server), node names in an
    ``/etc/hosts`` of the cluster's, and its own ``/tmp`` (``<root>/nodes/<name>/tmp`` bound
    there, so a test can look at what a node wrote). The nodes share nothing writable: the
    install, ``slurm.conf`` and the munge socket are read by all; each ``slurmd`` writes its
    spool and log under its own ``<root>/nodes/<name>``. ``kill_node`` ends a node as a power
    cut does (SIGKILL to its namespace's init: every process of the node dies); ``restart_node``
    starts its ``slurmd`` again. ``stop`` removes every process, namespace and interface, by id
    and by name. The root must not be under ``/tmp`` (each node mounts its own there)."""

    slurmd_timeout = 10  # a lost node is set DOWN by the controller within seconds

    def __init__(self, root: Path, names: tuple[str, ...] = ("node1", "node2"), cpus: int = 4):
        super().__init__(root, cpus)
        self.names = names
        pid = os.getpid()
        self.tag = f"cd{pid % 100000}"  # interface names: at most 15 characters
        self.prefix = f"10.{200 + pid % 50}.{(pid // 50) % 250}"
        self.host = f"{self.prefix}.1"
        self.addr = {n: f"{self.prefix}.{11 + i}" for i, n in enumerate(names)}
        self.netns = {n: f"{self.tag}-{n}" for n in names}
        self.bridge = f"{self.tag}br"
        self.node = names[0]
        self.node_procs: dict[str, subprocess.Popen] = {}
        self.s3_proc: subprocess.Popen | None = None
        self.s3_endpoint = ""
        self.scratch = f"/tmp/{SCRATCH_NAME}"
        # what every node must see of this machine although it has its own /tmp: the code and
        # the Python environment, where they live under /tmp (a checkout there)
        import sys

        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.install_under_tmp = sorted({p for p in (repo, os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix))
                                         if p.startswith("/tmp/")})

    def node_dir(self, name: str) -> Path:
        return self.root / "nodes" / name

    # -- network
    def _net_up(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.host}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, name in enumerate(self.names):
            ns, host_end, node_end = self.netns[name], f"{self.tag}h{i}", f"{self.tag}n{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", host_end, "type", "veth", "peer", "name", node_end)
            _ip("link", "set", node_end, "netns", ns)
            _ip("link", "set", host_end, "master", self.bridge)
            _ip("link", "set", host_end, "up")
            _ip("-n", ns, "link", "set", node_end, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.addr[name]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        (self.root / "hosts").write_text(
            "127.0.0.1 localhost\n" + f"{self.host} {socket.gethostname().split('.')[0]}\n"
            + "".join(f"{a} {n}\n" for n, a in self.addr.items()))

    def interfaces(self) -> list[str]:
        """This cluster's interfaces and namespaces still present on the host (by name)."""
        links = _ip("-o", "link", "show", check=False).stdout
        spaces = _ip("netns", "list", check=False).stdout
        return sorted({w.split("@")[0].rstrip(":") for w in links.split() if w.startswith(self.tag)}
                      | {w for w in spaces.split() if w.startswith(self.tag)})

    def _net_down(self) -> None:
        for ns in self.netns.values():
            _ip("netns", "del", ns, check=False)
        for i in range(len(self.names)):
            _ip("link", "del", f"{self.tag}h{i}", check=False)
        _ip("link", "del", self.bridge, check=False)
        deadline = time.monotonic() + 10
        while self.interfaces() and time.monotonic() < deadline:
            for name in self.interfaces():
                _ip("link", "del", name, check=False)
                _ip("netns", "del", name, check=False)
            time.sleep(0.2)

    # -- daemons
    @property
    def controller(self) -> str:
        return f"{socket.gethostname().split('.')[0]}({self.host})"  # slurmctld checks its own name

    @property
    def slurmd_dir(self) -> str:
        return f"{self.root}/nodes/%n"  # Slurm puts the node's name in

    @property
    def node_names(self) -> tuple[str, ...]:
        return self.names

    def node_lines(self) -> str:
        return "".join(f"NodeName={n} NodeAddr={a} CPUs={self.cpus} State=UNKNOWN\n" for n, a in self.addr.items())

    def _node_command(self, name: str) -> list[str]:
        d = self.node_dir(name)
        for sub in ("tmp", "spool", f"tmp/{SCRATCH_NAME}"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        (d / "tmp").chmod(0o1777)
        # inside: the hostname, the cluster's hosts file, the node's own /tmp (with the install
        # bound back read-only where it lives under /tmp), then slurmd as the namespace's init
        stage = [d / "install" / str(i) for i in range(len(self.install_under_tmp))]
        for st in stage:
            st.mkdir(parents=True, exist_ok=True)
        keep = "".join(f"mount --bind {p} {st}; " for p, st in zip(self.install_under_tmp, stage))
        back = "".join(f"mkdir -p {p}; mount --bind {st} {p}; mount -o remount,bind,ro {p}; "
                       for p, st in zip(self.install_under_tmp, stage))
        script = (f"set -e; hostname {name}; mount --bind {self.root}/hosts /etc/hosts; {keep}"
                  f"mount --bind {d}/tmp /tmp; {back}exec slurmd -D -N {name} -f {self.conf}")
        # nsenter, not `ip netns exec` (which mounts a /sys of the namespace's, hiding the cgroup
        # tree slurmd needs)
        return ["nsenter", f"--net=/run/netns/{self.netns[name]}", "unshare", "--uts", "--pid", "--mount", "--fork",
                "--mount-proc", "--propagation", "private", "--", "sh", "-c", script]

    def start_node(self, name: str) -> None:
        cmd = self._node_command(name)
        log = open(self.node_dir(name) / "daemon.log", "ab")
        self.node_procs[name] = subprocess.Popen(cmd, stdout=log, stderr=log,
                                                 env={**os.environ, **self.env})

    def node_init(self, name: str) -> int | None:
        """The host pid of the node's init (its slurmd), or None."""
        proc = self.node_procs.get(name)
        if proc is None or proc.poll() is not None:
            return None
        out = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        return int(out[0]) if out else None

    def kill_node(self, name: str) -> None:
        """The node's power cut: SIGKILL to its init, so every process in its PID namespace dies."""
        pid = self.node_init(name)
        if pid is None:
            raise RuntimeError(f"node {name} is not running")
        os.kill(pid, 9)
        self.node_procs[name].wait(timeout=30)

    def restart_node(self, name: str, timeout: float = 60) -> None:
        """Boot the node again: its /tmp emptied (what a lost job left there goes, as a tmpfs
        ``/tmp`` does at boot), slurmd started, the node set RESUME once the controller sees it."""
        tmp = self.node_dir(name) / "tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        self.start_node(name)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            subprocess.run(["scontrol", "update", f"nodename={name}", "state=resume"], capture_output=True,
                           env={**os.environ, **self.env})
            if self.node_state(name) in ("idle", "mixed", "allocated"):
                return
            time.sleep(0.5)
        raise RuntimeError(f"node {name} did not return to service ({self.node_state(name)})")

    def node_state(self, name: str) -> str:
        out = subprocess.run(["sinfo", "-h", "-n", name, "-o", "%T"], capture_output=True, text=True,
                             env={**os.environ, **self.env})
        return out.stdout.strip().rstrip("*~#")

    def start(self, timeout: float = 60) -> "TwoNodeCluster":
        try:
            self._net_up()
            self._start_munge()
            self._write_conf()
            log = open(self.root / "daemons.log", "ab")
            self.procs.append(subprocess.Popen(["slurmctld", "-D", "-i", "-f", str(self.conf)], stdout=log,
                                               stderr=log, env={**os.environ, **self.env}))
            for name in self.names:
                self.start_node(name)
            self._start_s3()
            self._wait(lambda: all(self.node_state(n) == "idle" for n in self.names), "the Slurm nodes", timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_s3(self) -> None:
        """moto's S3 server on the bridge address: the one place the nodes and the host both reach."""
        import sys
        import urllib.request

        with socket.socket() as s:
            s.bind((self.host, 0))
            port = s.getsockname()[1]
        exe = Path(sys.executable).with_name("moto_server")
        self.s3_proc = subprocess.Popen([str(exe), "-H", self.host, "-p", str(port)], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        self.s3_endpoint = f"http://{self.host}:{port}"

        def up() -> bool:
            try:
                urllib.request.urlopen(self.s3_endpoint + "/moto-api/", timeout=1)
                return True
            except OSError:
                return False

        self._wait(up, "the S3 server")

    def in_node(self, name: str, *argv: str) -> subprocess.CompletedProcess:
        """``argv`` run inside the node's namespaces (network, UTS, mount, PID)."""
        pid = self.node_init(name)
        return subprocess.run(["nsenter", "-t", str(pid), "-n", "-u", "-m", "-p", "--", *argv],
                              capture_output=True, text=True)

    def stop(self) -> None:
        try:
            if self.procs and all(p.poll() is None for p in self.procs) and self.node_procs:
                self.cancel_all()
            for name in list(self.node_procs):
                pid = self.node_init(name)
                if pid:
                    os.kill(pid, 9)  # the node's init: every process of the node goes with it
                proc = self.node_procs.pop(name)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if self.s3_proc is not None:
                self.s3_proc.terminate()
                try:
                    self.s3_proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.s3_proc.kill()
                    self.s3_proc.wait()
                self.s3_proc = None
            super().stop()
        finally:
            self._net_down()


class ServerNodeLoss:
    """A power cut of the node that holds only a rollout server, while that server has episodes
    in flight: a thread watches ``squeue`` for the RL job (``rl_job``) and the rollout services
    (``rollout-*``), picks a server whose node runs no RL job, polls that server's ``/load``
    (vLLM's count of requests in flight, at the node's address) and kills the node once it
    reaches ``min_load`` (2: more than the one probe request the orchestrator sends after each
    reload). ``victim``: (node, service name) once done; ``error``: why it could not."""

    def __init__(self, cluster: "TwoNodeCluster", rl_job: str = "composer-rl", min_load: int = 2,
                 timeout: float = 1500):
        import threading

        self.cluster, self.rl_job, self.min_load, self.timeout = cluster, rl_job, min_load, timeout
        self.victim: tuple[str, str] | None = None
        self.error = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="server-node-loss", daemon=True)

    def _slurm(self, *argv: str) -> str:
        return subprocess.run(list(argv), capture_output=True, text=True, env={**os.environ, **self.cluster.env}).stdout

    def _pick(self) -> tuple[str, str, str] | None:
        """(node, service name, job id) of a running rollout server on a node without the RL job."""
        jobs = [line.split() for line in self._slurm("squeue", "-h", "-t", "RUNNING", "-o", "%i %j %N").splitlines()]
        rl_nodes = {j[2] for j in jobs if len(j) == 3 and j[1] == self.rl_job}
        servers = [(j[2], j[1], j[0]) for j in jobs if len(j) == 3 and j[1].startswith("rollout-")]
        if not rl_nodes or len(servers) < 2:
            return None
        alone = [s for s in servers if s[0] not in rl_nodes]
        return alone[0] if alone else None

    def _run(self) -> None:
        import json
        import re
        import urllib.request

        deadline = time.monotonic() + self.timeout
        try:
            while not self._stop.is_set() and time.monotonic() < deadline:
                picked = self._pick()
                if picked is None:
                    time.sleep(0.3)
                    continue
                node, name, job = picked
                port = re.search(r"--port'?\s+'?(\d+)", self._slurm("scontrol", "write", "batch_script", job, "-"))
                if not port:
                    self.error = f"no --port in the batch script of job {job}"
                    return
                url = f"http://{self.cluster.addr[node]}:{port.group(1)}/load"
                while not self._stop.is_set() and time.monotonic() < deadline:
                    try:
                        load = json.loads(urllib.request.urlopen(url, timeout=2).read())["server_load"]
                    except (OSError, ValueError, KeyError):
                        load = 0
                    if load >= self.min_load:
                        self.cluster.kill_node(node)
                        self.victim = (node, name)
                        return
                    time.sleep(0.05)
            self.error = self.error or "no rollout server on a node of its own had a request in flight"
        except Exception as exc:  # reported by the test, never lost in the thread
            self.error = f"{type(exc).__name__}: {exc}"

    def __enter__(self) -> "ServerNodeLoss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
