"""deduped_shards: every source's files filtered, deduplicated, decontaminated and redacted."""


import dagster as dg

from assets._common import RETRY, counts_table, latest_metadata, latest_uri, progress_logger
from assets.corpus import code_corpus, sources_partitions
from assets.envs import eval_task_texts
from composer_dag import dedup as engine
from resources import ArtifactStorage, CatalogResource
from resources.dagster_config import dagster_config, engine_config

ASSET = "deduped_shards"


DedupParams = dagster_config(engine.DedupConfig, module=__name__)
"""Near-dedup defaults follow BigCode's: 256 permutations, Jaccard 0.7, 5-gram shingles."""


def corpus_inputs(context: dg.AssetExecutionContext | dg.AssetCheckExecutionContext, storage) -> tuple[list[str], list[str]]:
    """Parquet files of the newest materialization of every ``code_corpus`` partition."""
    partitions = sorted(context.instance.get_dynamic_partitions(sources_partitions.name))
    urls, used = [], []
    for p in partitions:
        if latest_metadata(context.instance, "code_corpus", p) is None:
            context.log.warning(f"source {p!r} has no code_corpus materialization yet; left out")
            continue
        base = latest_uri(context.instance, "code_corpus", p)
        storage.verify_manifest(base)  # never read a half-written or changed artifact
        urls += [u for u in storage.find(base) if u.rsplit("/", 1)[-1].startswith("files-")]
        used.append(p)
    if not urls:
        raise dg.Failure(description="no code_corpus partition has been materialized: nothing to deduplicate", allow_retries=False)
    return urls, used


def _has_eval_tasks(context) -> bool:
    return latest_metadata(context.instance, "eval_tasks") is not None


@dg.asset(
    deps=[code_corpus, dg.AssetDep("eval_tasks")],
    group_name="data",
    kinds={"python", "parquet", "duckdb"},
    retry_policy=RETRY,
    # Rebuild after a source is (re)ingested, once no source is still being ingested.
    automation_condition=dg.AutomationCondition.eager(),
    description="Clean training shards: quality filters, exact and MinHash near dedup, HumanEval "
    "decontamination and secret redaction; every dropped file listed with its reason.",
)
def deduped_shards(
    context: dg.AssetExecutionContext,
    config: DedupParams,
    artifacts: ArtifactStorage,
    catalog: CatalogResource,
) -> dg.MaterializeResult:
    storage = artifacts.get()
    inputs, used = corpus_inputs(context, storage)
    context.log.info(f"deduplicating {len(inputs)} Parquet files from sources {used}")
    out_url = storage.url(ASSET, context.run.run_id)
    contamination = None
    if _has_eval_tasks(context):
        contamination = eval_task_texts(context, storage)
        context.log.info(f"decontaminating against HumanEval and {len(contamination)} texts of the held-out tasks")
    else:
        context.log.warning("eval_tasks not materialized yet: decontaminating against HumanEval only")
    cfg = engine_config(engine.DedupConfig, config)
    result = engine.dedup(inputs, storage, out_url, cfg, contamination=contamination, progress=progress_logger(context))

    cat = catalog.get()
    extra = {"run_id": context.run.run_id}
    cat.replace_rows("shard_files", result.shard_urls, extra=extra)
    cat.replace_rows("dedup_clusters", [result.clusters_url], extra=extra)
    cat.replace_rows("dedup_dropped", [result.dropped_url], extra=extra)

    return dg.MaterializeResult(
        metadata={
            "dagster/uri": out_url,
            "dagster/row_count": result.files_kept,
            "manifest_digest": result.manifest_digest,
            "sources": ", ".join(used),
            "files_in": result.files_in,
            "files_kept": result.files_kept,
            "bytes_in": result.bytes_in,
            "bytes_kept": result.bytes_kept,
            "clusters": result.clusters,
            "shards": len(result.shard_urls),
            "map_tasks": result.extra["map_tasks"],
            "dropped_by_reason": counts_table({k: v for k, v in result.dropped.items() if v}, "reason"),
            "decontamination_set": "HumanEval + eval_tasks" if contamination else "HumanEval",
            "redactions": counts_table(result.redactions, "kind", "count"),
            "stage_seconds": dg.MetadataValue.json({k: round(v, 3) for k, v in result.stage_seconds.items()}),
            "MB_per_s": round(result.bytes_in / 1e6 / max(sum(result.stage_seconds.values()), 1e-9), 2),
            "config": dg.MetadataValue.json(cfg.to_dict()),
        }
    )


