"""The catalog: a DuckDB database with one table per stage, queryable with plain SQL.

Parquet artifacts are read through the storage's fsspec filesystem registered in DuckDB, so
the same SQL works whether the artifacts sit on local disk or in S3, and no DuckDB extension
has to be downloaded.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from typing import Any, Iterator, Sequence

import duckdb

from composer_dag.storage import Storage


class CatalogError(RuntimeError):
    """A catalog operation failed; the message is one line naming the database and the cause."""


# DuckDB reports OS errors as text; the errno name is added so "disk full" is easy to spot.
_OS_ERRORS = (
    ("no space left on device", "ENOSPC"),
    ("disk quota exceeded", "EDQUOT"),
    ("read-only file system", "EROFS"),
    ("permission denied", "EACCES"),
)


def _sql_list(urls: Sequence[str]) -> str:
    return "[" + ", ".join("'" + u.replace("'", "''") + "'" for u in urls) + "]"


class Catalog:
    """A DuckDB file (or ``:memory:``) plus the storage it reads Parquet from."""

    def __init__(self, path: str, storage: Storage, lock_timeout_s: float = 120.0):
        self.path = path if path == ":memory:" else os.path.abspath(path)
        self.storage = storage
        self.lock_timeout_s = lock_timeout_s
        if self.path != ":memory:":
            try:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
            except OSError as exc:
                raise self._error("creating its directory", exc) from None

    def _error(self, what: str, exc: BaseException) -> CatalogError:
        msg = " ".join(str(exc).split())
        names = [name for text, name in _OS_ERRORS if text in msg.lower()]
        if names:
            msg += f" ({names[0]})"
        return CatalogError(f"catalog {self.path}: {what} failed: {msg}")

    @contextlib.contextmanager
    def _sql(self, what: str) -> Iterator[None]:
        """Turn a DuckDB error inside the block into one CatalogError line."""
        try:
            yield
        except duckdb.Error as exc:
            raise self._error(what, exc) from None

    @staticmethod
    def _rollback(con: duckdb.DuckDBPyConnection) -> None:
        # After a failed COMMIT (e.g. disk full) DuckDB has already ended the transaction;
        # the error that matters is the first one, so a failing ROLLBACK is ignored.
        with contextlib.suppress(duckdb.Error):
            con.execute("ROLLBACK")

    def _duckdb_url(self, url: str) -> str:
        """DuckDB reads local files by OS path and remote ones through the registered fs."""
        local = self.storage.local_path(url) if url.startswith(self.storage.protocol) else None
        return local if local is not None else url

    @contextlib.contextmanager
    def connect(self, read_only: bool = False) -> Iterator[duckdb.DuckDBPyConnection]:
        """Open the database, retrying while another process holds the write lock."""
        deadline = time.monotonic() + self.lock_timeout_s
        while True:
            try:
                con = duckdb.connect(self.path, read_only=read_only and self.path != ":memory:")
                break
            except duckdb.Error as exc:
                locked = isinstance(exc, duckdb.IOException) and "lock" in str(exc).lower()
                if not locked or time.monotonic() > deadline:
                    raise self._error("open", exc) from None
                time.sleep(0.2 + random.random() * 0.5)
        try:
            if self.storage.protocol != "file":
                con.register_filesystem(self.storage.fs)
            yield con
        except BaseException:
            with contextlib.suppress(duckdb.Error):
                con.close()
            raise
        with self._sql("close"):
            con.close()

    def query(self, sql: str, params: Sequence[Any] | None = None) -> list[tuple]:
        with self.connect() as con, self._sql("query"):
            return con.execute(sql, params or []).fetchall()

    def query_df(self, sql: str, params: Sequence[Any] | None = None):
        """Run SQL and return a pyarrow Table."""
        with self.connect() as con, self._sql("query"):
            return con.execute(sql, params or []).fetch_arrow_table()

    def scan(self, urls: Sequence[str], columns: str = "*") -> str:
        """A SQL fragment reading Parquet files (local or through the registered fs)."""
        if not urls:
            raise CatalogError("no Parquet files to read")
        return f"(SELECT {columns} FROM read_parquet({_sql_list([self._duckdb_url(u) for u in urls])}))"

    def replace_rows(
        self,
        table: str,
        urls: Sequence[str],
        *,
        where: dict[str, Any] | None = None,
        exclude: Sequence[str] = ("content",),
        extra: dict[str, Any] | None = None,
    ) -> int:
        """Load Parquet rows into ``table`` (created on first use), replacing earlier rows.

        ``where`` selects the rows being replaced (e.g. ``{"source": "python"}`` for one
        partition); without it the table is replaced whole. Large text columns named in
        ``exclude`` stay in the Parquet; the catalog keeps what SQL over metadata needs.
        ``extra`` adds constant columns (e.g. the run id and artifact URI).
        """
        extra = extra or {}
        if not urls:
            return 0
        with self.connect() as con, self._sql(f"loading {table}"):
            probe = con.execute(f"DESCRIBE SELECT * FROM {self.scan(urls)}").fetchall()
            cols = [r[0] for r in probe if r[0] not in exclude]
            select = ", ".join(f'"{c}"' for c in cols)
            consts = "".join(f", ? AS \"{k}\"" for k in extra)
            source_sql = f"SELECT {select}{consts} FROM {self.scan(urls)}"
            params = list(extra.values())
            con.execute("BEGIN TRANSACTION")
            try:
                exists = con.execute(
                    "SELECT count(*) FROM information_schema.tables WHERE table_name = ?", [table]
                ).fetchone()[0]
                if exists and where is not None:
                    cond = " AND ".join(f'"{k}" = ?' for k in where)
                    con.execute(f'DELETE FROM "{table}" WHERE {cond}', list(where.values()))
                    con.execute(f'INSERT INTO "{table}" BY NAME {source_sql}', params)
                else:
                    con.execute(f'CREATE OR REPLACE TABLE "{table}" AS {source_sql}', params)
                n = con.execute(
                    f'SELECT count(*) FROM "{table}"'
                    + (" WHERE " + " AND ".join(f'"{k}" = ?' for k in where) if where else ""),
                    list((where or {}).values()),
                ).fetchone()[0]
                con.execute("COMMIT")
            except Exception:
                self._rollback(con)
                raise
        return int(n)

    def insert_records(self, table: str, records: Sequence[dict[str, Any]], *, where: dict[str, Any] | None = None) -> int:
        """Insert plain dict rows (small tables: run summaries, skip counts, eval results)."""
        import pyarrow as pa

        if not records:
            return 0
        arrow = pa.Table.from_pylist(list(records))
        with self.connect() as con, self._sql(f"inserting into {table}"):
            con.register("_incoming", arrow)
            con.execute("BEGIN TRANSACTION")
            try:
                exists = con.execute(
                    "SELECT count(*) FROM information_schema.tables WHERE table_name = ?", [table]
                ).fetchone()[0]
                if not exists:
                    con.execute(f'CREATE TABLE "{table}" AS SELECT * FROM _incoming')
                else:
                    have = {r[0] for r in con.execute(f'DESCRIBE "{table}"').fetchall()}
                    for name, kind, *_ in con.execute("DESCRIBE SELECT * FROM _incoming").fetchall():
                        if name not in have:  # a new column (e.g. a new task source): earlier rows hold NULL
                            con.execute(f'ALTER TABLE "{table}" ADD COLUMN "{name}" {kind}')
                    if where:
                        cond = " AND ".join(f'"{k}" = ?' for k in where)
                        con.execute(f'DELETE FROM "{table}" WHERE {cond}', list(where.values()))
                    con.execute(f'INSERT INTO "{table}" BY NAME SELECT * FROM _incoming')
                con.execute("COMMIT")
            except Exception:
                self._rollback(con)
                raise
        return len(records)

    def tables(self) -> list[str]:
        return [r[0] for r in self.query("SELECT table_name FROM information_schema.tables ORDER BY 1")]
