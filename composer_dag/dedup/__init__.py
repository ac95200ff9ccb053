"""Deduplication engine: quality filters, exact and MinHash near dedup, decontamination, redaction.

Plain Python (no Dagster). ``dedup`` runs the whole pipeline (see ``pipeline.py`` for the order
of stages); the helpers below are what asset checks use on its output. Names are imported on
first use, so worker processes that only need ``features`` do not import pyarrow or fsspec.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ContaminationIndex": "decontam",
    "check_shards": "decontam",
    "default_index": "decontam",
    "humaneval_texts": "decontam",
    "Carried": "increment",
    "CarryMismatch": "increment",
    "Increment": "increment",
    "carry_shards": "increment",
    "check_carried": "increment",
    "contamination_digest": "increment",
    "plan_increment": "increment",
    "Refresh": "increment",
    "refresh": "increment",
    "DROP_REASONS": "pipeline",
    "DedupConfig": "pipeline",
    "DedupResult": "pipeline",
    "dedup": "pipeline",
    "inspect_inputs": "pipeline",
    "work_url": "pipeline",
    "PLACEHOLDERS": "secrets",
    "SECRET_KINDS": "secrets",
    "SECRET_PATTERNS": "secrets",
    "find_secrets": "secrets",
    "redact": "secrets",
    "ngram_hashes": "text",
    "tokens": "text",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .decontam import ContaminationIndex, check_shards, default_index, humaneval_texts
    from .increment import (Carried, CarryMismatch, Increment, Refresh, carry_shards, check_carried, contamination_digest,
                            plan_increment, refresh)
    from .pipeline import DROP_REASONS, DedupConfig, DedupResult, dedup, inspect_inputs, work_url
    from .secrets import PLACEHOLDERS, SECRET_KINDS, SECRET_PATTERNS, find_secrets, redact
    from .text import ngram_hashes, tokens


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
