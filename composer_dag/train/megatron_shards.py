"""Megatron-Core ``MMIDIDX`` token shards: open them as one token stream, and vet shards made
elsewhere against a tokenizer.

A ``<prefix>.bin``/``<prefix>.idx`` pair is what ``megatron.core.datasets.indexed_dataset``
writes (``IndexedDatasetBuilder``) and reads (``IndexedDataset``): the ``.bin`` holds the
sequences back to back in one integer dtype, the ``.idx`` holds the header (``MMIDIDX``,
version 1, dtype code), the length and byte offset of every sequence, and the sequence indices
that start each document. Megatron-Core is imported on first use (it takes seconds).
"""

from __future__ import annotations

import os
import struct
import warnings

import numpy as np

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, documents
_CHUNK_TOKENS = 1 << 24  # tokens per step of the streamed scans in check_external_shards


def indexed_dataset_module():
    """``megatron.core.datasets.indexed_dataset``, imported once, without the warnings its
    package prints on machines without Transformer Engine or Apex."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def token_dtype(vocab_size: int) -> np.dtype:
    """The token dtype Megatron-Core picks for this vocabulary (uint16 below 65,500, else int32)."""
    return np.dtype(indexed_dataset_module().DType.optimal_dtype(vocab_size))


class _Pinned:
    """Exposes a view of a Megatron mmap to numpy while holding its ``IndexedDataset``:
    ``IndexedDataset`` unmaps its files when it is collected, even while views of them are
    still in use, so every array handed out keeps the dataset alive through its ``base``."""

    def __init__(self, view: np.ndarray, owner) -> None:
        self.__array_interface__ = view.__array_interface__
        self._view, self._owner = view, owner


def open_indexed(prefix: str):
    """Megatron-Core's ``IndexedDataset`` over ``<prefix>.bin``/``.idx`` (memory-mapped; an
    empty ``.bin``, which cannot be mapped, is opened with the file reader)."""
    mod = indexed_dataset_module()
    mmap = os.path.getsize(prefix + ".bin") > 0
    return mod.IndexedDataset(prefix, mmap=mmap)


def stream_of(ds) -> tuple[np.ndarray, np.ndarray]:
    """(read-only token stream, int64 token offset of each document, length documents + 1) of an
    ``IndexedDataset`` whose sequences lie back to back in the ``.bin`` (as the builder writes
    them). The stream is a view of the mmap that keeps ``ds`` open."""
    lengths = np.asarray(ds.sequence_lengths, dtype=np.int64)
    seq_starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=seq_starts[1:])
    doc_index = np.asarray(ds.document_indices, dtype=np.int64)
    if (len(doc_index) == 0 or doc_index[0] != 0 or doc_index[-1] != len(lengths)
            or (np.diff(doc_index) < 0).any()):
        raise ValueError(f"{ds.path_prefix}.idx: document indices do not run from 0 to the "
                         f"{len(lengths)} sequences in order")
    doc_offsets = seq_starts[doc_index]
    total = int(seq_starts[-1])
    dtype = np.dtype(ds.index.dtype)
    if total == 0:
        return np.zeros(0, dtype=dtype), doc_offsets
    pointers = np.asarray(ds.index.sequence_pointers, dtype=np.int64)
    if not np.array_equal(pointers, seq_starts[:-1] * dtype.itemsize):
        raise ValueError(f"{ds.path_prefix}: the sequences are not stored back to back in the .bin")
    size = os.path.getsize(ds.path_prefix + ".bin")
    if size != total * dtype.itemsize:
        raise ValueError(f"{ds.path_prefix}.bin: {size} bytes, the index describes "
                         f"{total} {dtype.name} tokens ({total * dtype.itemsize} bytes)")
    # The first sequence read with the total length spans the whole back-to-back stream.
    view = ds.get(0, offset=0, length=total)
    return np.asarray(_Pinned(view, ds)), doc_offsets


def _check_index_header(path: str) -> None:
    """Raise ``ValueError`` unless ``path`` starts like a Megatron index and is long enough for
    the counts it declares (so Megatron's reader is never handed a file it would choke on)."""
    with open(path, "rb") as f:
        head = f.read(_HEADER.size)
    if head[:len(MEGATRON_MAGIC)] != MEGATRON_MAGIC:
        raise ValueError(f"{path}: not a Megatron index (starts with {head[:9]!r}, "
                         f"expected {MEGATRON_MAGIC!r})")
    if len(head) < _HEADER.size:
        raise ValueError(f"{path}: unreadable Megatron index (header cut at {len(head)} bytes)")
    _, version, code, n_seqs, n_docs = _HEADER.unpack(head)
    if version != 1:
        raise ValueError(f"{path}: unreadable Megatron index (version {version}, expected 1)")
    if code not in {d.value for d in indexed_dataset_module().DType}:
        raise ValueError(f"{path}: unreadable Megatron index (unknown dtype code {code})")
    need = _HEADER.size + 12 * n_seqs + 8 * n_docs
    if os.path.getsize(path) < need:
        raise ValueError(f"{path}: unreadable Megatron index ({os.path.getsize(path)} bytes, its "
                         f"{n_seqs} sequences and {n_docs} document indices need {need})")


def check_external_shards(prefix: str, tokenizer) -> dict:
    """Open a ``<prefix>.bin``/``.idx`` pair made elsewhere with Megatron-Core's reader and check
    it against ``tokenizer`` (a fast tokenizer or a path to one): the index is a Megatron
    ``MMIDIDX`` index of an integer dtype, the ``.bin`` matches it, every token id is in
    ``[0, vocabulary size)``, and every document ends with the tokenizer's EOS token.

    Returns ``{prefix, documents, sequences, tokens, dtype, max_token_id, vocab_size,
    eos_token_id, eos_ok}``; raises ``ValueError`` with a one-line reason on any mismatch.
    """
    if isinstance(tokenizer, str):
        from .tokenizer import load_tokenizer
        tokenizer = load_tokenizer(tokenizer)
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no end-of-document (EOS) token")
    for ext in (".idx", ".bin"):
        if not os.path.isfile(prefix + ext):
            raise ValueError(f"{prefix}{ext}: no such file")
    _check_index_header(prefix + ".idx")
    try:
        ds = open_indexed(prefix)
    except (AssertionError, ValueError, KeyError, IndexError, OSError, struct.error) as e:
        reason = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(f"{prefix}.idx: unreadable Megatron index ({reason})") from None
    dtype = np.dtype(ds.index.dtype)
    if dtype.kind not in "iu":
        raise ValueError(f"{prefix}: tokens stored as {dtype.name}, not an integer dtype")
    tokens, doc_offsets = stream_of(ds)
    n_docs = len(doc_offsets) - 1
    top = None
    for start in range(0, len(tokens), _CHUNK_TOKENS):
        chunk = tokens[start:start + _CHUNK_TOKENS]
        hi, lo = int(chunk.max()), int(chunk.min())
        top = hi if top is None else max(top, hi)
        if hi >= vocab or lo < 0:
            at = start + int(np.flatnonzero((chunk >= vocab) | (chunk < 0))[0])
            doc = int(np.searchsorted(doc_offsets, at, side="right")) - 1
            raise ValueError(f"{prefix}: token id {int(tokens[at])} at position {at} (document "
                             f"{doc}) is outside the vocabulary of {vocab}")
    ends = doc_offsets[1:]
    if n_docs:
        empty = np.flatnonzero(ends == doc_offsets[:-1])
        if len(empty):
            raise ValueError(f"{prefix}: document {int(empty[0])} is empty (no EOS token), "
                             f"{len(empty)} of {n_docs} documents")
        last = tokens[ends - 1]
        bad = np.flatnonzero(last != eos)
        if len(bad):
            raise ValueError(f"{prefix}: {len(bad)} of {n_docs} documents do not end with EOS id "
                             f"{eos} (document {int(bad[0])} ends with {int(last[bad[0]])})")
    return {"prefix": prefix, "documents": n_docs, "sequences": len(ds), "tokens": len(tokens),
            "dtype": dtype.name, "max_token_id": top, "vocab_size": vocab, "eos_token_id": eos,
            "eos_ok": True}
