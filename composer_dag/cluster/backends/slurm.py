"""The ``slurm`` backend: batch scripts, parsers for the Slurm tools' output, and ``SlurmBackend``
(``sbatch``, ``scontrol``, ``scancel``): a stage's job is ``srun`` of the job runner once per node,
a service a one-node job, an array ``sbatch --array``."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import threading
import time
from typing import Mapping, Optional

from ..spec import (ARRAY_INDEX_ENV, ArrayConfig, ArrayTask, BIND_ALL, RDZV_PORT, SchedulerError, ServiceConfig,
    ServiceError, ServiceHandle, cache_dir, check_abort, fill_address, free_port, job_argv, job_env, log_tail,
    service_failure, track, untrack, wait_healthy, why_from_log)
from .base import Backend, Interrupts, register_backend

# What ``srun`` runs on each node of a Slurm job: the job's scratch and the node's cache made,
# the job runner run, the scratch removed when it ends (nodes share no disk: each does its own).
# An argument ``@NAME@`` becomes the value of ``$NAME`` on the node: the per-task variables
# (``SLURM_NODEID``, ``SLURM_PROCID``) differ between nodes, so the batch script, which runs on
# the first node only, must not expand them.
NODE_SETUP = ('scratch=$1 cache=$2; shift 2; mkdir -p "$scratch" "$cache"; '
              'trap \'rm -rf "$scratch"\' EXIT; args=(); '
              'for a in "$@"; do if [[ $a =~ ^@([A-Z_]+)@$ ]]; then n=${BASH_REMATCH[1]}; args+=("${!n}"); '
              'else args+=("$a"); fi; done; "${args[@]}"')
SLURM_ENV = ("SLURM_JOB_ID", "SLURM_NODEID", "SLURM_PROCID", "SLURM_NNODES", "COMPOSER_RDZV_ENDPOINT")
# What a Slurm job's end state means, in the step's one-line failure.
SLURM_ENDS = {"CANCELLED": "was cancelled by the scheduler or an operator (scancel)",
              "NODE_FAIL": "lost its node (node failure or DOWN)", "PREEMPTED": "was preempted",
              "OUT_OF_MEMORY": "ran out of memory"}


def slurm_script(command: list[str], name: str = "composer-job", nodes: int = 1,
                 gpus_per_node: int = 0, partition: str | None = None, account: str | None = None,
                 time: str = "04:00:00", output: str = "/tmp/%x-%j.out", chdir: str = "/tmp",
                 container_image: str | None = None, env: dict[str, str] | None = None,
                 setup: list[str] | None = None, sbatch: list[str] | None = None) -> str:
    """An sbatch script: ``srun`` starts ``command`` once per node (the stage's job runner,
    which starts torchrun with c10d rendezvous at the first node of the allocation, exported
    as ``COMPOSER_RDZV_ENDPOINT``). ``container_image`` runs it in a container on sites with
    pyxis/enroot. ``sbatch``: more options (``--array=0-7``, ``--cpus-per-task=4``). The job is
    never requeued by Slurm (``--no-requeue``): a job the scheduler ended fails its step, and the
    step's retry decides what runs again."""
    lines = ["#!/bin/bash", f"#SBATCH --job-name={name}", f"#SBATCH --nodes={nodes}",
             "#SBATCH --ntasks-per-node=1", f"#SBATCH --time={time}",
             f"#SBATCH --output={output}", f"#SBATCH --chdir={chdir}", "#SBATCH --no-requeue"]
    lines += [f"#SBATCH {opt}" for opt in sbatch or []]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if account:
        lines.append(f"#SBATCH --account={account}")
    if gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    lines += ["", "set -euo pipefail"]
    lines += [f"export {k}={shlex.quote(str(v))}" for k, v in (env or {}).items()]
    lines += setup or []
    lines += ['head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              f'export COMPOSER_RDZV_ENDPOINT="$head:{RDZV_PORT}"', ""]
    srun = ["srun", "--kill-on-bad-exit=1"] + (["--label"] if nodes > 1 else [])  # "1: ..." names the node's task
    if container_image:
        srun.append(f"--container-image={shlex.quote(container_image)}")
    lines.append(" ".join([*srun, *map(_shell_word, command)]))
    return "\n".join(lines) + "\n"


def _shell_word(arg: str) -> str:
    """``arg`` quoted for bash; ``${NAME}`` alone stays a reference to the job's environment
    (how a credential reaches a sandboxed job without being written into the script)."""
    return f'"{arg}"' if re.fullmatch(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}", arg) else shlex.quote(arg)


# ---- watching a Slurm job --------------------------------------------------------------
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL",
            "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


def parse_sbatch_output(text: str) -> str:
    """The job id from ``sbatch`` output ("Submitted batch job 123" or ``--parsable`` "123;c")."""
    m = re.search(r"Submitted batch job (\d+)", text) or re.match(r"\s*(\d+)(?:;\S+)?\s*$", text)
    if not m:
        raise ValueError(f"no job id in sbatch output: {text!r}")
    return m.group(1)


def normalize_state(state: str) -> str:
    """'CANCELLED by 123' -> 'CANCELLED'; squeue's short codes (R, PD, CG, ...) -> long names."""
    short = {"PD": "PENDING", "R": "RUNNING", "CG": "COMPLETING", "CD": "COMPLETED",
             "F": "FAILED", "CA": "CANCELLED", "TO": "TIMEOUT", "OOM": "OUT_OF_MEMORY",
             "NF": "NODE_FAIL", "PR": "PREEMPTED", "S": "SUSPENDED", "CF": "CONFIGURING"}
    s = state.strip().split()[0].rstrip("+") if state.strip() else "UNKNOWN"
    return short.get(s, s)


def parse_squeue(text: str) -> dict[str, str]:
    """job id -> state from ``squeue -h -o '%i %T'`` (or ``%t``) output."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0][0].isdigit():
            out[parts[0]] = normalize_state(parts[1])
    return out


def parse_scontrol_job(text: str) -> dict[str, str]:
    """``JobState``, ``Reason`` and ``ExitCode`` from ``scontrol show job -o ID`` output (a job
    stays there for ``MinJobAge`` seconds after it ends; accounting is not needed); {} when
    the job is unknown."""
    out = {}
    for key in ("JobState", "Reason", "ExitCode"):
        m = re.search(rf"\b{key}=(\S+)", text)
        if m:
            out[key] = normalize_state(m.group(1)) if key == "JobState" else m.group(1)
    return out


def parse_sacct(text: str) -> dict[str, dict[str, str]]:
    """job id -> {state, exit_code} from ``sacct -P -n -o JobID,State,ExitCode`` output; job
    steps (``123.batch``, ``123.0``) are skipped."""
    out = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 3 and "." not in parts[0] and parts[0]:
            out[parts[0]] = {"state": normalize_state(parts[1]), "exit_code": parts[2]}
    return out


def is_terminal(state: str) -> bool:
    return normalize_state(state) in TERMINAL


def parse_scontrol_records(text: str) -> list[dict[str, str]]:
    """Every record of ``scontrol show job -o ID`` / ``scontrol show node -o NAME`` output (one
    line each; an array job gives one line per task) as ``{key: value}`` (``JobState``
    normalized)."""
    out = []
    for line in text.splitlines():
        rec = dict(re.findall(r"(?:^|\s)([A-Za-z][\w/:]*)=(\S*)", line))
        if rec:
            if "JobState" in rec:
                rec["JobState"] = normalize_state(rec["JobState"])
            out.append(rec)
    return out


def parse_exit_code(code: str) -> int:
    """Slurm's ``ExitCode=status:signal`` as one number, as ``subprocess`` gives it: the exit
    status, or minus the signal that ended the process (``0:15`` -> -15)."""
    status, _, sig = (code or "0:0").partition(":")
    return -int(sig) if sig and sig.isdigit() and int(sig) else int(status or 0)


@register_backend
class SlurmBackend(Backend):
    """A Slurm cluster whose nodes share no disk with this machine (the same Python environment
    at the same path on each)."""

    name = "slurm"
    node_env = SLURM_ENV  # filled in on each node (NODE_SETUP)

    def render(self, spec_url: str, name: str, env: dict[str, str], scratch: str) -> str:
        """The job's sbatch script: ``srun`` of the job runner on every node, in a scratch
        directory each node makes before it starts and removes when it ends."""
        c = self.cluster
        argv = job_argv(c, spec_url, scratch, env, self.node_env)
        if argv[0] == "bwrap":
            env = {}  # the sandbox gets its environment from the command line
        argv = ["bash", "-c", NODE_SETUP, "composer-node", scratch, cache_dir(c), *argv]
        return slurm_script(
            argv, name=name, nodes=c.nnodes, gpus_per_node=c.gpus_per_node, partition=c.partition,
            account=c.account, time=c.time_limit, output=os.path.join(c.scratch_dir, "%x-%j.out"),
            chdir=c.scratch_dir, container_image=c.container_image, env=env)

    def launch(self, spec_url: str, name: str, env: dict[str, str],
               interrupts: Interrupts = (KeyboardInterrupt,)) -> tuple[Optional[str], Optional[str]]:
        job = sbatch(self.render(spec_url, name, job_env(self.cluster, name, env), self.scratch(name)))
        self.log(f"[cluster:slurm] submitted job {job}")
        try:
            state = wait_slurm(job, self.cluster.poll_seconds)
        except BaseException as exc:  # cancelled run, step timeout, anything: the job must not outlive the step
            why = "run cancelled" if isinstance(exc, interrupts) else type(exc).__name__
            self.log(f"[cluster:slurm] {why}: scancel {job}")
            subprocess.run(["scancel", job], check=False)
            deadline = time.monotonic() + self.cluster.grace_seconds + 30
            while time.monotonic() < deadline and not is_terminal(slurm_state(job).get("JobState", "UNKNOWN")):
                time.sleep(0.5)
            raise
        self.log(f"[cluster:slurm] job {job} ended {state['JobState']}")
        return slurm_failure(job, state, self.cluster.time_limit), None

    def _script(self, argv, name, env, output, cpus, gpus, memory, time_limit, sbatch=(), setup=()) -> str:
        c = self.cluster
        opts = [f"--cpus-per-task={cpus}", *sbatch]
        if memory:
            opts.append(f"--mem={slurm_memory(memory)}")
        if c.log_uri:  # the log leaves the node when the script ends (a failure's lines read from there)
            ship = [sys.executable, "-m", "composer_dag.cluster.backends", "ship-log", output, c.log_uri]
            setup = [f"trap {shlex.quote(' '.join(map(shlex.quote, ship)) + ' || true')} EXIT", *setup]
        return slurm_script(
            list(argv), name=name, nodes=1, gpus_per_node=gpus, partition=c.partition, account=c.account,
            time=time_limit or c.time_limit, output=output, chdir=c.scratch_dir,
            container_image=c.container_image, env=env, setup=list(setup), sbatch=opts)

    def service_script(self, cfg: ServiceConfig, port: int) -> str:
        """The sbatch script of a service (one node, ``srun`` of its argv, log ``<scratch>/<name>-<job>.out``)."""
        argv = [fill_address(a, BIND_ALL, port) for a in cfg.argv]
        env = {k: fill_address(v, BIND_ALL, port) for k, v in cfg.env.items()}
        return self._script(argv, cfg.name, env, self._service_log(cfg), cfg.cpus, cfg.gpus, cfg.memory, cfg.time_limit,
                            sbatch=[f"--nodelist={cfg.node}"] if cfg.node else [])

    def _service_log(self, cfg: ServiceConfig) -> str:
        return os.path.join(self.cluster.scratch_dir, f"{cfg.name}-%j.out")

    def _readable_log(self, pattern: str, **fields: str) -> str:
        """Where this machine reads the log Slurm writes at ``pattern`` (``%j``, ``%A``, ``%a``
        filled from ``fields``): its copy under ``log_uri``, else the path itself."""
        path = _fill_slurm_pattern(pattern, fields)
        return f"{self.cluster.log_uri.rstrip('/')}/{os.path.basename(path)}" if self.cluster.log_uri else path

    def array_script(self, cfg: ArrayConfig) -> str:
        """The sbatch script of an array (``--array=0-(count-1)%parallelism``, the index exported as
        ``COMPOSER_ARRAY_INDEX``, log ``<scratch>/<name>-<job>_<index>.out``)."""
        parallelism = cfg.parallelism or self.cluster.array_parallelism
        spec = f"--array=0-{cfg.count - 1}" + (f"%{parallelism}" if parallelism else "")
        return self._script(cfg.argv, cfg.name, cfg.env, self._array_log(cfg), cfg.cpus, cfg.gpus, cfg.memory,
                            cfg.time_limit, sbatch=[spec], setup=[f'export {ARRAY_INDEX_ENV}="$SLURM_ARRAY_TASK_ID"'])

    def _array_log(self, cfg: ArrayConfig) -> str:
        return os.path.join(self.cluster.scratch_dir, f"{cfg.name}-%A_%a.out")

    def start(self, cfg: ServiceConfig, abort: Optional[threading.Event] = None) -> ServiceHandle:
        port = cfg.port or free_port()
        out = self._service_log(cfg)
        job = sbatch(self.service_script(cfg, port))
        handle = ServiceHandle(cfg.name, self.name, "", port, "", "", job_id=job, log=self._readable_log(out, j=job),
                               _backend=self)
        track(handle)
        self.log(f"[service:slurm] {cfg.name}: submitted job {job}")
        try:
            queued = time.monotonic()
            while True:
                state = slurm_state(job)
                if is_terminal(state.get("JobState", "UNKNOWN")) or state.get("JobState") == "UNKNOWN":
                    raise service_failure(handle, f"(slurm job {job}) ended {_slurm_what(state)} before it started serving",
                                           handle.log)
                if state.get("JobState") == "RUNNING":
                    break
                check_abort(cfg.name, abort)
                if cfg.queue_timeout_s and time.monotonic() - queued > cfg.queue_timeout_s:
                    raise ServiceError(f"service {cfg.name} (slurm job {job}) waited in the queue for more than "
                                       f"{cfg.queue_timeout_s:g} s ({state.get('Reason', 'no reason given')}); now cancelled")
                time.sleep(min(self.cluster.poll_seconds, 0.5))
            # the URL names the node, as the cluster's other nodes reach it; this machine checks
            # its health at the node's address (NodeAddr), which it reaches whether or not it
            # resolves the cluster's node names
            handle.host, addr = slurm_node_address(job)
            handle.url = f"http://{handle.host}:{port}"
            handle.health_url = fill_address(cfg.health_url, addr, port)
            self.log(f"[service:slurm] {cfg.name}: job {job} runs on {handle.host} ({addr}); "
                     f"waiting for {handle.health_url}")

            def ended() -> Optional[str]:
                st = slurm_state(job)
                return f"slurm job {job} ended {_slurm_what(st)}" if is_terminal(st.get("JobState", "RUNNING")) else None

            wait_healthy(handle, cfg.start_timeout_s, min(self.cluster.poll_seconds, 0.5), ended, abort)
        except BaseException:
            self.stop(handle)
            raise
        return handle

    def stop(self, handle: ServiceHandle) -> None:
        scancel_and_wait(handle.job_id, self.cluster.grace_seconds + 30)
        untrack(handle)
        self.log(f"[service:slurm] {handle.name}: job {handle.job_id} cancelled")

    def run_array(self, cfg: ArrayConfig) -> list[ArrayTask]:
        out = self._array_log(cfg)
        job = sbatch(self.array_script(cfg))
        self.log(f"[array:slurm] {cfg.name}: job {job}, {cfg.count} tasks")
        deadline = time.monotonic() + cfg.timeout_s if cfg.timeout_s else None
        timed_out = False
        try:
            while slurm_queued(job):
                if deadline and time.monotonic() > deadline:
                    timed_out = True
                    scancel_and_wait(job, self.cluster.grace_seconds + 30)
                    break
                time.sleep(self.cluster.poll_seconds)
        except BaseException:
            scancel_and_wait(job, self.cluster.grace_seconds + 30)
            raise
        sc = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True)
        records = {int(r["ArrayTaskId"]): r for r in parse_scontrol_records(sc.stdout)
                   if r.get("ArrayTaskId", "").isdigit()}
        tasks = []
        for i in range(cfg.count):
            r = records.get(i, {})
            state = r.get("JobState", "UNKNOWN")
            code = parse_exit_code(r.get("ExitCode", "0:0")) if r else -1
            log = (self._readable_log(out, A=job, a=str(i)) if self.cluster.log_uri
                   else r.get("StdOut") or _fill_slurm_pattern(out, {"A": job, "a": str(i)}))
            task = ArrayTask(i, code, state, log=log)
            if not task.ok:
                why = why_from_log(log_tail(log))
                task.error = why or (f"{_slurm_what(r)}" if r else "no record of this task in scontrol")
                if timed_out and state in ("CANCELLED", "UNKNOWN"):
                    task.state, task.error = "TIMEOUT", f"array timeout ({cfg.timeout_s:g} s)"
            tasks.append(task)
        return tasks


# ---- Slurm -----------------------------------------------------------------------------------
def sbatch(script: str) -> str:
    out = subprocess.run(["sbatch", "--parsable"], input=script, capture_output=True, text=True)
    if out.returncode != 0:
        raise SchedulerError(f"sbatch failed: {' '.join(out.stderr.split())[:300]}")
    return parse_sbatch_output(out.stdout)


def slurm_state(job: str) -> dict[str, str]:
    """``{"JobState", "Reason", "ExitCode"}`` of a Slurm job: ``squeue`` while it is queued or
    running, then ``scontrol`` (kept ``MinJobAge`` seconds), then ``sacct`` when accounting is
    on; ``{"JobState": "UNKNOWN"}`` if none knows it."""
    q = subprocess.run(["squeue", "-h", "-j", job, "-o", "%i %T"], capture_output=True, text=True)
    state = parse_squeue(q.stdout).get(job)
    if state and not is_terminal(state):
        return {"JobState": state}
    sc = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True)
    found = parse_scontrol_job(sc.stdout) if sc.returncode == 0 else {}
    if found.get("JobState"):
        return found
    acct = subprocess.run(["sacct", "-j", job, "-P", "-n", "-o", "JobID,State,ExitCode"], capture_output=True, text=True)
    row = parse_sacct(acct.stdout).get(job) if acct.returncode == 0 else None
    if row:
        return {"JobState": row["state"], "ExitCode": row["exit_code"]}
    return {"JobState": state or "UNKNOWN"}


def slurm_queued(job: str) -> bool:
    """Whether any task of the job (an array's included) is still in ``squeue``."""
    while True:
        q = subprocess.run(["squeue", "-h", "-j", job, "-o", "%i %T"], capture_output=True, text=True)
        if q.returncode == 0:
            return bool(q.stdout.strip())
        if "Invalid job id" in q.stderr:
            return False
        time.sleep(1.0)  # the controller is busy: ask again


def scancel_and_wait(job: Optional[str], timeout: float) -> None:
    """``scancel`` the job and wait until it has left ``squeue`` (its processes are gone)."""
    if not job:
        return
    subprocess.run(["scancel", job], check=False, capture_output=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and slurm_queued(job):
        time.sleep(0.3)


def wait_slurm(job: str, poll_seconds: float) -> dict[str, str]:
    """The job's final ``{"JobState", ...}``, polled every ``poll_seconds``."""
    while True:
        state = slurm_state(job)
        if is_terminal(state.get("JobState", "PENDING")):
            return state
        time.sleep(poll_seconds)


def slurm_failure(job: str, state: dict[str, str], time_limit: str) -> str | None:
    """None for a completed job, else one line: which job, what ended it, its state and exit code."""
    s = state["JobState"]
    if s == "COMPLETED":
        return None
    if s == "TIMEOUT":  # the job's own limit (an operator may have changed it)
        sc = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True)
        time_limit = next(iter(parse_scontrol_records(sc.stdout)), {}).get("TimeLimit", time_limit)
    what = f"hit its time limit ({time_limit})" if s == "TIMEOUT" else SLURM_ENDS.get(s, "failed")
    return f"in slurm job {job} {what} (state {s}, exit code {state.get('ExitCode', '?')})"


def slurm_node_address(job: str) -> tuple[str, str]:
    """The node that runs the job (its ``BatchHost``) and that node's ``NodeAddr`` (its name
    where Slurm has no address for it)."""
    sc = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True)
    rec = next(iter(parse_scontrol_records(sc.stdout)), {})
    node = rec.get("BatchHost") or rec.get("NodeList", "")
    if not node or node == "(null)":
        raise ServiceError(f"slurm job {job} runs on no node that scontrol names")
    sn = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True, text=True)
    addr = next(iter(parse_scontrol_records(sn.stdout)), {}).get("NodeAddr")
    return node, addr or node


