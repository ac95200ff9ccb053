"""A rollout server that keeps itself on the published weights: for servers that share no disk
with the orchestrator (``fleet.weight_sync: server``).

    python -m composer_dag.rl.fleet.serve --weights-uri URI [--work-dir DIR] [--poll-seconds S]
        [--skip-reload V] -- <vLLM OpenAI server arguments, --model DIR|URL among them>
    python -m composer_dag.rl.fleet.serve --attach http://HOST:PORT --weights-uri URI ...

The first form starts vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``
with ``VLLM_SERVER_DEV_MODE=1``) as its child, in the same process group (a cluster backend
that stops the group, cancels the job or deletes the pod stops both), waits until it answers,
then runs the ``Follower`` loop against it over loopback; it exits when the server exits (with
its status) or on SIGTERM/SIGINT (stopping the server). A ``--model`` given as a storage URL
(``s3://...``, ``file://...``) is downloaded into the work directory first, so the machine
needs nothing but the storage (``--max-model-len`` is capped at what its positions cover).
``--attach`` runs only the loop, for a server already running
on this machine.

The loop: poll ``<weights-uri>/latest.json``; when the server is behind, rebuild the next
version (the latest for a server that holds none or was restarted) from the full checkpoint
+ deltas (``WeightCache``: each blob's sha256 and each version's digest checked) into
``<work-dir>/v<version>/model.safetensors`` on this machine, and have the server reload it
in place (``ServerClient.reload``: ``/pause?mode=wait``, ``/collective_rpc reload_weights``,
``/reset_prefix_cache``, ``/update_weight_version``, ``/resume``). The version the server
reports is a tag ``<version>@<first 16 hex of the version's digest>`` (``version_tag``): the
orchestrator reads it from ``/weight_info``, checks the digest against the published manifest
(a server left on another run's weights does not pass for this run's version), rebuilds the
same version itself for the reference logprobs and scores the probe on the server, so the
tracking of versions, the staleness bound and the probe check stay in the orchestrator. One
version at a time, as with the orchestrator's sync: every version is served and can be
checked. A broken publication (``DigestMismatch``) is logged and retried; the server keeps
serving the version it holds, and the orchestrator, which rebuilds the same version, stops the
run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from ...inference.server import VLLM_SERVER, ServerClient, ServerDown, server_env


def version_tag(version: int, digest: str) -> str:
    """What a following server reports as its weight version."""
    return f"{version}@{digest[:16]}"


def parse_tag(tag) -> tuple[int, str] | None:
    """``(version, digest prefix)`` of a ``version_tag``; ``None`` for anything else (a fresh
    server, a plain version number)."""
    if not isinstance(tag, str) or "@" not in tag:
        return None
    v, _, d = tag.partition("@")
    return (int(v), d) if v.isdigit() and d else None


class Follower:
    """Keeps one server on the weights published under ``prefix`` of ``storage``."""

    def __init__(self, client: ServerClient, storage, prefix: str, work_dir: str, poll_seconds: float = 0.5,
                 skip_version: int | None = None, log=print):
        from ..weights import WeightCache

        self.client, self.storage, self.prefix, self.work_dir = client, storage, prefix, work_dir
        self.poll_seconds, self.skip_version, self.log = poll_seconds, skip_version, log
        self.cache = WeightCache(storage, prefix)
        self.loaded: str | None = None     # the tag this follower set on the server
        self.reloads: list[dict] = []      # {"version", "reload_s", "rebuild_s"}
        os.makedirs(work_dir, exist_ok=True)

    def step(self) -> bool:
        """One poll: reload the next version if the server is behind. True if it reloaded."""
        from ..weights import latest_version, version_manifest, write_weights_dir

        latest = latest_version(self.storage, self.prefix)
        if latest is None:
            return False
        fresh = self.loaded is None or self.client.weight_version() != self.loaded
        have = None if fresh else parse_tag(self.loaded)[0]
        if have is not None and have >= latest:
            return False
        version = latest if have is None else have + 1
        t0 = time.perf_counter()
        state = self.cache.get(version)  # verified: sha256 of each blob, digest of each version
        rebuild_s = time.perf_counter() - t0
        tag = version_tag(version, version_manifest(self.storage, self.prefix, version)["digest"])
        if version == self.skip_version:  # fault injection: claim the version, keep the old weights
            self.client.set_weight_version(tag)
            secs = 0.0
            self.log(f"skipping the reload of version {version} (fault injection)")
        else:
            d = write_weights_dir(state, os.path.join(self.work_dir, f"v{version:08d}"))
            secs = self.client.reload(d, tag)
            for old in os.listdir(self.work_dir):  # the server holds its weights in memory now
                if old.startswith("v") and os.path.join(self.work_dir, old) != d:
                    shutil.rmtree(os.path.join(self.work_dir, old), ignore_errors=True)
        self.loaded = tag
        self.reloads.append({"version": version, "reload_s": round(secs, 4), "rebuild_s": round(rebuild_s, 4)})
        self.log(f"serving version {version} ({tag}): rebuilt in {rebuild_s:.2f} s, reloaded in {secs:.2f} s")
        return True

    def run(self, stop: threading.Event, alive=lambda: True) -> None:
        """Poll until ``stop`` is set or ``alive()`` is false; a server that does not answer is
        waited for (a restarted one gets the latest version)."""
        while not stop.is_set() and alive():
            try:
                if not self.client.healthy():
                    self.loaded = None
                elif self.step():
                    continue
            except ServerDown:
                self.loaded = None
            except Exception as e:  # noqa: BLE001 - a broken publication, storage down: keep serving, retry
                self.log(f"cannot take the published version: {type(e).__name__}: {e}")
            stop.wait(self.poll_seconds)


def _arg(args: list[str], name: str, default: str | None = None) -> str | None:
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return default


def _set_arg(args: list[str], name: str, value: str) -> list[str]:
    out = list(args)
    for i, a in enumerate(out):
        if a == name and i + 1 < len(out):
            out[i + 1] = value
            return out
        if a.startswith(name + "="):
            out[i] = f"{name}={value}"
            return out
    return out + [name, value]


def fetch_model(model: str, work_dir: str, log=print) -> str:
    """``model`` if it is a local directory, else the storage URL downloaded under ``work_dir``
    (checked against its manifest when it has one)."""
    if "://" not in model or model.startswith("file://") and os.path.isdir(model[len("file://"):]):
        return model[len("file://"):] if model.startswith("file://") else model
    from ...storage import open_storage

    st = open_storage(model)
    dst = os.path.join(work_dir, "model")
    t0 = time.perf_counter()
    st.get_dir(model, dst)
    if st.exists(st.url("manifest.json")):
        st.verify_manifest(model)
    log(f"model {model} downloaded in {time.perf_counter() - t0:.1f} s")
    return dst


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python -m composer_dag.rl.fleet.serve",
                                description="a vLLM rollout server that follows the published weights")
    p.add_argument("--weights-uri", required=True, help="where the trainer publishes (latest.json, v*.json)")
    p.add_argument("--work-dir", help="where versions are rebuilt on this machine (default: a temporary directory)")
    p.add_argument("--poll-seconds", type=float, default=0.5)
    p.add_argument("--skip-reload", type=int, help="fault injection: report this version without loading it")
    p.add_argument("--attach", help="follow a server already running at this URL instead of starting one")
    p.add_argument("--start-timeout", type=float, default=900.0)
    a = p.parse_args(argv)

    def log(msg: str) -> None:
        print(f"[serve] {msg}", file=sys.stderr, flush=True)

    from ...storage import open_storage

    work = a.work_dir or tempfile.mkdtemp(prefix="composer-serve-")
    storage = open_storage(a.weights_uri)
    stop = threading.Event()
    child: subprocess.Popen | None = None

    def on_signal(signum, frame):
        stop.set()
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        if a.attach:
            url = a.attach.rstrip("/")
        else:
            if _arg(rest, "--model") is None:
                p.error("the vLLM server arguments after -- need --model")
            model = fetch_model(_arg(rest, "--model"), work, log)
            rest = _set_arg(rest, "--model", model)
            from ...inference.engine import model_max_len

            cap = model_max_len(model)  # vLLM refuses a context longer than the model's positions
            if cap and int(_arg(rest, "--max-model-len", "0")) > cap:
                rest = _set_arg(rest, "--max-model-len", str(cap))
            port = _arg(rest, "--port", "8000")
            host = _arg(rest, "--host", "127.0.0.1")
            url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{port}"
            # same process group as this wrapper: stopping the group stops the server too
            child = subprocess.Popen([sys.executable, *VLLM_SERVER, *rest], env=server_env(None),
                                     stdin=subprocess.DEVNULL)
        client = ServerClient(url)
        alive = (lambda: True) if child is None else (lambda: child.poll() is None)
        deadline = time.monotonic() + a.start_timeout
        while not stop.is_set() and alive() and not client.healthy():
            if time.monotonic() > deadline:
                log(f"the server at {url} did not answer within {a.start_timeout:.0f} s")
                return 1
            stop.wait(1.0)
        follower = Follower(client, storage, storage.root, os.path.join(work, "versions"), a.poll_seconds,
                            a.skip_reload, log)
        follower.run(stop, alive)
        if child is not None and child.poll() is not None and not stop.is_set():
            log(f"the vLLM server exited with status {child.returncode}")
            return child.returncode or 1
        return 0
    finally:
        if child is not None and child.poll() is None:
            child.terminate()
            try:
                child.wait(timeout=20)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        if not a.work_dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
