"""The credential scanner finds a secret wherever a run could leave it, compressed or not, so a
clean scan after a run means something."""

import sqlite3

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from composer_dag.storage import Storage
from tests.leak_scan import scan_storage, scan_tree

SECRET = "fake/secret/planted-0123456789abcdef"


def test_scanner_finds_planted_secrets_in_every_format(tmp_path):
    clean = tmp_path / "clean"
    clean.mkdir()
    (clean / "notes.txt").write_text("nothing to see\n")
    assert scan_tree(clean, [SECRET]) == []

    dirty = tmp_path / "dirty"
    dirty.mkdir()
    (dirty / "log.txt").write_text(f"token={SECRET}\n")
    pq.write_table(pa.table({"content": [f"x = '{SECRET}'"] * 50}), dirty / "rows.parquet", compression="zstd")
    con = duckdb.connect(str(dirty / "catalog.duckdb"))
    con.execute("CREATE TABLE t AS SELECT ? AS error FROM range(2000)", [SECRET])
    con.close()
    db = sqlite3.connect(dirty / "events.db")
    db.execute("CREATE TABLE e (body TEXT)")
    db.execute("INSERT INTO e VALUES (?)", (f'{{"message": "{SECRET}"}}',))
    db.commit()
    db.close()
    hits = scan_tree(dirty, [SECRET])
    assert {h.split(":")[0].rsplit("/", 1)[-1] for h in hits} == {"log.txt", "rows.parquet", "catalog.duckdb", "events.db"}

    st = Storage(str(tmp_path / "bucket"))
    st.write_bytes(st.url("a", "ok.json"), b"{}")
    assert scan_storage(st, st.url(), [SECRET]) == []
    buf = pa.BufferOutputStream()
    pq.write_table(pa.table({"v": [SECRET]}), buf, compression="zstd")
    st.write_bytes(st.url("a", "leak.parquet"), buf.getvalue().to_pybytes())
    assert len(scan_storage(st, st.url(), [SECRET])) == 1
