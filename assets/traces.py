"""Production sessions in: ``production_traces``, one partition per hour, fed by a sensor on the
storage prefix the serving side writes session files to.

Each hour's files are read, checked against the session schema, scrubbed, deduplicated against
the other hours and decontaminated against ``eval_tasks`` (``composer_dag.traces.intake``); the
kept sessions go to ``production_traces/<hour>/<run id>/sessions.parquet`` and one row each to
the catalog's ``traces`` table, every file to ``trace_files``. A file that arrives late changes
its hour's set of digests, and the sensor requests that hour again.
"""

import contextlib
import datetime
import hashlib
import json
import os
import tempfile

import dagster as dg

from assets.common import (RETRY, counts_table, latest_metadata, latest_uri, local_copy, md_table, record_provenance,
                            run_stage)
from assets.train import CHECKPOINT_FILES
from composer_dag.evals.gate import decide
from composer_dag.evals.run import EvalRunConfig
from composer_dag.sft.run import SFTConfig
from composer_dag.sft.trajectories import session_set
from composer_dag.traces import cycle as cycle_engine
from composer_dag.traces import intake as engine
from composer_dag.traces import registry
from composer_dag.traces.rl_job import SessionRLConfig
from composer_dag.traces.store import deleted_users, good_sessions, list_incoming, session_artifacts
from resources import ArtifactStorage, CatalogResource
from resources.cluster import ClusterResource
from resources.dagster_config import dagster_config, engine_config

TraceParams = dagster_config(engine.TraceConfig, module=__name__)
TRACES_START = os.environ.get("COMPOSER_TRACES_START", "2026-01-01-00:00")
traces_partitions = dg.HourlyPartitionsDefinition(start_date=TRACES_START, end_offset=1)
"""One partition per hour, the current one included (sessions of the hour so far)."""
TRACES_FRESHNESS = dg.FreshnessPolicy.time_window(warn_window=datetime.timedelta(hours=2),
                                                  fail_window=datetime.timedelta(hours=6))
"""The UI warns when no hour of sessions was taken in for two hours (and fails after six)."""


def _earlier(cat, hour: str, file_digests: list[str]):
    """What the other hours hold, asked of the catalog for this hour's own sessions and files
    only: a lookup ``(session ids, conversation digests) -> {"session_ids", "conversations"}``
    for the intake, and file digest -> hour for ``file_digests``."""
    tables = cat.tables()

    def lookup(ids: list[str], convs: list[str]) -> dict:
        seen = {"session_ids": set(), "conversations": set()}
        if "traces" in tables:
            for sid, conv in cat.query("SELECT session_id, conversation_digest FROM traces WHERE hour <> ? AND "
                                       "(list_contains(?, session_id) OR list_contains(?, conversation_digest))",
                                       [hour, ids, convs]):
                seen["session_ids"].add(sid)
                seen["conversations"].add(conv)
        return seen

    taken = {}
    if "trace_files" in tables and file_digests:
        taken = dict(cat.query("SELECT digest, hour FROM trace_files WHERE hour <> ? AND kept >= 0 "
                               "AND list_contains(?, digest)", [hour, file_digests]))
    return lookup, taken


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
    data = [(f, storage.read_bytes(f)) for f in files]
    earlier, taken = _earlier(cat, hour, sorted({engine.file_digest(b) for _, b in data}))
    decontaminate = cfg.decontaminate and latest_metadata(context.instance, "eval_tasks") is not None
    with (local_copy(storage, latest_uri(context.instance, "eval_tasks")) if decontaminate
          else contextlib.nullcontext()) as ev:
        rows, summary = engine.intake(data, hour, cfg, known_models=registry.known_models(storage), earlier=earlier,
                                      deleted_users=deleted_users(storage), taken_elsewhere=taken, eval_tasks_dir=ev)
    summary["decontaminated"] = decontaminate
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


@dg.sensor(job=traces_job, minimum_interval_seconds=60, default_status=dg.DefaultSensorStatus.RUNNING,
           description="Requests a production_traces partition for every hour whose session files changed "
                       "(a new file, a late one, a rewritten one), keyed by the digests of that hour's files.")
