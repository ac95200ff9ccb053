"""deduped_shards as an asset beyond one machine and one pass: the map as a Slurm job array
(same kept files as the local process pool), and incremental mode (only a new source is
deduplicated, the earlier shards carried, the accounting exact)."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pyarrow as pa
import pytest

from assets.common import latest_uri
from composer_dag.dedup import DedupConfig, carry_shards, check_carried, dedup, plan_increment, work_url
from composer_dag.dedup.shards import main as map_main
from composer_dag.definitions import build_defs, materialize_all
from composer_dag.storage import ArtifactError, Storage
from resources.cluster import ClusterResource
from tests.data.test_dedup import _code
from tests.graph.test_graph_data import check_outcomes, resources_for

# small and fast: no HumanEval index to build (nothing here is contaminated)
SETTINGS = {"decontam_humaneval": False}


def _source(root: Path, files: dict[str, str]) -> Path:
    root.mkdir(parents=True)
    for name, text in files.items():
        (root / name).write_text(text)
    return root


def _sources_file(path: Path, roots: dict[str, Path]) -> Path:
    path.write_text("sources:\n" + "".join(f"  - name: {n}\n    kind: local\n    uri: {r}\n" for n, r in roots.items()))
    return path


def _refresh(instance, resources, **config) -> tuple[dict, dict]:
    """One ``data_refresh`` run (every source, then the shards); the shards' metadata and the
    check outcomes."""
    results = materialize_all(instance=instance, definitions=build_defs(resources), log=lambda m: None,
                              jobs=["data_refresh"],
                              run_config={"data_refresh": {"ops": {"deduped_shards": {"config": {**SETTINGS, **config}}}}})
    assert all(r.success for r in results)
    ev = instance.get_latest_materialization_event(dg.AssetKey("deduped_shards"))
    return {k: v.value for k, v in ev.asset_materialization.metadata.items()}, check_outcomes(results)


def _kept(storage: Storage, uri: str) -> pa.Table:
    shards = [u for u in storage.find(uri) if u.rsplit("/", 1)[-1].startswith("shard-")]
    return pa.concat_tables([storage.read_parquet(u, columns=["id", "source", "path", "sha256"]) for u in shards])


def _files(table: pa.Table) -> set[tuple[str, str]]:
    return set(zip(table.column("source").to_pylist(), table.column("path").to_pylist()))


def test_map_task_index_comes_from_the_array_environment(tmp_path, monkeypatch, capsys):
    spec = f"file://{tmp_path}/spec.json"  # not there
    monkeypatch.delenv("COMPOSER_ARRAY_INDEX", raising=False)
    assert map_main([spec]) == 2  # no index anywhere: usage
    monkeypatch.setenv("COMPOSER_ARRAY_INDEX", "3")
    assert map_main([spec]) == 1  # index 3 taken, then the missing spec named in one line
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"DedupTaskError: dedup task 3 of {spec} failed: missing artifact file"), err


def test_increment_plan_says_why_it_rebuilds(tmp_path):
    storage = Storage(str(tmp_path))
    url = storage.url("deduped_shards", "run-1")
    storage.write_json(url + "/manifest.json", {"files": {}})
    storage.write_json(work_url(url) + "/index.json", {"files": 0})
    cfg = DedupConfig(incremental=True)
    latest = {"url": url, "config": cfg.to_dict(), "sources": {"a": "da"}, "contamination": "c"}

    def plan(sources=None, run_cfg=cfg, contamination="c", **latest_changes):
        return plan_increment(storage, run_cfg, sources or {"a": "da", "b": "db"}, contamination,
                              {**latest, **latest_changes})

    got = plan()
    assert (got.mode, got.previous, got.new_sources) == ("increment", url, ["b"])
    assert plan(run_cfg=cfg.replace(workers=1, task_bytes=1000, shard_bytes=1000)).mode == "increment"
    assert plan({"a": "da"}).mode == "unchanged"
    for why, got in [
        ("a re-ingested with other content", plan({"a": "new", "b": "db"})),
        ("a no longer in the corpus", plan({"b": "db"})),
        ("settings changed since the latest output: threshold", plan(run_cfg=cfg.replace(threshold=0.8))),
        ("decontamination set changed", plan(contamination="other")),
        ("not made in incremental mode", plan(config=DedupConfig().to_dict())),
        ("incremental mode is off", plan(run_cfg=cfg.replace(incremental=False))),
    ]:
        assert got.mode == "full" and why in got.why, (why, got)
    assert plan_increment(storage, cfg, {"a": "da"}, "c", None).why == "no earlier output to build on"
    storage.fs.rm_file(storage._path(work_url(url) + "/index.json"))
    assert "has no index of kept files" in plan().why


def test_carried_shards_are_copied_on_s3_and_checked(s3_bucket):
    """The earlier output's shards (its own carried ones first) copied server-side on S3, counted
    from their footers, and checked against its manifest once the new one is written."""
    storage = Storage(f"s3://{s3_bucket['bucket']}/root", s3_bucket["options"])
    old, new = storage.url("deduped_shards", "run-1"), storage.url("deduped_shards", "run-2")
    for name, n in (("shard-00000.parquet", 2), ("shard-c00000.parquet", 3)):
        storage.write_parquet(pa.table({"id": [f"{name}-{i}" for i in range(n)]}), f"{old}/{name}")
    storage.write_parquet(pa.table({"id": ["x"]}), f"{old}/dropped.parquet")
    storage.write_manifest(old)
    carried = carry_shards(storage, old, new)
    assert [u.rsplit("/", 1)[1] for u in carried.urls] == ["shard-c00000.parquet", "shard-c00001.parquet"]
    assert carried.files == 5
    assert storage.read_parquet(carried.urls[0]).column("id").to_pylist()[0] == "shard-c00000.parquet-0"
    storage.write_manifest(new)
    check_carried(storage, carried, new)
    storage.write_parquet(pa.table({"id": ["changed"]}), carried.urls[1])
    storage.write_manifest(new)
    with pytest.raises(ArtifactError, match="shard-c00001.parquet"):
        check_carried(storage, carried, new)


def test_incremental_asset_dedups_only_the_new_source(tmp_path):
    a = {f"m{i}.py": _code(i) for i in range(6)}
    b = {f"n{i}.py": _code(100 + i) for i in range(4)}
    # a longer copy of a file source a kept (trailing blanks: the same normalised content)
    b["copy_of_m2.py"] = "\n".join(line + "   " if line else line for line in a["m2.py"].split("\n"))
    roots = {"a": _source(tmp_path / "src-a", a), "b": _source(tmp_path / "src-b", b)}
    sources = _sources_file(tmp_path / "sources.yaml", {"a": roots["a"]})
    resources = resources_for(str(tmp_path / "artifacts"), tmp_path, sources)
    storage = Storage(str(tmp_path / "artifacts"))
    (tmp_path / "dagster_home").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster_home")) as instance:
        first, checks = _refresh(instance, resources, incremental=True)
        assert first["incremental_mode"] == "full" and first["files_kept"] == 6 and all(checks.values()), checks
        assert set(first["source_digests"]) == {"a"}

        # a new source: source a is ingested again (same content), b deduplicated against a's kept files
        _sources_file(sources, roots)
        inc, checks = _refresh(instance, resources, incremental=True)
        assert checks and all(checks.values()), checks
        assert inc["incremental_mode"] == "increment" and inc["sources_deduplicated"] == "b", inc["incremental_why"]
        assert inc["previous"] == first["dagster/uri"] and set(inc["source_digests"]) == {"a", "b"}
        assert inc["source_digests"]["a"] == first["source_digests"]["a"]
        assert inc["files_in"] == len(b) and inc["map_tasks"] == 1 and inc["map_backend"] == "local"
        assert inc["files_carried"] == 6 and inc["bytes_carried"] == first["bytes_kept"]
        assert inc["files_kept"] == 6 + 4 == inc["dagster/row_count"]
        kept = _kept(storage, inc["dagster/uri"])  # old and new kept files, in one output
        assert _files(kept) == {("a", p) for p in a} | {("b", p) for p in b if p != "copy_of_m2.py"}
        assert kept.num_rows == len(set(kept.column("id").to_pylist()))
        content = [storage.read_parquet(u, columns=["content"]) for u in storage.find(inc["dagster/uri"])
                   if u.rsplit("/", 1)[-1].startswith("shard-")]
        assert inc["bytes_kept"] == sum(len(t.encode()) for c in content for t in c.column("content").to_pylist())
        dropped = storage.read_parquet(inc["dagster/uri"] + "/dropped.parquet").to_pylist()
        assert [(d["path"], d["reason"]) for d in dropped] == [("copy_of_m2.py", "exact_duplicate")]
        assert "(a:m2.py)" in dropped[0]["detail"]  # the file already kept wins
        assert inc["files_in"] + inc["files_carried"] == inc["files_kept"] + len(dropped)
        storage.verify_manifest(inc["dagster/uri"])

        # nothing new: the latest output is reported again, unchanged
        same, checks = _refresh(instance, resources, incremental=True)
        assert same["incremental_mode"] == "unchanged" and same["dagster/uri"] == inc["dagster/uri"]
        assert all(checks.values()), checks

        # a full rebuild keeps the longer copy instead (the keep rule); otherwise the same files
        full, checks = _refresh(instance, resources)
        assert "incremental_mode" not in full and full["files_carried"] == 0 and all(checks.values()), checks
        assert full["files_in"] == len(a) + len(b) and full["files_kept"] == inc["files_kept"]
        assert _files(_kept(storage, full["dagster/uri"])) == (_files(kept) - {("a", "m2.py")}) | {("b", "copy_of_m2.py")}


def test_slurm_dedup_map_runs_as_a_job_array(cluster_bucket, tmp_path):
    """Two sources, one map task each, run as the elements of one ``sbatch --array`` job on the
    two-node cluster that reaches the artifacts on the S3 server only; the kept files are those
    of the local pool."""
    s3_bucket = cluster_bucket
    bucket = s3_bucket["bucket"]
    roots = {"a": _source(tmp_path / "src-a", {f"m{i}.py": _code(i) for i in range(5)} | {"dup.py": _code(1)}),
             "b": _source(tmp_path / "src-b", {f"n{i}.py": _code(50 + i) for i in range(5)} | {"dup.py": _code(3)})}
    sources = _sources_file(tmp_path / "sources.yaml", roots)
    resources = resources_for(f"s3://{bucket}/artifacts", tmp_path, sources, s3_bucket["options"])
    resources["cluster"] = ClusterResource(backend="slurm", scratch_dir="/tmp/composer-scratch",
                                           log_uri=f"s3://{bucket}/logs", poll_seconds=0.5, grace_seconds=3)
    (tmp_path / "dagster_home").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster_home")) as instance:
        meta, checks = _refresh(instance, resources)
        assert checks and all(checks.values()), checks
        inputs = {p: latest_uri(instance, "code_corpus", p) for p in ("a", "b")}
    assert meta["map_backend"] == "slurm" and meta["map_tasks"] == 2
    storage = Storage(f"s3://{bucket}/artifacts", s3_bucket["options"])
    # sbatch --array: <name>-<job>_<index>.out, each copied from its node to log_uri
    logs = sorted(u.rsplit("/", 1)[1] for u in storage.find(f"s3://{bucket}/logs") if "/dedup-map-" in u)
    assert len(logs) == 2 and {n.rsplit("_", 1)[1] for n in logs} == {"0.out", "1.out"}, logs
    assert len({n.rsplit("_", 1)[0] for n in logs}) == 1, logs  # one job, two elements

    urls = [u for p in ("a", "b") for u in storage.find(inputs[p]) if u.rsplit("/", 1)[-1].startswith("files-")]
    local = dedup(urls, storage, storage.url("local-check"), DedupConfig(**SETTINGS))
    assert local.extra["map_processes"] != "run_tasks"
    on_slurm = _kept(storage, meta["dagster/uri"])
    here = pa.concat_tables([storage.read_parquet(u, columns=["id", "source", "path", "sha256"]) for u in local.shard_urls])
    assert sorted(zip(on_slurm.column("id").to_pylist(), on_slurm.column("sha256").to_pylist())) == \
        sorted(zip(here.column("id").to_pylist(), here.column("sha256").to_pylist()))
    assert meta["files_kept"] == local.files_kept == 10 and meta["files_in"] == 12
    assert meta["manifest_digest"] != "" and storage.verify_manifest(meta["dagster/uri"])


def test_slurm_dedup_map_failure_names_the_index(cluster_bucket, tmp_path):
    """A map task that fails on the cluster fails the step with one line naming the array, the
    index and the task's own error (not the scheduler's last words), read from the task's log
    copied to S3."""
    from assets.dedup import _map_runner
    from resources import ArtifactStorage

    cluster = ClusterResource(backend="slurm", scratch_dir="/tmp/composer-scratch",
                              log_uri=f"s3://{cluster_bucket['bucket']}/logs", poll_seconds=0.5, grace_seconds=3)
    spec = f"file://{tmp_path}/art/spec.json"  # never written

    @dg.asset
    def mapped(context):
        _map_runner(context, cluster, ArtifactStorage(root=str(tmp_path / "art")))(spec, 1)

    res = dg.materialize([mapped], raise_on_error=False)
    failure = next(e for e in res.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE)
    lines = failure.event_specific_data.error.message.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(
        f"array dedup-map: 1 of 1 indexes failed: index 0 failed (exit code 1): DedupTaskError: dedup task 0 of "
        f"{spec} failed: missing artifact file: {spec}"), lines
