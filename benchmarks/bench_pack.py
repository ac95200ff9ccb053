"""Token shard packing speed: the Megatron-Core packer (``composer_dag.train.data``) against
the packer it replaced (its own ``CDTOKIDX`` index), on the same documents in one run.

    python benchmarks/bench_pack.py [--corpus-mb 30] [--reps 3] [--append]

The documents are the first ``--corpus-mb`` MB of the running Python's standard library
``.py`` files, tokenized with a byte-level BPE (vocab 8192) trained as
``composer_dag.train.tokenizer`` does. The two packers alternate (old, new, new, old, ...),
``--reps`` runs each; MB/s is input text bytes over the wall time of one
``pack_documents`` call. Both write the same uint16 token stream (checked byte for byte).
Megatron-Core's one-time import and a small warm-up pack with each are done before timing.
--append adds the markdown section to the day's journal file, benchmarks/journal/YYYY-MM-DD.md
(benchmarks/RESULTS.md keeps the current figure of each measurement).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from composer_dag.train.data import pack_documents  # noqa: E402
from composer_dag.train.tokenizer import train_tokenizer  # noqa: E402


BASELINE_COMMIT = "6ae7dbee7a2ae81d55f906a458afae43d259c426"
"""The commit whose ``composer_dag/train/data.py`` is the baseline: the packer with its own
``CDTOKIDX`` index, as it was before the Megatron-Core format."""


def baseline_packer():
    """The baseline packer's module, read from git history at benchmark time and run as a module
    of its own (it imports nothing of the project's but the tokenizer loader, used for a path)."""
    import subprocess
    import types

    src = subprocess.run(["git", "-C", ROOT, "show", f"{BASELINE_COMMIT}:composer_dag/train/data.py"],
                         capture_output=True, text=True, check=True).stdout
    mod = types.ModuleType("composer_dag.train._baseline_data")
    mod.__package__ = "composer_dag.train"
    exec(compile(src, f"{BASELINE_COMMIT[:12]}:composer_dag/train/data.py", "exec"), mod.__dict__)
    assert mod.IDX_MAGIC == b"CDTOKIDX", "the baseline commit does not hold the CDTOKIDX packer"
    return mod


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

    packers = {"old": baseline_packer().pack_documents, "new": pack_documents}
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
        f"packer with its own `CDTOKIDX` index (read from git history, commit {BASELINE_COMMIT[:12]}); new: "
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
        with open(os.path.join(ROOT, "benchmarks", "journal", datetime.date.today().isoformat() + ".md"), "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
