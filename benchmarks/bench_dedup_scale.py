"""Dedup at corpus scale: time, CPU and peak memory of the whole process tree, against the
pipeline of an earlier commit and against datatrove's MinHash pipeline, in one run.

    .venv/bin/python benchmarks/bench_dedup_scale.py [--gb 2] [--fractions 0.1,0.25,0.5,1.0]
        [--baseline-rev 66c2f15 --baseline-fractions 0.1,0.25] [--one-process-fraction 0.25]
        [--datatrove] [--work /tmp/dedup-scale]

Corpus: every ``.py`` file of the running interpreter's tree (stdlib with its tests) and of the
venv's site-packages (sorted walk, UTF-8 only), then rounds of copies with planted edits until
``--gb``: per file one of a CRLF copy (an exact duplicate after normalisation), every 15th line
tweaked, the last 4% of lines cut, or a line inserted (near duplicates). Rows are shuffled with
a fixed seed and written as ~64 MB Parquet files of one row group each, as ``code_corpus``
writes them; a fraction is the first files.

Every pipeline run is a fresh subprocess; a thread samples the summed RSS of it and all its
children every 10 ms (the peak is the whole tree's: main, map workers, DuckDB); CPU is user +
sys of the process and its children. ``--baseline-rev`` runs the dedup engine of that commit
(``git archive`` into the work directory) on the same files. ``--datatrove`` installs datatrove
in its own venv under the work directory and runs its MinHash pipeline (signatures, buckets,
clusters, filter; its default 14 x 8 hashes, 5-grams, 2 workers) on the interpreter's own
``.py`` tree, and this pipeline on the same files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import sysconfig
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
COLUMNS = ["id", "source", "repo", "path", "language", "content", "size_bytes", "sha256", "revision"]
# datatrove's JSONL reader needs orjson and its default word tokenizer spaCy
DATATROVE = ["datatrove[processing]==0.10.1", "orjson==3.13.0", "spacy==3.8.18"]


def real_files() -> list[tuple[str, str, str]]:
    """``(source, relative path, text)`` of the interpreter's and the venv's ``.py`` files."""
    roots = [("python", sysconfig.get_paths()["stdlib"]), ("site-packages", sysconfig.get_paths()["purelib"])]
    out, seen = [], set()
    for source, root in roots:
        for dirpath, dirnames, files in os.walk(root):
            dirnames.sort()
            for name in sorted(files):
                full = os.path.realpath(os.path.join(dirpath, name))
                if not name.endswith(".py") or full in seen or not os.path.isfile(full):
                    continue
                seen.add(full)
                try:
                    with open(full, "rb") as f:
                        text = f.read().decode("utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                out.append((source, os.path.relpath(os.path.join(dirpath, name), root), text))
    return out


def planted(text: str, kind: int, rnd: random.Random) -> str:
    lines = text.split("\n")
    if kind == 0:
        return text.replace("\n", "\r\n")
    if kind == 1:
        return "\n".join(ln + "  # tweaked" if k % 15 == 7 and ln.strip() else ln for k, ln in enumerate(lines))
    if kind == 2:
        return "\n".join(lines[: len(lines) - max(1, len(lines) // 25)])
    at = rnd.randrange(len(lines) + 1)
    return "\n".join(lines[:at] + [f"# note {rnd.randrange(10**6)}"] + lines[at:])


def row(source: str, path: str, text: str) -> dict:
    data = text.encode("utf-8", "surrogatepass")
    return {"id": hashlib.sha256(f"{source}:{path}".encode()).hexdigest()[:16], "source": source,
            "repo": path.split(os.sep)[0], "path": path, "language": "python", "content": text,
            "size_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "revision": ""}


def build_corpus(work: str, gb: float) -> list[str]:
    """The corpus as ~64 MB Parquet files (made once per size, then reused)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = os.path.join(work, f"corpus-{gb:g}gb")
    done = os.path.join(folder, "files.json")
    if os.path.exists(done):
        with open(done) as f:
            return json.load(f)
    files = real_files()
    rows = [row(s, p, t) for s, p, t in files]
    total = sum(r["size_bytes"] for r in rows)
    rnd = random.Random(0)
    r = 0
    while total < gb * 1e9:
        r += 1
        for s, p, t in files:
            copy = row(f"copy{r}-{s}", p, planted(t, rnd.randrange(4), rnd))
            rows.append(copy)
            total += copy["size_bytes"]
            if total >= gb * 1e9:
                break
    random.Random(1).shuffle(rows)
    os.makedirs(folder, exist_ok=True)
    paths, chunk, size = [], [], 0
    for i, x in enumerate(rows):
        chunk.append(x)
        size += x["size_bytes"]
        if size >= 64_000_000 or i == len(rows) - 1:
            table = pa.table({c: pa.array([y[c] for y in chunk], pa.int64() if c == "size_bytes" else pa.string())
                              for c in COLUMNS})
            path = os.path.join(folder, f"files-{len(paths):05d}.parquet")
            pq.write_table(table, path, compression="zstd")
            paths.append(path)
            chunk, size = [], 0
    with open(done, "w") as f:
        json.dump(paths, f)
    return paths


