"""Production sessions in: ``production_traces``, one partition per hour, fed by a sensor on the
storage prefix the serving side writes session files to.

Each hour's files are read, checked against the session schema, scrubbed, deduplicated against
the other hours and decontaminated against ``eval_tasks`` (``composer_dag.traces.intake``); the
kept sessions go to ``production_traces/<hour>/<run id>/sessions.parquet`` and one row each to
the catalog's ``traces`` table, every file to ``trace_files``. A file that arrives late changes
its hour's set of digests, and the sensor requests that hour again.
"""

import datetime
import hashlib
import json
import os

import dagster as dg

from assets._common import RETRY, counts_table, latest_metadata, latest_uri, local_copy, md_table, record_provenance
from composer_dag.traces import intake as engine
from composer_dag.traces.store import deleted_users, known_models, list_incoming
from resources import ArtifactStorage, CatalogResource
from resources.dagster_config import dagster_config, engine_config

TraceParams = dagster_config(engine.TraceConfig, module=__name__)
TRACES_START = os.environ.get("COMPOSER_TRACES_START", "2026-01-01-00:00")
traces_partitions = dg.HourlyPartitionsDefinition(start_date=TRACES_START, end_offset=1)
"""One partition per hour, the current one included (sessions of the hour so far)."""
TRACES_FRESHNESS = dg.FreshnessPolicy.time_window(warn_window=datetime.timedelta(hours=2),
                                                  fail_window=datetime.timedelta(hours=6))
"""The UI warns when no hour of sessions was taken in for two hours (and fails after six)."""


def _earlier(cat, hour: str) -> tuple[dict, dict]:
    """The other hours' session ids and conversation digests, and file digest -> hour."""
    tables = cat.tables()
    earlier = {"session_ids": set(), "conversations": set()}
    if "traces" in tables:
        for sid, conv in cat.query("SELECT session_id, conversation_digest FROM traces WHERE hour <> ?", [hour]):
            earlier["session_ids"].add(sid)
            earlier["conversations"].add(conv)
    taken = {}
    if "trace_files" in tables:
        taken = dict(cat.query("SELECT digest, hour FROM trace_files WHERE hour <> ? AND kept >= 0", [hour]))
    return earlier, taken


@dg.asset(
    partitions_def=traces_partitions,
    deps=["eval_tasks"],
    group_name="traces",
    kinds={"parquet", "duckdb"},
    retry_policy=RETRY,
    freshness_policy=TRACES_FRESHNESS,
    check_specs=[dg.AssetCheckSpec("sessions_accounted", asset="production_traces", blocking=True,
                                   description="Every line read is a kept session or counted under one reason.")],
)
def production_traces(context: dg.AssetExecutionContext, config: TraceParams, artifacts: ArtifactStorage,
                      catalog: CatalogResource):
    """One hour of production harness sessions (``composer-session/1``): consent checked, scrubbed of
    secrets and identities, deduplicated against earlier hours, decontaminated against the
    evaluation tasks; bad records counted by reason, never failing the partition."""
    record_provenance(context)
    storage = artifacts.get()
    cat = catalog.get()
    cfg = engine_config(engine.TraceConfig, config)
    hour = context.partition_key
    incoming = engine.incoming_url(storage, cfg.incoming)
    files = list_incoming(storage, incoming).get(hour, [])
    context.log.info(f"{hour}: {len(files)} session files under {incoming}")
    earlier, taken = _earlier(cat, hour)
    data = [(f, storage.read_bytes(f)) for f in files]
    eval_meta = latest_metadata(context.instance, "eval_tasks")
    if cfg.decontaminate and eval_meta:
        with local_copy(storage, latest_uri(context.instance, "eval_tasks")) as ev:
            rows, summary = engine.intake(data, hour, cfg, known_models=known_models(storage), earlier=earlier,
                                          deleted_users=deleted_users(storage), taken_elsewhere=taken,
                                          eval_tasks_dir=ev)
    else:
        rows, summary = engine.intake(data, hour, cfg, known_models=known_models(storage), earlier=earlier,
                                      deleted_users=deleted_users(storage), taken_elsewhere=taken)
        summary["decontaminated"] = False
    import pyarrow as pa

    url = storage.url("production_traces", engine.hour_dir(hour), context.run.run_id)
    storage.write_parquet(pa.Table.from_pylist(rows, schema=engine.row_schema()), f"{url}/sessions.parquet")
    storage.write_json(f"{url}/summary.json", summary)
    digest = storage.write_manifest(url)
    now = datetime.datetime.now(datetime.timezone.utc)
    cat.insert_records("traces", [{k: v for k, v in r.items() if k != "record"} | {"uri": url, "run_id": context.run.run_id,
                                                                                  "taken_in_at": now} for r in rows]
                       or [], where={"hour": hour})
    if not rows and "traces" in cat.tables():
        cat.query("DELETE FROM traces WHERE hour = ?", [hour])
    cat.insert_records("trace_files", [{"digest": f["digest"], "url": f["file"], "hour": hour, "records": f["records"],
                                        "kept": f["kept"] if f["skipped"] is None else -1, "run_id": context.run.run_id}
                                       for f in summary["per_file"]], where={"hour": hour})
    dropped = summary["dropped"]
    context.log.info(f"{hour}: {summary['records_in']} records, {summary['kept']} kept ({summary['good']} good), "
                     f"dropped {dropped}, redactions {summary['redactions']}")
    yield dg.MaterializeResult(metadata={
        "dagster/uri": url,
        "manifest_digest": digest,
        "dagster/row_count": summary["kept"],
        "records_in": summary["records_in"],
        "good_sessions": summary["good"],
        "files": summary["files"],
        "files_duplicate": summary["files_duplicate"],
        "dropped": counts_table(dropped, "reason", "records"),
        "redactions": counts_table(summary["redactions"], "kind", "replaced"),
        "generations_dropped": summary["generations_dropped"],
        "by_outcome": dg.MetadataValue.json(summary["by_outcome"]),
        "by_file": md_table(["file", "records", "kept", "skipped"],
                            [[f["file"].rsplit("/", 1)[-1], f["records"], f["kept"], f["skipped"]] for f in summary["per_file"]]),
        "format": summary["format"],
    })
    accounted = summary["records_in"] == summary["kept"] + sum(dropped.values())
    yield dg.AssetCheckResult(check_name="sessions_accounted", passed=accounted, metadata={
        "records_in": summary["records_in"], "kept": summary["kept"], "dropped": dg.MetadataValue.json(dropped)})


