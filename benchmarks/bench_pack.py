"""Token shard packing speed: the Megatron-Core packer (``composer_dag.train.data``) against
the packer it replaced (its own ``CDTOKIDX`` index), on the same documents in one run.

    python benchmarks/bench_pack.py [--corpus-mb 30] [--reps 3] [--append]

The documents are the first ``--corpus-mb`` MB of the running Python's standard library
``.py`` files, tokenized with a byte-level BPE (vocab 8192) trained as
``composer_dag.train.tokenizer`` does. The two packers alternate (old, new, new, old, ...),
``--reps`` runs each; MB/s is input text bytes over the wall time of one
``pack_documents`` call. Both write the same uint16 token stream (checked byte for byte).
Megatron-Core's one-time import and a small warm-up pack with each are done before timing.
--append adds the markdown section to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import hashlib
import json
import os
import platform
import shutil
import statistics
import struct
import sys
import tempfile
import time
from collections import Counter
from typing import Iterable

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from composer_dag.train.data import pack_documents  # noqa: E402
from composer_dag.train.tokenizer import train_tokenizer  # noqa: E402


# ---------------------------------------------------------------------------------------------
# Baseline: the packer as it was before the Megatron-Core format (composer_dag/train/data.py
# at the previous commit), copied verbatim except for the function's name and an absolute
# import.
# ---------------------------------------------------------------------------------------------

IDX_MAGIC = b"CDTOKIDX"
IDX_VERSION = 1
IDX_HEADER = struct.Struct("<8sIIQ")
REPLAY_LANGUAGES = {"markdown", "restructuredtext", "rst", "text", "plain text", "txt",
                    "html", "asciidoc", "tex", "org"}


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


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size < 65536 else np.dtype(np.uint32)


class _ShardWriter:
    def __init__(self, out_dir: str, split: str, dtype: np.dtype):
        self.path = os.path.join(out_dir, split)
        self.dtype = dtype
        self.f = open(self.path + ".bin.tmp", "wb")
        self.offsets = [0]

    def add(self, tokens: np.ndarray) -> None:
        self.f.write(tokens.astype(self.dtype, copy=False).tobytes())
        self.offsets.append(self.offsets[-1] + len(tokens))

    def close(self) -> None:
        self.f.close()
        with open(self.path + ".idx.tmp", "wb") as f:
            f.write(IDX_HEADER.pack(IDX_MAGIC, IDX_VERSION, self.dtype.itemsize,
                                    len(self.offsets) - 1))
            f.write(np.asarray(self.offsets, dtype=np.int64).tobytes())
        os.replace(self.path + ".bin.tmp", self.path + ".bin")
        os.replace(self.path + ".idx.tmp", self.path + ".idx")


def read_idx(path: str) -> tuple[np.dtype, np.ndarray]:
    """(token dtype, int64 document offsets) of an ``.idx`` file."""
    with open(path, "rb") as f:
        magic, version, code, n = IDX_HEADER.unpack(f.read(IDX_HEADER.size))
        if magic != IDX_MAGIC or version != IDX_VERSION:
            raise ValueError(f"{path}: not a token index (magic {magic!r}, version {version})")
        offsets = np.frombuffer(f.read(8 * (n + 1)), dtype=np.int64)
    return np.dtype({2: np.uint16, 4: np.uint32}[code]), offsets


def load_tokens(prefix: str) -> tuple[np.ndarray, np.ndarray]:
    """(memory-mapped token stream, document offsets) of a ``<prefix>.bin``/``.idx`` pair."""
    dtype, offsets = read_idx(prefix + ".idx")
    if offsets[-1] == 0:
        return np.zeros(0, dtype=dtype), offsets
    return np.memmap(prefix + ".bin", dtype=dtype, mode="r", shape=(int(offsets[-1]),)), offsets


def baseline_pack_documents(docs: Iterable[tuple[str, str, str, str]], tokenizer, out_dir: str,
                   val_fraction: float = 0.01, mixture: dict[str, float] | None = None,
                   seed: int = 0, batch_docs: int = 512) -> dict:
    """Tokenize ``(doc_id, text, source, language)`` rows into train/val shards in ``out_dir``.

    ``tokenizer`` is a transformers fast tokenizer or a path to one. Returns (and writes as
    ``summary.json``) counters: docs in/train/val/dropped, tokens train/val, bytes in,
    seconds, MB/s, tokens per language and per source (train), replay tokens and share.
    """
    if isinstance(tokenizer, str):
        from composer_dag.train.tokenizer import load_tokenizer
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
            toks = np.empty(len(enc.ids) + 1, dtype=np.int64)
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


# ---------------------------------------------------------------------------------------------


def stdlib_docs(max_mb: float):
    src = os.path.dirname(os.__file__)
    total = 0
    for path in sorted(glob.glob(src + "/**/*.py", recursive=True)):
        try:
            text = open(path, encoding="utf-8").read()
        except (UnicodeDecodeError, OSError):
            continue
        total += len(text.encode())
        if total > max_mb * 1e6:
            return
        yield os.path.relpath(path, src), text, "stdlib", "Python"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus-mb", type=float, default=30.0)
    ap.add_argument("--reps", type=int, default=3, help="runs of each packer, interleaved")
    ap.add_argument("--append", action="store_true")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    work = tempfile.mkdtemp(prefix="bench_pack_")
    docs = list(stdlib_docs(args.corpus_mb))
    mb = sum(len(d[1].encode("utf-8", "surrogatepass")) for d in docs) / 1e6
    tok = train_tokenizer((d[1] for d in docs[:400]), os.path.join(work, "tok"), vocab_size=8192)

    t = time.perf_counter()
    from composer_dag.train.megatron_shards import indexed_dataset_module

    indexed_dataset_module()
    import_s = time.perf_counter() - t

    packers = {"old": baseline_pack_documents, "new": pack_documents}
    for name, pack in packers.items():  # warm both paths up on a few documents, untimed
        pack(docs[:50], tok, os.path.join(work, f"warm_{name}"), val_fraction=0.02, seed=0)
    rates: dict[str, list[float]] = {"old": [], "new": []}
    order = [("old", "new") if i % 2 == 0 else ("new", "old") for i in range(args.reps)]
    tokens = {}
    for i, pair in enumerate(order):
        for name in pair:
            out = os.path.join(work, f"{name}{i}")
            t = time.perf_counter()
            s = packers[name](docs, tok, out, val_fraction=0.02, seed=0)
            rates[name].append(mb / (time.perf_counter() - t))
            tokens[name] = s["tokens_train"] + s["tokens_val"]
            print(f"rep {i + 1} {name}: {rates[name][-1]:.2f} MB/s", flush=True)
            if i == 0:
                continue
            shutil.rmtree(out)
    for split in ("train", "val"):  # the same token stream, byte for byte
        a, b = (open(os.path.join(work, f"{n}0", f"{split}.bin"), "rb").read()
                for n in ("old", "new"))
        assert a == b, f"{split}.bin differs between the packers"
    shutil.rmtree(work)
    old, new = statistics.median(rates["old"]), statistics.median(rates["new"])
    res = {"date": datetime.date.today().isoformat(), "corpus_mb": round(mb, 2), "docs": len(docs),
           "tokens": tokens["new"], "old_mb_per_s": [round(r, 2) for r in rates["old"]],
           "new_mb_per_s": [round(r, 2) for r in rates["new"]], "old_median": round(old, 2),
           "new_median": round(new, 2), "ratio": round(new / old, 3),
           "megatron_import_s": round(import_s, 2)}
    print(json.dumps(res))

    import megatron.core
    import tokenizers

    cmd = ".venv/bin/python benchmarks/bench_pack.py " + " ".join(sys.argv[1:])
    md = [
        "", "## Token shard packing (Megatron format)", "",
        f"`{cmd.strip()}` on {res['date']} ({os.cpu_count()} shared CPU cores, Python "
        f"{platform.python_version()}, megatron-core {megatron.core.__version__}, tokenizers "
        f"{tokenizers.__version__}; load average {load_before:.1f} before the run).", "",
        f"Same documents for both: {res['corpus_mb']} MB of stdlib `.py` files "
        f"({res['docs']} docs, "
        f"{res['tokens']:,} tokens), byte-level BPE vocab 8192, `val_fraction=0.02`. Old: the "
        f"packer with its own `CDTOKIDX` index (copied into the script as the baseline); new: "
        f"`pack_documents` writing through Megatron-Core's `IndexedDatasetBuilder`. "
        f"{args.reps} runs each, interleaved; both write the same `.bin` bytes.", "",
        "| packer | MB/s per run | median MB/s |", "|---|---|---|",
        f"| old (`CDTOKIDX`) | {', '.join(f'{r:.2f}' for r in rates['old'])} | {old:.2f} |",
        f"| new (Megatron `MMIDIDX`) | {', '.join(f'{r:.2f}' for r in rates['new'])} | {new:.2f} |",
        f"| ratio new / old, medians (target >= 0.95) | | {res['ratio']:.3f} |",
        "",
        f"Megatron-Core's import, once per process and not in the figures above: "
        f"{res['megatron_import_s']} s.", "",
    ]
    text = "\n".join(md)
    print(text)
    if args.append:
        with open(os.path.join(ROOT, "benchmarks", "RESULTS.md"), "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
