"""The data half of the graph, materialized through Dagster on tiny inputs, locally and on S3."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import dagster as dg
import pytest

from composer_dag.catalog import Catalog
from composer_dag.definitions import build_defs, materialize_all
from composer_dag.storage import Storage
from resources import ArtifactStorage, CatalogResource, SourceRegistry
from tests.conftest import FAKE_KEY, FAKE_SECRET
from tests.leak_scan import scan_storage, scan_tree

BASE = textwrap.dedent(
    '''
    """Utilities for parsing configuration records."""

    import re


    def parse_record(line, sep=","):
        """Split a record into trimmed fields, dropping comments."""
        line = line.split("#", 1)[0]
        fields = [f.strip() for f in line.split(sep)]
        return [f for f in fields if f]


    def merge_records(records):
        merged = {}
        for rec in records:
            key, *values = rec
            merged.setdefault(key, []).extend(values)
        return merged


    def render(merged, width=40):
        out = []
        for key in sorted(merged):
            out.append(key.ljust(width) + " ".join(merged[key]))
        return "\\n".join(out)
    '''
)


def make_source(root: Path) -> dict[str, int]:
    root.mkdir(parents=True)
    (root / "records.py").write_text(BASE)
    (root / "vendor").mkdir()
    (root / "vendor/records.py").write_text(BASE)  # exact duplicate (a vendored copy)
    (root / "vendor/records_v2.py").write_text(BASE.replace("width=40", "width=60"))  # near duplicate
    (root / "settings.py").write_text('DB_HOST = "db"\npassword = "hunter2-very-secret"\nADMIN = "ops@example.com"\n')
    (root / "solution.py").write_text(
        "from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
        "    for idx, elem in enumerate(numbers):\n        for idx2, elem2 in enumerate(numbers):\n"
        "            if idx != idx2:\n                distance = abs(elem - elem2)\n"
        "                if distance < threshold:\n                    return True\n\n    return False\n"
    )
    (root / "app.js").write_text("export function add(a, b) {\n  return a + b;\n}\n")
    (root / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    return {"files": 7}


def resources_for(root: str, tmp_path: Path, sources_file: Path, options: dict | None = None, watch: str | None = None):
    options = options or {}
    storage = ArtifactStorage(
        root=root,
        endpoint_url=options.get("endpoint_url"),
        aws_access_key_id=options.get("key"),
        aws_secret_access_key=options.get("secret"),
    )
    return {
        "artifacts": storage,
        "catalog": CatalogResource(storage=storage, path=str(tmp_path / "catalog.duckdb")),
        "sources": SourceRegistry(storage=storage, sources_file=str(sources_file), watch_s3_prefix=watch),
    }


def check_outcomes(results) -> dict[str, bool]:
    out = {}
    for r in results:
        for ev in r.get_asset_check_evaluations():
            out[f"{ev.asset_key.to_user_string()}:{ev.check_name}"] = ev.passed
    return out


def run_graph(resources, tmp_path):
    (tmp_path / "dagster_home").mkdir(exist_ok=True)
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster_home")) as instance:
        defs = build_defs(resources)
        results = materialize_all(instance=instance, definitions=defs, log=lambda m: None, jobs=["data_refresh"])
        assert all(r.success for r in results), [r.run_id for r in results if not r.success]
        mats = {}
        for key in ("deduped_shards",):
            ev = instance.get_latest_materialization_event(dg.AssetKey(key))
            mats[key] = {k: v.value for k, v in ev.asset_materialization.metadata.items()}
        return results, mats


def assert_data_half(results, mats, cat: Catalog, source: str = "local"):
    checks = check_outcomes(results)
    assert checks and all(checks.values()), checks
    assert {"code_corpus:files_accounted", "deduped_shards:kept_files_unique", "deduped_shards:no_contamination",
            "deduped_shards:no_secrets", "deduped_shards:files_accounted"} <= set(checks)
    meta = mats["deduped_shards"]
    assert meta["files_in"] == meta["files_kept"] + sum(
        r[0] for r in cat.query("SELECT count(*) FROM dedup_dropped")
    )
    dropped = dict(cat.query("SELECT path, reason FROM dedup_dropped WHERE source = ?", [source]))
    assert dropped.get("solution.py") == "contaminated"
    dup = {p for p, r in dropped.items() if r in ("exact_duplicate", "near_duplicate")}
    assert len(dup & {"records.py", "vendor/records.py", "vendor/records_v2.py"}) == 2
    skips = dict(cat.query("SELECT reason, count(*) FROM corpus_skips WHERE source = ? GROUP BY 1", [source]))
    assert skips == {"binary": 1}
    assert set(t for t in cat.tables()) >= {"corpus_files", "corpus_skips", "shard_files", "dedup_clusters", "dedup_dropped"}
    return meta


def test_data_half_local(tmp_path):
    make_source(tmp_path / "src")
    sources = tmp_path / "sources.yaml"
    sources.write_text(
        f"sources:\n  - name: local\n    kind: local\n    uri: {tmp_path / 'src'}\n"
        "  - name: python\n    kind: python\n    max_total_mb: 1\n"
    )
    resources = resources_for(str(tmp_path / "artifacts"), tmp_path, sources)
    results, mats = run_graph(resources, tmp_path)
    storage = Storage(str(tmp_path / "artifacts"))
    cat = Catalog(str(tmp_path / "catalog.duckdb"), storage)
    assert_data_half(results, mats, cat)
    assert dict(cat.query("SELECT source, count(*) > 0 FROM corpus_files GROUP BY 1")) == {"local": True, "python": True}
    # Redaction: the password and e-mail survive only as placeholders.
    shard_urls = [u for u in storage.find(mats["deduped_shards"]["dagster/uri"]) if "/shard-" in u]
    text = "".join(cat.query(f"SELECT string_agg(content, '') FROM {cat.scan(shard_urls, 'content')}")[0][0])
    assert "hunter2-very-secret" not in text and "ops@example.com" not in text
    assert mats["deduped_shards"]["dagster/uri"].startswith("file://")
    storage.verify_manifest(mats["deduped_shards"]["dagster/uri"])
    # Provenance: the code and the settings that made it, on the materialization itself.
    meta = mats["deduped_shards"]
    spec_version = build_defs(resources).resolve_asset_graph().get(dg.AssetKey("deduped_shards")).code_version
    assert meta["code_version"] == spec_version and len(spec_version) == 16
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?|unknown", meta["code_commit"]), meta["code_commit"]
    assert re.fullmatch(r"[0-9a-f]{16}", meta["config_digest"]) and meta["seeds"].get("seed") == 42, meta["seeds"]  # DedupConfig.seed (MinHash)


def test_data_half_on_s3_server(tmp_path, s3_bucket):
    """The whole data half against moto's S3 server over HTTP: a watched S3 prefix as the source,
    artifacts in the bucket, the catalog reading Parquet from it through s3fs."""
    bucket = s3_bucket["bucket"]
    make_source(tmp_path / "src")
    up = Storage(f"s3://{bucket}/incoming", s3_bucket["options"])
    up.put_dir(str(tmp_path / "src"), up.url("local"))
    sources = tmp_path / "sources.yaml"
    sources.write_text("sources: []\n")
    resources = resources_for(f"s3://{bucket}/artifacts", tmp_path, sources, s3_bucket["options"], watch=f"s3://{bucket}/incoming")
    assert resources["sources"].names() == ["s3-local"]
    results, mats = run_graph(resources, tmp_path)
    storage = Storage(f"s3://{bucket}/artifacts", s3_bucket["options"])
    cat = Catalog(str(tmp_path / "catalog.duckdb"), storage)
    assert_data_half(results, mats, cat, source="s3-local")
    assert mats["deduped_shards"]["dagster/uri"].startswith(f"s3://{bucket}/artifacts/deduped_shards/")
    storage.verify_manifest(mats["deduped_shards"]["dagster/uri"])
    # Credentials never reach logs, metadata, the catalog, the run history or the bucket.
    secrets = [FAKE_KEY, FAKE_SECRET]
    assert scan_tree(tmp_path, secrets) == []  # run and event storage, catalog, local files
    assert scan_storage(Storage(f"s3://{bucket}", s3_bucket["options"]), f"s3://{bucket}", secrets) == []


def test_new_source_sensor(tmp_path, s3_bucket):
    bucket = s3_bucket["bucket"]
    sources = tmp_path / "sources.yaml"
    sources.write_text(f"sources:\n  - name: local\n    kind: local\n    uri: {tmp_path}\n")
    resources = resources_for(str(tmp_path / "artifacts"), tmp_path, sources, s3_bucket["options"], watch=f"s3://{bucket}/in")
    defs = build_defs(resources)
    sensor = defs.resolve_sensor_def("new_source_sensor")

    def evaluate(instance):
        with dg.build_sensor_context(instance=instance, resources=resources) as ctx:
            return sensor(ctx)

    with dg.instance_for_test() as instance:
        res = evaluate(instance)
        assert [r.partition_key for r in res.run_requests] == ["local"]
        assert res.dynamic_partitions_requests[0].partition_keys == ["local"]
        instance.add_dynamic_partitions("sources", ["local"])
        assert isinstance(evaluate(instance), dg.SkipReason)
        # a new top-level prefix under the watched S3 prefix is a new source
        Storage(f"s3://{bucket}/in", s3_bucket["options"]).write_bytes(f"s3://{bucket}/in/team-a/x.py", b"x = 1\n")
        res = evaluate(instance)
        assert [r.partition_key for r in res.run_requests] == ["s3-team-a"]
        # a new entry in the sources file is a new source
        sources.write_text(sources.read_text() + f"  - name: more\n    kind: local\n    uri: {tmp_path}\n")
        instance.add_dynamic_partitions("sources", ["s3-team-a"])
        res = evaluate(instance)
        assert [r.partition_key for r in res.run_requests] == ["more"]


def test_bad_sources_file_is_one_clear_line(tmp_path):
    sources = tmp_path / "sources.yaml"
    sources.write_text("sources:\n  - name: x\n    kind: ftp\n    uri: ftp://h/\n")
    reg = SourceRegistry(storage=ArtifactStorage(root=str(tmp_path)), sources_file=str(sources))
    with pytest.raises(ValueError, match="unknown kind 'ftp'"):
        reg.names()


def test_no_contamination_check_uses_the_runs_ngram_size(tmp_path):
    """A run configured with ``decontam_n: 20`` keeps a file that shares only a 14-word run with
    HumanEval; the ``no_contamination`` check must judge the shards by the run's n-gram size (it
    used the default n = 10 whatever the run was configured with, and failed here)."""
    from composer_dag.dedup.decontam import default_index, humaneval_texts
    from composer_dag.dedup.text import tokens

    text = dict(humaneval_texts())["HumanEval/0"]
    words = [w.decode() for w in tokens(text)]
    start = words.index("enumerate")
    snippet = " ".join(words[start - 3:start + 11])  # 14 words of the canonical solution
    code = (
        '"""Pairwise checks for sensor readings."""\n\n\n'
        "def scan(readings, limit):\n"
        f"    # {snippet}\n"
        "    seen = []\n    for value in readings:\n        if any(abs(value - s) < limit for s in seen):\n"
        "            return value\n        seen.append(value)\n    return None\n"
    )
    assert default_index(n=10).first_match(code) and not default_index(n=20).first_match(code)
    src = tmp_path / "src"
    src.mkdir()
    (src / "scan.py").write_text(code)
    sources = tmp_path / "sources.yaml"
    sources.write_text(f"sources:\n  - name: local\n    kind: local\n    uri: {src}\n")
    resources = resources_for(str(tmp_path / "artifacts"), tmp_path, sources)
    (tmp_path / "dagster_home").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster_home")) as instance:
        results = materialize_all(instance=instance, definitions=build_defs(resources), log=lambda m: None,
                                  jobs=["data_refresh"],
                                  run_config={"data_refresh": {"ops": {"deduped_shards": {"config": {"decontam_n": 20}}}}})
        assert all(r.success for r in results)
        checks = check_outcomes(results)
        assert checks["deduped_shards:no_contamination"], checks
        meta = instance.get_latest_materialization_event(dg.AssetKey("deduped_shards")).asset_materialization.metadata
        assert meta["files_kept"].value == 1 and meta["config"].value["decontam_n"] == 20
