"""Operating the graph: jobs, schedules, the run-failure sensor and multi-source runs."""

from __future__ import annotations

import datetime
from pathlib import Path

import dagster as dg
import pytest

from assets.jobs import RANGE_END, RANGE_START
from composer_dag.catalog import Catalog
from composer_dag.definitions import build_defs
from composer_dag.storage import Storage
from tests.graph.test_graph_data import make_source, resources_for


def _defs_with_sources(tmp_path: Path, sources_yaml: str) -> tuple[dg.Definitions, dict]:
    sources = tmp_path / "sources.yaml"
    sources.write_text(sources_yaml)
    resources = resources_for(str(tmp_path / "artifacts"), tmp_path, sources)
    return build_defs(resources), resources


def test_jobs_schedules_and_sensors_are_declared():
    """The operator-facing names exist, with the intended default states: the nightly refresh on,
    the weekly training off, both sensors on."""
    defs = build_defs()
    for job in ("data_refresh", "train", "everything", "midtrain", "rl", "evaluate", "build_tasks", "ingest_source"):
        defs.resolve_job_def(job)
    nightly = defs.resolve_schedule_def("nightly_data_refresh")
    weekly = defs.resolve_schedule_def("weekly_train")
    assert nightly.cron_schedule == "0 2 * * *" and nightly.job_name == "data_refresh"
    assert nightly.default_status == dg.DefaultScheduleStatus.RUNNING
    assert weekly.job_name == "train" and weekly.default_status == dg.DefaultScheduleStatus.STOPPED
    for name in ("new_source_sensor", "record_run_failures", "rebuild_shards_after_ingest"):
        assert defs.resolve_sensor_def(name).default_status == dg.DefaultSensorStatus.RUNNING
    train_keys = {k.to_user_string() for k in defs.resolve_job_def("train").asset_layer.executable_asset_keys}
    assert {"midtrained_checkpoint", "rl_checkpoint", "evaluated_model", "promoted_model"} <= train_keys
    data_keys = {k.to_user_string() for k in defs.resolve_job_def("data_refresh").asset_layer.executable_asset_keys}
    assert data_keys == {"code_corpus", "deduped_shards"}


def test_nightly_schedule_requests_one_run_over_every_source(tmp_path):
    """The nightly refresh skips (with a reason) before any source exists, then asks for one run
    whose partition range covers every source."""
    defs, _ = _defs_with_sources(tmp_path, "sources: []\n")
    schedule = defs.resolve_schedule_def("nightly_data_refresh")
    with dg.instance_for_test() as instance:
        when = datetime.datetime(2026, 11, 30, 2, 0, tzinfo=datetime.timezone.utc)
        out = schedule.evaluate_tick(dg.build_schedule_context(instance=instance, scheduled_execution_time=when))
        assert not out.run_requests and "no source partition" in out.skip_message
        instance.add_dynamic_partitions("sources", ["alpha", "beta", "gamma"])
        out = schedule.evaluate_tick(dg.build_schedule_context(instance=instance, scheduled_execution_time=when))
        (req,) = out.run_requests
        assert req.tags[RANGE_START] == "alpha" and req.tags[RANGE_END] == "gamma"
        assert req.run_key == "nightly-2026-11-30"


@pytest.mark.slow
def test_many_sources_one_run_and_a_failing_source_is_isolated(tmp_path):
    """A data_refresh over three sources is one run: each source gets its own materialization
    and artifact, dedup reads all three. A source that fails is named in a clear failure while
    the others stay materialized; the run-failure sensor records it in the catalog."""
    for name in ("a", "b"):
        make_source(tmp_path / name)
    decl = "".join(f"  - name: {n}\n    kind: local\n    uri: {tmp_path / n}\n" for n in ("a", "b"))
    defs, resources = _defs_with_sources(tmp_path, "sources:\n" + decl + f"  - name: c\n    kind: local\n    uri: {tmp_path / 'a'}\n")
    job = defs.resolve_job_def("data_refresh")
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("sources", ["a", "b", "c"])
        tags = {RANGE_START: "a", RANGE_END: "c"}
        result = job.execute_in_process(instance=instance, tags=tags)
        assert result.success
        records = instance.fetch_materializations(dg.AssetKey("code_corpus"), limit=100).records
        assert {r.partition_key for r in records} == {"a", "b", "c"}
        assert len({r.run_id for r in records}) == 1
        storage = Storage(str(tmp_path / "artifacts"))
        from assets.common import latest_uri

        uris = {p: latest_uri(instance, "code_corpus", p) for p in "abc"}
        assert len(set(uris.values())) == 3 and all(uris[p].endswith("/" + p) for p in "abc")
        for uri in uris.values():
            storage.verify_manifest(uri)
        cat = Catalog(resources["catalog"].resolved_path(), storage)
        assert dict(cat.query("SELECT source, count(*) > 0 FROM corpus_files GROUP BY 1")) == {"a": True, "b": True, "c": True}
        checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
        assert checks["files_accounted"] and checks["kept_files_unique"]

        # The run-failure sensor, evaluated as the daemon does (the first tick sets its cursor).
        sensor = defs.resolve_sensor_def("record_run_failures")

        def tick(cursor):
            with dg.build_sensor_context(
                instance=instance, cursor=cursor,
                resources={"catalog": resources["catalog"]},
            ) as ctx:
                data = sensor.evaluate_tick(ctx)
                assert not [r.error for r in data.dagster_run_reactions or [] if r.error]
                return data.cursor

        cursor = tick(None)

        # Source b disappears from disk: its failure is named, a and c are still materialized.
        (tmp_path / "b").rename(tmp_path / "b-gone")
        before = {r.storage_id for r in records}
        failed = job.execute_in_process(instance=instance, tags=tags, raise_on_error=False)
        assert not failed.success
        failure = next(e for e in failed.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE)
        message = failure.event_specific_data.error.message
        assert "1 of 3 sources failed (b)" in message
        new = [r for r in instance.fetch_materializations(dg.AssetKey("code_corpus"), limit=100).records if r.storage_id not in before]
        assert sorted(r.partition_key for r in new) == ["a", "c"]

        # The failure lands in the catalog (run, job, range, step, first line), once.
        cursor = tick(cursor)
        tick(cursor)
        rows = cat.query("SELECT run_id, job_name, partition, failed_steps, error FROM run_failures")
        assert len(rows) == 1
        run_id, job_name, partition, steps, error = rows[0]
        assert (run_id, job_name, partition) == (failed.run_id, "data_refresh", "a...c")
        assert "code_corpus" in steps and error.startswith("1 of 3 sources failed (b)") and "\n" not in error
        assert cat.query("SELECT failed_at IS NOT NULL FROM run_failures")[0][0]


