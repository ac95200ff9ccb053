"""CPU per byte of the dedup engine, old against new in one run, on the interpreter's ``.py`` tree.

    .venv/bin/python benchmarks/bench_dedup_cpu.py [--max-mb 100] [--baseline-rev ac65404]
        [--repeat 2] [--work /tmp/dedup-cpu] [--skip-stage] [--skip-pipeline]

Corpus: the UTF-8 ``.py`` files of the running interpreter's stdlib tree (with its tests), in a
fixed shuffle, up to ``--max-mb``, written as 4 zstd Parquet files.

1. **Per-file stage** (one process, CPU seconds from ``time.process_time``): ``analyse_batch``
   on the same batches of about 4 MB with the plain Python/numpy code and with the compiled
   kernels, alternating batch by batch so that load from other jobs hits both alike; every
   result is compared (verdicts, exact hashes, signatures, contamination hits, redactions).
2. **Whole pipeline**: ``dedup`` with the default config (2 map workers) on the same Parquet
   files, the engine of ``--baseline-rev`` (``git archive``) and this tree alternately, each in a
   fresh process, ``--repeat`` times; CPU is user + sys of the process tree (``getrusage``),
   including interpreter start-up and imports.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from bench_dedup_scale import COLUMNS, baseline_code, measured, real_files, row  # noqa: E402


def corpus(work: str, max_mb: float) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = os.path.join(work, f"pytree-{max_mb:g}mb")
    paths = [os.path.join(folder, f"part-{k}.parquet") for k in range(4)]
    if all(os.path.exists(p) for p in paths):
        return paths
    files = [f for f in real_files() if f[0] == "python"]
    random.Random(0).shuffle(files)
    rows, total = [], 0
    for s, p, t in files:
        rows.append(row(s, p, t))
        total += rows[-1]["size_bytes"]
        if total >= max_mb * 1e6:
            break
    os.makedirs(folder, exist_ok=True)
    for k, path in enumerate(paths):
        part = rows[k::4]
        table = pa.table({c: pa.array([y[c] for y in part], pa.int64() if c == "size_bytes" else pa.string())
                          for c in COLUMNS})
        pq.write_table(table, path, compression="zstd")
    return paths


def stage(paths: list[str]) -> dict:
    """The per-file pass, plain and compiled, on the same batches; results compared."""
    import numpy as np
    import pyarrow.parquet as pq

    sys.path.insert(0, REPO)
    from types import SimpleNamespace

    from composer_dag.dedup import kernels
    from composer_dag.dedup.decontam import default_index
    from composer_dag.dedup.features import analyse_batch
    from composer_dag.dedup.pipeline import DedupConfig
    from composer_dag.dedup.shards import batch_rows

    cfg = SimpleNamespace(**DedupConfig().model_dump())
    contam = default_index().hashes
    t = time.process_time()
    kernels.warm()
    load = time.process_time() - t
    cpu = {False: {}, True: {}}
    total = {False: 0.0, True: 0.0}
    nbytes, same = 0, True
    for path in paths:
        pf = pq.ParquetFile(path)
        size = batch_rows(pf.metadata, list(range(pf.num_row_groups)), cfg.batch_bytes)
        for batch in pf.iter_batches(batch_size=size, columns=["path", "content"]):
            docs = batch.column("content").cast("binary").to_pylist()
            names = batch.column("path").to_pylist()
            nbytes += sum(len(d) for d in docs if d is not None)
            got = {}
            for native in (False, True):
                t = time.process_time()
                got[native] = analyse_batch(docs, names, cfg, contam, native=native)
                total[native] += time.process_time() - t
                for k, v in got[native]["cpu"].items():
                    cpu[native][k] = cpu[native].get(k, 0.0) + v
            a, b = got[False], got[True]
            same &= all(a[k] == b[k] for k in ("verdicts", "live", "exact", "hits", "redacted"))
            same &= bool(np.array_equal(a["sig"], b["sig"]) and np.array_equal(a["has_shingles"], b["has_shingles"]))
    per = 1e8 / nbytes
    return {
        "mb": round(nbytes / 1e6, 1),
        "same_results": same,
        "plain_cpu_s_per_100mb": round(total[False] * per, 2),
        "compiled_cpu_s_per_100mb": round(total[True] * per, 2),
        "ratio": round(total[True] / total[False], 3),
        "plain_by_stage": {k: round(v * per, 2) for k, v in cpu[False].items()},
        "compiled_by_stage": {k: round(v * per, 2) for k, v in cpu[True].items()},
        "kernel_load_cpu_s": round(load, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-mb", type=float, default=100)
    ap.add_argument("--baseline-rev", default="ac65404")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--work", default="/tmp/dedup-cpu")
    ap.add_argument("--skip-stage", action="store_true")
    ap.add_argument("--skip-pipeline", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    paths = corpus(a.work, a.max_mb)
    print(json.dumps({"inputs": paths, "cpus": os.cpu_count(), "python": sys.version.split()[0],
                      "load": os.getloadavg()}), flush=True)
    if not a.skip_stage:
        print(json.dumps({"per_file_stage": stage(paths), "load": os.getloadavg()}), flush=True)
    if a.skip_pipeline:
        return
    base = baseline_code(a.work, a.baseline_rev)
    out = os.path.join(a.work, "out")
    runs: dict[str, list[dict]] = {"baseline": [], "ours": []}
    for _ in range(a.repeat):
        for name, code in (("baseline", base), ("ours", REPO)):
            rep = measured(code, paths, out, {"workers": 2})
            rep["load"] = os.getloadavg()[0]
            runs[name].append(rep)
            print(json.dumps({name: rep}), flush=True)
    b = min(r["cpu_s"] for r in runs["baseline"])
    o = min(r["cpu_s"] for r in runs["ours"])
    keys = ("files_kept", "mb_kept", "dropped", "clusters", "candidate_pairs")
    print(json.dumps({"pipeline": {
        "baseline_rev": a.baseline_rev, "mb": runs["ours"][0]["mb_in"],
        "baseline_cpu_s_per_100mb": [r["cpu_s_per_100mb"] for r in runs["baseline"]],
        "ours_cpu_s_per_100mb": [r["cpu_s_per_100mb"] for r in runs["ours"]],
        "cpu_ratio_best": round(o / b, 3),
        "wall_ratio_best": round(min(r["wall_s"] for r in runs["ours"]) / min(r["wall_s"] for r in runs["baseline"]), 3),
        "same_output_counts": all(r[k] == runs["baseline"][0][k] for r in runs["ours"] + runs["baseline"] for k in keys),
    }}), flush=True)


if __name__ == "__main__":
    main()
