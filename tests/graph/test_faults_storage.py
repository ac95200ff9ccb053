"""Storage under faults: a flaky or failing S3 server, a full disk, a read-only storage root.

S3 faults come from a fault-injecting proxy (tests/fault_proxy.py) in front of the moto server;
the full disk is a 2 MiB tmpfs and the read-only root a read-only bind mount (root ignores
file modes, so only a mount makes a directory truly read-only).
"""

from __future__ import annotations

import hashlib
import os
import subprocess

import dagster as dg
import pyarrow as pa
import pytest

from composer_dag.catalog import Catalog, CatalogError
from composer_dag.storage import ArtifactError, Storage, StorageError
from resources.artifacts import ArtifactStorage
from tests.conftest import FAKE_KEY, FAKE_SECRET
from tests.fault_proxy import FaultProxy


# ---- fixtures ----------------------------------------------------------------------------
@pytest.fixture
def proxy(s3_server):
    with FaultProxy(s3_server) as p:
        yield p


def _s3(s3_bucket, proxy, **config) -> Storage:
    opts = {"endpoint_url": proxy.url, "key": FAKE_KEY, "secret": FAKE_SECRET}
    if config:
        opts["config_kwargs"] = config
    return Storage(f"s3://{s3_bucket['bucket']}/root", opts)


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


