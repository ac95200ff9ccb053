"""Benchmark of the dedup engine on the running Python's stdlib + site-packages ``.py`` files.

    .venv/bin/python benchmarks/bench_dedup.py [--max-mb 100] [--fractions 0.1,0.25,0.5,1.0]
                                               [--workers 2] [--libs] [--lib-fraction 0.1]

For every fraction the pipeline runs in a fresh subprocess (so its peak RSS is its own) on the
first files of a fixed, seeded shuffle of the corpus. ``--libs`` also times the MinHash
libraries alone on the same files, single core: rensa (bulk flat-hash path as the engine uses
it, and per-document ``RMinHash.update`` + ``RMinHashLSH``) and datasketch (``MinHash`` +
``MinHashLSH``), each doing shingling + signatures + LSH insert/query.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pyarrow and the engine are imported inside functions: worker processes (spawn) re-import
# this module and should not pay for them.


def gather(max_mb: float) -> list[dict]:
    """Rows for the ``.py`` files under stdlib and purelib (sorted walk), up to ``max_mb``."""
    roots = [("stdlib", sysconfig.get_paths()["stdlib"]), ("site-packages", sysconfig.get_paths()["purelib"])]
    rows, seen, total = [], set(), 0
    for source, root in roots:
        for dirpath, dirnames, files in os.walk(root):
            dirnames.sort()
            if source == "stdlib" and "site-packages" in dirnames:
                dirnames.remove("site-packages")
            for name in sorted(files):
                full = os.path.join(dirpath, name)
                if not name.endswith(".py") or full in seen or not os.path.isfile(full):
                    continue
                seen.add(full)
                try:
                    with open(full, "rb") as f:
                        data = f.read()
                    text = data.decode("utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                rel = os.path.relpath(full, root)
                rows.append(
                    {
                        "id": hashlib.sha256(f"{source}:{rel}".encode()).hexdigest()[:16],
                        "source": source,
                        "repo": rel.split(os.sep)[0],
                        "path": rel,
                        "language": "python",
                        "content": text,
                        "size_bytes": len(data),
                        "sha256": hashlib.sha256(data).hexdigest(),
                        "revision": "",
                    }
                )
                total += len(data)
                if total >= max_mb * 1e6:
                    return rows
    return rows


def to_table(rows: list[dict]):
    import pyarrow as pa

    cols = ["id", "source", "repo", "path", "language", "content", "size_bytes", "sha256", "revision"]
    return pa.table({c: pa.array([r[c] for r in rows], pa.int64() if c == "size_bytes" else pa.string()) for c in cols})


def peak_mb() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return own, kids


def run_one(input_urls: list[str], root: str, out: str, workers: int) -> None:
    from composer_dag.dedup import DedupConfig, dedup
    from composer_dag.storage import Storage

    storage = Storage(root)
    t = time.perf_counter()
    res = dedup(input_urls, storage, out, DedupConfig(workers=workers))
    wall = time.perf_counter() - t
    own, kids = peak_mb()
    cpu = sum(getattr(resource.getrusage(w), f) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) for f in ("ru_utime", "ru_stime"))
    rep = {"wall": wall, "cpu": cpu, "peak_self_mb": own, "peak_children_mb": kids, "result": res.to_dict()}
    print(json.dumps(rep))


def shingle_strings(text: str, k: int = 5) -> list[str]:
    from composer_dag.dedup.text import tokens

    toks = [t.decode() for t in tokens(text)]
    return [" ".join(toks[i : i + k]) for i in range(len(toks) - k + 1)]


def bench_libs(texts: list[str]) -> dict:
    import numpy as np
    import rensa
    from datasketch import MinHash, MinHashLSH

    from composer_dag.dedup.near import candidate_pairs, signatures
    from composer_dag.dedup.text import token_hashes

    mb = sum(len(t.encode()) for t in texts) / 1e6
    out = {"mb": round(mb, 2), "files": len(texts)}
    docs = [t.encode() for t in texts]

    t = time.process_time()
    sig = np.concatenate([signatures(*token_hashes(docs[s : s + 2000]), 256, 42, 5)[0] for s in range(0, len(docs), 2000)])
    t_sig = time.process_time() - t
    candidate_pairs(sig, 25, 10)
    t_all = time.process_time() - t
    out["rensa_bulk"] = {"sign_s": round(t_sig, 2), "total_s": round(t_all, 2), "mb_s": round(mb / t_all, 1)}

    t = time.process_time()
    shingles = [shingle_strings(x) for x in texts]
    t_sh = time.process_time() - t
    lsh = rensa.RMinHashLSH(0.7, 256, 32)  # rensa needs bands dividing num_perm: 32 x 8
    hashes = []
    for i, sh in enumerate(shingles):
        m = rensa.RMinHash(256, 42)
        m.update(sh)
        hashes.append(m)
        lsh.insert(i, m)
    for m in hashes:
        lsh.query(m)
    t_all = time.process_time() - t
    out["rensa_rminhash"] = {"shingle_s": round(t_sh, 2), "total_s": round(t_all, 2), "mb_s": round(mb / t_all, 1)}

    t = time.process_time()
    lsh2 = MinHashLSH(threshold=0.7, num_perm=256)
    mhs = []
    for i, sh in enumerate(shingles):
        m = MinHash(num_perm=256, seed=42)
        m.update_batch([s.encode() for s in sh])
        mhs.append(m)
        lsh2.insert(i, m)
    for m in mhs:
        lsh2.query(m)
    t_ds = time.process_time() - t + t_sh
    out["datasketch"] = {"total_s": round(t_ds, 2), "mb_s": round(mb / t_ds, 1)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-mb", type=float, default=100)
    ap.add_argument("--fractions", default="0.1,0.25,0.5,1.0")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--libs", action="store_true")
    ap.add_argument("--lib-fraction", type=float, default=0.1)
    ap.add_argument("--run-one", nargs=3, metavar=("INPUTS_JSON", "ROOT", "OUT"))
    a = ap.parse_args()
    if a.run_one:
        run_one(json.loads(a.run_one[0]), a.run_one[1], a.run_one[2], a.workers)
        return

    from composer_dag.storage import Storage

    rows = gather(a.max_mb)
    random.Random(0).shuffle(rows)
    total_mb = sum(r["size_bytes"] for r in rows) / 1e6
    print(f"corpus: {len(rows)} files, {total_mb:.1f} MB (python {sys.version.split()[0]}, {os.cpu_count()} cpus)")
    with tempfile.TemporaryDirectory() as tmp:
        storage = Storage(tmp)
        for frac in [float(f) for f in a.fractions.split(",") if f]:
            part = rows[: max(1, int(len(rows) * frac))]
            urls = []
            for k in range(4):  # four input files, as a corpus asset with several sources would give
                url = storage.url(f"in-{frac}", f"part-{k}.parquet")
                storage.write_parquet(to_table(part[k::4]), url)
                urls.append(url)
            cmd = [sys.executable, __file__, "--workers", str(a.workers), "--run-one", json.dumps(urls), tmp, storage.url(f"out-{frac}")]
            rep = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
            r = rep["result"]
            mb_in = r["bytes_in"] / 1e6
            print(
                json.dumps(
                    {
                        "fraction": frac,
                        "files_in": r["files_in"],
                        "mb_in": round(mb_in, 2),
                        "wall_s": round(rep["wall"], 2),
                        "mb_s": round(mb_in / rep["wall"], 1),
                        "cpu_s": round(rep["cpu"], 2),  # whole process incl. imports and workers
                        "peak_self_mb": round(rep["peak_self_mb"]),
                        "peak_children_mb": round(rep["peak_children_mb"]),
                        "files_kept": r["files_kept"],
                        "mb_kept": round(r["bytes_kept"] / 1e6, 2),
                        "dropped": {k: v for k, v in r["dropped"].items() if v},
                        "redactions": {k: v for k, v in r["redactions"].items() if v},
                        "clusters": r["clusters"],
                        "stage_seconds": r["stage_seconds"],
                        "lsh": r["extra"],
                    }
                )
            )
    if a.libs:
        part = rows[: max(1, int(len(rows) * a.lib_fraction))]
        print(json.dumps({"libs": bench_libs([r["content"] for r in part])}))


if __name__ == "__main__":
    main()
