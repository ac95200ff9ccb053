"""Where the gateway's calls go: rollout servers over HTTP (``Servers``: the least busy one
that answers, as the fleet routes), or an ``Engine`` in this process (``InProcess``). Each
returns the completion (token ids and sampling logprobs), the server's name and the policy
version it serves."""

from __future__ import annotations

import threading
import time

from composer_dag.inference.engine import Completion, Engine, Sampling
from composer_dag.inference.server import ServerClient, ServerDown


class Upstream:
    """Where a call is sampled: ``complete`` returns the completion, the server's name and the
    policy version it served; ``episode`` is the calling episode's key."""

    def complete(self, prompt_ids: list[int], sampling: Sampling, episode: str | None = None) -> tuple[Completion, str, str | None]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class InProcess(Upstream):
    """One engine in this process, one call at a time; ``version``: what it reports."""

    def __init__(self, engine: Engine, version: str | None = None, name: str = "in-process"):
        self.engine, self.version, self.name = engine, version, name
        self._lock = threading.Lock()

    def complete(self, prompt_ids, sampling, episode=None):
        with self._lock:
            c = self.engine.generate([list(prompt_ids)], sampling)[0]
        return c, self.name, self.version


class Bound(Upstream):
    """Each episode's calls go to the engine bound to its key: the rollout fleet picks a server
    for an episode (least busy among those serving a recent enough version) as it does for the
    built-in loop, and an external harness's episode keeps to it. Calls on one engine are
    serialized when ``exclusive`` (an in-process engine); a server's client is not."""

    def __init__(self):
        self._bound: dict[str, tuple] = {}
        self._lock = threading.Lock()

    def bind(self, key: str, engine, version: str | None, name: str = "bound", exclusive: bool = False) -> None:
        with self._lock:
            self._bound[key] = (engine, version, name, threading.Lock() if exclusive else None)

    def unbind(self, key: str) -> None:
        with self._lock:
            self._bound.pop(key, None)

    def complete(self, prompt_ids, sampling, episode=None):
        with self._lock:
            bound = self._bound.get(episode or "")
        if bound is None:
            raise ServerDown("no server is bound to this episode")
        engine, version, name, lock = bound
        if lock is None:
            return engine.generate([list(prompt_ids)], sampling)[0], name, version
        with lock:
            return engine.generate([list(prompt_ids)], sampling)[0], name, version


class Servers(Upstream):
    """vLLM servers by URL: each call goes to the one with the fewest calls in flight among those
    up; a server that stops answering is set aside for ``down_s`` seconds and the call tries the
    next. The policy version each serves is read from its ``/weight_info`` every ``poll_s``."""

    def __init__(self, urls: list[str], timeout: float = 600.0, poll_s: float = 1.0, down_s: float = 5.0):
        if not urls:
            raise ValueError("the gateway needs at least one upstream server")
        self.clients = [ServerClient(u.rstrip("/"), timeout=timeout) for u in urls]
        self.in_flight = [0] * len(urls)
        self.down_until = [0.0] * len(urls)
        self.versions: list[str | None] = [None] * len(urls)
        self.poll_s, self.down_s = poll_s, down_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._poll()
        self._poller = threading.Thread(target=self._poll_loop, name="gateway-versions", daemon=True)
        self._poller.start()

    def _poll(self) -> None:
        for i, c in enumerate(self.clients):
            try:
                self.versions[i] = c.weight_version()
            except Exception:  # a server without the dev endpoints, or down: keep what it said last
                pass

    def _poll_loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._poll()

    def close(self) -> None:
        self._stop.set()

    def _pick(self, tried: set[int]) -> int | None:
        now = time.monotonic()
        with self._lock:
            up = [i for i in range(len(self.clients)) if i not in tried and self.down_until[i] <= now]
            if not up:
                up = [i for i in range(len(self.clients)) if i not in tried]
            if not up:
                return None
            i = min(up, key=lambda j: self.in_flight[j])
            self.in_flight[i] += 1
            return i

    def complete(self, prompt_ids, sampling, episode=None):
        tried: set[int] = set()
        last: Exception | None = None
        while (i := self._pick(tried)) is not None:
            tried.add(i)
            try:
                c = self.clients[i].complete(prompt_ids, sampling, sampling.seed)
                return c, self.clients[i].url, self.versions[i]
            except ServerDown as e:
                last = e
                with self._lock:
                    self.down_until[i] = time.monotonic() + self.down_s
            finally:
                with self._lock:
                    self.in_flight[i] -= 1
        raise ServerDown(f"no upstream server answered ({last})")


class Scripted(Upstream):
    """Replies given in advance, one per call in order, as the policy's tokens (each ended by the
    end-of-turn token; logprobs 0): a reference policy for checking a harness's plumbing end to
    end, and for demonstrations. Past the last reply every call gets an empty turn."""

    def __init__(self, tokenizer, replies: list[str], name: str = "scripted"):
        self.tok, self.replies, self.name = tokenizer, list(replies), name
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self._lock = threading.Lock()
        self.served = 0

    def complete(self, prompt_ids, sampling, episode=None):
        with self._lock:
            text = self.replies[self.served] if self.served < len(self.replies) else ""
            self.served += 1
        ids = self.tok(text, add_special_tokens=False).input_ids[:max(0, sampling.max_tokens - 1)] + [self.end]
        return Completion(list(prompt_ids), ids, [0.0] * len(ids), text, "stop"), self.name, "scripted"
