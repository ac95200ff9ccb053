"""A fixed dedup input built from the running Python's stdlib, and digests of what dedup makes of it.

The input is every other ``.py`` file of 1-40 kB under the stdlib root (sorted relative paths;
test suites, IDLE, tkinter, turtledemo, distutils, lib2to3, ensurepip and the build-specific
``config-*`` / ``_sysconfigdata*`` files left out, since distributions split or patch them),
read as bytes and decoded as UTF-8, plus planted rows made from those files by fixed edits:

- exact duplicates (a verbatim copy, a CRLF copy, a copy with trailing blanks and blank lines),
- near duplicates (every 15th line tweaked, or the tail cut off),
- a file with secrets (an AWS key pair, a GitHub token, a password) so redaction rewrites it,
- files for the quality filters (a ``.min.js`` name, an over-long line, a number table) and a
  row with null content,
- a HumanEval solution, and an extra contamination text cut from one of the stdlib files.

The rows are split over two Parquet inputs. ``summary`` digests the logical content of the
output (rows, not Parquet bytes, which carry library versions): the kept rows in order (content
as its SHA-256), each shard's rows, ``clusters.parquet`` and ``dropped.parquet`` rows, the shard
schema, the progress lines (timings left out) and the result's counts.

    .venv/bin/python -m tests.dedup_golden      # print the summary of the current code
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from typing import Any

SKIP_DIRS = {"site-packages", "__pycache__", "test", "tests", "idlelib", "tkinter", "turtledemo",
             "distutils", "lib2to3", "ensurepip"}
COLUMNS = ["id", "source", "repo", "path", "language", "content", "size_bytes", "sha256", "revision"]
SECRETS = (
    "\n# deployment settings (planted)\n"
    "aws_access_key_id = 'AKIAIOSFODNN7EXAMPLE'\n"
    "aws_secret_access_key = 'wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY'\n"
    "gh = 'ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8'\n"
    'db_password = "hunter2"\n'
)
# The two runs: the default config in one process (one shard), and worker processes with small
# batches and shards; both must give the same rows.
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "parallel": {"workers": 2, "parallel_min_input_bytes": 0, "batch_bytes": 300_000, "shard_bytes": 600_000},
}


def stdlib_files() -> list[tuple[str, bytes]]:
    """``(path relative to the stdlib root, bytes)`` of the selected stdlib files, sorted."""
    root = sysconfig.get_paths()["stdlib"]
    rels = []
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-"))
        for name in files:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                rels.append(os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
    out = []
    for rel in sorted(rels):
        full = os.path.join(root, *rel.split("/"))
        if not 1000 <= os.path.getsize(full) <= 40_000:
            continue
        with open(full, "rb") as f:
            data = f.read()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        out.append((rel, data))
    return out[::2]


def _row(source: str, path: str, content: str | None) -> dict:
    data = content.encode() if content is not None else b""
    return {
        "id": hashlib.sha256(f"{source}:{path}".encode()).hexdigest()[:16],
        "source": source,
        "repo": path.split("/")[0] if "/" in path else "python3.11",
        "path": path,
        "language": "javascript" if path.endswith(".js") else "python",
        "content": content,
        "size_bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "revision": "",
    }


def corpus() -> tuple[list[dict], list[tuple[str, str]]]:
    """The rows (stdlib files, then planted ones) and the extra contamination texts."""
    from composer_dag.dedup import humaneval_texts

    files = [(rel, data.decode("utf-8")) for rel, data in stdlib_files()]
    rows = [_row("stdlib", rel, text) for rel, text in files]
    code = [(rel, text) for rel, text in files if not rel.startswith("encodings/")]
    pick = lambda k: code[(k * 7) % len(code)]  # noqa: E731 - spread over the list

    planted = []
    rel, text = pick(1)
    planted.append(("planted/exact_copy.py", text))
    planted.append(("planted/exact_crlf.py", text.replace("\n", "\r\n")))
    rel, text = pick(2)
    planted.append(("planted/exact_blanks.py", "\n\n" + text.replace("\n", "  \n") + "\n\n"))
    rel, text = pick(3)
    lines = text.split("\n")
    planted.append(("planted/near_tweaked.py",
                    "\n".join(line + "  # tweaked" if k % 15 == 7 and line.strip() else line
                              for k, line in enumerate(lines))))
    rel, text = pick(4)
    lines = text.split("\n")
    planted.append(("planted/near_cut.py", "\n".join(lines[: len(lines) - max(2, len(lines) // 25)]) + "\n"))
    rel, text = pick(5)
    planted.append(("planted/settings.py", text + SECRETS))
    rel, text = pick(6)
    planted.append(("planted/long_line.py", text + "BANNER = '" + "=-" * 800 + "'\n"))
    planted.append(("planted/static/bundle.min.js", "var a=1;function f(){return a}\n"))
    numbers = ", ".join(str((i * 7919) % 100000) for i in range(2500))
    planted.append(("planted/table.py", "TABLE = [\n" + "\n".join(numbers[i : i + 70] for i in range(0, len(numbers), 70)) + "]\n"))
    name, he = humaneval_texts()[3]
    rel, text = pick(8)
    planted.append(("planted/humaneval.py", text + "\n" + he.split("def check")[0]))
    rows += [_row("planted", path, content) for path, content in planted]
    rows.append(_row("planted", "planted/null.py", None))

    rel, text = pick(9)
    extra = [(f"heldout/{rel}", "\n".join(text.split("\n")[20:80]))]
    return rows, extra


def input_digest(rows: list[dict], extra: list[tuple[str, str]]) -> str:
    return _sha([[r[c] for c in COLUMNS] for r in rows] + [list(e) for e in extra])


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=True).encode()).hexdigest()


def _table_rows(table) -> list[list]:
    rows = []
    for r in table.to_pylist():
        rows.append([hashlib.sha256(v).hexdigest() if isinstance(v, bytes) else
                     hashlib.sha256(v.encode()).hexdigest() if k == "content" and isinstance(v, str) else v
                     for k, v in r.items()])
    return rows


def run(tmp_dir: str, rows: list[dict], extra: list[tuple[str, str]], config: Any, run_tasks: Any = None) -> dict[str, Any]:
    """Write ``rows`` as two Parquet inputs under ``tmp_dir`` (a directory or a storage URL), run
    dedup with ``config`` (its map tasks through ``run_tasks``, e.g. a cluster's job array, when
    given) and return ``summary``."""
    import pyarrow as pa

    from composer_dag.dedup import dedup
    from composer_dag.storage import open_storage

    storage = open_storage(tmp_dir)
    urls = []
    half = len(rows) // 2
    for k, part in enumerate((rows[:half], rows[half:])):
        table = pa.table({c: pa.array([r[c] for r in part], pa.int64() if c == "size_bytes" else pa.string())
                          for c in COLUMNS})
        url = storage.url("in", f"files-{k:05d}.parquet")
        storage.write_parquet(table, url)
        urls.append(url)
    msgs: list[str] = []
    res = dedup(urls, storage, storage.url("out"), config, contamination=extra, progress=msgs.append,
                run_tasks=run_tasks)
    return summary(res, storage, msgs)


def summary(res, storage, msgs: list[str]) -> dict[str, Any]:
    shards = [storage.read_parquet(u) for u in res.shard_urls]
    shard_rows = [_table_rows(t) for t in shards]
    manifest = storage.read_manifest(storage.url("out"))
    return {
        "kept_rows": _sha([r for rows in shard_rows for r in rows]),
        "shard_rows": [_sha(rows) for rows in shard_rows],
        "shard_schema": _sha([[f.name, str(f.type)] for t in shards for f in t.schema]),
        "clusters_rows": _sha(_table_rows(storage.read_parquet(res.clusters_url))),
        "dropped_rows": _sha(_table_rows(storage.read_parquet(res.dropped_url))),
        "progress": _sha([m for m in msgs if not m.startswith("analyse:")]),
        "files": sorted(u.rsplit("/", 1)[-1] for u in [*res.shard_urls, res.clusters_url, res.dropped_url]),
        "manifest_files": sorted(manifest["files"]),
        "counts": {
            "files_in": res.files_in,
            "files_kept": res.files_kept,
            "bytes_in": res.bytes_in,
            "bytes_kept": res.bytes_kept,
            "dropped": {k: v for k, v in res.dropped.items() if v},
            "redactions": {k: v for k, v in res.redactions.items() if v},
            "clusters": res.clusters,
            "lsh": {k: res.extra[k] for k in ("lsh_bands", "lsh_rows", "candidate_pairs", "verified_pairs",
                                              "contamination_ngrams")},
        },
    }


def main() -> None:
    import tempfile

    from composer_dag.dedup import DedupConfig

    rows, extra = corpus()
    out: dict[str, Any] = {"input": input_digest(rows, extra), "files": len(rows)}
    for name, cfg in CONFIGS.items():
        with tempfile.TemporaryDirectory() as tmp:
            out[name] = run(tmp, rows, extra, DedupConfig(**cfg))
    print(json.dumps(out, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
