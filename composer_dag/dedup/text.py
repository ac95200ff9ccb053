"""Word tokens, token hashes and n-gram hashes shared by near-dedup and decontamination.

Tokens are maximal runs of ASCII ``[A-Za-z0-9_]`` bytes (every other byte, including non-ASCII
ones, separates tokens), so formatting, punctuation and indentation do not change them. Tokens
are hashed to u64 by rensa (``RMinHash.hash_token_sets``: a fixed hash, identical in every
process); an n-gram's hash folds its n token hashes in order with a multiply-xor step in numpy.
"""

from __future__ import annotations

import numpy as np
import rensa

_WORD_BYTES = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_TO_SPACES = bytes(c if c in _WORD_BYTES else 32 for c in range(256))
_MIX = np.uint64(0x9E3779B97F4A7C15)


def _as_bytes(text: str | bytes) -> bytes:
    return text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)


def tokens(text: str | bytes) -> list[bytes]:
    """The word tokens of a text, in order."""
    return _as_bytes(text).translate(_TO_SPACES).split()


def token_hashes(docs: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """All docs' token hashes as one flat u64 array, plus ``starts`` (len(docs)+1 offsets)."""
    hashed = rensa.RMinHash.hash_token_sets([d.translate(_TO_SPACES).split() for d in docs])
    parts = [np.array(h, dtype=np.uint64) for h in hashed]
    starts = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in parts], out=starts[1:])
    flat = np.concatenate(parts) if parts else np.zeros(0, np.uint64)
    return flat, starts


def ngrams_flat(flat: np.ndarray, starts: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Hashes of every n-gram that lies inside one document, and each one's document index.

    Windows are taken over the flat token array and those crossing a document boundary are
    dropped, so the result is in document order, then token order.
    """
    m = len(flat) - n + 1
    if m <= 0:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    h = flat[:m].copy()
    for k in range(1, n):
        h *= _MIX
        h ^= flat[k : k + m]
    doc_of = np.repeat(np.arange(len(starts) - 1), np.diff(starts))
    valid = doc_of[:m] == doc_of[n - 1 :]
    return h[valid], doc_of[:m][valid]


def ngram_hashes(text: str | bytes, n: int) -> np.ndarray:
    """u64 hashes of the text's word n-grams, in token order (empty if it has < n tokens)."""
    flat, starts = token_hashes([_as_bytes(text)])
    return ngrams_flat(flat, starts, n)[0]


def in_sorted(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """Mask of ``values`` found in the sorted array ``sorted_set`` (binary search)."""
    if not len(sorted_set):
        return np.zeros(len(values), bool)
    idx = np.minimum(np.searchsorted(sorted_set, values), len(sorted_set) - 1)
    return sorted_set[idx] == values