def production_traces_sensor(context: dg.SensorEvaluationContext, artifacts: ArtifactStorage):
    storage = artifacts.get()
    incoming = engine.incoming_url(storage, engine.TraceConfig().incoming)
    try:
        stamps: dict[str, str] = {}
        listing = list_incoming(storage, incoming, stamps)
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
            fp = stamps[u]
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




# ---------------------------------------------------------------- the cycle

CYCLE_CRON = os.environ.get("COMPOSER_CYCLE_CRON", "0 */5 * * *")
cycle_partitions = dg.TimeWindowPartitionsDefinition(cron_schedule=CYCLE_CRON, start=TRACES_START, fmt=engine.PARTITION)
"""One partition per cycle window (every 5 hours by default: ``COMPOSER_CYCLE_CRON``)."""
CycleParams = dagster_config(cycle_engine.CycleConfig, module=__name__)


def _skip(context, reason: str):
    context.log.info(f"cycle {context.partition_key} skipped: {reason}")
    yield dg.AssetObservation(asset_key="cycle_checkpoints", partition=context.partition_key,
                              metadata={"skipped": reason})
    yield dg.AssetCheckResult(check_name="no_candidate_refused", passed=True, metadata={"skipped": reason})


@dg.asset(
    partitions_def=cycle_partitions,
    deps=[dg.AssetDep(production_traces, partition_mapping=dg.TimeWindowPartitionMapping()),
          dg.AssetDep("cycle_checkpoints", partition_mapping=dg.TimeWindowPartitionMapping(start_offset=-1, end_offset=-1)),
          "eval_tasks", "token_shards"],
    group_name="traces",
    kinds={"pytorch", "deepspeed"},
    pool="gpu",
    output_required=False,
    check_specs=[dg.AssetCheckSpec("no_candidate_refused", asset="cycle_checkpoints",
                                   description="Fails when the gate refused the window's candidate against the served "
                                               "checkpoint (the served version stays; the reasons are here). A window "
                                               "skipped for want of sessions has no candidate: it passes, saying why.")],
)
def cycle_checkpoints(context: dg.AssetExecutionContext, config: CycleParams, artifacts: ArtifactStorage,
                      catalog: CatalogResource, cluster: ClusterResource):
    """One cycle: the served checkpoint fine-tuned on its window's good sessions and updated by
    off-policy GRPO on all of them, evaluated against the served one through the same gate as
    evaluated_model, promoted and published to the serving fleet when it passes. Depends on the
    previous cycle and on the hours of sessions since then."""
    record_provenance(context)
    storage = artifacts.get()
    cat = catalog.get()
    cfg = engine_config(cycle_engine.CycleConfig, config)
    key = context.partition_key
    others = [r for r in context.instance.get_run_records(dg.RunsFilter(
        job_name=cycle_job.name, statuses=[dg.DagsterRunStatus.STARTED])) if r.dagster_run.run_id != context.run.run_id]
    if others:
        raise dg.Failure(description=f"cycle run {others[0].dagster_run.run_id} is still running: one cycle at a time",
                         allow_retries=False)
    window = context.partition_time_window
    hours = cycle_engine.hours_in(window.start, window.end)
    served = registry.current(storage)
    if served is None or not served.get("checkpoint_uri"):
        yield from _skip(context, "no promoted model to continue from (materialize promoted_model first)")
        return
    sessions = good_sessions(storage, cat, hours)
    if cfg.candidate_uri is None and len(sessions) < cfg.min_good_sessions:
        yield from _skip(context, f"{len(sessions)} good sessions in {hours[0]} .. {hours[-1]} "
                                  f"(at least {cfg.min_good_sessions} needed)")
        return
    url = storage.url("cycle_checkpoints", engine.hour_dir(key), context.run.run_id)
    given = {"served_checkpoint": (served["checkpoint_uri"], served["checkpoint_digest"])}
    replay = ["token_shards"] if latest_metadata(context.instance, "token_shards") else []
    if cfg.candidate_uri is None:
        (cand_url, cand_digest), lineage, trained = _train(context, storage, cluster, cat, cfg, url, served, sessions,
                                                           hours, given, replay)
    else:
        cand_url, cand_digest = cfg.candidate_uri, storage.manifest_digest(cfg.candidate_uri)
        lineage, trained = [("candidate_uri", cfg.candidate_uri)], {}
    given["candidate_checkpoint"] = (cand_url, cand_digest)
    _, ev = run_stage(context, storage, cluster, "eval", EvalRunConfig, cfg.eval,
                      ["served_checkpoint", "candidate_checkpoint", "eval_tasks", *replay],
                      lambda d, wd: {"checkpoints": {"served": d["served_checkpoint"], "candidate": d["candidate_checkpoint"]},
                                     "tasks_dir": d["eval_tasks"], "val_dir": d.get("token_shards"),
                                     "out_dir": os.path.join(wd, "out")},
                      "composer_dag.evals.run", launcher="python",
                      outputs={"cycle_evaluation": [["served", "served"], ["candidate", "candidate"]]}, given=given,
                      state_exclude=("gate",))
    gate = decide(ev["summary"], "candidate", "served", cfg.eval.gate, midtrained=None)
    cat.insert_records("checkpoint_inputs", [
        {"checkpoint": "cycle_checkpoints", "run_id": context.run.run_id, "uri": cand_url, "input": name,
         "input_uri": uri} for name, uri in lineage], where={"checkpoint": "cycle_checkpoints", "run_id": context.run.run_id})
    served_line = _promote(context, storage, cfg, served, gate, cand_url, cand_digest, ev, trained) if gate["passed"] else None
    if served_line is None:
        context.log.warning(f"cycle {key}: the gate refused the candidate; {registry.model_version(served)} keeps "
                            f"serving: {'; '.join(gate['reasons'])}")
    storage.write_bytes(f"{url}/report.md", gate["report"].encode())
    yield dg.MaterializeResult(metadata={
        "dagster/uri": cand_url,
        "manifest_digest": cand_digest,
        "promoted": gate["passed"],
        "version": served_line["version"] if served_line else "",
        "served": served_line["version"] if served_line else registry.model_version(served),
        "parent": registry.model_version(served),
        "weights_version": -1 if (served_line or {}).get("weights_version") is None else served_line["weights_version"],
        "sessions": dg.MetadataValue.json(trained.get("sft") or {}),
        "rl_from_sessions": dg.MetadataValue.json(trained.get("rl") or {}),
        "stage_seconds": dg.MetadataValue.json(trained.get("seconds") or {}),
        "hours": dg.MetadataValue.json(hours),
        "gate": dg.MetadataValue.md(gate["report"]),
        "report_uri": f"{url}/report.md",
    })
    yield dg.AssetCheckResult(check_name="no_candidate_refused", passed=bool(gate["passed"]),
                              metadata={"reasons": dg.MetadataValue.json(gate["reasons"])})


