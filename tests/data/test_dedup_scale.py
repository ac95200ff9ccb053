"""Dedup at corpus scale: the map over shards gives the same output on 1 process, 2 processes
and as separate `python -m composer_dag.dedup.shards` commands (what a job array runs); the
process tree stays under the memory setting; incremental runs keep what is already kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pytest

from composer_dag.dedup import DedupConfig, dedup, work_url
from composer_dag.storage import Storage
from tests.data.test_dedup import COLUMNS, _code, _row


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _write(storage: Storage, rows: list[dict], name: str = "in/part-0.parquet", row_group: int = 4) -> str:
    """Rows as a Parquet input with row groups of ``row_group`` rows (the unit a task takes)."""
    table = pa.table({c: pa.array([r[c] for r in rows], pa.int64() if c == "size_bytes" else pa.string())
                      for c in COLUMNS})
    url = storage.url(name)
    storage.write_parquet(table, url, row_group_size=row_group)
    return url


def _corpus(n: int = 40) -> list[dict]:
    """Distinct files, exact copies, near copies and a file with a secret."""
    rows = [_row(f"f{i}", f"pkg/m{i}.py", _code(i, n_funcs=20)) for i in range(n)]
    rows += [_row(f"copy{i}", f"copy/m{i}.py", _code(i, n_funcs=20)) for i in range(0, n, 5)]
    for i in range(1, n, 7):
        lines = _code(i, n_funcs=20).split("\n")
        lines[10] += "  # edited"
        rows.append(_row(f"near{i}", f"near/m{i}.py", "\n".join(lines)))
    rows.append(_row("secret", "s.py", _code(999) + 'password = "hunter2"\n'))
    return rows


def _outputs(storage: Storage, res) -> tuple:
    kept = pa.concat_tables([storage.read_parquet(u) for u in res.shard_urls])
    return (kept, storage.read_parquet(res.dropped_url), storage.read_parquet(res.clusters_url), res.dropped,
            res.redactions, res.extra["candidate_pairs"])


def _subprocess_runner(spec_url: str, n: int) -> None:
    """Each task as its own command, two at a time: what a Slurm array or k8s indexed Job runs."""
    def one(i: int) -> None:
        proc = subprocess.run([sys.executable, "-m", "composer_dag.dedup.shards", spec_url, str(i)],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert proc.returncode == 0, proc.stderr
    with ThreadPoolExecutor(2) as ex:
        list(ex.map(one, range(n)))


def test_map_on_two_processes_and_as_commands_matches_one_process(tmp_path):
    storage = Storage(str(tmp_path / "store"))
    rows = _corpus()
    urls = [_write(storage, rows[k::3], f"in/part-{k}.parquet") for k in range(3)]
    small = {"task_bytes": 40_000, "batch_bytes": 8_000, "decontam_humaneval": False, "shard_bytes": 30_000}
    runs = {}
    for name, extra, runner in (("one", {"workers": 1}, None),
                                ("two", {"workers": 2, "parallel_min_input_bytes": 0}, None),
                                ("commands", {}, _subprocess_runner)):
        msgs: list[str] = []
        res = dedup(urls, storage, storage.url(name), DedupConfig(**small, **extra), progress=msgs.append,
                    run_tasks=runner)
        assert res.extra["map_tasks"] >= 4
        runs[name] = (_outputs(storage, res), [m for m in msgs if not m.startswith("analyse:")], msgs)
        assert not storage.exists(work_url(storage.url(name)))  # the map's files are gone
    assert "2 process(es)" in " ".join(runs["two"][2]) and "1 process(es)" in " ".join(runs["one"][2])
    assert runs["one"][:2] == runs["two"][:2] == runs["commands"][:2]
    kept, dropped, clusters, by_reason, redactions, pairs = runs["one"][0]
    assert by_reason["exact_duplicate"] == 8 and by_reason["near_duplicate"] == 6 and pairs >= 6
    assert redactions["password"] == 1 and kept.num_rows == len(rows) - 14


def test_map_command_fails_in_one_line(tmp_path):
    storage = Storage(str(tmp_path / "store"))
    url = _write(storage, _corpus(6))

    def broken(spec_url: str, n: int) -> None:
        spec = storage.read_json(spec_url)
        storage.write_bytes(spec["tasks"][0]["input"], b"PAR1 not parquet")
        proc = subprocess.run([sys.executable, "-m", "composer_dag.dedup.shards", spec_url, "0"],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
        assert "part-0.parquet" in proc.stderr
        raise RuntimeError("task 0 failed")

    with pytest.raises(RuntimeError, match="task 0 failed"):
        dedup([url], storage, storage.url("out"), {"decontam_humaneval": False}, run_tasks=broken)
    assert storage.find(storage.url("out")) == []


MEASURE = textwrap.dedent("""
    import json, sys, threading, time
    import psutil
    from composer_dag.dedup import dedup
    from composer_dag.storage import Storage
    root, urls, cfg = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    me, peak, stop = psutil.Process(), [0], threading.Event()

    def sample():
        while not stop.is_set():
            total = 0
            for p in [me, *me.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            peak[0] = max(peak[0], total)
            time.sleep(0.005)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    storage = Storage(root)
    res = dedup(urls, storage, storage.url("out"), cfg)
    stop.set()
    t.join()
    print(json.dumps({"peak": peak[0], "kept": res.files_kept, "in": res.files_in, "tasks": res.extra["map_tasks"],
                      "processes": res.extra["map_processes"]}))
""")


def test_process_tree_stays_under_the_memory_setting(tmp_path):
    """Peak RSS of the process tree (main, 2 map workers, DuckDB), sampled every 5 ms, stays
    under ``memory_bytes`` on a corpus of about 12 MB of stdlib code run as many small tasks."""
    import sysconfig

    storage = Storage(str(tmp_path / "store"))
    root = sysconfig.get_paths()["stdlib"]
    rows, total = [], 0
    for dirpath, dirnames, files in sorted(os.walk(root)):
        dirnames.sort()
        for name in sorted(files):
            if name.endswith(".py") and total < 12_000_000:
                with open(os.path.join(dirpath, name), "rb") as f:
                    text = f.read().decode("utf-8", "replace")
                rows.append(_row(f"r{len(rows)}", os.path.join(dirpath, name), text))
                total += len(text.encode())
    urls = [_write(storage, rows[k::2], f"in/part-{k}.parquet", row_group=100) for k in range(2)]
    limit = 1_400_000_000  # 2 workers (see workers_for)
    cfg = {"memory_bytes": limit, "workers": 2, "parallel_min_input_bytes": 0, "task_bytes": 2_000_000,
           "batch_bytes": 1_000_000, "shard_bytes": 4_000_000}
    proc = subprocess.run([sys.executable, "-c", MEASURE, storage.root, json.dumps(urls), json.dumps(cfg)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["in"] == len(rows) and got["tasks"] >= 6 and got["processes"] == 2 and got["kept"] > 0.8 * len(rows)
    assert got["peak"] < limit, f"peak RSS of the process tree {got['peak'] / 1e6:.0f} MB >= {limit / 1e6:.0f} MB"


def test_memory_setting_caps_the_workers():
    from composer_dag.dedup.pipeline import workers_for

    assert workers_for(DedupConfig(workers=8)) == 3  # 2 GB: 400 MB here, 500 MB DuckDB, 300 MB a worker
    assert workers_for(DedupConfig(workers=8, memory_bytes=1_400_000_000)) == 2
    assert workers_for(DedupConfig(workers=8, memory_bytes=1_000_000_000)) == 1
    with pytest.raises(ValueError, match="memory_bytes"):
        DedupConfig(memory_bytes=100_000_000)


def _ids(storage: Storage, res) -> set[str]:
    return {i for u in res.shard_urls for i in storage.read_parquet(u, columns=["id"]).column("id").to_pylist()}


def test_incremental_keeps_what_is_kept_and_a_rebuild_matches(tmp_path):
    storage = Storage(str(tmp_path / "store"))
    old = [_row(f"a{i}", f"a/m{i}.py", _code(i, n_funcs=20), source="a") for i in range(12)]
    old.append(_row("a_dup", "a/dup.py", _code(3, n_funcs=20), source="a"))  # dropped in the first run
    lines = _code(5, n_funcs=20).split("\n")
    lines[12] += "  # edited in b"
    new = [
        *(_row(f"b{i}", f"b/m{i}.py", _code(100 + i, n_funcs=20), source="b") for i in range(8)),
        # longer copies of files source a kept: a rebuild keeps these, an increment keeps a's
        _row("b_crlf", "b/crlf.py", _code(2, n_funcs=20).replace("\n", "\r\n"), source="b"),
        _row("b_near", "b/near.py", "\n".join(lines), source="b"),
        _row("b_dup", "b/z_dup.py", _code(101, n_funcs=20), source="b"),  # a duplicate inside b
        _row("b_null", "b/null.py", None, source="b"),
    ]
    a_url = _write(storage, old, "in/a.parquet")
    b_url = _write(storage, new, "in/b.parquet")
    cfg = DedupConfig(incremental=True, decontam_humaneval=False)

    first = dedup([a_url], storage, storage.url("a"), cfg)
    assert first.dropped["exact_duplicate"] == 1 and len(_ids(storage, first)) == 12
    assert storage.read_json(work_url(storage.url("a")) + "/index.json")["files"] == 12

    msgs: list[str] = []
    inc = dedup([b_url], storage, storage.url("b"), cfg, previous=storage.url("a"), progress=msgs.append)
    assert msgs[0].startswith("read: 12 files")  # only the new source is read and signed
    assert inc.files_in == len(new) == inc.files_kept + sum(inc.dropped.values())
    assert _ids(storage, inc) == {f"b{i}" for i in range(8)}
    drops = {r["id"]: r for r in storage.read_parquet(inc.dropped_url).to_pylist()}
    assert drops["b_crlf"]["reason"] == "exact_duplicate" and "a2 (a:a/m2.py)" in drops["b_crlf"]["detail"]
    assert drops["b_near"]["reason"] == "near_duplicate" and "a5 (a:a/m5.py)" in drops["b_near"]["detail"]
    assert drops["b_dup"]["reason"] == "exact_duplicate" and drops["b_null"]["reason"] == "invalid_row"
    clusters = storage.read_parquet(inc.clusters_url).to_pylist()
    assert {(c["id"], c["kept"]) for c in clusters} >= {("a2", True), ("b_crlf", False), ("a5", True), ("b_near", False)}
    # the next increment sees both sources' kept files
    assert storage.read_json(work_url(storage.url("b")) + "/index.json")["files"] == 12 + 8

    # a full rebuild keeps the longer new copies instead; otherwise the same files
    full = dedup([a_url, b_url], storage, storage.url("full"), cfg.replace(incremental=False))
    assert _ids(storage, full) == (_ids(storage, first) | _ids(storage, inc) | {"b_crlf", "b_near"}) - {"a2", "a5"}
    # and a rebuild in incremental mode (no previous) gives the non-incremental output
    again = dedup([a_url, b_url], storage, storage.url("again"), cfg)
    assert _outputs(storage, again) == _outputs(storage, full)


def test_incremental_refuses_an_index_made_with_other_settings(tmp_path):
    storage = Storage(str(tmp_path / "store"))
    url = _write(storage, [_row(f"a{i}", f"a/m{i}.py", _code(i)) for i in range(3)])
    dedup([url], storage, storage.url("a"), DedupConfig(incremental=True, num_perm=128, decontam_humaneval=False))
    with pytest.raises(ValueError, match="num_perm") as err:
        dedup([url], storage, storage.url("b"), DedupConfig(incremental=True, decontam_humaneval=False),
              previous=storage.url("a"))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="incremental"):
        dedup([url], storage, storage.url("c"), DedupConfig(decontam_humaneval=False), previous=storage.url("a"))