def _shards(context: dg.AssetCheckExecutionContext, storage) -> tuple[str, list[str]]:
    base = latest_uri(context.instance, ASSET)
    storage.verify_manifest(base)
    return base, [u for u in storage.find(base) if u.rsplit("/", 1)[-1].startswith("shard-")]


@dg.asset_check(asset=deduped_shards, description="No two kept files have the same content.", blocking=True)
def kept_files_unique(context: dg.AssetCheckExecutionContext, artifacts: ArtifactStorage, catalog: CatalogResource):
    storage = artifacts.get()
    _, shards = _shards(context, storage)
    cat = catalog.get()
    dup = cat.query(
        f"SELECT count(*) FROM (SELECT sha256(content) h FROM {cat.scan(shards, 'content')} GROUP BY h HAVING count(*) > 1)"
    )[0][0]
    return dg.AssetCheckResult(passed=dup == 0, metadata={"duplicate_contents": int(dup)})


@dg.asset_check(asset=deduped_shards, description="No kept file shares a long n-gram with an evaluation benchmark.", blocking=True)
def no_contamination(context: dg.AssetCheckExecutionContext, artifacts: ArtifactStorage):
    storage = artifacts.get()
    _, shards = _shards(context, storage)
    extra = eval_task_texts(context, storage) if _has_eval_tasks(context) else None
    # the n-gram size the shards were built with, not today's default
    run_cfg = engine.DedupConfig.load((latest_metadata(context.instance, ASSET) or {}).get("config") or {})
    hits = engine.check_shards(storage, shards, n=run_cfg.decontam_n, extra=extra)
    return dg.AssetCheckResult(
        passed=not hits, metadata={"contaminated_files": len(hits), "ngram": run_cfg.decontam_n,
                                   "examples": dg.MetadataValue.json(hits[:10])}
    )


@dg.asset_check(asset=deduped_shards, description="No secret pattern (keys, tokens, passwords, e-mails) remains.", blocking=True)
def no_secrets(context: dg.AssetCheckExecutionContext, artifacts: ArtifactStorage):
    storage = artifacts.get()
    _, shards = _shards(context, storage)
    found: dict[str, int] = {}
    for url in shards:
        table = storage.read_parquet(url, columns=["path", "content"])
        for text in table.column("content").to_pylist():
            for kind in engine.find_secrets(text):
                found[kind] = found.get(kind, 0) + 1
    return dg.AssetCheckResult(passed=not found, metadata={"secrets_found": dg.MetadataValue.json(found)})


@dg.asset_check(asset=deduped_shards, description="Files in = files kept + files dropped (by reason), recounted from the artifacts.", blocking=True)
def files_accounted(context: dg.AssetCheckExecutionContext, artifacts: ArtifactStorage, catalog: CatalogResource):
    storage = artifacts.get()
    base, shards = _shards(context, storage)
    meta = latest_metadata(context.instance, ASSET) or {}
    kept = sum(storage.read_parquet(u, columns=["id"]).num_rows for u in shards)
    dropped = storage.read_parquet(base.rstrip("/") + "/dropped.parquet", columns=["id"]).num_rows
    files_in = int(meta.get("files_in", -1))
    return dg.AssetCheckResult(
        passed=files_in == kept + dropped,
        metadata={"files_in": files_in, "kept": kept, "dropped": dropped},
    )
