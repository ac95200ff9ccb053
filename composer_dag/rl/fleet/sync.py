"""Keeping rollout servers on the published weights, and checking that they really are.

``Fleet`` holds the orchestrator's view of its servers: which version each one serves (after
its probe check passed), whether it is up, how many episodes it runs. One thread per server
polls ``latest.json`` and the server's own ``/weight_info``. Two ways to move a server to a new
version (``fleet.weight_sync``):

- ``orchestrator`` (the default): when the server is behind, the thread rebuilds the next
  version (the latest for a server that holds none) (``WeightCache``: full + deltas, sha256
  and digest checked) into ``work_dir/v<version>/model.safetensors`` (once for all servers)
  and has the server reload it in place.
- ``server``: each server runs ``composer_dag.rl.fleet.serve`` beside it (same process group or
  job), which pulls, rebuilds and reloads on the server's machine and reports
  ``<version>@<digest>``; the thread checks that tag against the published manifest and
  rebuilds the version here only for the reference.

Either way the thread then scores the fixed probe sequence on the server and compares with
the reference logprobs of the same bf16 weights computed here with transformers on CPU; a
difference beyond ``probe_tolerance`` stops the run: ``ProbeMismatch``, one line. Only then
may the server take episodes of that version. Each check is recorded (``reloads``: reload,
rebuild and lag seconds, lag being from the version's first sight on ``latest.json`` to its
check passing, and the probe difference).

Why the orchestrator keeps the version tracking and the checks in both modes: it must know
each server's version at the moment it routes an episode (staleness bound) and learns of a
dead server from its episodes first; the reference scoring is done once per version for the
whole fleet; and a failed check stops the run from the process that owns the run. In the
``orchestrator`` mode the rebuild too is done once per version, which is what costs on two
cores; the price is that a server must see the orchestrator's ``work_dir`` (same host or a
shared filesystem). The ``server`` mode rebuilds once per server and needs nothing shared but
the weights storage.
"""
from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..config import RLConfig
from ..weights import WeightCache, latest_version, version_manifest, write_weights_dir
from ...inference.server import ServerClient, ServerDown


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
        self._seen: dict[int, float] = {}   # version -> when latest.json first showed it
        self.mode = getattr(cfg, "weight_sync", "orchestrator")
        if self.mode == "orchestrator":
            os.makedirs(work_dir, exist_ok=True)

    # -- lifecycle
    def start(self) -> "Fleet":
        loop = self._sync if self.mode == "orchestrator" else self._watch
        for s in self.servers:
            t = threading.Thread(target=loop, args=(s,), name=f"sync-{s.id}", daemon=True)
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
                                                   for s in self.servers) + self._hint())
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
                    raise FleetStopped(f"servers not on version {version} after {timeout or self.cfg.version_timeout:.0f} s: "
                                       + ", ".join(f"{s.id} {'up' if s.alive else 'down'} v{s.version}"
                                                   for s in self.servers) + self._hint())
                self.cond.wait(1.0)

    # -- weights
    def _weights_dir(self, version: int) -> tuple[str, dict]:
        with self._build_lock:
            state = self.cache.get(version)  # verified: sha256 of each blob, digest of each version
            d = self._dirs.get(version)
            if d is None:
                d = write_weights_dir(state, os.path.join(self.work_dir, f"v{version:08d}"))
                self._dirs[version] = d
                import shutil

                held = [x.version for x in self.servers if x.version is not None]
                for v in [v for v in self._dirs if held and v < min(held) and v != version]:
                    shutil.rmtree(self._dirs.pop(v), ignore_errors=True)  # no server needs it any more
            return d, state

    def _follow(self, s: Server, step: Callable[[Server], None]) -> None:
        """Run ``step`` on server ``s`` until the run stops: a server that does not answer is
        marked dead and waited for; a probe mismatch or a broken publication stops the run."""
        cfg = self.cfg
        while not self._stop.is_set():
            try:
                if not s.client.healthy():
                    if s.alive:
                        self.mark_dead(s)
                    self._stop.wait(cfg.poll_seconds)
                    continue
                step(s)
            except ServerDown:
                self.mark_dead(s)
                self._stop.wait(cfg.poll_seconds)
            except ProbeMismatch as e:
                self.fail(e)
                return
            except Exception as e:  # a broken publication (DigestMismatch, ...) also stops the run
                self.fail(RuntimeError(f"weight sync of rollout server {s.id} failed: {type(e).__name__}: {e}"))
                return

    def _alive(self, s: Server) -> None:
        with self.cond:
            s.alive = True
            self.cond.notify_all()

    def _sync(self, s: Server) -> None:
        self._follow(s, self._sync_step)

    def _sync_step(self, s: Server) -> None:
        """``weight_sync: orchestrator``: bring the server to the next version (each one is served
        and probe-checked in turn)."""
        cfg = self.cfg
        skip = tuple(cfg.skip_reload) if cfg.skip_reload else None
        latest = self._poll_latest()
        reported = s.client.weight_version()
        behind = latest is not None and (s.version is None or s.version < latest or reported != str(s.version))
        if not behind:
            if not s.alive:
                self._alive(s)
            self._stop.wait(cfg.poll_seconds)
            return
        # one version at a time (each one is served and probe-checked); a server that
        # knows no version yet, or lost it (restarted), goes straight to the latest
        fresh = s.version is None or reported != str(s.version)
        latest = latest if fresh else min(latest, s.version + 1)
        d, state = self._weights_dir(latest)
        if skip == (s.index, latest):  # fault injection: claim the version, keep the old weights
            s.client.set_weight_version(latest)
            secs = 0.0
            self.log(f"{s.id}: skipping the reload of version {latest} (fault injection)")
        else:
            secs = s.client.reload(d, latest)
        diff = self._probe(s, latest, state)
        self._serving(s, latest, {"reload_s": round(secs, 4), "probe_diff": diff,
                                  "rebuild_s": round(self.cache.last_seconds, 4)})

    def _hint(self) -> str:
        return ("" if self.mode == "orchestrator" else
                " (weight_sync server: each server reloads by itself, under python -m composer_dag.rl.fleet.serve)")

    def _poll_latest(self) -> int | None:
        latest = latest_version(self.storage, self.prefix)
        if latest is not None:
            with self.cond:  # versions published between two polls count as seen now
                self.latest, now = latest, time.monotonic()
                for v in range(max(self._seen) + 1 if self._seen else latest, latest + 1):
                    self._seen.setdefault(v, now)
        return latest

    def _serving(self, s: Server, version: int, info: dict) -> None:
        """``s`` serves ``version``, probe-checked: it may take episodes of that version."""
        seen = self._seen.get(version)
        with self.cond:
            s.version, s.alive = version, True
            s.reloads.append({"version": version, **info,
                              "lag_s": round(time.monotonic() - seen, 4) if seen is not None else None})
            if version not in s.versions_served:
                s.versions_served.append(version)
            self.cond.notify_all()

    def _probe(self, s: Server, version: int, state: dict, moved_on=lambda: False) -> float:
        """Score the probe on ``s`` and compare with the reference of ``version``; stop the run
        (``ProbeMismatch``) beyond the tolerance, unless ``moved_on()`` says the server took
        another version meanwhile (then the score is not of ``version``: -1.0, check again).
        Returns the largest difference."""
        got = s.client.score(self.reference.probe)
        ref = self.reference.logprobs(version, state)
        diff = max(abs(a - b) for a, b in zip(got, ref))
        if diff > self.cfg.probe_tolerance and moved_on():
            return -1.0
        if diff > self.cfg.probe_tolerance:
            raise ProbeMismatch(
                f"probe check failed: rollout server {s.id} ({s.client.url}) after loading version {version} "
                f"scores the probe {diff:.3g} nats away from the published weights (tolerance "
                f"{self.cfg.probe_tolerance:g}); stopping the run")
        return diff

    def _watch(self, s: Server) -> None:
        """``weight_sync: server``: the server reloads by itself (``composer_dag.rl.fleet.serve``
        beside it); this thread tracks the version it reports (``<version>@<digest>``, checked
        against the published manifest), rebuilds that version here for the reference and
        checks the probe, then lets the server take episodes of it."""
        self._follow(s, self._watch_step)

    def _watch_step(self, s: Server) -> None:
        from .serve import parse_tag

        cfg = self.cfg
        self._poll_latest()
        reported = s.client.weight_version()
        tag = parse_tag(reported)
        if tag is None or tag[0] == s.version:  # nothing published loaded yet, or checked already
            if tag is not None and not s.alive:
                self._alive(s)
            self._stop.wait(cfg.poll_seconds)
            return
        version = tag[0]
        meta = version_manifest(self.storage, self.prefix, version)
        if meta is None or not meta["digest"].startswith(tag[1]):
            # another run's weights (a server reused across runs): not this run's version
            if s.version is not None:
                with self.cond:
                    s.version = None
                    self.cond.notify_all()
            self._stop.wait(cfg.poll_seconds)
            return
        with self._build_lock:
            state = self.cache.get(version)  # verified, as the server's own rebuild
            rebuild_s = self.cache.last_seconds
        # a server that reloads by itself may take the next version while the probe waits in its
        # queue (the probe then runs on the new weights): such a score proves nothing either way
        moved_on = lambda: s.client.weight_version() != reported  # noqa: E731
        diff = self._probe(s, version, state, moved_on)
        if diff < 0 or moved_on():  # it moved on while scored: check the new one
            return
        self._serving(s, version, {"reload_s": None, "probe_diff": diff, "rebuild_s": round(rebuild_s, 4)})

    def summary(self) -> dict:
        return {s.id: {"url": s.client.url, "version": s.version, "alive": s.alive, "deaths": s.deaths,
                       "versions_served": s.versions_served, "reloads": s.reloads} for s in self.servers}


def role_main(description: str, run, argv=None) -> dict:
    """Entry point of a fleet role's process (trainer, orchestrator): the RL config in, and a
    fleet failure (probe mismatch, stopped fleet, timeout) as one line with exit status 1."""
    from ...pipes import entry_point

    try:
        return entry_point(RLConfig, description, run, argv)
    except (ProbeMismatch, FleetStopped, TimeoutError) as e:
        raise SystemExit(str(e)) from None