# ---- one measured run (in its own process) ---------------------------------------------------

def run_one(code: str, inputs: list[str], out: str, config: dict) -> None:
    import resource
    import threading

    import psutil

    sys.path.insert(0, code)
    from composer_dag.dedup import dedup
    from composer_dag.storage import Storage

    me, peak, stop = psutil.Process(), [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            total = 0
            for p in [me, *me.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            peak[0] = max(peak[0], total)
            time.sleep(0.01)

    threading.Thread(target=sample, daemon=True).start()
    storage = Storage(os.path.dirname(out))
    t = time.perf_counter()
    res = dedup(["file://" + p for p in inputs], storage, "file://" + out, config)
    wall = time.perf_counter() - t
    stop.set()
    cpu = sum(getattr(resource.getrusage(w), f) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))
    r = res.to_dict()
    print(json.dumps({"wall_s": round(wall, 2), "cpu_s": round(cpu, 1), "peak_tree_mb": round(peak[0] / 1e6),
                      "files_in": r["files_in"], "mb_in": round(r["bytes_in"] / 1e6, 1),
                      "files_kept": r["files_kept"], "mb_kept": round(r["bytes_kept"] / 1e6, 1),
                      "dropped": {k: v for k, v in r["dropped"].items() if v}, "clusters": r["clusters"],
                      "stage_seconds": r["stage_seconds"], "candidate_pairs": r["extra"]["candidate_pairs"]}),
          flush=True)
    # the figures are out: skip interpreter teardown, where a native library's thread at times
    # aborts the process ("terminate called without an active exception") after a complete run
    os._exit(0)


def measured(code: str, inputs: list[str], out: str, config: dict) -> dict:
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, __file__, "--run-one", json.dumps([code, inputs, out, config])]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=code)
    if proc.returncode:
        raise SystemExit(f"run failed: {proc.stderr[-3000:]}")
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(out + ".work", ignore_errors=True)
    rep = json.loads(proc.stdout.strip().splitlines()[-1])
    rep["mb_s"] = round(rep["mb_in"] / rep["wall_s"], 1)
    rep["cpu_s_per_100mb"] = round(rep["cpu_s"] / rep["mb_in"] * 100, 2)
    return rep


