"""Token shards: pack documents into Megatron-Core ``.bin``/``.idx`` files and stream them.

Layout of a shard directory::

    train.bin  train.idx  val.bin  val.idx  summary.json

Each ``<split>.bin``/``.idx`` pair is a Megatron-Core ``MMIDIDX`` indexed dataset, written with
``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder`` and read with its
``IndexedDataset`` (see ``megatron_shards``): one sequence and one document per packed
document, its tokens followed by one EOS token, in the dtype Megatron-Core picks for the
vocabulary (uint16 below 65,500 ids, else int32). Megatron's GPT datasets read the files as
they are; ``TokenShardDataset`` reads the concatenated token stream through the same reader.

Train/val membership is a deterministic hash of the document id (independent of the seed, so
a document never moves between splits). The mixture gives each document a weight looked up by
language, then source, then ``"replay"`` (non-code text: Markdown, reST, plain text, ...),
then ``"*"`` (default 1.0): the integer part is a number of copies and the fractional part the
probability of one more, drawn from a hash of (seed, doc id). Validation keeps one copy of
every document whose weight is > 0, so it measures the natural distribution.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from typing import Iterable, Iterator

import numpy as np

from pydantic import Field

from ..runtime.config import StageConfig
from .megatron_shards import check_external_shards, indexed_dataset_module, open_indexed, stream_of, token_dtype

REPLAY_LANGUAGES = {"markdown", "restructuredtext", "rst", "text", "plain text", "txt",
                    "html", "asciidoc", "tex", "org"}


class TokenShardConfig(StageConfig):
    """How documents become token shards. ``mixture``: weights by language, source, ``replay``
    (non-code text) or ``*``; the integer part is copies, the fraction a deterministic chance of
    one more (default: code once, replay text at half weight). ``external_prefix``: use a
    ``<prefix>.bin/.idx`` pair made elsewhere (a path or ``s3://`` URL, checked against the
    tokenizer) as the train split instead of packing the deduplicated shards;
    ``external_val_prefix`` the same for validation."""

    val_fraction: float = Field(0.02, ge=0.0, le=1.0)
    mixture: dict[str, float] = {"*": 1.0, "replay": 0.5}
    seed: int = 0
    external_prefix: str = ""
    external_val_prefix: str = ""


def import_external_shards(cfg: TokenShardConfig, tokenizer, out_dir: str) -> dict:
    """Copy the external ``<prefix>.bin/.idx`` pairs of ``cfg`` into ``out_dir`` as ``train``
    (and ``val``), each checked against ``tokenizer`` with Megatron-Core's reader
    (``check_external_shards``); returns (and writes) the summary. ``ValueError`` in one line."""
    from ..storage import open_storage

    os.makedirs(out_dir, exist_ok=True)
    summary: dict = {"external": True}
    for split, prefix in (("train", cfg.external_prefix), ("val", cfg.external_val_prefix)):
        if not prefix:
            continue
        dest = os.path.join(out_dir, split)
        if "://" not in prefix:
            prefix = os.path.abspath(prefix)
        st = open_storage(prefix.rsplit("/", 1)[0])
        for ext in (".bin", ".idx"):
            if not st.exists(prefix + ext):
                raise ValueError(f"{prefix}{ext}: no such file")
            st.get_file(prefix + ext, dest + ext)
        checked = check_external_shards(dest, tokenizer)
        summary[f"{split}_source"] = prefix
        summary[f"docs_{split}"], summary[f"tokens_{split}"] = checked["documents"], checked["tokens"]
        summary.update(dtype=checked["dtype"], vocab_size=checked["vocab_size"], eos_token_id=checked["eos_token_id"])
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def _unit(*parts) -> float:
    """A deterministic number in [0, 1) from the parts."""
    h = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2**64


def is_replay(language: str | None) -> bool:
    return (language or "").strip().lower() in REPLAY_LANGUAGES


def mixture_weight(mixture: dict[str, float] | None, source: str, language: str) -> float:
    if not mixture:
        return 1.0
    for key in (language, source, "replay" if is_replay(language) else None, "*"):
        if key is not None and key in mixture:
            return float(mixture[key])
    return 1.0


def copies(weight: float, doc_id: str, seed: int) -> int:
    whole = int(weight)
    return whole + (1 if _unit(seed, "mix", doc_id) < weight - whole else 0)


class _ShardWriter:
    """One split's Megatron-Core builder, writing to temporary names until ``close``."""

    def __init__(self, out_dir: str, split: str, dtype: np.dtype):
        import torch  # the builder takes tensors

        self._from_numpy = torch.from_numpy
        self.path = os.path.join(out_dir, split)
        self.builder = indexed_dataset_module().IndexedDatasetBuilder(
            self.path + ".bin.tmp", dtype=dtype.type)

    def add(self, tokens: np.ndarray) -> None:
        """One document: its tokens (EOS included) as one sequence."""
        self.builder.add_item(self._from_numpy(tokens))
        self.builder.end_document()

    def close(self) -> None:
        self.builder.finalize(self.path + ".idx.tmp")
        os.replace(self.path + ".bin.tmp", self.path + ".bin")
        os.replace(self.path + ".idx.tmp", self.path + ".idx")


