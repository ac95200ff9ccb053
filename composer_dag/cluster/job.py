"""A stage's job on a node that shares no disk with Dagster: storage URLs in, storage URLs out.

``python -m composer_dag.cluster.job --spec URL`` reads a job spec (JSON, written by the
launching asset) from artifact storage, and then, in a scratch directory of its own:

1. pulls every input (``{"url", "digest"}``) and checks it against its manifest and the digest
   the asset saw, so a job never trains on an artifact that changed or arrived half;
2. pulls the stage's resumable state from ``state_url`` (keyed by the inputs and settings, so a
   retry on another node resumes where the last job's newest sealed checkpoint left off);
3. writes the stage config with ``{scratch}`` in its path fields replaced by the scratch path,
   and runs the stage's entry point (``torchrun``/``deepspeed``/``python``) on it, while a
   thread copies the state back to ``state_url`` as it changes (sealed checkpoints only, their
   ``manifest.json`` after their files and ``latest`` last, so what is there always resumes);
4. publishes each output (``{"url", "files": [[dest, src], ...]}``, ``src`` relative to the
   stage's ``out_dir``, ``{key}`` taken from the stage's result, glob patterns allowed) sealed
   with a manifest, and reports ``{"summary", "outputs": {name: {"url", "digest"}}}`` as its
   result; a failure is reported as ``{"error": "<the failing rank's exception>"}``.

On a multi-node job one such process runs per node (``SLURM_NODEID``); node 0 reports and
publishes. Every node syncs its own part of the state (node 0 to ``state_url``, node k to
``state_url/nodes/<k>``) and pulls all of them: no disk is shared between nodes.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import posixpath
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from ..runtime.checkpoint import PER_NODE_ENV, write_json_atomic
from ..runtime.errors import error_line
from ..pipes import RESULT_PATH_ENV, Reporter
from ..storage import MANIFEST, ArtifactError, Storage, open_storage

SCRATCH = "{scratch}"
STATE_SYNC_S = 1.0
NODES_DIR = "nodes"  # under the state URL: node k's part of each checkpoint (k >= 1)

def _fill(obj: Any, scratch: str) -> Any:
    if isinstance(obj, str):
        return obj.replace(SCRATCH, scratch)
    if isinstance(obj, dict):
        return {k: _fill(v, scratch) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fill(v, scratch) for v in obj]
    return obj
from .spec import LaunchSpec, local_command


def pull_input(storage: Storage, name: str, url: str, digest: str | None, dest: str) -> None:
    """Download the artifact at ``url`` into ``dest`` and verify it there: every file against
    its manifest, and the manifest against the digest the launching asset recorded."""
    got = storage.fetch_dir(url, dest)
    if digest and got != digest:
        raise ArtifactError(f"input {name} at {url} is not the artifact the asset saw (manifest digest differs)")


class StateSync:
    """Copies a stage's ``out_dir`` to ``url`` as it changes, so that what is there is always a
    state the stage resumes from: a checkpoint directory (``checkpoints/<tag>/``) goes once it
    is sealed (its files, then its manifest), ``latest`` goes after everything else; temporary
    files and the final ``hf`` export stay behind."""

    def __init__(self, storage: Storage, out_dir: str, url: str, node: int = 0, nodes: int = 1):
        self.storage, self.out_dir, self.state_url = storage, out_dir, url
        self.nodes = nodes
        self.url = url if node == 0 else f"{url}/{NODES_DIR}/{node}"  # where this node's part goes
        self.sent: dict[str, tuple[int, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._lock = threading.Lock()

    def pull(self) -> bool:
        """Download the last synced state into ``out_dir``; True when there was one. On a
        multi-node job every node gets every node's part (a ZeRO checkpoint loads all optimizer
        partitions), and ``latest`` is moved back to the newest checkpoint that every node sealed
        (a node lost between its seal and another's leaves the newer one incomplete)."""
        if not self.storage.exists(f"{self.state_url}/latest"):
            return False
        self.storage.get_dir(self.state_url, self.out_dir)
        if self.nodes > 1 and not self._merge_parts():
            return False
        self.sent = {p: self._stat(p) for p in self._files()}
        return True

    def _merge_parts(self) -> bool:
        """Every node's part of each checkpoint into ``out_dir/checkpoints``, ``latest`` pointed
        at the newest checkpoint sealed by all nodes (False, and no ``latest``, when there is none)."""
        parts = os.path.join(self.out_dir, NODES_DIR)
        ckpts = os.path.join(self.out_dir, "checkpoints")
        sealed = {t for t in _listdir(ckpts) if os.path.exists(os.path.join(ckpts, t, MANIFEST))}
        for k in range(1, self.nodes):
            node_ckpts = os.path.join(parts, str(k), "checkpoints")
            own = set()
            for tag in _listdir(node_ckpts):
                src = os.path.join(node_ckpts, tag)
                try:
                    Storage(src).verify_manifest(src)
                except (ArtifactError, OSError, ValueError):
                    continue  # cut short on its way up, or changed since
                own.add(tag)
                for name in os.listdir(src):
                    if name != MANIFEST:
                        os.makedirs(os.path.join(ckpts, tag), exist_ok=True)
                        os.replace(os.path.join(src, name), os.path.join(ckpts, tag, name))
            sealed &= own
        shutil.rmtree(parts, ignore_errors=True)
        latest = _read_json(os.path.join(self.out_dir, "latest"))
        usable = sorted(t for t in sealed if t <= str(latest.get("tag", "")))
        for tag in _listdir(ckpts):
            if not usable or tag > usable[-1]:
                shutil.rmtree(os.path.join(ckpts, tag), ignore_errors=True)
        if not usable:
            os.remove(os.path.join(self.out_dir, "latest"))
            return False
        if usable[-1] != latest.get("tag"):
            st = _read_json(os.path.join(ckpts, usable[-1], "trainer_state.json"))
            write_json_atomic(os.path.join(self.out_dir, "latest"),
                              {"tag": usable[-1], "step": st.get("step"), "samples": st.get("samples")})
        return True

    def _stat(self, path: str) -> tuple[int, int]:
        st = os.stat(os.path.join(self.out_dir, path))
        return st.st_size, st.st_mtime_ns

    def _files(self) -> list[str]:
        out = []
        for dirpath, dirs, files in os.walk(self.out_dir):
            rel_dir = os.path.relpath(dirpath, self.out_dir)
            parts = [] if rel_dir == "." else rel_dir.split(os.sep)
            if parts[:1] == ["hf"] or any(p.startswith(".") for p in parts):
                dirs[:] = []
                continue
            if len(parts) >= 2 and parts[0] == "checkpoints" and not os.path.exists(
                    os.path.join(self.out_dir, parts[0], parts[1], MANIFEST)):
                dirs[:] = []
                continue  # not sealed yet
            for name in files:
                if name.startswith(".") or ".tmp" in name:
                    continue
                out.append("/".join([*parts, name]))
        return out

    def sync(self) -> int:
        """Upload what changed since the last call; returns the number of files sent."""
        with self._lock:
            changed = []
            for rel in self._files():
                try:
                    stat = self._stat(rel)
                except FileNotFoundError:
                    continue
                if self.sent.get(rel) != stat:
                    changed.append((rel, stat))
            # manifests after the files they seal, ``latest`` after everything
            changed.sort(key=lambda x: (x[0] == "latest", posixpath.basename(x[0]) == MANIFEST, x[0]))
            for rel, stat in changed:
                try:
                    self.storage.put_file(os.path.join(self.out_dir, rel), f"{self.url}/{rel}")
                except FileNotFoundError:
                    continue  # removed meanwhile (an old checkpoint the stage dropped)
                self.sent[rel] = stat
            return len(changed)

    def _loop(self) -> None:
        while not self._stop.wait(STATE_SYNC_S):
            try:
                self.sync()
            except Exception as exc:  # noqa: BLE001 - retried next round; the final sync raises
                print(f"state sync to {self.url} failed, retrying: {exc}", file=sys.stderr, flush=True)

    def start(self) -> "StateSync":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        self.sync()


def _listdir(path: str) -> list[str]:
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            out = json.load(f)
        return out if isinstance(out, dict) else {}
    except (OSError, ValueError):
        return {}


def stage_command(spec: dict, config_path: str) -> list[str]:
    """The argv that runs the stage on this node: one process, or torchrun/deepspeed with
    ``nproc_per_node`` ranks (multi-node: c10d rendezvous at ``$COMPOSER_RDZV_ENDPOINT``)."""
    lspec = LaunchSpec(entry=spec["entry"], args=["--config", config_path],
                              launcher=spec.get("launcher", "python"),
                              nproc_per_node=int(spec.get("nproc_per_node", 1)),
                              nnodes=int(spec.get("nnodes", 1)))
    if lspec.nnodes > 1:
        endpoint = os.environ["COMPOSER_RDZV_ENDPOINT"]
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(lspec.nnodes),
                "--nproc-per-node", str(lspec.nproc_per_node), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", endpoint, "--rdzv-id", os.environ.get("SLURM_JOB_ID", "composer"),
                "-m", lspec.entry, *lspec.args]
    return local_command(lspec)


