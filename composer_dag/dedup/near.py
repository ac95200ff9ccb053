"""Near-duplicate detection: MinHash signatures (rensa), LSH banding, verification, union-find.

Signatures: each document's word 5-gram shingle hashes (``text.ngrams_flat``) go to rensa's
``RMinHash.digest_matrix_from_flat_token_hashes`` (num_perm u32 values per row, fixed seed).
The same token hashes serve the decontamination n-gram lookups (``contamination_hits``), so
each byte is tokenised once.

LSH: ``bands`` x ``rows`` (by default the datasketch optimum for the threshold, minimising
equal-weighted false positive and false negative areas: 25 x 10 for 0.7 at 256 permutations).
Documents sharing a band hash become candidates (each bucket yields edges to its first member
and to the previous member, in index order); each candidate pair is kept only if the
signatures' estimated Jaccard (fraction of equal slots) is >= the threshold.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import rensa

from .text import _MIX, in_sorted, ngrams_flat


def signatures(
    flat: np.ndarray, starts: np.ndarray, num_perm: int, seed: int, shingle: int
) -> tuple[np.ndarray, np.ndarray]:
    """MinHash signatures (docs x num_perm u32) of each document's shingles, and a has-shingles mask.

    ``flat``/``starts`` are the documents' token hashes (``text.token_hashes``). A document with
    fewer than ``shingle`` tokens has no shingles (its row is all 0xFFFFFFFF).
    """
    sh, sh_doc = ngrams_flat(flat, starts, shingle)
    return signature_matrix(sh, np.bincount(sh_doc, minlength=len(starts) - 1), num_perm, seed)


def signature_matrix(shingles: np.ndarray, counts: np.ndarray, num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """MinHash signatures (docs x num_perm u32) of shingle hashes given as one flat array with
    each document's count, and the has-shingles mask."""
    n_docs = len(counts)
    offsets = np.zeros(n_docs + 1, dtype=np.uint64)
    np.cumsum(counts, out=offsets[1:])
    matrix = rensa.RMinHash.digest_matrix_from_flat_token_hashes(shingles, offsets, num_perm, seed)
    rows = matrix.to_rows()
    sig = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.uint32, count=n_docs * num_perm)
    return sig.reshape(n_docs, num_perm), np.asarray(counts) > 0


def contamination_hits(flat: np.ndarray, starts: np.ndarray, contam: np.ndarray, n: int) -> list[tuple[int, int, int]]:
    """``(doc, token position, n-gram hash)`` of each document's first n-gram in sorted ``contam``."""
    if not len(contam):
        return []
    grams, gram_doc = ngrams_flat(flat, starts, n)
    # a bitmap of the set's low 22 bits rules out almost every n-gram before the binary search
    bitmap = np.zeros(1 << 22, dtype=bool)
    bitmap[(contam & np.uint64((1 << 22) - 1)).astype(np.intp)] = True
    maybe = np.flatnonzero(bitmap[(grams & np.uint64((1 << 22) - 1)).astype(np.intp)])
    found = maybe[in_sorted(grams[maybe], contam)]
    hits: list[tuple[int, int, int]] = []
    if len(found):
        first_of_doc = np.searchsorted(gram_doc, np.arange(len(starts) - 1))
        for g in found.tolist():
            d = int(gram_doc[g])
            if not hits or hits[-1][0] != d:  # found is ascending, so a doc's first hit comes first
                hits.append((d, g - int(first_of_doc[d]), int(grams[g])))
    return hits


@functools.lru_cache(maxsize=16)
def optimal_bands(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows) minimising 0.5*false-positive + 0.5*false-negative area (as datasketch)."""
    xs = np.linspace(0.0, 1.0, 1001)
    lo, hi = xs <= threshold, xs >= threshold
    best = (np.inf, 1, num_perm)
    for b in range(1, num_perm + 1):
        for r in range(1, num_perm // b + 1):
            p = 1.0 - (1.0 - xs**r) ** b
            err = 0.5 * np.trapezoid(p[lo], xs[lo]) + 0.5 * np.trapezoid(1.0 - p[hi], xs[hi])
            if err < best[0]:
                best = (err, b, r)
    return best[1], best[2]


def band_keys(sig: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """The LSH bucket of each signature in each band (docs x bands u64): the band's ``rows``
    values folded with a multiply-xor step."""
    keys = np.empty((len(sig), bands), dtype=np.uint64)
    for b in range(bands):
        block = sig[:, b * rows : (b + 1) * rows].astype(np.uint64)
        key = block[:, 0].copy()
        for c in range(1, rows):
            key *= _MIX
            key ^= block[:, c]
        keys[:, b] = key
    return keys


def candidate_pairs(sig: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """Unique (i, j), i < j, row pairs of ``sig`` that share at least one band (in memory; the
    pipeline does the same grouping out of core in DuckDB, ``reduce.py``)."""
    edges = []
    all_keys = band_keys(sig, bands, rows)
    for b in range(bands):
        key = all_keys[:, b]
        order = np.argsort(key, kind="stable")
        ks = key[order]
        same = np.flatnonzero(ks[1:] == ks[:-1]) + 1  # positions continuing a bucket
        if not len(same):
            continue
        is_start = np.r_[True, ks[1:] != ks[:-1]]
        bucket_start = np.maximum.accumulate(np.where(is_start, np.arange(len(ks)), 0))
        edges.append(np.stack([order[bucket_start[same]], order[same]], 1))
        edges.append(np.stack([order[same - 1], order[same]], 1))
    if not edges:
        return np.zeros((0, 2), np.int64)
    e = np.concatenate(edges).astype(np.int64)
    e.sort(axis=1)
    e = e[e[:, 0] != e[:, 1]]
    return np.unique(e, axis=0)


def similarities(sig: np.ndarray, pairs: np.ndarray, chunk: int = 65536) -> np.ndarray:
    """Estimated Jaccard (fraction of equal signature slots) of each pair."""
    out = np.empty(len(pairs), dtype=np.float64)
    for s in range(0, len(pairs), chunk):
        p = pairs[s : s + chunk]
        out[s : s + chunk] = (sig[p[:, 0]] == sig[p[:, 1]]).mean(axis=1)
    return out


def connected_components(n: int, pairs: np.ndarray) -> list[list[int]]:
    """Union-find over ``pairs``; components of size >= 2, each sorted, ordered by first member."""
    parent = list(range(n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in pairs.tolist():
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    groups: dict[int, list[int]] = {}
    for x in range(n):  # roots are component minima, so groups come out in first-member order
        groups.setdefault(find(x), []).append(x)
    return [g for g in groups.values() if len(g) > 1]