def load_tokens(prefix: str) -> tuple[np.ndarray, np.ndarray]:
    """(memory-mapped token stream, int64 document offsets in tokens, length documents + 1) of
    a ``<prefix>.bin``/``.idx`` pair, read with Megatron-Core's ``IndexedDataset``."""
    return stream_of(open_indexed(prefix))


def pack_documents(docs: Iterable[tuple[str, str, str, str]], tokenizer, out_dir: str,
                   val_fraction: float = 0.01, mixture: dict[str, float] | None = None,
                   seed: int = 0, batch_docs: int = 512) -> dict:
    """Tokenize ``(doc_id, text, source, language)`` rows into train/val shards in ``out_dir``.

    ``tokenizer`` is a transformers fast tokenizer or a path to one. Returns (and writes as
    ``summary.json``) counters: docs in/train/val/dropped, tokens train/val, bytes in,
    seconds, MB/s, tokens per language and per source (train), replay tokens and share.
    """
    if isinstance(tokenizer, str):
        from .tokenizer import load_tokenizer
        tokenizer = load_tokenizer(tokenizer)
    backend = tokenizer.backend_tokenizer  # the Rust tokenizer: batch encode in parallel
    eos = tokenizer.eos_token_id
    vocab = len(tokenizer)
    dtype = token_dtype(vocab)
    os.makedirs(out_dir, exist_ok=True)
    writers = {s: _ShardWriter(out_dir, s, dtype) for s in ("train", "val")}
    c = Counter()
    by_lang, by_source = Counter(), Counter()
    t0 = time.perf_counter()

    def flush(batch):
        encs = backend.encode_batch([b[1] for b in batch], add_special_tokens=False)
        for (doc_id, _, source, language, n, split), enc in zip(batch, encs):
            toks = np.empty(len(enc.ids) + 1, dtype=dtype)  # already the shard dtype
            toks[:-1] = enc.ids
            toks[-1] = eos
            for _ in range(n):
                writers[split].add(toks)
            c[f"tokens_{split}"] += n * len(toks)
            c[f"docs_{split}"] += 1
            if split == "train":
                by_lang[language] += n * len(toks)
                by_source[source] += n * len(toks)
                c["replay_tokens"] += n * len(toks) if is_replay(language) else 0

    batch = []
    for doc_id, text, source, language in docs:
        c["docs_in"] += 1
        c["bytes_in"] += len(text.encode("utf-8", "surrogatepass"))
        weight = mixture_weight(mixture, source, language)
        split = "val" if _unit("split", doc_id) < val_fraction else "train"
        n = (1 if weight > 0 else 0) if split == "val" else copies(weight, doc_id, seed)
        if n == 0:
            c["docs_dropped"] += 1
            continue
        batch.append((doc_id, text, source, language, n, split))
        if len(batch) >= batch_docs:
            flush(batch)
            batch = []
    if batch:
        flush(batch)
    for w in writers.values():
        w.close()
    seconds = time.perf_counter() - t0
    summary = {
        "docs_in": c["docs_in"], "docs_train": c["docs_train"], "docs_val": c["docs_val"],
        "docs_dropped": c["docs_dropped"], "tokens_train": c["tokens_train"],
        "tokens_val": c["tokens_val"], "bytes_in": c["bytes_in"],
        "seconds": round(seconds, 3), "mb_per_s": round(c["bytes_in"] / 1e6 / max(seconds, 1e-9), 3),
        "tokens_by_language": dict(by_lang.most_common()),
        "tokens_by_source": dict(by_source.most_common()),
        "replay_tokens": c["replay_tokens"],
        "replay_share": round(c["replay_tokens"] / max(c["tokens_train"], 1), 4),
        "dtype": dtype.name, "vocab_size": vocab, "eos_token_id": eos,
        "val_fraction": val_fraction, "mixture": mixture or {}, "seed": seed,
    }
    with open(os.path.join(out_dir, "summary.json.tmp"), "w") as f:
        json.dump(summary, f, indent=2)
    os.replace(os.path.join(out_dir, "summary.json.tmp"), os.path.join(out_dir, "summary.json"))
    return summary