def _pump(stream, sink, lines: collections.deque, rep: Reporter) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        sink.write(line + "\n")
        sink.flush()
        lines.append(line)
        rep.log(line)
    stream.close()


def run_stage_process(spec: dict, config_path: str, scratch: str, rep: Reporter,
                      need_result: bool = True) -> tuple[int, str, dict | None]:
    """Run the stage; forward its output; return (exit code, error line, result). A node other
    than the first runs ranks that write no result (``need_result=False``)."""
    result_path = os.path.join(scratch, "result.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DAGSTER_PIPES")}
    env.update({str(k): str(v) for k, v in (spec.get("env") or {}).items()})
    env[RESULT_PATH_ENV] = result_path
    if int(spec.get("nnodes", 1)) > 1:  # each node's out_dir is its own
        env[PER_NODE_ENV] = "1"
    cmd = stage_command(spec, config_path)
    rep.log(f"[job] {' '.join(cmd)}")
    proc = subprocess.Popen(cmd, env=env, cwd=scratch, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    tail: collections.deque = collections.deque(maxlen=200)
    pumps = [threading.Thread(target=_pump, args=(proc.stdout, sys.stdout, collections.deque(maxlen=1), rep),
                              daemon=True),
             threading.Thread(target=_pump, args=(proc.stderr, sys.stderr, tail, rep), daemon=True)]
    for t in pumps:
        t.start()

    def stop(signum, frame):  # scancel / pod deletion: stop the stage's process group first
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    old = signal.signal(signal.SIGTERM, stop)
    try:
        rc = proc.wait()
    finally:
        signal.signal(signal.SIGTERM, old)
        for t in pumps:
            t.join(timeout=10)
    if rc != 0:
        return rc, error_line(tail), None
    if not need_result:
        return 0, "", None
    if not os.path.exists(result_path):
        return 1, f"{spec['entry']} finished without writing its result", None
    with open(result_path) as f:
        return 0, "", json.load(f)


def publish(storage: Storage, out_dir: str, outputs: dict, result: dict, staging_root: str) -> dict:
    """Stage every output's files from ``out_dir``, upload, seal; ``{name: {url, digest}}``."""
    flat = {k: v for k, v in result.items() if isinstance(v, (str, int, float))}
    published = {}
    for name, out in outputs.items():
        staging = os.path.join(staging_root, name)
        os.makedirs(staging, exist_ok=True)
        for dest, src in out["files"]:
            pattern = os.path.join(out_dir, src.format(**flat))
            for path in sorted(glob.glob(pattern)):
                if os.path.isdir(path):
                    shutil.copytree(path, os.path.join(staging, dest), dirs_exist_ok=True)
                elif glob.has_magic(src) or dest.endswith("/") or not dest:
                    os.makedirs(os.path.join(staging, dest), exist_ok=True)
                    shutil.copy2(path, os.path.join(staging, dest, os.path.basename(path)))
                else:
                    os.makedirs(os.path.dirname(os.path.join(staging, dest)) or staging, exist_ok=True)
                    shutil.copy2(path, os.path.join(staging, dest))
        published[name] = {"url": out["url"], "digest": storage.publish_dir(staging, out["url"])}
    return published


def run_job(spec_url: str, scratch: str | None = None) -> int:
    node = int(os.environ.get("SLURM_NODEID", "0"))
    nodes = int(os.environ.get("SLURM_NNODES", "1"))
    storage = open_storage(posixpath.dirname(spec_url))
    own_scratch = scratch is None
    scratch = scratch or tempfile.mkdtemp(prefix="composer-job-", dir=os.environ.get("COMPOSER_SCRATCH"))
    with Reporter(rank=node) as rep:
        sync = None
        try:
            spec = storage.read_json(spec_url)
            t0 = time.monotonic()
            for name, inp in (spec.get("inputs") or {}).items():
                pull_input(storage, name, inp["url"], inp.get("digest"), os.path.join(scratch, "inputs", name))
            config = _fill(spec["config"], scratch)
            out_dir = config.get("out_dir") or os.path.join(scratch, "out")
            os.makedirs(out_dir, exist_ok=True)
            if spec.get("state_url"):
                sync = StateSync(storage, out_dir, spec["state_url"], node, nodes)
                if sync.pull():
                    rep.log(f"[job] resuming from the state at {spec['state_url']}")
                sync.start()
            rep.log(f"[job] inputs pulled and verified in {time.monotonic() - t0:.1f} s")
            config_path = os.path.join(scratch, f"{spec.get('stage', 'stage')}.json")
            with open(config_path, "w") as f:
                json.dump(config, f, indent=2)
            rc, why, result = run_stage_process(spec, config_path, scratch, rep, need_result=node == 0)
            if sync is not None:
                sync.stop()
                sync = None
            if rc != 0:  # the error line may be empty (killed by a signal): the exit code says it then
                rep.report_custom_message({"error": why, "exit_code": rc})
                print(f"[job] stage failed with exit code {rc}", file=sys.stderr, flush=True)
                return 1
            if node == 0:
                outputs = publish(storage, out_dir, spec.get("outputs") or {}, result, os.path.join(scratch, "publish"))
                rep.result({"summary": result, "outputs": outputs})
            return 0
        except Exception as exc:  # one line to Dagster, the traceback in the job's log
            import traceback

            traceback.print_exc()
            rep.report_custom_message({"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300], "exit_code": 1})
            return 1
        finally:
            if sync is not None:
                try:
                    sync.stop()
                except Exception:  # noqa: BLE001 - the stage's own failure is what to report
                    pass
            if own_scratch:
                shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m composer_dag.cluster.job", description=__doc__.splitlines()[0])
    p.add_argument("--spec", required=True, help="URL of the job spec (JSON)")
    p.add_argument("--scratch", default=None, help="working directory (default: a new one under $COMPOSER_SCRATCH or /tmp, removed at the end)")
    args = p.parse_args(argv)
    return run_job(args.spec, args.scratch)


if __name__ == "__main__":
    sys.exit(main())
