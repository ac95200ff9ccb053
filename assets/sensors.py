"""Sensors: a new declared source (or a new prefix under the watched S3 prefix) becomes a
``code_corpus`` partition and a run that ingests it; a newly declared repository becomes a
``repo_environments`` partition and a run; every failed run is recorded in the catalog."""


import datetime

import dagster as dg

from assets.corpus import code_corpus, sources_partitions
from assets.envs import repositories_partitions
from assets.jobs import repo_environments_job
from resources import CatalogResource, SourceRegistry

ingest_source_job = dg.define_asset_job(
    "ingest_source",
    selection=dg.AssetSelection.assets(code_corpus),
    description="Ingest one corpus source (one code_corpus partition).",
)


@dg.sensor(
    job=ingest_source_job,
    minimum_interval_seconds=60,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Adds a code_corpus partition and requests a run for every new source.",
)
def new_source_sensor(context: dg.SensorEvaluationContext, sources: SourceRegistry):
    return _new_partitions(context, sources.names, sources_partitions, "source")


@dg.sensor(
    job=repo_environments_job,
    minimum_interval_seconds=60,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Adds a repo_environments partition and requests a run for every newly declared repository.",
)
def new_repository_sensor(context: dg.SensorEvaluationContext, sources: SourceRegistry):
    return _new_partitions(context, lambda: [r.name for r in sources.repositories()], repositories_partitions,
                           "repository")


def _new_partitions(context, declared, partitions: dg.DynamicPartitionsDefinition, what: str):
    """A partition of ``partitions`` and a run for each name of ``declared()`` not a partition yet."""
    try:
        names = declared()
    except Exception as exc:  # a broken sources file must not crash the daemon
        return dg.SkipReason(f"cannot read the declared {what} list: {exc}")
    existing = set(context.instance.get_dynamic_partitions(partitions.name))
    new = [n for n in names if n not in existing]
    if not new:
        return dg.SkipReason(f"no new {what} ({len(names)} declared)")
    return dg.SensorResult(
        run_requests=[dg.RunRequest(partition_key=n, run_key=f"new-{what}:{n}") for n in new],
        dynamic_partitions_requests=[partitions.build_add_request(new)],
    )


def _first_line(text: str | None, limit: int = 500) -> str:
    line = next((ln.strip() for ln in (text or "").splitlines() if ln.strip()), "")
    return line[:limit]


def _error_line(error) -> str:
    """``Failure: text`` -> ``text``; ``pkg.mod.SomeError: text`` -> ``SomeError: text``."""
    line = _first_line(error.message)
    head, sep, rest = line.partition(": ")
    if not sep or " " in head:
        return line
    name = head.rsplit(".", 1)[-1]
    return rest if name == "Failure" else f"{name}: {rest}"


def _ended_at(instance: dg.DagsterInstance, run_id: str) -> datetime.datetime:
    record = instance.get_run_record_by_id(run_id)
    end = record.end_time if record and record.end_time else None
    return datetime.datetime.fromtimestamp(end, datetime.timezone.utc) if end else datetime.datetime.now(datetime.timezone.utc)


@dg.run_failure_sensor(
    name="record_run_failures",
    default_status=dg.DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=30,
    description="Records every failed run (job, partition, failed steps, first line of the error) in the "
    "catalog table run_failures, so failures can be queried beside the data they concern.",
)
def record_run_failures(context: dg.RunFailureSensorContext, catalog: CatalogResource):
    run = context.dagster_run
    steps = context.get_step_failure_events()
    errors = [ev.event_specific_data.error for ev in steps if ev.event_specific_data and ev.event_specific_data.error]
    message = (_error_line(errors[0]) if errors else "") or _first_line(context.failure_event.message)
    tags = run.tags or {}
    partition = tags.get("dagster/partition") or (
        f"{tags['dagster/asset_partition_range_start']}...{tags['dagster/asset_partition_range_end']}"
        if "dagster/asset_partition_range_start" in tags else None
    )
    catalog.get().insert_records(
        "run_failures",
        [{
            "run_id": run.run_id,
            "job_name": run.job_name,
            "partition": partition,
            "failed_steps": ",".join(ev.step_key for ev in steps if ev.step_key),
            "error": message,
            "failed_at": _ended_at(context.instance, run.run_id),
            "backfill_id": tags.get("dagster/backfill"),
        }],
        where={"run_id": run.run_id},
    )
    context.log.info(f"recorded failure of run {run.run_id} ({run.job_name}): {message}")