class TokenShardDataset:
    """Fixed-length samples of ``seq_len + 1`` tokens over a shard's token stream.

    Sample ``j`` of an epoch is the window ``tokens[j*seq_len : j*seq_len + seq_len + 1]``
    (consecutive windows share one token, so every token is a target exactly once). Global
    sample ``g`` is window ``perm_e[g % n]`` of epoch ``e = g // n`` (``perm_e`` the identity,
    or a permutation seeded by ``(shuffle_seed, e)``); rank ``r`` of ``world_size`` gets the
    global samples ``g >= start_sample`` with ``g % world_size == r``. ``start_sample`` is the
    number of global samples already consumed, so a run resumes at the exact sample.
    Iteration cycles through epochs forever unless ``epochs`` is given. The stream is read
    through Megatron-Core's memory-mapped ``IndexedDataset`` (``load_tokens``).
    """

    def __init__(self, prefix: str, seq_len: int, rank: int = 0, world_size: int = 1,
                 start_sample: int = 0, shuffle_seed: int | None = None,
                 epochs: int | None = None):
        self.tokens, self.doc_offsets = load_tokens(prefix)
        self.seq_len, self.rank, self.world_size = seq_len, rank, world_size
        self.start_sample, self.shuffle_seed, self.epochs = start_sample, shuffle_seed, epochs
        self.num_samples = max(0, (len(self.tokens) - 1) // seq_len)
        if self.num_samples == 0:
            raise ValueError(f"{prefix}: {len(self.tokens)} tokens, fewer than seq_len + 1")
        self._perm: tuple[int, np.ndarray] | None = None

    def window(self, g: int) -> int:
        epoch, j = divmod(g, self.num_samples)
        if self.shuffle_seed is None:
            return j
        if self._perm is None or self._perm[0] != epoch:
            rng = np.random.default_rng([self.shuffle_seed, epoch])
            self._perm = (epoch, rng.permutation(self.num_samples))
        return int(self._perm[1][j])

    def __getitem__(self, g: int) -> np.ndarray:
        start = self.window(g) * self.seq_len
        return np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64)

    def indices(self) -> Iterator[int]:
        g = self.start_sample + (self.rank - self.start_sample) % self.world_size
        end = None if self.epochs is None else self.epochs * self.num_samples
        while end is None or g < end:
            yield g
            g += self.world_size

    def __iter__(self) -> Iterator[np.ndarray]:
        for g in self.indices():
            yield self[g]

    def collate(self, samples) -> np.ndarray:
        return np.stack(samples)

    def batches(self, batch_size: int) -> Iterator:
        """Collated micro-batches of ``batch_size`` samples (the last partial one dropped): here
        ``[batch_size, seq_len + 1]`` int64 arrays."""
        buf = []
        for sample in self:
            buf.append(sample)
            if len(buf) == batch_size:
                yield self.collate(buf)
                buf = []


class TranscriptDataset(TokenShardDataset):
    """Supervised fine-tuning samples: one tokenized transcript each, from a Parquet file with
    ``input_ids`` and ``loss_mask`` (1 on the assistant's tokens) per row.

    Sharding across ranks and resume at ``start_sample`` are those of ``TokenShardDataset``;
    the order is its seeded permutation with each block of ``bucket`` samples sorted by length,
    so that a micro-batch, padded to its longest sample, wastes little on padding. A transcript
    longer than ``seq_len + 1`` tokens is cut there. ``batches`` returns ``(inputs, labels)``,
    labels ``-100`` wherever the loss does not apply (prompt, tool output, padding).
    """

    bucket = 64

    def __init__(self, path: str, seq_len: int, pad_id: int, rank: int = 0, world_size: int = 1,
                 start_sample: int = 0, shuffle_seed: int | None = None, epochs: int | None = None):
        import pyarrow.parquet as pq

        table = pq.read_table(path, columns=["input_ids", "loss_mask"])
        self.ids = table.column("input_ids").to_pylist()
        self.masks = table.column("loss_mask").to_pylist()
        self.seq_len, self.pad_id, self.rank, self.world_size = seq_len, pad_id, rank, world_size
        self.start_sample, self.shuffle_seed, self.epochs = start_sample, shuffle_seed, epochs
        self.num_samples = len(self.ids)
        if self.num_samples == 0:
            raise ValueError(f"{path}: no transcripts")
        self._perm = None

    def window(self, g: int) -> int:
        epoch, j = divmod(g, self.num_samples)
        if self.shuffle_seed is None:
            return j
        if self._perm is None or self._perm[0] != epoch:
            perm = np.random.default_rng([self.shuffle_seed, epoch]).permutation(self.num_samples)
            blocks = [sorted(perm[i:i + self.bucket], key=lambda k: len(self.ids[k]))
                      for i in range(0, len(perm), self.bucket)]
            self._perm = (epoch, np.concatenate(blocks))
        return int(self._perm[1][j])

    def __getitem__(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        j = self.window(g)
        n = self.seq_len + 1
        return np.asarray(self.ids[j][:n], dtype=np.int64), np.asarray(self.masks[j][:n], dtype=np.int8)

    def collate(self, samples) -> tuple[np.ndarray, np.ndarray]:
        width = max(len(ids) for ids, _ in samples)
        x = np.full((len(samples), width), self.pad_id, dtype=np.int64)
        y = np.full((len(samples), width), -100, dtype=np.int64)
        for i, (ids, mask) in enumerate(samples):
            x[i, :len(ids)] = ids
            y[i, :len(ids)] = np.where(mask == 1, ids, -100)
        return x, y


def mixed_batches(transcripts: Iterator, pretrain: TokenShardDataset, windows: int) -> Iterator:
    """Each transcript micro-batch ``(inputs, labels)`` with ``windows`` pre-training windows of
    ``pretrain`` appended as a third array ``[windows, seq_len + 1]``: the replay that keeps SFT
    from erasing what mid-training taught (the trainer weighs the two losses)."""
    replay = pretrain.batches(windows)
    for inputs, labels in transcripts:
        yield inputs, labels, next(replay)
