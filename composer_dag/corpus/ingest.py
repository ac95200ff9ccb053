"""Ingest one source into Parquet: ``files-NNNNN.parquet`` (one row per kept file),
``skipped.parquet`` (one row per skipped file with its reason) and ``manifest.json``.

Bad input is counted, never fatal. Every file a walker meets ends up either ingested or in
``skipped`` under exactly one reason, so ``files_seen == files_ingested + sum(skipped)``.
Reasons: ``binary``, ``invalid_utf8``, ``too_large``, ``empty``, ``unreadable``,
``lfs_pointer``, ``unknown_language``, ``language_excluded`` (known, but not in
``CorpusConfig.languages``), ``over_budget``, ``bad_filename``, ``not_regular_file``,
``symlink``, ``symlink_loop``, ``symlink_outside_root``, ``submodule`` (see ``sources`` for the
walk rules).
The same input gives byte-identical Parquet: files are met in sorted order and no row holds
a time or a temporary path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import posixpath
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

from composer_dag.corpus.languages import (
    is_binary_name, language_from_name, language_from_shebang,
)
from composer_dag.corpus.sources import CorpusConfig, Entry, SourceSpec, open_entries
from composer_dag.storage import Storage

FILES_SCHEMA = pa.schema([
    ("id", pa.string()), ("source", pa.string()), ("repo", pa.string()), ("path", pa.string()),
    ("language", pa.string()), ("content", pa.string()), ("size_bytes", pa.int64()),
    ("sha256", pa.string()), ("revision", pa.string()),
])
SKIPPED_SCHEMA = pa.schema([
    ("source", pa.string()), ("path", pa.string()), ("reason", pa.string()),
    ("size_bytes", pa.int64()), ("detail", pa.string()),
])
LFS_POINTER = b"version https://git-lfs.github.com/spec/v1"
_OWN_FILES = re.compile(r"files-\d{5}\.parquet|skipped\.parquet|manifest\.json")


@dataclass
class CorpusResult:
    files_seen: int = 0
    files_ingested: int = 0
    bytes_ingested: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    languages: dict[str, int] = field(default_factory=dict)
    bytes_per_language: dict[str, int] = field(default_factory=dict)
    parquet_urls: list[str] = field(default_factory=list)
    skipped_url: str = ""
    manifest_digest: str = ""
    rows: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def file_id(source: str, path: str) -> str:
    return hashlib.sha256(f"{source}\0{path}".encode()).hexdigest()[:32]


def _examine(e: Entry, cfg: CorpusConfig) -> tuple[str | None, str, str | None]:
    """(skip reason, detail, None) for a skipped entry, (None, text, language) for a kept one."""
    if e.skip:
        return e.skip, e.detail, None
    if is_binary_name(e.path):
        return "binary", "binary file extension", None
    if e.size > cfg.max_file_bytes:
        return "too_large", f"over {cfg.max_file_bytes} bytes", None
    if e.size == 0:  # listed as empty: not read (a ranged GET of an empty object fails)
        return "empty", "", None
    lang = language_from_name(e.path)
    if lang and cfg.languages is not None and lang not in cfg.languages:
        return "language_excluded", lang, None
    try:
        data = e.read(cfg.max_file_bytes + 1)
    except Exception as exc:  # permission, vanished file, object-store error: all counted
        why = getattr(exc, "strerror", None) or str(exc)  # strerror: no temp paths in rows
        return "unreadable", f"{type(exc).__name__}: {why}"[:300], None
    if not data:
        return "empty", "", None
    if len(data) > cfg.max_file_bytes:
        return "too_large", f"over {cfg.max_file_bytes} bytes", None
    if data.startswith(LFS_POINTER):
        return "lfs_pointer", "git-lfs pointer, object not fetched", None
    if b"\0" in data[:8192]:
        return "binary", "NUL byte in the first 8 KB", None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return "invalid_utf8", f"at byte {exc.start}", None
    lang = lang or language_from_shebang(text)
    if lang is None:
        return "unknown_language", "", None
    if cfg.languages is not None and lang not in cfg.languages:
        return "language_excluded", lang, None
    return None, text, lang


def _capped(res: CorpusResult, cap_bytes: int | None, cap_files: int | None) -> bool:
    return (cap_bytes is not None and res.bytes_ingested >= cap_bytes) or (
        cap_files is not None and res.files_ingested >= cap_files)


def _clear_own_output(storage: Storage, out_url: str) -> None:
    """Remove the files an earlier run of ``ingest`` wrote directly under ``out_url``."""
    for url in storage.find(out_url):
        if posixpath.dirname(url) == out_url and _OWN_FILES.fullmatch(posixpath.basename(url)):
            storage.fs.rm(url)


def _file_row(source: str, e, lang: str, text: str, data: bytes) -> dict[str, Any]:
    """A kept file's row of the files table (``data``: ``text`` encoded)."""
    return {"id": file_id(source, e.path), "source": source, "repo": e.repo, "path": e.path, "language": lang,
            "content": text, "size_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "revision": e.revision}


def ingest(
    source: SourceSpec,
    storage: Storage,
    out_url: str,
    config: CorpusConfig = CorpusConfig(),
    progress: Callable[[str], None] | None = None,
) -> CorpusResult:
    """Read every file of ``source`` and write the corpus tables under ``out_url``."""
    start = time.monotonic()
    out_url = out_url.rstrip("/")
    _clear_own_output(storage, out_url)  # a retried run replaces its own earlier output
    res = CorpusResult(skipped_url=posixpath.join(out_url, "skipped.parquet"))
    skipped, langs, lang_bytes = Counter(), Counter(), Counter()
    batch: list[dict[str, Any]] = []
    batch_bytes = 0
    skip_rows: list[dict[str, Any]] = []

    def flush_files(final: bool = False) -> None:
        nonlocal batch, batch_bytes
        if batch or (final and not res.parquet_urls):
            url = posixpath.join(out_url, f"files-{len(res.parquet_urls):05d}.parquet")
            storage.write_parquet(pa.Table.from_pylist(batch, schema=FILES_SCHEMA), url)
            res.parquet_urls.append(url)
        batch, batch_bytes = [], 0

    def report(prefix: str = "scanned") -> None:
        if progress:
            progress(f"{prefix} {res.files_seen:,} files, {res.bytes_ingested / 1e6:.1f} MB kept, "
                     f"{sum(skipped.values()):,} skipped")

    cap_bytes, cap_files = config.max_total_bytes, config.max_files
    exhausted = _capped(res, cap_bytes, cap_files)
    with contextlib.ExitStack() as stack:
        f = stack.enter_context(storage.open_atomic(res.skipped_url))
        skip_writer = stack.enter_context(pq.ParquetWriter(f, SKIPPED_SCHEMA, compression="zstd"))
        entries = stack.enter_context(
            open_entries(source, config.skip_dirs, config.python_parts))
        for e in entries:
            res.files_seen += 1
            if exhausted:
                reason, note, lang = "over_budget", "corpus cap reached", None
            else:
                reason, note, lang = _examine(e, config)  # note: skip detail, or the kept text
            if reason is None:
                data = note.encode("utf-8")
                if cap_bytes is not None and res.bytes_ingested + len(data) > cap_bytes:
                    reason, note, exhausted = "over_budget", "corpus cap reached", True
            if reason is not None:
                skipped[reason] += 1
                skip_rows.append({"source": source.name, "path": e.path, "reason": reason,
                                  "size_bytes": e.size, "detail": note})
                if len(skip_rows) >= 50_000:
                    skip_writer.write_table(pa.Table.from_pylist(skip_rows, schema=SKIPPED_SCHEMA))
                    skip_rows = []
            else:
                batch.append(_file_row(source.name, e, lang, note, data))
                res.files_ingested += 1
                res.bytes_ingested += len(data)
                langs[lang] += 1
                lang_bytes[lang] += len(data)
                batch_bytes += len(data)
                if batch_bytes >= config.shard_bytes:
                    flush_files()
                exhausted = _capped(res, cap_bytes, cap_files)
            if progress and res.files_seen % config.progress_every == 0:
                report()
        skip_writer.write_table(pa.Table.from_pylist(skip_rows, schema=SKIPPED_SCHEMA))
    flush_files(final=True)
    res.rows = res.files_ingested
    res.skipped, res.languages = dict(sorted(skipped.items())), dict(sorted(langs.items()))
    res.bytes_per_language = dict(sorted(lang_bytes.items()))
    res.manifest_digest = storage.write_manifest(out_url, extra={
        "source": source.name, "kind": source.kind, "files_seen": res.files_seen,
        "files_ingested": res.files_ingested, "bytes_ingested": res.bytes_ingested,
        "skipped": res.skipped,
    })
    res.seconds = round(time.monotonic() - start, 3)
    report("done:")
    return res
