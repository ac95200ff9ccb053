"""A real one-node Slurm cluster for the tests: munged, slurmctld and slurmd started as
processes of this session with a generated ``slurm.conf`` in a temporary directory, on free
ports, declaring more CPUs than the machine has (so a trainer and services run at once), and
stopped by process id at the end. Needs root and the Debian packages slurmctld, slurmd,
slurm-client and munge (``make system-deps``)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")


def missing() -> str:
    """Why this machine cannot run the cluster, or ''."""
    gone = [b for b in BINARIES if shutil.which(b) is None]
    if gone:
        return f"not installed: {', '.join(gone)} (make system-deps installs them)"
    if os.geteuid() != 0:
        return "the one-node Slurm cluster runs as root"
    return ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
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
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={r}/munge/munge.sock
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
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
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=600
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
""")

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
