"""Per-file work of every stage, done in one pass over a batch of files (in worker processes).

``analyse_batch`` returns each file's filter verdict and, for files that pass the filters, the
exact-dedup hash, the MinHash signature, the first contaminated n-gram and the redacted text.
The pipeline then applies these in stage order; computing them together reads and tokenises
each file once and lets all of it run in parallel. Two implementations give the same results:
the compiled byte loops of ``kernels.py`` over a batch joined into one buffer (``_analyse_native``,
for map tasks of at least ``native_min_bytes``) and the plain Python/numpy code
(``_analyse_plain``: ``filters``, ``normalised_hash``, ``text``, ``near``, ``secrets``).
"""

from __future__ import annotations

import functools
import hashlib
import time
from typing import Any

import numpy as np

from .filters import quality_reason
from .near import contamination_hits, signature_matrix, signatures
from .secrets import NEEDLES, ON_LOWER, PATTERN_IDS, redact
from .text import token_hashes

STAGES = ("filter", "exact", "minhash", "decontaminate", "redact")


def normalised_hash(data: bytes) -> bytes:
    """SHA-256 of ``data`` with CRLF/CR -> LF, trailing whitespace stripped per line, and
    leading/trailing blank lines removed."""
    if b"\r" in data:
        data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    if b" \n" in data or b"\t\n" in data or b"\x0c\n" in data or b"\x0b\n" in data:
        data = b"\n".join([line.rstrip() for line in data.split(b"\n")])
    return hashlib.sha256(data.rstrip().lstrip(b"\n")).digest()


def ready() -> bool:
    """A no-op a new worker process runs first, so that it imports this module early (the
    compiled kernels load on a worker's first task that uses them)."""
    return True


@functools.lru_cache(maxsize=1)
def native_available() -> bool:
    """Whether the compiled kernels can be used in this process: numba imports and the kernels
    compile (or load from the cache) and run; otherwise the plain code runs, with the same
    results."""
    from . import kernels

    if not kernels.AVAILABLE:
        return False
    try:
        kernels.warm()
    except Exception:  # a broken numba/LLVM install: the plain code gives the same output
        return False
    return True


def analyse_batch(docs: list[bytes | None], paths: list[str], cfg: Any, contam: np.ndarray,
                  native: bool | None = None) -> dict[str, Any]:
    """The per-file results of one batch; ``cfg`` has ``DedupConfig``'s fields as attributes
    (a plain namespace, so a worker imports only this module and what it uses). ``native``:
    use the compiled kernels (``kernels.py``; the default where numba imports) or the plain
    Python/numpy code; both give the same results."""
    if native is None:
        native = native_available()
    return (_analyse_native if native else _analyse_plain)(docs, paths, cfg, contam)


class _Laps:
    """CPU seconds by stage."""

    def __init__(self) -> None:
        self.cpu = dict.fromkeys(STAGES, 0.0)
        self.t = time.process_time()

    def __call__(self, stage: str) -> None:
        now = time.process_time()
        self.cpu[stage] += now - self.t
        self.t = now


def _analyse_plain(docs: list[bytes | None], paths: list[str], cfg: Any, contam: np.ndarray) -> dict[str, Any]:
    lap = _Laps()
    verdicts = [None if d is None else quality_reason(d, p or "", cfg) for d, p in zip(docs, paths)]
    live = [j for j, d in enumerate(docs) if d is not None and verdicts[j] is None]
    live_docs = [docs[j] for j in live]
    lap("filter")
    exact = [normalised_hash(d) for d in live_docs]
    lap("exact")
    flat, starts = token_hashes(live_docs)
    sig, has_shingles = signatures(flat, starts, cfg.num_perm, cfg.seed, cfg.shingle_size)
    lap("minhash")
    hits = contamination_hits(flat, starts, contam, cfg.decontam_n)
    del flat
    lap("decontaminate")
    redacted = {}
    if cfg.redact:
        for k, d in enumerate(live_docs):
            new, counts = redact(d)
            if counts:
                redacted[k] = (new, counts)
    lap("redact")
    return {"verdicts": verdicts, "live": live, "exact": exact, "sig": sig, "has_shingles": has_shingles,
            "hits": hits, "redacted": redacted, "cpu": lap.cpu}


@functools.lru_cache(maxsize=1)
def _secret_needles():
    """The secret patterns' literals (``secrets.NEEDLES``) as one ``kernels.Needles``, and for
    each pattern the columns of its literals."""
    from .kernels import Needles

    literals: list[tuple[bytes, bool]] = []
    first: list[int] = []
    for kind, i in PATTERN_IDS:
        first.append(len(literals))
        literals += [(lit, kind in ON_LOWER) for lit in NEEDLES[kind][i]]
    return Needles(literals), np.array(first, np.intp)


def _analyse_native(docs: list[bytes | None], paths: list[str], cfg: Any, contam: np.ndarray) -> dict[str, Any]:
    from . import kernels

    lap = _Laps()
    present = [j for j, d in enumerate(docs) if d is not None]
    sizes = np.array([len(docs[j]) for j in present], np.int64)
    ends = np.cumsum(sizes)
    starts = ends - sizes
    buf = np.frombuffer(b"".join([docs[j] for j in present]), np.uint8)
    stats = kernels.doc_stats(buf, starts, ends, cfg.base64_min_run)
    verdicts: list = [None] * len(docs)
    alive = []
    for k, j in enumerate(present):
        verdicts[j] = quality_reason(docs[j], paths[j] or "", cfg, stats[k])
        if verdicts[j] is None:
            alive.append(k)
    live = [present[k] for k in alive]
    sel = np.array(alive, np.int64)
    starts, ends = starts[sel], ends[sel]
    lap("filter")
    out, spans = kernels.normalise(buf, starts, ends)
    exact = [hashlib.sha256(out[a:b]).digest() for a, b in spans.tolist()]
    del out
    lap("exact")
    flat, offsets = kernels.token_hashes(buf, starts, ends)
    shingles, counts = kernels.ngrams(flat, offsets, cfg.shingle_size)
    sig, has_shingles = signature_matrix(shingles, counts, cfg.num_perm, cfg.seed)
    del shingles
    lap("minhash")
    hits = kernels.first_hits(flat, offsets, contam, cfg.decontam_n)
    del flat
    lap("decontaminate")
    redacted = {}
    if cfg.redact and len(live):
        needles, first = _secret_needles()
        # which patterns may match in each file: those with one of their literals in it
        may = np.logical_or.reduceat(needles.find(buf, starts, ends), first, axis=1)
        for k in np.flatnonzero(may.any(axis=1)).tolist():
            only = frozenset(PATTERN_IDS[p] for p in np.flatnonzero(may[k]).tolist())
            new, counts = redact(docs[live[k]], only)
            if counts:
                redacted[k] = (new, counts)
    lap("redact")
    return {"verdicts": verdicts, "live": live, "exact": exact, "sig": sig, "has_shingles": has_shingles,
            "hits": hits, "redacted": redacted, "cpu": lap.cpu}
