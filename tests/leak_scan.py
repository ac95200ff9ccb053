"""Find known secret strings anywhere a run leaves text: files (plain, Parquet, DuckDB, SQLite),
objects in a bucket, and Dagster's event log (logs and metadata of every run)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import duckdb
import pyarrow.parquet as pq


def _texts_of_parquet(data: bytes) -> str:
    table = pq.read_table(io.BytesIO(data))
    return repr(table.to_pylist())


def _texts_of_duckdb(path: str) -> str:
    con = duckdb.connect(path, read_only=True)
    try:
        out = []
        for (name,) in con.execute("SELECT table_name FROM information_schema.tables").fetchall():
            out.append(repr(con.execute(f'SELECT * FROM "{name}"').fetchall()))
        return "\n".join(out)
    finally:
        con.close()


def _texts(name: str, data: bytes, path: str | None = None) -> str:
    """The file's bytes as text, plus the decoded contents of formats that compress strings."""
    text = data.decode("utf-8", "replace")
    if data[:4] == b"PAR1":
        text += _texts_of_parquet(data)
    elif path and name.endswith(".duckdb"):
        text += _texts_of_duckdb(path)
    return text


def scan_tree(root: str | Path, secrets: list[str]) -> list[str]:
    """Paths under ``root`` whose contents (decoded where compressed) contain a secret."""
    hits = []
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            if os.path.islink(p) or not os.path.isfile(p):
                continue
            if f.endswith((".wal", ".tmp")):
                continue
            with open(p, "rb") as fh:
                data = fh.read()
            try:
                text = _texts(f, data, p)
            except Exception:  # a file we cannot decode further is still scanned as bytes
                text = data.decode("utf-8", "replace")
            hits += [f"{p}: {s[:6]}..." for s in secrets if s in text]
    return hits


def scan_storage(storage, root_url: str, secrets: list[str]) -> list[str]:
    """Objects under ``root_url`` (any fsspec storage) whose contents contain a secret."""
    hits = []
    for url in storage.find(root_url):
        data = storage.read_bytes(url)
        text = _texts(url.rsplit("/", 1)[-1], data)
        hits += [f"{url}: {s[:6]}..." for s in secrets if s in text]
    return hits


def scan_instance(instance, secrets: list[str]) -> list[str]:
    """Runs whose event log (messages, errors, metadata, tags, config) contains a secret."""
    from dagster._serdes import serialize_value

    hits = []
    for run in instance.get_runs():
        text = serialize_value(run) + "".join(serialize_value(e) for e in instance.all_logs(run.run_id))
        hits += [f"run {run.run_id} ({run.job_name}): {s[:6]}..." for s in secrets if s in text]
    return hits