def _slurm_what(state: Mapping[str, str]) -> str:
    s = state.get("JobState", "UNKNOWN")
    what = {"CANCELLED": "cancelled (scancel)", "TIMEOUT": "at its time limit", "NODE_FAIL": "with its node lost (DOWN)",
            "FAILED": "failed", "COMPLETED": "completed", "OUT_OF_MEMORY": "out of memory"}.get(s, s.lower())
    return f"{what} (state {s}, exit code {state.get('ExitCode', '?')})"


def _fill_slurm_pattern(pattern: str, fields: Mapping[str, str]) -> str:
    """An ``--output`` pattern with ``%j`` / ``%A`` / ``%a`` / ``%x`` replaced from ``fields``."""
    return re.sub(r"%([jAax])", lambda m: fields.get(m.group(1), m.group(0)), pattern)


def ship_log(pattern: str, log_uri: str) -> str:
    """Copy this Slurm task's log (``pattern`` filled from its ``SLURM_*`` environment) to
    ``log_uri``; the EXIT trap of a service's or array task's script (``ClusterConfig.log_uri``)."""
    from ...storage import open_storage

    env = os.environ
    path = _fill_slurm_pattern(pattern, {"j": env.get("SLURM_JOB_ID", ""), "A": env.get("SLURM_ARRAY_JOB_ID", ""),
                                         "a": env.get("SLURM_ARRAY_TASK_ID", ""), "x": env.get("SLURM_JOB_NAME", "")})
    url = f"{log_uri.rstrip('/')}/{os.path.basename(path)}"
    open_storage(log_uri).put_file(path, url)
    return url


def slurm_memory(memory: str) -> str:
    """A k8s-style quantity as Slurm's ``--mem`` ("64Gi" -> "64G", "512Mi" -> "512M")."""
    m = re.fullmatch(r"(\d+)([KMGT])i?B?", memory.strip(), re.I)
    return f"{m.group(1)}{m.group(2).upper()}" if m else memory
