"""deduped_shards: every source's files filtered, deduplicated, decontaminated and redacted.

Where the map runs: with the ``cluster`` resource's backend ``local``, the engine's own process
pool on this machine (small inputs in this process). With ``slurm`` or ``k8s``, the engine's map
tasks run as one job array through ``cluster.run_array`` (``sbatch --array``, an indexed Job):
element ``i`` runs ``python -m composer_dag.dedup.shards SPEC_URL`` with ``i`` in
``COMPOSER_ARRAY_INDEX``; a failing element fails the step with one line naming it. The reduce
runs here. Array tasks share nothing with this process but storage: the job spec, the inputs and
the map's output are storage URLs, so the artifact storage must be reachable from the nodes:
S3 (or any object store over HTTP; the endpoint travels in ``COMPOSER_S3_ENDPOINT_URL``, the
keys in the job's environment as for every cluster job, never in the job script), or local
files only on a filesystem every node mounts at the same path. The array tasks are not run
under bubblewrap even with ``isolate``: they run only this project's code over file contents as
bytes (nothing from the corpus is executed), and a sandbox would hide a ``file://`` storage root
(only the code, the Python environment and the scratch directory are bound into it; object
storage stays reachable, the network is not unshared).

Incremental mode (``incremental: true``): when the latest materialization was itself made in
incremental mode with the same settings and decontamination set, and every source it used still
has the same ``code_corpus`` content (the corpus manifest digest of each source is recorded in
``source_digests``), only the sources new since then are deduplicated, against the index of every
file kept so far; a file already kept wins over a new copy. The earlier shards are copied into
the new output (``shard-c*.parquet``), so it still holds every kept file; ``files_carried`` and
``bytes_carried`` count them, and ``files_in + files_carried = kept + dropped``. A source that
changed or disappeared, other settings or no usable earlier output mean a full rebuild (logged
with the reason); nothing new at all re-reports the latest output as it is.
See ``composer_dag/dedup/increment.py``.
"""

import dagster as dg

from assets.common import RETRY, counts_table, latest_metadata, latest_uri, progress_logger, record_provenance
from assets.corpus import code_corpus, sources_partitions
from assets.envs import eval_task_texts
from composer_dag import dedup as engine
from resources import ArtifactStorage, CatalogResource
from resources.cluster import ClusterResource
from resources.dagster_config import dagster_config, engine_config

ASSET = "deduped_shards"
MAP_ARRAY = "dedup-map"


DedupParams = dagster_config(engine.DedupConfig, module=__name__)
"""Near-dedup defaults follow BigCode's: 256 permutations, Jaccard 0.7, 5-gram shingles."""


def corpus_sources(context: dg.AssetExecutionContext | dg.AssetCheckExecutionContext, storage) -> dict[str, tuple[list[str], str]]:
    """For every ``code_corpus`` partition with a materialization: the Parquet files of its
    newest one and that artifact's manifest digest."""
    partitions = sorted(context.instance.get_dynamic_partitions(sources_partitions.name))
    found: dict[str, tuple[list[str], str]] = {}
    for p in partitions:
        if latest_metadata(context.instance, "code_corpus", p) is None:
            context.log.warning(f"source {p!r} has no code_corpus materialization yet; left out")
            continue
        base = latest_uri(context.instance, "code_corpus", p)
        storage.verify_manifest(base)  # never read a half-written or changed artifact
        urls = [u for u in storage.find(base) if u.rsplit("/", 1)[-1].startswith("files-")]
        found[p] = (urls, storage.manifest_digest(base))
    if not any(urls for urls, _ in found.values()):
        raise dg.Failure(description="no code_corpus partition has been materialized: nothing to deduplicate", allow_retries=False)
    return found


def corpus_inputs(context: dg.AssetExecutionContext | dg.AssetCheckExecutionContext, storage) -> tuple[list[str], list[str]]:
    """Parquet files of the newest materialization of every ``code_corpus`` partition."""
    found = corpus_sources(context, storage)
    return [u for urls, _ in found.values() for u in urls], list(found)


def _has_eval_tasks(context) -> bool:
    return latest_metadata(context.instance, "eval_tasks") is not None


def _latest_entries(instance: dg.DagsterInstance) -> dict | None:
    """The newest materialization's metadata entries, as recorded (values with their types)."""
    records = instance.fetch_materializations(dg.AssetKey(ASSET), limit=1).records
    mat = records[0].asset_materialization if records else None
    return dict(mat.metadata or {}) if mat else None