@pytest.mark.slow
def test_backfill_over_sources_from_the_command_line(tmp_path, monkeypatch):
    """`dagster asset materialize --partition-range` backfills several code_corpus partitions in
    one run (the single-run backfill policy; the command refuses a range otherwise), and every
    partition ends up with its own materialization and artifact."""
    import os
    import subprocess
    import sys

    for name in ("s1", "s2", "s3"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "mod.py").write_text(f"def {name}_value(x):\n    return x * {len(name)} + 1\n")
    decl = "".join(f"  - name: {n}\n    kind: local\n    uri: {tmp_path / n}\n" for n in ("s1", "s2", "s3"))
    (tmp_path / "sources.yaml").write_text("sources:\n" + decl)
    home = tmp_path / "dagster_home"
    home.mkdir()
    env = {**os.environ, "DAGSTER_HOME": str(home), "COMPOSER_HOME": str(tmp_path / "composer"),
           "COMPOSER_SOURCES": str(tmp_path / "sources.yaml")}
    with dg.DagsterInstance.from_config(str(home)) as instance:
        instance.add_dynamic_partitions("sources", ["s1", "s2", "s3"])
    exe = Path(sys.executable).with_name("dagster")
    proc = subprocess.run(
        [str(exe), "asset", "materialize", "-m", "composer_dag.definitions", "--select", "code_corpus",
         "--partition-range", "s1...s3"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with dg.DagsterInstance.from_config(str(home)) as instance:
        runs = instance.get_runs()
        assert len(runs) == 1 and runs[0].tags[RANGE_START] == "s1" and runs[0].tags[RANGE_END] == "s3"
        records = instance.fetch_materializations(dg.AssetKey("code_corpus"), limit=10).records
        per_partition = [r for r in records if r.asset_materialization.metadata.get("files_ingested")]
        assert {r.partition_key for r in records} == {"s1", "s2", "s3"}
        from assets.common import latest_uri

        uris = {p: latest_uri(instance, "code_corpus", p) for p in ("s1", "s2", "s3")}
    storage = Storage(str(tmp_path / "composer" / "artifacts"))
    for p, uri in uris.items():
        assert uri.endswith("/" + p)
        storage.verify_manifest(uri)
    assert len(per_partition) >= 3


def test_shards_rebuild_after_a_source_is_ingested():
    """deduped_shards' automation condition, evaluated as its sensor does: nothing while the
    held-out tasks are missing, a request once a source is (re)ingested, nothing again until the
    next ingestion after the shards are rebuilt."""
    defs = build_defs()
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("sources", ["a"])

        def requested(cursor=None):
            res = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=cursor)
            return res.get_num_requested(dg.AssetKey("deduped_shards")), res.cursor

        def materialize(key, partition=None):
            @dg.op(name=f"report_{key}")
            def report(context):
                context.log_event(dg.AssetMaterialization(key, partition=partition))

            dg.GraphDefinition(name=f"report_{key}_job", node_defs=[report]).to_job().execute_in_process(instance=instance)

        materialize("code_corpus", "a")
        got, cursor = requested()
        assert got == 0  # eval_tasks missing: decontamination needs it
        materialize("eval_tasks")
        materialize("code_corpus", "a")
        got, cursor = requested(cursor)
        assert got == 1
        materialize("deduped_shards")
        got, cursor = requested(cursor)
        assert got == 0
