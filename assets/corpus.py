"""code_corpus: one partition per declared source, ingested into Parquet and the catalog."""


import dagster as dg

from assets.common import RETRY, column_schema, counts_table, progress_logger, record_provenance
from composer_dag.corpus import ingest
from resources import ArtifactStorage, CatalogResource, SourceRegistry

sources_partitions = dg.DynamicPartitionsDefinition(name="sources")


@dg.asset(
    partitions_def=sources_partitions,
    group_name="data",
    kinds={"python", "parquet", "duckdb"},
    retry_policy=RETRY,
    # A backfill over many sources is one run: each source costs seconds to ingest, while a run
    # costs a process and a code-location load. Sources are still ingested, materialized and
    # reported one by one inside that run, and one failing source does not stop the others.
    backfill_policy=dg.BackfillPolicy.single_run(),
    check_specs=[
        dg.AssetCheckSpec(
            "files_accounted",
            asset="code_corpus",
            description="files seen = files ingested + files skipped, recounted from the written artifacts "
            "(every source of the run)",
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
    record_provenance(context)
    names = list(context.partition_keys)
    if len(names) == 1:  # the common case: one source, its own metadata
        metadata, counts = _ingest_one(context, names[0], artifacts, catalog, sources)
        return dg.MaterializeResult(metadata=metadata, check_results=[_accounted_check({names[0]: counts})])

    # Many sources in one run (a backfill or data_refresh): each is ingested and recorded with its
    # own materialization as it finishes; the run's result then covers every partition of the
    # range, with a table per source and each partition's artifact under ``partition_uris``.
    failed: dict[str, str] = {}
    done: dict[str, dict] = {}
    uris: dict[str, str] = {}
    for i, name in enumerate(names, 1):
        context.log.info(f"[{i}/{len(names)}] source {name!r}")
        try:
            metadata, counts = _ingest_one(context, name, artifacts, catalog, sources)
        except dg.Failure as exc:
            context.log.error(exc.description)
            failed[name] = str(exc.description)
            continue
        done[name], uris[name] = counts, metadata["dagster/uri"]
        context.log_event(dg.AssetMaterialization(asset_key=context.asset_key, partition=name, metadata=metadata))
    if failed:
        raise dg.Failure(
            description=f"{len(failed)} of {len(names)} sources failed ({', '.join(sorted(failed))}); "
            f"the other {len(done)} are materialized",
            metadata={"errors": dg.MetadataValue.md("\n".join(f"- **{k}**: {v}" for k, v in sorted(failed.items())))},
            allow_retries=False,  # the errors are the sources' own (missing path, bad spec); a retry repeats them
        )
    table = ["| source | files seen | ingested | skipped |", "|---|---:|---:|---:|"] + [
        f"| {n} | {c['files_seen']:,} | {c['rows_written']:,} | {c['skips_written']:,} |" for n, c in done.items()
    ]
    return dg.MaterializeResult(
        metadata={
            "sources": len(done),
            "files_seen": sum(c["files_seen"] for c in done.values()),
            "files_ingested": sum(c["rows_written"] for c in done.values()),
            "files_skipped": sum(c["skips_written"] for c in done.values()),
            "by_source": dg.MetadataValue.md("\n".join(table)),
            "partition_uris": dg.MetadataValue.json(uris),
        },
        check_results=[_accounted_check(done)],
    )


def _accounted_check(done: dict[str, dict]) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(
        check_name="files_accounted",
        passed=all(c["accounted"] for c in done.values()),
        metadata={
            "sources": len(done),
            "files_seen": sum(c["files_seen"] for c in done.values()),
            "rows_written": sum(c["rows_written"] for c in done.values()),
            "skips_written": sum(c["skips_written"] for c in done.values()),
            "not_accounted": ", ".join(n for n, c in done.items() if not c["accounted"]) or "none",
        },
    )


def _ingest_one(context, name: str, artifacts: ArtifactStorage, catalog: CatalogResource, sources: SourceRegistry):
    """Ingest one source; returns its materialization metadata and its recount."""
    try:
        spec, cfg = sources.resolve(name)
    except ValueError as exc:
        raise dg.Failure(description=str(exc), allow_retries=False) from None
    storage = artifacts.get()
    out_url = storage.url("code_corpus", context.run.run_id, name)
    context.log.info(f"ingesting source {name!r} ({spec.kind}) into {out_url}")
    try:
        result = ingest(spec, storage, out_url, cfg, progress=progress_logger(context))
    except (ValueError, FileNotFoundError, PermissionError) as exc:
        raise dg.Failure(description=f"source {name!r}: {exc}", allow_retries=False) from None

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
    counts = {"accounted": bool(accounted), "files_seen": result.files_seen,
              "rows_written": stored_rows, "skips_written": stored_skips}
    return metadata, counts