def _train(context, storage, cluster, cat, cfg, url, served, sessions, hours, given, replay):
    """SFT of the served checkpoint on the good sessions, then GRPO on all the window's
    sessions: ``((candidate url, digest), lineage, {"sft", "rl", "seconds"})``."""
    import time

    seconds = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="composer-cycle-") as tmp:
        traj = session_set(sessions, tmp, seed=0)
        given["cycle_trajectories"] = (f"{url}/trajectories", storage.publish_dir(tmp, f"{url}/trajectories"))
    cat.insert_records("sft_trajectories", [
        {k: v for k, v in r.items() if k != "messages"} | {"run_id": context.run.run_id, "uri": f"{url}/trajectories"}
        for r in traj.pop("rows")])
    rl = cfg.rl.steps > 0
    sft_key = "cycle_sft" if rl else "cycle_checkpoints"
    _, job = run_stage(context, storage, cluster, "sft", SFTConfig, cfg.sft if replay else cfg.sft.replace(pretrain_share=0.0),
                       ["cycle_trajectories", "served_checkpoint", *replay],
                       lambda d, wd: {"trajectories_dir": d["cycle_trajectories"], "model_dir": d["served_checkpoint"],
                                      "pretrain_dir": d.get("token_shards", ""), "out_dir": os.path.join(wd, "run")},
                       "composer_dag.sft.run", outputs={sft_key: CHECKPOINT_FILES}, given=given)
    out = job["outputs"][sft_key]
    seconds["sft"] = round(time.perf_counter() - t0, 1)
    lineage = [("cycle_trajectories", f"{url}/trajectories"), ("served_checkpoint", served["checkpoint_uri"])]
    trained = {"sft": traj, "seconds": seconds}
    if rl:
        t0 = time.perf_counter()
        hour_uris = session_artifacts(cat, hours)
        given["cycle_sft"] = (out["url"], out["digest"])
        for k, u in enumerate(hour_uris):
            given[f"sessions_{k}"] = (u, storage.manifest_digest(u))
        tasks = ["rl_tasks"] if latest_metadata(context.instance, "rl_tasks") else []
        versions = [registry.model_version(e) for e in registry.history(storage)]
        _, job = run_stage(context, storage, cluster, "cycle-rl", SessionRLConfig, cfg.rl,
                           ["cycle_sft", *[f"sessions_{k}" for k in range(len(hour_uris))], *tasks],
                           lambda d, wd: {"model_dir": d["cycle_sft"], "out_dir": os.path.join(wd, "run"),
                                          "sessions_dirs": [d[f"sessions_{k}"] for k in range(len(hour_uris))],
                                          "tasks_dir": d.get("rl_tasks"), "current_version": registry.model_version(served),
                                          "versions": versions},
                           "composer_dag.traces.rl_job", launcher="python",
                           outputs={"cycle_checkpoints": [["", "hf"], ["result.json", "result.json"]]}, given=given)
        out = job["outputs"]["cycle_checkpoints"]
        trained["rl"] = {k: v for k, v in job["summary"].items() if k not in ("steps", "rewards")}
        seconds["rl"] = round(time.perf_counter() - t0, 1)
        lineage += [(f"sessions_{k}", u) for k, u in enumerate(hour_uris)]
    return (out["url"], out["digest"]), lineage, trained


