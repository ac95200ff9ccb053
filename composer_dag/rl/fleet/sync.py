"""Keeping rollout servers on the published weights, and checking that they really are.

``Fleet`` holds the orchestrator's view of its servers: which version each one serves (after
its probe check passed), whether it is up, how many episodes it runs. One ``_Sync`` thread per
server polls ``latest.json`` (and the server's own ``/weight_info``); when either says the
server is behind, it rebuilds the next version (the latest for a server that holds none) (``WeightCache``: full + deltas, sha256 and digest
checked) into ``work_dir/v<version>/model.safetensors`` (once for all servers), has the server
reload it in place, then scores the fixed probe sequence on the server and compares with the
reference logprobs of the same bf16 weights computed here with transformers on CPU. A
difference beyond ``probe_tolerance`` stops the run: ``ProbeMismatch``, one line.

Why a thread in the orchestrator and not a process beside each server: the orchestrator must
know each server's version at the moment it routes an episode (staleness bound) and learns of a
dead server from its episodes first; the rebuild and the reference scoring are done once per
version for the whole fleet instead of once per server (on two cores that is what costs); and a
failed check stops the run from the process that owns the run. The price: a server must see
the orchestrator's ``work_dir`` (same host or a shared filesystem); a server on another machine
would need the same loop beside it.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field

from ..weights import WeightCache, latest_version
from .server import ServerClient, ServerDown


class ProbeMismatch(RuntimeError):
    """A server's probe logprobs differ from the published weights' beyond the tolerance."""


class FleetStopped(RuntimeError):
    pass


def probe_sequence(vocab_size: int, n: int, seed: int = 1234) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab_size) for _ in range(n)]


class Reference:
    """Reference logprobs of the probe under a published version: the policy's architecture in
    transformers (float32, CPU) with that version's tensors loaded; one scoring per version."""

    def __init__(self, policy_dir: str, probe: list[int]):
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
        self.probe, self.cache, self.lock = probe, {}, threading.Lock()

    def logprobs(self, version: int, state: dict) -> list[float]:
        import torch

        with self.lock:
            if version not in self.cache:
                self.model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
                x = torch.tensor([self.probe])
                with torch.no_grad():
                    lp = self.model(input_ids=x).logits[0, :-1].float().log_softmax(-1)
                self.cache[version] = lp.gather(-1, x[0, 1:, None]).squeeze(-1).tolist()
            return self.cache[version]


@dataclass
class Server:
    index: int
    client: ServerClient
    version: int | None = None       # the version it serves, probe-checked
    alive: bool = False
    inflight: int = 0
    reloads: list = field(default_factory=list)   # {"version", "reload_s", "probe_diff"}
    versions_served: list = field(default_factory=list)
    deaths: int = 0

    @property
    def id(self) -> str:
        return f"s{self.index}"


