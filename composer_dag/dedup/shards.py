"""The map: every stage's per-file work on one input shard, as a task that shares nothing.

A task reads its row groups of one input Parquet file in batches of about ``batch_bytes`` of
content, runs ``features.analyse_batch`` on each batch and streams what the reduce needs to two
Parquet files in the run's work directory:

- ``features-NNNNN.parquet``, one row per input row: ``row`` (its place in the input order),
  ``id``, ``source``, ``path``, ``size``; ``reason`` and ``detail`` when the row fails a filter
  (``invalid_row`` for null content); for the others ``exact`` (the normalised SHA-256),
  ``has_shingles``, ``sig`` (the MinHash signature, num_perm little-endian u32), the first
  contaminated n-gram (``hit_hash``, ``hit_ngram``), the secrets found by kind (``n_<kind>``)
  and ``redacted`` (the redacted content, null when there is nothing to redact);
- ``bands-NNNNN.parquet``: ``(band, key, row)`` for each file with shingles, its LSH buckets.

and ``task-NNNNN.json`` (rows, bytes, CPU seconds by stage) last, which marks the task done.

Everything a task needs is in the job spec (``spec.json`` in the work directory): the storage
root, the config, the n-gram hashes of the evaluation texts and the task list. So a task runs in
a local process pool, or on any machine that reaches the storage as

    python -m composer_dag.dedup.shards SPEC_URL INDEX

which is one element of a Slurm job array or of a Kubernetes indexed Job (``INDEX`` may be left
out: it is then read from ``$COMPOSER_ARRAY_INDEX``, which ``run_array`` sets).
"""

from __future__ import annotations

import posixpath
import sys
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..cluster.spec import array_task_args
from ..storage import ArtifactError, Storage, open_storage
from .features import STAGES, analyse_batch, native_available
from .near import band_keys, optimal_bands
from .secrets import SECRET_KINDS
from .text import tokens

RunTasks = Callable[[str, int], None]
"""Runs ``python -m composer_dag.dedup.shards SPEC_URL I`` for every I in ``range(n)``, each
anywhere that reaches the storage, and returns once all have succeeded (raises otherwise)."""

FEATURES_SCHEMA = pa.schema(
    [
        ("row", pa.int64()),
        ("id", pa.string()),
        ("source", pa.string()),
        ("path", pa.string()),
        ("size", pa.int64()),
        ("reason", pa.string()),
        ("detail", pa.string()),
        ("exact", pa.binary()),
        ("has_shingles", pa.bool_()),
        ("sig", pa.binary()),
        ("hit_hash", pa.uint64()),
        ("hit_ngram", pa.string()),
        *((f"n_{kind}", pa.int32()) for kind in SECRET_KINDS),
        ("redacted", pa.binary()),
    ]
)
BANDS_SCHEMA = pa.schema([("band", pa.int16()), ("key", pa.uint64()), ("row", pa.int64())])


