"""Sensors: a new declared source (or a new prefix under the watched S3 prefix) becomes a
``code_corpus`` partition and a run that ingests it."""


import dagster as dg

from assets.corpus import code_corpus, sources_partitions
from resources import SourceRegistry

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
    try:
        names = sources.names()
    except Exception as exc:  # a broken sources file must not crash the daemon
        return dg.SkipReason(f"cannot read sources: {exc}")
    existing = set(context.instance.get_dynamic_partitions(sources_partitions.name))
    new = [n for n in names if n not in existing]
    if not new:
        return dg.SkipReason(f"no new source ({len(names)} declared)")
    return dg.SensorResult(
        run_requests=[dg.RunRequest(partition_key=n, run_key=f"new-source:{n}") for n in new],
        dynamic_partitions_requests=[sources_partitions.build_add_request(new)],
    )