class Fleet:
    def __init__(self, urls: list[str], storage, prefix: str, policy_dir: str, work_dir: str, cfg, log=print):
        from ...train.tokenizer import load_tokenizer

        self.cfg, self.storage, self.prefix, self.work_dir, self.log = cfg, storage, prefix, work_dir, log
        self.servers = [Server(i, ServerClient(u.rstrip("/"), cfg.request_timeout)) for i, u in enumerate(urls)]
        self.cache = WeightCache(storage, prefix)
        vocab = len(load_tokenizer(policy_dir))
        self.reference = Reference(policy_dir, probe_sequence(vocab, cfg.probe_tokens))
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.latest: int | None = None
        self._build_lock = threading.Lock()
        self._dirs: dict[int, str] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        os.makedirs(work_dir, exist_ok=True)

    # -- lifecycle
    def start(self) -> "Fleet":
        for s in self.servers:
            t = threading.Thread(target=self._sync, args=(s,), name=f"sync-{s.id}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        with self.cond:
            self.cond.notify_all()
        for t in self._threads:
            t.join(timeout=10)

    def fail(self, exc: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = exc
            self.cond.notify_all()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    # -- routing
    def acquire(self, min_version: int, timeout: float | None = None) -> Server:
        """The up server with the fewest episodes among those serving ``min_version`` or newer
        (waits for one)."""
        deadline = time.monotonic() + (timeout or self.cfg.version_timeout)
        with self.cond:
            while True:
                self.check()
                ok = [s for s in self.servers if s.alive and s.version is not None and s.version >= min_version]
                if ok:
                    s = min(ok, key=lambda s: (s.inflight, s.index))
                    s.inflight += 1
                    return s
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    raise FleetStopped(f"no rollout server serves version {min_version} or newer after "
                                       f"{timeout or self.cfg.version_timeout:.0f} s: "
                                       + ", ".join(f"{s.id} {'up' if s.alive else 'down'} v{s.version}"
                                                   for s in self.servers))
                self.cond.wait(min(left, 1.0))

    def release(self, s: Server) -> None:
        with self.cond:
            s.inflight -= 1
            self.cond.notify_all()

    def mark_dead(self, s: Server) -> None:
        with self.cond:
            if s.alive:
                s.deaths += 1
                self.log(f"rollout server {s.id} ({s.client.url}) is down")
            s.alive, s.version = False, None
            self.cond.notify_all()

    def wait_serving(self, version: int, servers: list[Server] | None = None, timeout: float | None = None) -> None:
        """Until every server of ``servers`` (default: every up one) serves ``version`` or newer."""
        deadline = time.monotonic() + (timeout or self.cfg.version_timeout)
        with self.cond:
            while True:
                self.check()
                group = servers if servers is not None else [s for s in self.servers if s.alive]
                if group and all(s.alive and s.version is not None and s.version >= version for s in group):
                    return
                if time.monotonic() > deadline:
                    raise FleetStopped(f"servers not on version {version} after {timeout or self.cfg.version_timeout:.0f} s")
                self.cond.wait(1.0)

    # -- weights
    def _weights_dir(self, version: int) -> tuple[str, dict]:
        with self._build_lock:
            state = self.cache.get(version)  # verified: sha256 of each blob, digest of each version
            d = self._dirs.get(version)
            if d is None:
                from safetensors.torch import save_file

                d = os.path.join(self.work_dir, f"v{version:08d}")
                os.makedirs(d, exist_ok=True)
                tmp = os.path.join(d, ".model.safetensors.tmp")
                save_file(state, tmp, metadata={"format": "pt"})
                os.replace(tmp, os.path.join(d, "model.safetensors"))
                self._dirs[version] = d
                import shutil

                held = [x.version for x in self.servers if x.version is not None]
                for v in [v for v in self._dirs if held and v < min(held) and v != version]:
                    shutil.rmtree(self._dirs.pop(v), ignore_errors=True)  # no server needs it any more
            return d, state

    def _sync(self, s: Server) -> None:
        cfg = self.cfg
        skip = tuple(cfg.skip_reload) if cfg.skip_reload else None
        while not self._stop.is_set():
            try:
                if not s.client.healthy():
                    if s.alive:
                        self.mark_dead(s)
                    self._stop.wait(cfg.poll_seconds)
                    continue
                latest = latest_version(self.storage, self.prefix)
                self.latest = latest if latest is not None else self.latest
                reported = s.client.weight_version()
                behind = latest is not None and (s.version is None or s.version < latest or reported != str(s.version))
                if not behind:
                    if not s.alive:
                        with self.cond:
                            s.alive = True
                            self.cond.notify_all()
                    self._stop.wait(cfg.poll_seconds)
                    continue
                # one version at a time (each one is served and probe-checked); a server that
                # knows no version yet, or lost it (restarted), goes straight to the latest
                fresh = s.version is None or reported != str(s.version)
                latest = latest if fresh else min(latest, s.version + 1)
                d, state = self._weights_dir(latest)
                if skip == (s.index, latest):  # fault injection: claim the version, keep the old weights
                    s.client._call("/update_weight_version", {"new_version": str(latest)})
                    secs = 0.0
                    self.log(f"{s.id}: skipping the reload of version {latest} (fault injection)")
                else:
                    secs = s.client.reload(d, latest)
                got = s.client.score(self.reference.probe)
                ref = self.reference.logprobs(latest, state)
                diff = max(abs(a - b) for a, b in zip(got, ref))
                if diff > cfg.probe_tolerance:
                    raise ProbeMismatch(
                        f"probe check failed: rollout server {s.id} ({s.client.url}) after loading version {latest} "
                        f"scores the probe {diff:.3g} nats away from the published weights (tolerance "
                        f"{cfg.probe_tolerance:g}); stopping the run")
                with self.cond:
                    s.version, s.alive = latest, True
                    s.reloads.append({"version": latest, "reload_s": round(secs, 4), "probe_diff": diff,
                                      "rebuild_s": round(self.cache.last_seconds, 4)})
                    if latest not in s.versions_served:
                        s.versions_served.append(latest)
                    self.cond.notify_all()
            except ServerDown:
                self.mark_dead(s)
                self._stop.wait(cfg.poll_seconds)
            except ProbeMismatch as e:
                self.fail(e)
                return
            except Exception as e:  # a broken publication (DigestMismatch, ...) also stops the run
                self.fail(RuntimeError(f"weight sync of rollout server {s.id} failed: {type(e).__name__}: {e}"))
                return

    def summary(self) -> dict:
        return {s.id: {"url": s.client.url, "version": s.version, "alive": s.alive, "deaths": s.deaths,
                       "versions_served": s.versions_served, "reloads": s.reloads} for s in self.servers}


def role_main(description: str, run, argv=None) -> dict:
    """Entry point of a fleet role's process (trainer, orchestrator): the RL config in, and a
    fleet failure (probe mismatch, stopped fleet, timeout) as one line with exit status 1."""
    from ...pipes import entry_point
    from ..run import RLConfig

    try:
        return entry_point(RLConfig, description, run, argv)
    except (ProbeMismatch, FleetStopped, TimeoutError) as e:
        raise SystemExit(str(e)) from None