traces_job = dg.define_asset_job("take_in_traces", selection=dg.AssetSelection.assets(production_traces),
                                 description="Take in one hour of production sessions (a production_traces partition).")


def _fingerprint(storage, url: str) -> str:
    info = storage.info(url)
    return f"{info.get('size')}:{info.get('mtime') or info.get('LastModified') or info.get('ETag') or info.get('created')}"


@dg.sensor(job=traces_job, minimum_interval_seconds=60, default_status=dg.DefaultSensorStatus.RUNNING,
           description="Requests a production_traces partition for every hour whose session files changed "
                       "(a new file, a late one, a rewritten one), keyed by the digests of that hour's files.")
def production_traces_sensor(context: dg.SensorEvaluationContext, artifacts: ArtifactStorage):
    storage = artifacts.get()
    incoming = engine.incoming_url(storage, engine.TraceConfig().incoming)
    try:
        listing = list_incoming(storage, incoming)
    except Exception as exc:  # storage down: the next tick tries again
        return dg.SkipReason(f"cannot list {incoming}: {exc}")
    cursor = json.loads(context.cursor or "{}")
    files, hours = dict(cursor.get("files") or {}), dict(cursor.get("hours") or {})
    now = datetime.datetime.now(datetime.timezone.utc)
    first = datetime.datetime.strptime(TRACES_START, engine.PARTITION).replace(tzinfo=datetime.timezone.utc)
    requests, outside = [], []
    for hour, urls in listing.items():
        at = datetime.datetime.strptime(hour, engine.PARTITION).replace(tzinfo=datetime.timezone.utc)
        if at < first or at > now:
            outside.append(hour)
            continue
        digests = []
        for u in urls:  # a file is read (hashed) only when its size or time changed
            fp = _fingerprint(storage, u)
            if (files.get(u) or [None])[0] != fp:
                files[u] = [fp, engine.file_digest(storage.read_bytes(u))]
            digests.append(files[u][1])
        key = hashlib.sha256("\n".join(sorted(digests)).encode()).hexdigest()[:16]
        if hours.get(hour) != key:
            requests.append(dg.RunRequest(partition_key=hour, run_key=f"traces:{hour}:{key}"))
            hours[hour] = key
    live = {u for urls in listing.values() for u in urls}
    files = {u: v for u, v in files.items() if u in live}
    if outside:
        context.log.warning(f"session folders outside the partitions ({TRACES_START} .. now) left alone: {outside[:5]}")
    new_cursor = json.dumps({"files": files, "hours": hours}, sort_keys=True)
    if not requests:
        context.update_cursor(new_cursor)
        return dg.SkipReason(f"no new session files ({len(live)} files in {len(listing)} hours)")
    return dg.SensorResult(run_requests=requests, cursor=new_cursor)