def _promote(context, storage, cfg, served, gate, cand_url, cand_digest, ev, trained) -> dict:
    version = registry.new_version(cand_digest)
    entry = {"version": version, "checkpoint_uri": cand_url, "checkpoint_digest": cand_digest,
             "cycle": context.partition_key, "parent": registry.model_version(served),
             "sessions": (trained.get("sft") or {}).get("out", 0),
             "evaluation_uri": ev["outputs"]["cycle_evaluation"]["url"], "run_id": context.run.run_id,
             "pass@1": ev["summary"]["candidate"].get("pass@1")}
    line = registry.promote(storage, entry, version, reason=f"cycle {context.partition_key}",
                            weights_uri=cycle_engine.weights_url(storage, cfg), full_every=cfg.full_every,
                            dtype=cfg.weights_dtype)
    context.log.info(f"cycle {context.partition_key}: {version} promoted and published (weights version "
                     f"{line['weights_version']})")
    return line


cycle_job = dg.define_asset_job("cycle", selection=dg.AssetSelection.assets(cycle_checkpoints),
                                description="One cycle: fine-tune the served checkpoint on a window's sessions, gate, "
                                            "promote and publish.")


@dg.schedule(job=cycle_job, cron_schedule=CYCLE_CRON, default_status=dg.DefaultScheduleStatus.RUNNING,
             description="At the end of each cycle window, the cycle of that window (skipped while another runs).")
def cycle_schedule(context: dg.ScheduleEvaluationContext):
    keys = cycle_partitions.get_partition_keys(current_time=context.scheduled_execution_time)
    if not keys:
        return dg.SkipReason("no complete cycle window yet")
    running = context.instance.get_run_records(dg.RunsFilter(
        job_name=cycle_job.name, statuses=[dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.STARTING,
                                           dg.DagsterRunStatus.STARTED]), limit=1)
    if running:
        return dg.SkipReason(f"cycle run {running[0].dagster_run.run_id} is still running: one cycle at a time")
    return dg.RunRequest(partition_key=keys[-1], run_key=f"cycle:{keys[-1]}")
