"""Per-file work of every stage, done in one pass over a batch of files (in worker processes).

``analyse_batch`` returns each file's filter verdict and, for files that pass the filters, the
exact-dedup hash, the MinHash signature, the first contaminated n-gram and the redacted text.
The pipeline then applies these in stage order; computing them together reads and tokenises
each file once and lets all of it run in parallel.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import numpy as np

from .filters import quality_reason
from .near import contamination_hits, signatures
from .secrets import redact
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
    """A no-op a new worker process runs first, so that it imports this module early."""
    return True


def analyse_batch(docs: list[bytes | None], paths: list[str], cfg: Any, contam: np.ndarray) -> dict[str, Any]:
    """The per-file results of one batch; ``cfg`` has ``DedupConfig``'s fields as attributes
    (a plain namespace, so a worker imports only this module and what it uses)."""
    cpu = dict.fromkeys(STAGES, 0.0)
    t = time.process_time()

    def lap(stage: str) -> None:
        nonlocal t
        now = time.process_time()
        cpu[stage] += now - t
        t = now

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
    return {
        "verdicts": verdicts,
        "live": live,
        "exact": exact,
        "sig": sig,
        "has_shingles": has_shingles,
        "hits": hits,
        "redacted": redacted,
        "cpu": cpu,
    }
