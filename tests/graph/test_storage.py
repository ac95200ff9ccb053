import pyarrow as pa
import pytest

from composer_dag.catalog import Catalog
from composer_dag.storage import ArtifactError, Storage, sweep_temporaries


def _roots(tmp_path, request):
    if request.param == "local":
        return Storage(str(tmp_path / "root"))
    bucket = request.getfixturevalue("s3_bucket")
    return Storage(f"s3://{bucket['bucket']}/root", bucket["options"])


@pytest.fixture(params=["local", "s3"])
def storage(tmp_path, request):
    return _roots(tmp_path, request)


def test_atomic_write_leaves_nothing_on_crash(storage):
    url = storage.url("a", "run1", "data.bin")
    with pytest.raises(RuntimeError):
        with storage.open_atomic(url) as f:
            f.write(b"half")
            raise RuntimeError("crash mid-write")
    assert not storage.exists(url)
    assert storage.find(storage.url("a")) == []
    storage.write_bytes(url, b"whole")
    assert storage.read_bytes(url) == b"whole"


def test_a_write_killed_midway_leaves_a_temporary_that_the_owner_sweeps(tmp_path):
    """SIGKILL inside ``open_atomic`` skips its cleanup (simulated: the generator is never
    resumed): the temporary file stays, the target never appears, and ``sweep_temporaries``
    removes exactly the temporaries, not the finished files beside them."""
    st = Storage(str(tmp_path))
    st.write_bytes(st.url("step_0000.parquet"), b"done")
    writer = st.open_atomic(st.url("step_0001.parquet"))
    writer.__enter__().write(b"half")  # killed here: neither rename nor unlink runs
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left[0].startswith(".step_0001.parquet.tmp-") and left[1:] == ["step_0000.parquet"]
    (tmp_path / "sub").mkdir()
    assert sweep_temporaries(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000.parquet", "sub"]
    assert sweep_temporaries(tmp_path / "missing") == 0


def test_read_verified_reads_a_few_files_of_a_sealed_artifact(storage):
    d = storage.url("tasks", "run1")
    for name in ("a/task.json", "a/repo/big.py", "b/task.json"):
        storage.write_bytes(f"{d}/{name}", name.encode() * 3)
    storage.write_manifest(d)
    assert storage.read_verified(d, ["a/task.json", "b/task.json"]) == {"a/task.json": b"a/task.json" * 3,
                                                                       "b/task.json": b"b/task.json" * 3}
    with pytest.raises(ArtifactError, match="not listed"):
        storage.read_verified(d, ["c/task.json"])
    storage.write_bytes(f"{d}/b/task.json", b"changed")
    with pytest.raises(ArtifactError, match="does not match its manifest"):
        storage.read_verified(d, ["b/task.json"])


def test_manifest_round_trip_and_corruption(storage):
    d = storage.artifact_dir("asset", "run1")
    storage.write_bytes(d + "/x.txt", b"hello")
    storage.write_parquet(pa.table({"a": [1, 2]}), d + "/t.parquet")
    digest = storage.write_manifest(d)
    assert len(digest) == 64 and digest == storage.manifest_digest(d)
    manifest = storage.verify_manifest(d)
    assert set(manifest["files"]) == {"x.txt", "t.parquet"}
    assert manifest["files"]["x.txt"]["size"] == 5
    storage.write_bytes(d + "/x.txt", b"HELLO")  # same size, different bytes
    with pytest.raises(ArtifactError, match="does not match"):
        storage.verify_manifest(d)
    with pytest.raises(ArtifactError, match="no manifest"):
        storage.verify_manifest(storage.artifact_dir("asset", "run2"))


def test_corrupt_parquet_is_a_clear_error(storage):
    url = storage.url("bad.parquet")
    storage.write_bytes(url, b"PAR1 not really parquet")
    with pytest.raises(ArtifactError, match="unreadable Parquet file .*bad.parquet"):
        storage.read_parquet(url)


def test_repr_never_shows_credentials(s3_bucket):
    st = Storage(f"s3://{s3_bucket['bucket']}/r", s3_bucket["options"])
    assert s3_bucket["options"]["secret"] not in repr(st)
    assert s3_bucket["options"]["key"] not in repr(st)


def test_catalog_reads_parquet_through_storage(storage, tmp_path):
    urls = []
    for i, src in enumerate(["a", "b"]):
        url = storage.url("t", f"{src}.parquet")
        storage.write_parquet(pa.table({"source": [src] * 3, "n": [i, i + 1, i + 2], "content": ["x"] * 3}), url)
        urls.append(url)
    cat = Catalog(str(tmp_path / "cat.duckdb"), storage)
    assert cat.replace_rows("files", urls[:1], where={"source": "a"}, extra={"run_id": "r1"}) == 3
    assert cat.replace_rows("files", urls[1:], where={"source": "b"}, extra={"run_id": "r1"}) == 3
    # replacing one partition keeps the other
    assert cat.replace_rows("files", urls[:1], where={"source": "a"}, extra={"run_id": "r2"}) == 3
    rows = cat.query("SELECT source, run_id, count(*) FROM files GROUP BY ALL ORDER BY 1")
    assert rows == [("a", "r2", 3), ("b", "r1", 3)]
    assert "content" not in [r[0] for r in cat.query("DESCRIBE files")]
    assert cat.query(f"SELECT sum(n) FROM {cat.scan(urls)}")[0][0] == 0 + 1 + 2 + 1 + 2 + 3


def test_catalog_records_gain_new_columns(storage, tmp_path):
    """A record with a column the table lacks (e.g. pass@1 of a new task source) adds the
    column; earlier rows hold NULL there."""
    cat = Catalog(str(tmp_path / "cat.duckdb"), storage)
    cat.insert_records("eval_summaries", [{"checkpoint": "a", "pass_at_1": 0.5}])
    cat.insert_records("eval_summaries", [{"checkpoint": "b", "pass_at_1": 0.25, "pass_at_1_learnable": 1.0}])
    assert cat.query("SELECT checkpoint, pass_at_1, pass_at_1_learnable FROM eval_summaries ORDER BY 1") == [
        ("a", 0.5, None), ("b", 0.25, 1.0)]


def test_incoming_listing_gives_each_file_its_fingerprint_in_one_listing(storage):
    """The production-sessions sensor's listing: every hour's session files with their size and
    time (or ETag) from one ``find``, on a local root and on the S3 server alike; a rewritten file
    gets another fingerprint."""
    from composer_dag.traces.store import list_incoming

    incoming = storage.url("traces", "incoming")
    storage.write_bytes(f"{incoming}/2026-12-01T10/a.jsonl", b"{}\n")
    storage.write_bytes(f"{incoming}/2026-12-01T10/b.jsonl", b"{}\n{}\n")
    storage.write_bytes(f"{incoming}/not-an-hour/c.jsonl", b"{}\n")
    stamps: dict[str, str] = {}
    listing = list_incoming(storage, incoming, stamps)
    files = [f"{incoming}/2026-12-01T10/a.jsonl", f"{incoming}/2026-12-01T10/b.jsonl"]
    assert listing == {"2026-12-01-10:00": files} and set(stamps) == set(files)  # the hourly partition key
    assert [s.split(":")[0] for s in (stamps[files[0]], stamps[files[1]])] == ["3", "6"]
    assert all(s.split(":", 1)[1] not in ("", "None") for s in stamps.values()), stamps
    storage.write_bytes(files[0], b"{}\n{}\n{}\n")
    again: dict[str, str] = {}
    list_incoming(storage, incoming, again)
    assert again[files[0]] != stamps[files[0]] and again[files[1]] == stamps[files[1]]


def test_a_published_tree_is_synced_to_disk_once_before_its_manifest_seals_it(tmp_path, monkeypatch):
    """``publish_dir`` on local storage writes a tree's files without an fsync each and syncs the
    file system once, after the last file and before the manifest (itself written durably)."""
    import composer_dag.storage as cs

    src = tmp_path / "tree"
    for i in range(40):
        (src / f"d{i % 4}").mkdir(parents=True, exist_ok=True)
        (src / f"d{i % 4}" / f"f{i}.txt").write_text(f"file {i}\n")
    st = Storage(str(tmp_path / "root"))
    url = st.url("tasks", "run1")
    events = []
    real_fsync, real_sync = cs.os.fsync, cs._sync_filesystem
    monkeypatch.setattr(cs.os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(cs, "_sync_filesystem", lambda path: (
        events.append(("sync", len(st.find(url)), st.exists(f"{url}/manifest.json"))), real_sync(path))[1])
    digest = st.publish_dir(str(src), url)
    assert events == [("sync", 40, False), "fsync"], events  # 40 files, one sync, then the manifest's fsync
    assert digest == st.manifest_digest(url) and st.verify_manifest(url) is not None
    assert len(st.read_manifest(url)["files"]) == 40
