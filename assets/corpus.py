"""code_corpus: one partition per declared source, ingested into Parquet and the catalog."""


import dagster as dg

from assets._common import RETRY, column_schema, counts_table, progress_logger
from composer_dag.corpus import ingest
from resources import ArtifactStorage, CatalogResource, SourceRegistry

sources_partitions = dg.DynamicPartitionsDefinition(name="sources")


@dg.asset(
    partitions_def=sources_partitions,
    group_name="data",
    kinds={"python", "parquet", "duckdb"},
    retry_policy=RETRY,
    backfill_policy=dg.BackfillPolicy.multi_run(max_partitions_per_run=1),
    check_specs=[
        dg.AssetCheckSpec(
            "files_accounted",
            asset="code_corpus",
            description="files seen = files ingested + files skipped, recounted from the written artifacts",
        )
    ],
    description="Source files of one declared source (see sources.yaml), with language, size and "
    "sha256; every file not ingested is counted by reason.",
)
def code_corpus(
    context: dg.AssetExecutionContext,
    artifacts: ArtifactStorage,
    catalog: CatalogResource,
    sources: SourceRegistry,
):
    name = context.partition_key
    try:
        spec, cfg = sources.resolve(name)
    except ValueError as exc:
        raise dg.Failure(description=str(exc)) from None
    storage = artifacts.get()
    out_url = storage.url("code_corpus", context.run.run_id, name)
    context.log.info(f"ingesting source {name!r} ({spec.kind}) into {out_url}")
    try:
        result = ingest(spec, storage, out_url, cfg, progress=progress_logger(context))
    except (ValueError, FileNotFoundError, PermissionError) as exc:
        raise dg.Failure(description=f"source {name!r}: {exc}") from None

    cat = catalog.get()
    extra = {"run_id": context.run.run_id}
    if result.parquet_urls:
        cat.replace_rows("corpus_files", result.parquet_urls, where={"source": name}, extra=extra)
    cat.replace_rows("corpus_skips", [result.skipped_url], where={"source": name}, extra=extra)

    # The check recounts from the artifacts themselves, not from the engine's counters.
    stored_rows = sum(storage.read_parquet(u, columns=["id"]).num_rows for u in result.parquet_urls)
    stored_skips = storage.read_parquet(result.skipped_url, columns=["reason"]).num_rows
    accounted = result.files_seen == stored_rows + stored_skips == result.files_ingested + sum(result.skipped.values())

    schema = storage.read_parquet(result.parquet_urls[0]).schema if result.parquet_urls else None
    metadata = {
        "dagster/uri": out_url,
        "dagster/row_count": result.rows,
        "manifest_digest": result.manifest_digest,
        "files_seen": result.files_seen,
        "files_ingested": result.files_ingested,
        "files_skipped": sum(result.skipped.values()),
        "bytes_ingested": result.bytes_ingested,
        "MB_per_s": round(result.bytes_ingested / 1e6 / max(result.seconds, 1e-9), 2),
        "languages": counts_table(result.languages, "language"),
        "skipped_by_reason": counts_table(result.skipped, "reason"),
        "seconds": round(result.seconds, 2),
    }
    if schema is not None:
        metadata["dagster/column_schema"] = column_schema(schema)
    return dg.MaterializeResult(
        metadata=metadata,
        check_results=[
            dg.AssetCheckResult(
                check_name="files_accounted",
                passed=bool(accounted),
                metadata={
                    "files_seen": result.files_seen,
                    "rows_written": stored_rows,
                    "skips_written": stored_skips,
                },
            )
        ],
    )