def _map_runner(context, cluster: ClusterResource, artifacts: ArtifactStorage):
    """None on a backend that runs jobs on this machine (the engine's process pool); otherwise the
    engine's ``run_tasks``: every map task one element of a job array on the cluster."""
    backend = cluster.get_backend()
    if backend.runs_here:
        return None
    python = backend.python  # the image's / the shared environment's
    env = {"COMPOSER_S3_ENDPOINT_URL": artifacts.endpoint_url} if artifacts.endpoint_url else {}
    root = artifacts.get().root
    if root.startswith("file://") and not backend.shares_disk:
        context.log.warning(f"map tasks on {cluster.backend} read and write {root}: every node must mount it at that path")
    if cluster.isolate:
        context.log.info("map tasks run without the bubblewrap sandbox (they execute no corpus code; "
                         "they reach the artifacts through storage only)")

    def run_tasks(spec_url: str, count: int) -> None:
        cluster.run_array(context, [python, "-m", "composer_dag.dedup.shards", spec_url], count, env=env, name=MAP_ARRAY)

    return run_tasks


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
    cluster: ClusterResource,
) -> dg.MaterializeResult:
    record_provenance(context)
    storage = artifacts.get()
    found = corpus_sources(context, storage)
    digests = {name: digest for name, (_, digest) in found.items()}
    out_url = storage.url(ASSET, context.run.run_id)
    contamination = None
    if _has_eval_tasks(context):
        contamination = eval_task_texts(context, storage)
        context.log.info(f"decontaminating against HumanEval and {len(contamination)} texts of the held-out tasks")
    else:
        context.log.warning("eval_tasks not materialized yet: decontaminating against HumanEval only")
    cfg = engine_config(engine.DedupConfig, config)
    contam_digest = engine.contamination_digest(contamination)
    prev_entries = _latest_entries(context.instance) if cfg.incremental else None
    prev = {k: v.value for k, v in (prev_entries or {}).items()}
    previous = prev and {"url": prev.get("dagster/uri"), "config": prev.get("config"),
                         "sources": prev.get("source_digests"), "contamination": prev.get("decontamination_digest"),
                         "files_kept": prev.get("files_kept"), "bytes_kept": prev.get("bytes_kept")}
    run_tasks = _map_runner(context, cluster, artifacts)
    try:
        done = engine.refresh(storage, cfg, {name: urls for name, (urls, _) in found.items()}, digests, out_url,
                              contamination, previous or None, log=context.log.info,
                              progress=progress_logger(context), run_tasks=run_tasks)
    except engine.CarryMismatch as exc:
        raise dg.Failure(description=str(exc), allow_retries=False) from None
    plan, result, sources = done.plan, done.result, done.sources
    if plan.mode == "unchanged":  # the latest output is still the whole answer
        return dg.MaterializeResult(metadata={**prev_entries, "incremental_mode": plan.mode,
                                              "incremental_why": plan.why})
    carried = plan.mode == "increment"
    files_carried, bytes_carried, shard_urls = done.files_carried, done.bytes_carried, done.shard_urls

    cat = catalog.get()
    extra = {"run_id": context.run.run_id}
    cat.replace_rows("shard_files", shard_urls, extra=extra)
    # an increment adds its clusters and drops to the earlier runs' (the carried files' own)
    keep = {"where": extra} if carried else {}
    cat.replace_rows("dedup_clusters", [result.clusters_url], extra=extra, **keep)
    cat.replace_rows("dedup_dropped", [result.dropped_url], extra=extra, **keep)

    metadata = {
        "dagster/uri": out_url,
        "dagster/row_count": result.files_kept + files_carried,
        "manifest_digest": result.manifest_digest,
        "sources": ", ".join(found),
        "source_digests": dg.MetadataValue.json(digests),
        "files_in": result.files_in,
        "files_carried": files_carried,
        "files_kept": result.files_kept + files_carried,
        "bytes_in": result.bytes_in,
        "bytes_carried": bytes_carried,
        "bytes_kept": result.bytes_kept + bytes_carried,
        "clusters": result.clusters,
        "shards": len(shard_urls),
        "map_backend": cluster.backend if run_tasks else "local",
        "map_tasks": result.extra["map_tasks"],
        "dropped_by_reason": counts_table({k: v for k, v in result.dropped.items() if v}, "reason"),
        "decontamination_set": "HumanEval + eval_tasks" if contamination else "HumanEval",
        "decontamination_digest": contam_digest,
        "redactions": counts_table(result.redactions, "kind", "count"),
        "stage_seconds": dg.MetadataValue.json({k: round(v, 3) for k, v in result.stage_seconds.items()}),
        "MB_per_s": round(result.bytes_in / 1e6 / max(sum(result.stage_seconds.values()), 1e-9), 2),
        "config": dg.MetadataValue.json(cfg.to_dict()),
    }
    if cfg.incremental:
        metadata.update({"incremental_mode": plan.mode, "incremental_why": plan.why,
                         "sources_deduplicated": ", ".join(sources)})
    if carried:
        metadata["previous"] = plan.previous
    return dg.MaterializeResult(metadata=metadata)


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


@dg.asset_check(asset=deduped_shards, description="Files in + files carried from the earlier output (incremental) = files kept + files dropped (by reason), recounted from the artifacts.", blocking=True)
def files_accounted(context: dg.AssetCheckExecutionContext, artifacts: ArtifactStorage, catalog: CatalogResource):
    storage = artifacts.get()
    base, shards = _shards(context, storage)
    meta = latest_metadata(context.instance, ASSET) or {}
    kept = sum(storage.read_parquet(u, columns=["id"]).num_rows for u in shards)
    dropped = storage.read_parquet(base.rstrip("/") + "/dropped.parquet", columns=["id"]).num_rows
    files_in = int(meta.get("files_in", -1))
    carried = int(meta.get("files_carried", 0))  # kept by earlier runs, copied into this output
    return dg.AssetCheckResult(
        passed=files_in + carried == kept + dropped,
        metadata={"files_in": files_in, "files_carried": carried, "kept": kept, "dropped": dropped},
    )