def _umount(path) -> None:
    if subprocess.run(["umount", str(path)], capture_output=True).returncode:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs: the disk that fills up."""
    d = tmp_path / "small"
    d.mkdir()
    _mount("-t", "tmpfs", "-o", "size=2m", "tmpfs", str(d))
    yield d
    _umount(d)


@pytest.fixture
def read_only(tmp_path):
    """(writable path, read-only bind mount of it)."""
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()
    _mount("--bind", str(src), str(ro))
    try:
        _mount("-o", "remount,bind,ro", str(ro))
    except Exception:
        _umount(ro)
        raise
    yield src, ro
    _umount(ro)


# ---- helpers -----------------------------------------------------------------------------
def _stage(tmp_path, name: str, files: dict[str, bytes]) -> str:
    d = tmp_path / name
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    return str(d)


def _publish(storage: Storage, local_dir: str, url: str) -> str:
    """Upload the files, then seal with a manifest (what the assets and jobs do)."""
    return storage.publish_dir(local_dir, url)


def _tree(path) -> dict[str, str]:
    out = {}
    for dirpath, dirs, files in os.walk(path):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, path)
            out[rel] = hashlib.sha256(open(p, "rb").read()).hexdigest() if os.path.isfile(p) else "dir"
    return out


def _one_clear_line(err: BaseException, *must: str) -> str:
    msg = str(err)
    assert "\n" not in msg and "Traceback" not in msg, msg
    assert FAKE_KEY not in msg and FAKE_SECRET not in msg, msg
    for part in must:
        assert part in msg, f"{part!r} not in {msg!r}"
    return msg


FILES = {"a.bin": os.urandom(3000), "sub/b.json": b'{"x": 1}', "c.txt": b"hello " * 500}


# ---- transient S3 faults -----------------------------------------------------------------
def test_transient_s3_faults_are_retried(s3_bucket, proxy, tmp_path):
    """Retries: SlowDown and InternalError answers, connection resets, a body cut mid-download
    and a slow answer (under the read timeout) are all ridden out; the artifact is written,
    verified and read back byte for byte. Without the client's retries the first fault fails
    the write."""
    st = _s3(s3_bucket, proxy)
    proxy.add("503", method="PUT", first=2)
    proxy.add("500", method="PUT", first=1)
    proxy.add("reset", method="PUT", path=r"c\.txt", first=1)
    proxy.add("slow", method="HEAD", delay_s=1.0, first=1)
    proxy.add("reset", method="GET", first=1)
    proxy.add("cut", method="GET", path=r"a\.bin", first=1)
    url = st.artifact_dir("asset", "run1")
    digest = _publish(st, _stage(tmp_path, "art", FILES), url)
    manifest = st.verify_manifest(url)
    assert digest == st.manifest_digest(url)
    assert set(manifest["files"]) == set(FILES)
    for rel, data in FILES.items():
        assert st.read_bytes(f"{url}/{rel}") == data
    seen = proxy.outcomes()
    for fault in ("SlowDown", "InternalError", "reset", "cut", "slow"):
        assert fault in seen, (fault, seen)


def test_seeded_fraction_of_failures_is_ridden_out(s3_bucket, proxy, tmp_path):
    """Retries under a steady error rate: a seeded eighth of all requests (every method) get
    InternalError, SlowDown or a reset; a 4-file artifact with a Parquet table still
    publishes, verifies, and reads back equal."""
    st = _s3(s3_bucket, proxy)
    proxy.add("500", fraction=0.04, seed=1)
    proxy.add("503", fraction=0.04, seed=2)
    proxy.add("reset", fraction=0.04, seed=3)
    files = {f"part-{i:02d}.bin": os.urandom(200 + i) for i in range(3)}
    url = st.artifact_dir("asset", "run1")
    staged = _stage(tmp_path, "art", files)
    table = pa.table({"id": list(range(500)), "text": [f"row {i}" for i in range(500)]})
    st.put_dir(staged, url)
    st.write_parquet(table, f"{url}/t.parquet")
    st.write_manifest(url)
    assert set(st.verify_manifest(url)["files"]) == set(files) | {"t.parquet"}
    for rel, data in files.items():
        assert st.read_bytes(f"{url}/{rel}") == data
    assert st.read_parquet(f"{url}/t.parquet").equals(table)
    faults = [o for o in proxy.outcomes() if o in ("InternalError", "SlowDown", "reset")]
    assert len(faults) >= 2, proxy.outcomes()


def test_read_timeout_is_applied_and_retried(s3_bucket, proxy):
    """Timeouts: with a 1 s read timeout (set through storage_options' config_kwargs, merged
    over S3_CLIENT_CONFIG) an answer that takes 3 s is abandoned and the request retried,
    so the read finishes with the right bytes instead of hanging on the slow server."""
    st = _s3(s3_bucket, proxy, read_timeout=1)
    url = st.url("x", "blob.bin")
    st.write_bytes(url, b"payload")
    proxy.add("slow", method="GET", delay_s=3.0, first=1)
    assert st.read_bytes(url) == b"payload"
    gets = proxy.outcomes("GET")
    assert gets[:1] == ["slow"] and "200" in gets[1:], gets


# ---- permanent S3 faults -----------------------------------------------------------------
def test_permanent_put_failure_leaves_no_partial_artifact(s3_bucket, proxy, tmp_path):
    """All-or-nothing publish: when every PUT of one file of an artifact fails (500 after all
    retries), the step fails with one line naming the URI, the operation and the server's
    answer; the files already sent are removed, no manifest is published, a reader refuses
    the artifact, and the earlier complete version stays intact and verifiable. The client
    gives up after exactly the configured number of attempts (3 here, to keep it short)."""
    st = _s3(s3_bucket, proxy, retries={"mode": "standard", "total_max_attempts": 3})
    old = st.artifact_dir("asset", "run1")
    old_digest = _publish(st, _stage(tmp_path, "v1", FILES), old)

    proxy.add("500", method="PUT", path=r"/run2/sub/b\.json")
    new = st.artifact_dir("asset", "run2")
    with pytest.raises(StorageError) as err:
        _publish(st, _stage(tmp_path, "v2", {k: v + b"!" for k, v in FILES.items()}), new)
    _one_clear_line(err.value, f"{new}/sub/b.json", "upload", "InternalError", "HTTP 500")
    failed_puts = [o for m, p, o in proxy.log if m == "PUT" and p.endswith("/run2/sub/b.json")]
    assert failed_puts == ["InternalError"] * 3

    proxy.clear()
    assert st.find(new) == []  # the two files sent before the failure were removed
    with pytest.raises(ArtifactError, match="no manifest"):
        st.verify_manifest(new)
    assert st.manifest_digest(old) == old_digest
    assert set(st.verify_manifest(old)["files"]) == set(FILES)
    assert st.read_bytes(f"{old}/a.bin") == FILES["a.bin"]


def test_publish_reads_back_only_what_it_did_not_send(s3_bucket, proxy, tmp_path):
    """Sealing after an upload hashes the sent files as they are read here, not by fetching
    them again: publishing 24 files sends 24 PUTs and GETs only the one file that was at the
    URL before; a copy fetched with fetch_dir verifies against that manifest file by file."""
    st = _s3(s3_bucket, proxy)
    url = st.artifact_dir("asset", "run1")
    st.write_bytes(f"{url}/earlier.txt", b"was here first")
    files = {f"t{i:02d}/{name}": os.urandom(100 + i) for i in range(12) for name in ("task.json", "repo/a.py")}
    before = len(proxy.log)
    digest = _publish(st, _stage(tmp_path, "art", files), url)
    log = proxy.log[before:]
    gets = sorted(p.split("/root/", 1)[1].split("?")[0] for m, p, _ in log if m == "GET" and "/asset/run1/" in p)
    assert gets == ["asset/run1/earlier.txt"], gets
    assert sum(m == "PUT" and "/asset/run1/t" in p for m, p, _ in log) == len(files)
    manifest = st.verify_manifest(url)
    assert set(manifest["files"]) == set(files) | {"earlier.txt"} and digest == st.manifest_digest(url)
    assert st.fetch_dir(url, str(tmp_path / "copy")) == digest  # downloaded, then verified here
    copy = Storage(str(tmp_path / "copy"))
    assert copy.verify_manifest(copy.root) == manifest
    got = _tree(tmp_path / "copy")
    assert {k: v for k, v in got.items() if k not in ("earlier.txt", "manifest.json")} == _tree(tmp_path / "art")


def test_access_denied_is_one_clear_line_without_credentials(s3_bucket, proxy):
    """Clear errors: a 403 AccessDenied is not retried and surfaces as one line with the URI,
    operation and code, with the access key removed even when the server's message quotes
    it; the file already at that URI keeps its old bytes."""
    st = _s3(s3_bucket, proxy)
    url = st.url("registry", "promoted.json")
    st.write_json(url, {"version": 1})
    proxy.add("403", method="PUT", message=f"Access Denied for {FAKE_KEY}")
    with pytest.raises(StorageError) as err:
        st.write_json(url, {"version": 2})
    msg = _one_clear_line(err.value, url, "write", "AccessDenied", "HTTP 403")
    assert "***" in msg  # the quoted key was redacted, not dropped silently
    assert proxy.outcomes("PUT")[-1:] == ["AccessDenied"] and proxy.outcomes("PUT").count("AccessDenied") == 1
    proxy.clear()
    assert st.read_json(url) == {"version": 1}

    proxy.add("403", method="GET")
    with pytest.raises(StorageError) as err:
        st.read_bytes(url)
    _one_clear_line(err.value, url, "read", "HTTP 403")


def test_failed_step_in_dagster_shows_one_line_not_a_botocore_chain(s3_bucket, proxy):
    """Clear step failures: an asset whose write is refused (403) fails its step, and the
    error Dagster records is the one StorageError line (URI, operation, server's answer),
    with no botocore exception chained under it and no credential anywhere in the record."""
    @dg.asset
    def blob(context, artifacts: ArtifactStorage) -> None:
        st = artifacts.get()
        st.write_bytes(st.url("blob", context.run.run_id, "x.bin"), b"x")

    proxy.add("403", method="PUT", message=f"Access Denied for {FAKE_KEY}")
    resource = ArtifactStorage(
        root=f"s3://{s3_bucket['bucket']}/root", endpoint_url=proxy.url,
        aws_access_key_id=FAKE_KEY, aws_secret_access_key=FAKE_SECRET,
    )
    result = dg.materialize([blob], resources={"artifacts": resource}, raise_on_error=False)
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    error = failure.step_failure_data.error
    user_error = error.cause
    assert user_error.cls_name == "StorageError"
    _one_clear_line(user_error.message.strip(), f"s3://{s3_bucket['bucket']}/root/blob/", "write", "AccessDenied", "HTTP 403")
    assert user_error.cause is None and user_error.context is None
    record = error.to_string()
    assert FAKE_KEY not in record and FAKE_SECRET not in record
    assert "botocore" not in record.split("caused by the following exception", 1)[1].split("Stack Trace")[0]


# ---- disk full ---------------------------------------------------------------------------
def test_disk_full_fails_cleanly_and_keeps_earlier_version(small_disk, tmp_path):
    """Disk full: publishing an artifact larger than the free space fails with one line
    naming ENOSPC and the file, leaves no temporary file and no part of the new artifact,
    and the earlier version (and a single file being overwritten) keep their bytes."""
    st = Storage(str(small_disk / "root"))
    old = st.artifact_dir("asset", "run1")
    _publish(st, _stage(tmp_path, "v1", FILES), old)
    single = st.url("registry", "promoted.json")
    st.write_json(single, {"version": 1})
    before = _tree(small_disk)

    big = {"a.bin": os.urandom(600_000), "b.bin": os.urandom(600_000), "c.bin": os.urandom(1_500_000)}
    new = st.artifact_dir("asset", "run2")
    with pytest.raises(StorageError) as err:
        _publish(st, _stage(tmp_path, "v2", big), new)
    assert err.value.errno == 28
    _one_clear_line(err.value, "ENOSPC", "No space left on device", new)
    assert not any(".tmp-" in p for p in _tree(small_disk)), _tree(small_disk)
    assert not os.path.exists(st.local_path(new))

    with pytest.raises(StorageError, match="ENOSPC"):
        st.write_bytes(single, os.urandom(3_000_000))
    with pytest.raises(StorageError, match=r"write .*t\.parquet failed: .*ENOSPC"):
        st.write_parquet(pa.table({"x": [os.urandom(1000).hex() for _ in range(2500)]}), st.url("t.parquet"))
    assert _tree(small_disk) == before  # nothing left behind, nothing changed
    assert st.read_json(single) == {"version": 1}
    assert set(st.verify_manifest(old)["files"]) == set(FILES)


def test_catalog_on_full_disk_fails_cleanly_and_recovers(small_disk, tmp_path):
    """Catalog on a full disk: loading rows fails with one CatalogError line naming ENOSPC
    (the failed ROLLBACK does not hide it), the database keeps its earlier rows, and once
    space is freed it reads and writes again."""
    st = Storage(str(tmp_path / "artifacts"))
    small = st.url("t", "small.parquet")
    st.write_parquet(pa.table({"source": ["a"] * 10, "n": list(range(10)), "s": ["x"] * 10}), small)
    big = st.url("t", "big.parquet")
    st.write_parquet(pa.table({"source": ["b"] * 20_000, "n": list(range(20_000)),
                               "s": [os.urandom(8).hex() for _ in range(20_000)]}), big)
    cat = Catalog(str(small_disk / "catalog.duckdb"), st)
    assert cat.replace_rows("files", [small], where={"source": "a"}) == 10

    filler = small_disk / "filler"
    with open(filler, "wb") as f, pytest.raises(OSError):
        while True:
            f.write(b"\0" * 65536)
            f.flush()
    with pytest.raises(CatalogError) as err:
        cat.replace_rows("files", [big], where={"source": "b"})
    _one_clear_line(err.value, "ENOSPC", str(small_disk / "catalog.duckdb"))

    filler.unlink()
    assert cat.query("SELECT source, count(*) FROM files GROUP BY 1") == [("a", 10)]
    assert cat.replace_rows("files", [big], where={"source": "b"}) == 20_000
    assert cat.query("SELECT count(*) FROM files")[0][0] == 20_010


# ---- read-only storage root --------------------------------------------------------------
def test_read_only_root_refuses_writes_and_changes_nothing(read_only, tmp_path):
    """Read-only storage: every kind of write (file, Parquet, directory upload, manifest)
    fails with one line naming EROFS, the files under the root are unchanged and the
    existing artifact still verifies; a root that would have to be created there fails at
    once with the same clear error."""
    src, ro = read_only
    Storage(str(src / "root"))  # create the root while writable
    _publish(Storage(str(src / "root")), _stage(tmp_path, "v1", FILES), Storage(str(src / "root")).artifact_dir("asset", "run1"))
    before = _tree(src)

    st = Storage(str(ro / "root"))
    old = st.artifact_dir("asset", "run1")
    attempts = [
        lambda: st.write_bytes(st.url("x.bin"), b"data"),
        lambda: st.write_bytes(f"{old}/a.bin", b"changed"),
        lambda: st.write_parquet(pa.table({"x": [1]}), st.url("t.parquet")),
        lambda: _publish(st, _stage(tmp_path, "v2", FILES), st.artifact_dir("asset", "run2")),
        lambda: st.write_manifest(old),
    ]
    for attempt in attempts:
        with pytest.raises(StorageError) as err:
            attempt()
        assert err.value.errno == 30
        _one_clear_line(err.value, "EROFS", str(ro / "root"))
    assert _tree(src) == before
    assert set(st.verify_manifest(old)["files"]) == set(FILES)

    with pytest.raises(StorageError) as err:
        Storage(str(ro / "elsewhere"))
    _one_clear_line(err.value, "open storage", "EROFS")
