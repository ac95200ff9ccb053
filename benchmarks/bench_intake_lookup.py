"""How an hour's intake finds the sessions other hours already hold, as the catalog grows.

    .venv/bin/python benchmarks/bench_intake_lookup.py [--earlier 1000000] [--candidates 200]

A DuckDB catalog with a ``traces`` table of ``--earlier`` sessions spread over earlier hours
(session id and conversation digest, as ``production_traces`` writes them) and an hour of
``--candidates`` sessions, a tenth of them repeats of earlier ones. Two ways to find the repeats,
in the same run: loading every earlier id and digest into Python sets (``full``, what intake did
before) and asking the catalog about the hour's candidates only (``lookup``, the
``assets.traces._earlier`` query). Prints each one's seconds and the peak memory Python allocated
for it (``tracemalloc``), and checks that both find the same repeats.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time
import tracemalloc
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--earlier", type=int, default=1_000_000)
    ap.add_argument("--candidates", type=int, default=200)
    args = ap.parse_args()

    import duckdb

    path = Path(tempfile.mkdtemp(prefix="bench-intake-")) / "catalog.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE traces AS SELECT 'sess-' || i::VARCHAR AS session_id, "
                "sha256('conv-' || i::VARCHAR) AS conversation_digest, "
                "'2026-11-' || lpad((1 + i % 28)::VARCHAR, 2, '0') || '-' || lpad((i % 24)::VARCHAR, 2, '0') || ':00' AS hour "
                f"FROM range({args.earlier}) t(i)")
    con.close()
    hour = "2026-12-01-00:00"
    repeats = args.candidates // 10
    ids = [f"sess-{i * 7919 % args.earlier}" for i in range(repeats)] + [f"new-{i}" for i in range(args.candidates - repeats)]
    convs = [hashlib.sha256(f"other-{i}".encode()).hexdigest() for i in range(args.candidates)]

    def full():
        c = duckdb.connect(str(path), read_only=True)
        seen_ids, seen_convs = set(), set()
        for sid, conv in c.execute("SELECT session_id, conversation_digest FROM traces WHERE hour <> ?", [hour]).fetchall():
            seen_ids.add(sid)
            seen_convs.add(conv)
        c.close()
        return {i for i in ids if i in seen_ids}

    def lookup():
        c = duckdb.connect(str(path), read_only=True)
        rows = c.execute("SELECT session_id, conversation_digest FROM traces WHERE hour <> ? AND "
                         "(list_contains(?, session_id) OR list_contains(?, conversation_digest))",
                         [hour, ids, convs]).fetchall()
        c.close()
        return {sid for sid, _ in rows}

    out = {}
    for name, fn in (("full", full), ("lookup", lookup)):
        tracemalloc.start()
        t0 = time.perf_counter()
        found = fn()
        secs = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        out[name] = {"seconds": round(secs, 3), "peak_mb": round(peak / 2**20, 1), "repeats_found": len(found)}
    assert out["full"]["repeats_found"] == out["lookup"]["repeats_found"] == repeats, out
    print("| way | seconds | Python peak MB | repeats found |")
    print("|---|---:|---:|---:|")
    for name, r in out.items():
        print(f"| {name} | {r['seconds']} | {r['peak_mb']} | {r['repeats_found']} / {args.candidates} |")
    print(json.dumps({"earlier": args.earlier, "candidates": args.candidates, **out,
                      "speedup": round(out["full"]["seconds"] / out["lookup"]["seconds"], 1)}))


if __name__ == "__main__":
    main()
