"""Rollout production decoupled from the update: with ``async_generation`` a thread
generates batch k+1 (with the newest weights it has) while the trainer updates on batch k.
Every batch carries the policy version that sampled it; the trainer takes a batch only if
``trainer_version - batch.version <= max_staleness`` and drops (and counts) the rest.

The generator holds at most ``queue_size`` batches, queued or in the making: it starts a batch
only when the trainer has taken one, so that the batch samples the newest weights there are
instead of running ahead with old ones (which the trainer would then drop as stale). With
``limit`` it makes no more batches than the trainer will still take."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Batch:
    index: int
    version: int
    rollouts: list[dict]
    seconds: dict = field(default_factory=dict)  # generate / tools / grade / sync / wall


class RolloutSource:
    """``produce(index, version) -> Batch`` makes one batch with the engine's current weights;
    ``sync() -> version`` brings the engine to the newest published weights first."""

    def __init__(self, produce: Callable[[int, int], Batch], sync: Callable[[], int], max_staleness: int = 1,
                 async_generation: bool = True, queue_size: int | None = None, start_index: int = 0,
                 limit: int | None = None):
        self.produce, self.sync = produce, sync
        self.max_staleness = max_staleness
        self.async_generation = async_generation
        self.next_index = self.start_index = start_index
        self.limit = limit
        self.dropped_batches = 0
        self.dropped_rollouts = 0
        self.staleness: list[int] = []
        size = max(1, queue_size or max_staleness or 1)
        self._q: queue.Queue = queue.Queue(maxsize=size)
        self._slots = threading.Semaphore(size)   # batches queued or in the making
        self._stop = threading.Event()
        self._thread = None

    def _make(self) -> Batch:
        t0 = time.perf_counter()
        version = self.sync()
        sync_s = time.perf_counter() - t0
        b = self.produce(self.next_index, version)
        b.seconds["sync"] = b.seconds.get("sync", 0.0) + sync_s
        self.next_index += 1
        return b

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._slots.acquire(timeout=0.2) or self._stop.is_set():
                    continue
                if self.limit is not None and self.next_index - self.start_index - self.dropped_batches >= self.limit:
                    self._slots.release()   # enough batches made: wait for a drop or the stop
                    time.sleep(0.05)
                    continue
                self._q.put(self._make())
        except BaseException as e:  # surfaced to the trainer by get()
            self._q.put(e)

    def start(self) -> "RolloutSource":
        if self.async_generation and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rollouts", daemon=True)
            self._thread.start()
        return self

    def get(self, trainer_version: int) -> Batch:
        """The next batch within the staleness bound (stale ones are dropped and counted)."""
        while True:
            if self.async_generation:
                b = self._q.get()
                self._slots.release()
            else:
                b = self._make()
            if isinstance(b, BaseException):
                raise RuntimeError("rollout generation failed") from b
            lag = trainer_version - b.version
            if lag <= self.max_staleness:
                self.staleness.append(lag)
                for r in b.rollouts:
                    r["staleness"] = lag
                return b
            self.dropped_batches += 1
            self.dropped_rollouts += len(b.rollouts)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            while self._thread.is_alive():
                try:
                    self._q.get_nowait()
                except queue.Empty:
                    pass
                self._thread.join(timeout=0.2)
            self._thread = None