def baseline_code(work: str, rev: str) -> str:
    folder = os.path.join(work, f"code-{rev}")
    if not os.path.isdir(folder):
        os.makedirs(folder)
        archive = subprocess.run(["git", "archive", rev, "composer_dag"], cwd=REPO, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", folder], input=archive.stdout, check=True)
    return folder


# ---- datatrove -------------------------------------------------------------------------------

DATATROVE_SCRIPT = """
import sys, time
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter
from datatrove.pipeline.dedup.minhash import (MinhashConfig, MinhashDedupSignature, MinhashDedupBuckets,
                                              MinhashDedupCluster, MinhashDedupFilter)

# datatrove 0.10.1's clustering step raises KeyError on its cluster-size statistic when a node
# was seen only paired with itself; the statistic becomes set_size.get(p, 1), nothing else changes.
import inspect, textwrap
from datatrove.pipeline.dedup import minhash as _mh
_src = textwrap.dedent(inspect.getsource(_mh.MinhashDedupCluster.run)).replace("set_size[p]", "set_size.get(p, 1)")
_ns = {}
exec(compile(_src, _mh.__file__, "exec"), _mh.__dict__, _ns)
_mh.MinhashDedupCluster.run = _ns["run"]

if __name__ == "__main__":
    src, work, tasks = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cfg = MinhashConfig()
    steps = [
        ([JsonlReader(src), MinhashDedupSignature(output_folder=work + "/sigs", config=cfg)], tasks),
        ([MinhashDedupBuckets(input_folder=work + "/sigs", output_folder=work + "/buckets", config=cfg)],
         cfg.num_buckets),
        ([MinhashDedupCluster(input_folder=work + "/buckets", output_folder=work + "/remove", config=cfg)], 1),
        ([JsonlReader(src), MinhashDedupFilter(input_folder=work + "/remove"), JsonlWriter(work + "/out")], tasks),
    ]
    t = time.perf_counter()
    for k, (pipeline, n) in enumerate(steps):
        LocalPipelineExecutor(pipeline=pipeline, tasks=n, workers=2, logging_dir=f"{work}/logs/{k}").run()
    print("WALL", time.perf_counter() - t)
"""


def bench_datatrove(work: str) -> dict:
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    venv = os.path.join(work, "datatrove-venv")
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py) or subprocess.run([py, "-c", "import datatrove, orjson, spacy"]).returncode:
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run([py, "-m", "pip", "install", "-q", *DATATROVE], check=True)
    files = [f for f in real_files() if f[0] == "python"]
    folder = os.path.join(work, "pytree")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(os.path.join(folder, "jsonl"))
    rows = [row(s, p, t) for s, p, t in files]
    parts = []
    for k in range(4):  # four input files, for both pipelines
        with open(os.path.join(folder, "jsonl", f"part-{k}.jsonl"), "w") as f:
            for x in rows[k::4]:
                f.write(json.dumps({"id": x["id"], "text": x["content"]}) + "\n")
        table = pa.table({c: pa.array([y[c] for y in rows[k::4]], pa.int64() if c == "size_bytes" else pa.string())
                          for c in COLUMNS})
        parts.append(os.path.join(folder, f"part-{k}.parquet"))
        pq.write_table(table, parts[-1], compression="zstd")
    script = os.path.join(folder, "datatrove_minhash.py")
    with open(script, "w") as f:
        f.write(DATATROVE_SCRIPT)
    t = time.perf_counter()
    proc = subprocess.run([py, script, os.path.join(folder, "jsonl"), os.path.join(folder, "dt"), "4"],
                          capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode:
        raise SystemExit(f"datatrove failed: {proc.stderr[-3000:]}")
    ours = measured(REPO, parts, os.path.join(folder, "ours"), {"workers": 2})
    mb = sum(x["size_bytes"] for x in rows) / 1e6
    return {"files": len(rows), "mb": round(mb, 1), "datatrove_wall_s": round(wall, 1),
            "datatrove_mb_s": round(mb / wall, 2), "ours": ours, "speed_ratio": round(wall / ours["wall_s"], 1),
            "datatrove": DATATROVE}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--fractions", default="0.1,0.25,0.5,1.0")
    ap.add_argument("--baseline-rev", default="66c2f15")
    ap.add_argument("--baseline-fractions", default="0.1,0.25")
    ap.add_argument("--one-process-fraction", type=float, default=0.25)
    ap.add_argument("--datatrove", action="store_true")
    ap.add_argument("--work", default="/tmp/dedup-scale")
    ap.add_argument("--run-one")
    a = ap.parse_args()
    if a.run_one:
        run_one(*json.loads(a.run_one))
        return
    os.makedirs(a.work, exist_ok=True)
    t = time.perf_counter()
    paths = build_corpus(a.work, a.gb)
    size = sum(os.path.getsize(p) for p in paths)
    print(json.dumps({"corpus_files": len(paths), "parquet_mb": round(size / 1e6), "build_s": round(time.perf_counter() - t),
                      "cpus": os.cpu_count(), "python": sys.version.split()[0], "load": os.getloadavg()}), flush=True)

    def part(frac: float) -> list[str]:
        return paths[: max(1, round(len(paths) * frac))]

    out = os.path.join(a.work, "out")
    base = baseline_code(a.work, a.baseline_rev) if a.baseline_fractions else None
    for frac in [float(f) for f in a.fractions.split(",") if f]:
        rep = {"fraction": frac, "load": os.getloadavg()[0], "ours": measured(REPO, part(frac), out, {"workers": 2})}
        if base and frac in [float(f) for f in a.baseline_fractions.split(",") if f]:
            rep["baseline"] = measured(base, part(frac), out, {"workers": 2})
            rep["speed_vs_baseline"] = round(rep["baseline"]["wall_s"] / rep["ours"]["wall_s"], 2)
            rep["cpu_vs_baseline"] = round(rep["ours"]["cpu_s"] / rep["baseline"]["cpu_s"], 2)
            rep["same_output_counts"] = all(rep["ours"][k] == rep["baseline"][k] for k in ("files_kept", "mb_kept", "dropped"))
        print(json.dumps(rep), flush=True)
    if a.one_process_fraction:
        files = part(a.one_process_fraction)
        two = measured(REPO, files, out, {"workers": 2})
        one = measured(REPO, files, out, {"workers": 1})
        print(json.dumps({"map_processes": {"fraction": a.one_process_fraction, "one": one, "two": two,
                                            "speedup_wall": round(one["wall_s"] / two["wall_s"], 2),
                                            "speedup_map": round(one["stage_seconds"]["analyse"] / two["stage_seconds"]["analyse"], 2)}}),
              flush=True)
    if a.datatrove:
        print(json.dumps({"datatrove": bench_datatrove(a.work)}), flush=True)


if __name__ == "__main__":
    main()