def lsh_shape(cfg: Any) -> tuple[int, int]:
    """(bands, rows per band) of the config."""
    return (cfg.bands, cfg.num_perm // cfg.bands) if cfg.bands else optimal_bands(cfg.threshold, cfg.num_perm)


def open_parquet(storage: Storage, url: str) -> pq.ParquetFile:
    """An input Parquet file, or ``ArtifactError`` in one line naming it."""
    try:
        return pq.ParquetFile(storage.open(url))
    except FileNotFoundError:
        raise ArtifactError(f"missing Parquet input {url}") from None
    except Exception as exc:  # pyarrow raises ArrowInvalid and friends
        why = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise ArtifactError(f"corrupt or unreadable Parquet input {url}: {why}") from None


def plan(inputs: list[tuple[str, pq.FileMetaData]], task_bytes: int, work_url: str) -> list[dict]:
    """Tasks of consecutive row groups of one input, about ``task_bytes`` (uncompressed) each;
    ``first_row`` numbers every input row in input order."""
    tasks: list[dict] = []
    first = 0
    for url, meta in inputs:
        groups: list[int] = []
        size = 0
        start = first
        for g in range(meta.num_row_groups):
            groups.append(g)
            size += meta.row_group(g).total_byte_size
            first += meta.row_group(g).num_rows
            if size >= task_bytes or g == meta.num_row_groups - 1:
                k = len(tasks)
                tasks.append({"input": url, "row_groups": groups, "first_row": start,
                              "features": posixpath.join(work_url, f"features-{k:05d}.parquet"),
                              "bands": posixpath.join(work_url, f"bands-{k:05d}.parquet"),
                              "stats": posixpath.join(work_url, f"task-{k:05d}.json")})
                groups, size, start = [], 0, first
    return tasks


def batch_rows(meta: pq.FileMetaData, row_groups: list[int], batch_bytes: int) -> int:
    """Rows per batch for about ``batch_bytes`` of the row groups' (uncompressed) data."""
    rows = sum(meta.row_group(g).num_rows for g in row_groups)
    size = sum(meta.row_group(g).total_byte_size for g in row_groups)
    return max(1, int(batch_bytes * rows / max(size, 1)))


def _column(batch: pa.RecordBatch, name: str, typ: pa.DataType) -> list:
    return batch.column(name).cast(typ).to_pylist()


def _features(batch: pa.RecordBatch, first_row: int, cfg: Any, contam: np.ndarray,
              lsh: tuple[int, int], native: bool = False) -> tuple[pa.Table, pa.Table, dict[str, float], int]:
    """One batch's features and band rows, the CPU seconds by stage, and its content bytes."""
    docs = _column(batch, "content", pa.binary())
    paths = _column(batch, "path", pa.string())
    r = analyse_batch(docs, paths, cfg, contam, native=native)
    n = len(docs)
    rows = np.arange(first_row, first_row + n, dtype=np.int64)
    reason = [None if v is None else v[0] for v in r["verdicts"]]
    detail = [None if v is None else v[1] for v in r["verdicts"]]
    for j, d in enumerate(docs):
        if d is None:
            reason[j], detail[j] = "invalid_row", "null content"
    live = r["live"]
    exact: list = [None] * n
    sig: list = [None] * n
    shingles: list = [None] * n
    for k, j in enumerate(live):
        exact[j] = r["exact"][k]
        sig[j] = r["sig"][k].astype("<u4").tobytes()
        shingles[j] = bool(r["has_shingles"][k])
    hit_hash: list = [None] * n
    hit_ngram: list = [None] * n
    for k, pos, h in r["hits"]:
        j = live[k]
        hit_hash[j] = h
        hit_ngram[j] = b" ".join(tokens(docs[j])[pos : pos + cfg.decontam_n]).decode("ascii")
    secrets = {kind: [None] * n for kind in SECRET_KINDS}
    redacted: list = [None] * n
    for k, (new, counts) in r["redacted"].items():
        j = live[k]
        redacted[j] = new
        for kind, c in counts.items():
            secrets[kind][j] = c
    columns = {
        "row": rows,
        "id": _column(batch, "id", pa.string()),
        "source": _column(batch, "source", pa.string()),
        "path": paths,
        "size": [0 if d is None else len(d) for d in docs],
        "reason": reason,
        "detail": detail,
        "exact": exact,
        "has_shingles": shingles,
        "sig": sig,
        "hit_hash": hit_hash,
        "hit_ngram": hit_ngram,
        **{f"n_{kind}": v for kind, v in secrets.items()},
        "redacted": redacted,
    }
    features = pa.table(columns, schema=FEATURES_SCHEMA)
    with_shingles = [k for k in range(len(live)) if r["has_shingles"][k]]
    keys = band_keys(r["sig"][with_shingles], *lsh)
    bands = pa.table(
        {
            "band": np.tile(np.arange(lsh[0], dtype=np.int16), len(with_shingles)),
            "key": keys.reshape(-1),
            "row": np.repeat(rows[[live[k] for k in with_shingles]], lsh[0]),
        },
        schema=BANDS_SCHEMA,
    )
    return features, bands, r["cpu"], sum(len(d) for d in docs if d is not None)


def run_task(storage: Storage, spec: dict, index: int) -> dict:
    """Task ``index`` of the job ``spec``: its features, band rows and stats in storage."""
    task = spec["tasks"][index]
    # plain values (a worker need not import pydantic); JSON made the config's tuples lists
    cfg = SimpleNamespace(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec["config"].items()})
    contam = np.asarray(spec["contam"], dtype=np.uint64)
    lsh = tuple(spec["lsh"])
    pf = open_parquet(storage, task["input"])
    meta = pf.metadata
    size = batch_rows(meta, task["row_groups"], cfg.batch_bytes)
    task_bytes = sum(meta.row_group(g).total_byte_size for g in task["row_groups"])
    native = task_bytes >= getattr(cfg, "native_min_bytes", 0) and native_available()
    stats = {"rows": 0, "bytes": 0, "batches": 0, "native": native, "cpu": dict.fromkeys(STAGES, 0.0)}
    row = task["first_row"]
    with storage.open_atomic(task["features"]) as ff, storage.open_atomic(task["bands"]) as bf:
        # read once by the reduce: no compression, dictionaries or statistics to spend time on
        plain = {"compression": "none", "use_dictionary": False, "write_statistics": False}
        fw = pq.ParquetWriter(ff, FEATURES_SCHEMA, **plain)
        bw = pq.ParquetWriter(bf, BANDS_SCHEMA, **plain)
        try:
            batches = pf.iter_batches(batch_size=size, row_groups=task["row_groups"],
                                      columns=["id", "source", "path", "content"])
            for batch in batches:
                features, bands, cpu, nbytes = _features(batch, row, cfg, contam, lsh, native)
                fw.write_table(features)
                bw.write_table(bands)
                row += batch.num_rows
                stats["rows"] += batch.num_rows
                stats["bytes"] += nbytes
                stats["batches"] += 1
                for stage, sec in cpu.items():
                    stats["cpu"][stage] += sec
        except (OSError, pa.ArrowException) as exc:
            why = " ".join(str(exc).split())[:300] or type(exc).__name__
            raise ArtifactError(f"corrupt or unreadable Parquet input {task['input']}: {why}") from None
        finally:
            fw.close()
            bw.close()
    storage.write_json(task["stats"], stats)
    return stats


def main(argv: list[str] | None = None) -> int:
    """``python -m composer_dag.dedup.shards SPEC_URL [INDEX]``: run one task of a job spec;
    without ``INDEX``, the task is ``$COMPOSER_ARRAY_INDEX`` (what ``run_array`` sets for each
    element of a Slurm job array or a k8s indexed Job)."""
    got = array_task_args(sys.argv[1:] if argv is None else argv, "composer_dag.dedup.shards")
    if got is None:
        return 2
    spec_url, index = got
    try:
        storage = open_storage(spec_url.rsplit("/", 1)[0])
        spec = storage.read_json(spec_url)
        storage = open_storage(spec["root"])
        run_task(storage, spec, index)
    except Exception as exc:  # one line for the job's log, never a traceback; shaped as an exception
        why = " ".join(str(exc).split())[:500] or type(exc).__name__  # line, so run_array names it
        print(f"DedupTaskError: dedup task {index} of {spec_url} failed: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
