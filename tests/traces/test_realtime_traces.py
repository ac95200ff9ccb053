"""Production sessions in: the session format, the production stand-in, the hourly
``production_traces`` partitions fed by their sensor, scrubbing, deduplication, consent,
deletion, and good sessions as an SFT source."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg
import torch
import pyarrow.parquet as pq
import pytest

from composer_dag.catalog import Catalog
from composer_dag.sft.trajectories import TrajectoryConfig, from_sessions, reference_calls
from composer_dag.storage import open_storage
from composer_dag.traces import format as fmt
from composer_dag.traces.intake import intake, user_hash
from composer_dag.traces.standin import serve_episodes, session_from_rollout, tokenizer_digest, write_hours

HOURS = ["2026-11-30-09:00", "2026-11-30-10:00", "2026-11-30-11:00"]
VERSION, DIGEST = "20261130T080000Z-abcdef12", "ab" * 32


@pytest.fixture(scope="module")
def rollouts(learnable_base):
    """Harness episodes: three tasks served by the policy (real sampled ids and logprobs), three
    by a model that writes the reference."""
    tasks = [p.parent for p in sorted(Path(learnable_base["tasks_dir"]).glob("*/task.json"))]
    return serve_episodes(learnable_base["policy_dir"], learnable_base["tokenizer_dir"], tasks[:6], 3, reference_calls)


@pytest.fixture(scope="module")
def sessions(rollouts, learnable_base):
    """The episodes as sessions (the simulated user accepts the reference's edits)."""
    return as_sessions(rollouts, learnable_base["tokenizer_dir"], VERSION, DIGEST)


def as_sessions(rollouts, tokenizer_dir, version, digest) -> list[dict]:
    """Harness episodes as the sessions their users had: two users, both consenting."""
    from composer_dag.laptop.image import task_persona

    tdig = tokenizer_digest(tokenizer_dir)
    out = []
    for k, r in enumerate(rollouts):
        task = json.loads((Path(r["task_dir"]) / "task.json").read_text())
        out.append(session_from_rollout(
            r, session_id=f"s{k}", user_id=f"user-{k % 2}", consent=True, ended_at=_dt("2026-11-30T09:30:00+00:00"),
            model_version=version, model_digest=digest, tokenizer_digest=tdig, persona=task_persona(task)))
    return out


@pytest.fixture(scope="module")
def promoted_base(graph, tmp_path_factory):
    """The model users are served when the cycles start: the whole-graph run's promoted model
    (the session's ``graph``), its registry entry and a local copy of its checkpoint (weights and
    tokenizer, verified against its manifest)."""
    from composer_dag.traces import registry

    entry = registry.current(graph["storage"])
    assert entry and entry.get("checkpoint_uri"), entry
    out = tmp_path_factory.mktemp("promoted") / "model"
    digest = graph["storage"].fetch_dir(entry["checkpoint_uri"], str(out))
    (out / "manifest.json").unlink()
    return {"version": registry.model_version(entry), "digest": digest, "dir": str(out)}


@pytest.fixture(scope="module")
def promoted_sessions(promoted_base, learnable_base):
    """Production, stood in for: the promoted model serves three tasks through the harness (its
    sampled ids and logprobs) and a model writing the reference three more; the simulated user
    accepts the edits whose tests pass."""
    tasks = [p.parent for p in sorted(Path(learnable_base["tasks_dir"]).glob("*/task.json"))]
    rollouts = serve_episodes(promoted_base["dir"], promoted_base["dir"], tasks[:6], 3, reference_calls)
    return as_sessions(rollouts, promoted_base["dir"], promoted_base["version"], promoted_base["digest"])


@pytest.fixture(scope="module")
def promoted_servers(promoted_base, tmp_path_factory):
    """A pair of vLLM rollout servers on the promoted model: the serving side of the cycles."""
    from tests.conftest import Servers

    s = Servers(promoted_base["dir"], tmp_path_factory.mktemp("promoted-servers"))
    try:
        yield s.start()
    finally:
        s.stop()


def _dt(s):
    import datetime

    return datetime.datetime.fromisoformat(s)


def test_realtime_session_format_round_trips_and_validates(sessions):
    # the schema is a valid 2020-12 schema (jsonschema's own meta-schema check) and every session
    # the stand-in wrote from a harness rollout satisfies it
    import jsonschema

    jsonschema.Draft202012Validator.check_schema(fmt.schema())
    for s in sessions:
        assert fmt.schema_errors(s) == [], fmt.schema_errors(s)
        back = fmt.from_openai(s["messages"])
        assert fmt.to_openai(back) == s["messages"]
        calls = [c for m in s["messages"] for c in m.get("tool_calls") or []]
        answered = [m["tool_call_id"] for m in s["messages"] if m["role"] == "tool" and "tool_call_id" in m]
        assert set(answered) <= {c["id"] for c in calls}
    served = sessions[:3]
    assert all(g["token_ids"] and len(g["logprobs"]) == len(g["token_ids"]) for s in served for g in s["generations"])
    good = sessions[3:]
    assert all(s["outcome"]["rating"] == 1 and all(e["accepted"] for e in s["outcome"]["edits"]) for s in good)
    # what the schema refuses
    bad = dict(sessions[0], consent={"training": "yes"})
    assert any(e.startswith("consent/training") for e in fmt.schema_errors(bad))
    bad = dict(sessions[0], generations=[{"message_index": 0, "token_ids": [1]}])
    assert any("not an assistant message" in e for e in fmt.schema_errors(bad))


def test_realtime_intake_scrubs_dedups_and_decontaminates(sessions, humaneval_tasks):
    home = sessions[3]["client"]["home"]
    leaky = json.loads(json.dumps(sessions[3]))
    leaky["session_id"] = "leaky"
    leaky["messages"][1]["content"] += (f"\nmy box: {sessions[3]['client']['user']}@{sessions[3]['client']['host']}:{home}/x, "
                                        "db at 10.20.30.40, key AKIAABCDEFGHIJKLMNOP")
    he_dir = Path(humaneval_tasks[0]) / "eval_tasks"
    he = json.loads(next(he_dir.glob("*/task.json")).read_text())
    prompt = next(he_dir.glob("*/repo/*.py")).read_text()
    contaminated = json.loads(json.dumps(sessions[4])) | {"session_id": "contaminated"}
    contaminated["messages"][1]["content"] = prompt
    again = dict(sessions[5], session_id="same-conversation-new-id")
    deleted = dict(sessions[0], session_id="deleted", user_id="gone")
    lines = [json.dumps(x).encode() for x in (leaky, contaminated, again, deleted, sessions[5])]
    rows, summary = intake([("f.jsonl", b"\n".join(lines) + b"\n")], HOURS[0], known_models={VERSION: DIGEST},
                           deleted_users={user_hash("gone")}, eval_tasks_dir=he_dir)
    assert he["source"] == "humaneval"
    assert summary["records_in"] == 5 and summary["kept"] + sum(summary["dropped"].values()) == 5
    assert summary["dropped"] == {"deleted_user": 1, "duplicate_session": 1, "contaminated": 1}, summary
    kept = {r["session_id"]: json.loads(r["record"]) for r in rows}
    text = json.dumps(kept["leaky"])
    for gone in (sessions[3]["client"]["user"], sessions[3]["client"]["host"], "10.20.30.40", "AKIAABCDEFGHIJKLMNOP"):
        assert gone not in text
    assert "client" not in kept["leaky"] and "<USER>@<HOST>" in text and "<IP>" in text and "<API_KEY>" in text
    assert {"home_path", "user_name", "host_name", "ip_address", "aws_access_key"} <= set(summary["redactions"])
    # the scrubbed user message was not generated: its assistant token ids stay
    assert kept["leaky"]["generations"] == sessions[3]["generations"]


def test_realtime_traces_sensor_partitions_deletion_and_sft(sessions, tmp_path, monkeypatch):
    from composer_dag.definitions import build_defs
    from tests.graph.test_graph_data import resources_for

    (tmp_path / "sources.yaml").write_text("sources: []\n")
    res = resources_for(str(tmp_path / "artifacts"), tmp_path, tmp_path / "sources.yaml")
    storage = open_storage(str(tmp_path / "artifacts"))
    storage.write_json(storage.url("registry", "history", "r1.json"), {"version": VERSION, "checkpoint_digest": DIGEST})
    incoming = storage.url("traces", "incoming")
    wrote = write_hours(storage, incoming, HOURS, sessions, bad=True)
    defs = build_defs(res)
    sensor = defs.resolve_sensor_def("production_traces_sensor")
    job = defs.resolve_job_def("take_in_traces")
    cat = Catalog(str(tmp_path / "catalog.duckdb"), storage)

    with dg.instance_for_test() as instance:
        def tick(cursor):
            with dg.build_sensor_context(instance=instance, cursor=cursor, resources={"artifacts": res["artifacts"]},
                                         repository_def=defs.get_repository_def()) as ctx:
                data = sensor.evaluate_tick(ctx)
            return data.run_requests or [], data.cursor

        def run(req):
            result = job.execute_in_process(instance=instance, partition_key=req.partition_key, raise_on_error=False)
            assert result.success
            checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
            assert checks == {"sessions_accounted": True}
            return result.asset_materializations_for_node("production_traces")[0].metadata

        reqs, cursor = tick(None)
        assert sorted(r.partition_key for r in reqs) == HOURS
        metas = {r.partition_key: run(r) for r in reqs}
        records = sum(m["records_in"].value for m in metas.values())
        kept = sum(m["dagster/row_count"].value for m in metas.values())
        assert records == sum(wrote["written"].values())
        # every bad record the stand-in wrote is dropped under its own reason, nothing else is
        dropped = {}
        for m in metas.values():
            for line in m["dropped"].value.splitlines()[2:]:
                _, reason, n, _ = line.split("|")
                dropped[reason.strip()] = dropped.get(reason.strip(), 0) + int(n.replace(",", ""))
        # two tasks with the same word give the same conversation: the second is a duplicate
        distinct = len({json.dumps(s["messages"], sort_keys=True) for s in sessions})
        good = len({json.dumps(s["messages"], sort_keys=True) for s in sessions[3:]})
        assert dropped == wrote["bad"] | ({"duplicate_session": len(sessions) - distinct} if distinct < len(sessions) else {})
        assert kept == distinct
        assert cat.query("SELECT count(*), count(DISTINCT hour) FROM traces")[0] == (distinct, 3)
        assert cat.query("SELECT count(*) FROM traces WHERE good")[0][0] == good >= 1

        # nothing new: no request; a late file for the second hour: that hour again, once
        reqs, cursor = tick(cursor)
        assert reqs == []
        late = json.dumps(dict(sessions[1], session_id="late", user_id="user-late")).encode() + b"\n"
        storage.write_bytes(wrote["files"][HOURS[1]].replace("sessions-1", "late"), late)
        # a file copied into another hour is taken in once
        storage.write_bytes(f"{incoming}/2026-11-30T11/copy.jsonl", storage.read_bytes(wrote["files"][HOURS[0]]))
        reqs, cursor = tick(cursor)
        assert sorted(r.partition_key for r in reqs) == HOURS[1:]
        metas = {r.partition_key: run(r) for r in reqs}
        assert metas[HOURS[2]]["files_duplicate"].value == 1
        # the late session repeats a conversation already taken in: a duplicate, not a second row
        assert "duplicate_session" in metas[HOURS[1]]["dropped"].value
        assert cat.query("SELECT count(*) FROM traces")[0][0] == distinct
        assert tick(cursor)[0] == []
        # a backfill over the hours (a run per hour partition, as Dagster's backfill launches them)
        # rebuilds a cycle's inputs from the incoming files: the same sessions, hour by hour
        before = sorted(cat.query("SELECT session_id, hour, good FROM traces"))
        for h in HOURS:
            result = job.execute_in_process(instance=instance, partition_key=h, tags={"dagster/backfill": "rebuild"})
            assert result.success and result.dagster_run.tags["dagster/backfill"] == "rebuild"
        assert sorted(cat.query("SELECT session_id, hour, good FROM traces")) == before

    # good sessions become SFT trajectories (harness messages, at most the configured share)
    rows = [r for u in sorted({u for (u,) in cat.query("SELECT DISTINCT uri FROM traces")})
            for r in pq.read_table(storage.local_path(f"{u}/sessions.parquet")).to_pylist()]
    sft_rows, skipped, n = from_sessions(rows, others=3, cfg=TrajectoryConfig(session_share=0.25))
    assert n == len(rows) == distinct and len(sft_rows) == 1 and skipped["not_good"] == distinct - good
    assert skipped["over_session_share"] == good - 1
    assert len(from_sessions(rows, others=3, cfg=TrajectoryConfig(session_share=0.0))[0]) == 0
    msgs = json.loads(sft_rows[0]["messages"])
    assert msgs[0]["role"] == "user" and all("id" not in c for m in msgs for c in m.get("tool_calls") or [])

    # a deletion request: gone from the partitions, the catalog and the incoming files; intake
    # keeps dropping the user
    r = subprocess.run([sys.executable, "-m", "composer_dag.cli", "traces", "delete", "--user", "user-1",
                        "--storage", str(tmp_path / "artifacts"), "--catalog", str(tmp_path / "catalog.duckdb")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    mine = sum(r["user_hash"] == user_hash("user-1") for r in rows)
    assert mine >= 1 and out["sessions"] == mine and out["checkpoints"] == [] and out["incoming_files"] >= 1
    assert cat.query("SELECT count(*) FROM traces WHERE user_hash = ?", [user_hash("user-1")])[0][0] == 0
    left = [r for u in sorted({u for (u,) in cat.query("SELECT DISTINCT uri FROM traces")})
            for r in pq.read_table(storage.local_path(f"{u}/sessions.parquet")).to_pylist()]
    assert left and all(r["user_hash"] != user_hash("user-1") for r in left)
    for url in storage.find(incoming):
        assert b'"user-1"' not in storage.read_bytes(url)
    storage.verify_manifest(sorted({u for (u,) in cat.query("SELECT DISTINCT uri FROM traces")})[0])
    again = [("x.jsonl", json.dumps(dict(sessions[1], session_id="back")).encode() + b"\n")]
    _, summary = intake(again, HOURS[0], known_models={VERSION: DIGEST},
                        deleted_users={json.loads(line)["user_hash"] for line in
                                       storage.read_bytes(storage.url("traces", "deletions.jsonl")).splitlines()})
    assert summary["dropped"] == {"deleted_user": 1}


def test_realtime_traces_validate_cli(sessions, tmp_path):
    f = tmp_path / "s.jsonl"
    f.write_text(json.dumps(sessions[0]) + "\n{not json\n" + json.dumps({"format": "composer-session/1"}) + "\n")
    r = subprocess.run([sys.executable, "-m", "composer_dag.cli", "traces", "validate", str(f)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    out = json.loads(r.stdout)[str(f)]
    assert out["ok"] == 1 and out["malformed_json"] == 1 and out["schema_violation"] == 1
    assert any("session_id" in e for e in out["errors"])


# Quick settings: 4 SFT steps, an evaluation of 2 tasks x 1 sample. At that size pass@1 measures
# nothing (a parent that solved both against a candidate that solved neither has a standard error
# of 0), so the cycles here gate on perplexity and cheat flags; the refusal below is on perplexity.
QUICK_CYCLE = {"sft": {"max_steps": 4, "eval_every": 4, "save_every": 4, "log_every": 2, "micro_batch": 2,
                       "format_samples": 1, "seq_len": 384},
               "eval": {"samples_per_task": 1, "ks": [1], "max_tasks": 2, "every_task_of": [], "humaneval_ids": [],
                        "ppl_max_batches": 2, "agent": {"max_turns": 2, "max_new_tokens": 32},
                        "inference": {"engine": "hf"}, "gate": {"max_ppl_increase": 0.5, "noise_sigmas": None}}}


def _utc(*a):
    import datetime

    return datetime.datetime(*a, tzinfo=datetime.timezone.utc)


@pytest.fixture
def following(promoted_servers, promoted_base, tmp_path):
    """The serving side of a weights URI: ``composer_dag.rl.fleet.serve --attach`` beside each of
    the promoted model's rollout servers (the loop a server that serves users runs), and a fleet in the
    ``server`` sync mode that checks each version a server reports with the probe against the
    published weights. Stopped at the end of the test."""
    from composer_dag.rl.fleet.config import FleetConfig
    from composer_dag.rl.fleet.sync import Fleet

    from tests.conftest import start_followers, stop_processes

    made = []

    def start(weights_uri):
        procs = start_followers(promoted_servers.urls, weights_uri, tmp_path)
        st = open_storage(weights_uri)
        fleet = Fleet(promoted_servers.urls, st, st.root, promoted_base["dir"], str(tmp_path / "fleet"),
                      FleetConfig.load({"weight_sync": "server", "poll_seconds": 0.2, "version_timeout": 180}))
        made.append((procs, fleet.start()))
        return fleet

    yield start
    for procs, fleet in made:
        fleet.stop()
        stop_processes(procs)


def test_realtime_cycles_promote_publish_refuse_and_roll_back(promoted_base, promoted_sessions, learnable_base, following,
                                                               tmp_path):
    """Two scheduled cycles continuing from the whole-graph run's promoted model, each promoting a new version from its window's sessions and
    publishing its weights, which the session's rollout servers follow (reloaded and
    probe-checked); a planted bad candidate refused by the gate; a window without sessions
    skipped; one command serving an earlier version again; a deletion withdrawing versions."""

    import torch
    from safetensors.torch import load_file, save_file

    from composer_dag.definitions import build_defs
    from composer_dag.rl.learnable import build_learnable_tasks
    from composer_dag.rl.weights import reconstruct, version_manifest
    from composer_dag.traces import registry
    from composer_dag.train.data import pack_documents
    from resources.cluster import ClusterResource
    from tests.graph.test_graph_data import resources_for

    (tmp_path / "sources.yaml").write_text("sources: []\n")
    res = resources_for(str(tmp_path / "artifacts"), tmp_path, tmp_path / "sources.yaml")
    (tmp_path / "scratch").mkdir()
    res["cluster"] = ClusterResource(backend="local", scratch_dir=str(tmp_path / "scratch"), poll_seconds=0.5)
    storage = open_storage(str(tmp_path / "artifacts"))
    defs = build_defs(res)
    # each cycle depends on the previous one and on the hours of sessions since then
    parents = defs.resolve_asset_graph().get(dg.AssetKey("cycle_checkpoints")).parent_keys
    assert {dg.AssetKey("cycle_checkpoints"), dg.AssetKey("production_traces")} <= parents

    def publish(local, *parts):
        url = storage.url(*parts)
        return url, storage.publish_dir(str(local), url)

    # the served model (the whole-graph run's promoted one), the held-out tasks and replay shards
    served_url, served_digest = publish(promoted_base["dir"], "rl_checkpoint", "seed")
    assert served_digest == promoted_base["digest"]
    v0 = promoted_base["version"]
    registry.promote(storage, {"version": v0, "checkpoint_uri": served_url, "checkpoint_digest": served_digest}, v0)
    import json as _json

    docs = [(f"d{i}", p.read_text(), "python", "python") for i, p in enumerate(sorted(Path(_json.__file__).parent.glob("*.py")))]
    pack_documents(docs, promoted_base["dir"], str(tmp_path / "shards"), val_fraction=0.3, seed=0)
    with dg.instance_for_test() as instance:
        # held-out tasks of other words than the sessions' (their instructions share no long n-gram)
        build_learnable_tasks(tmp_path / "eval_tasks", 4, seed=1, words=("green", "yellow"), request_file=False)
        for key, local in (("eval_tasks", tmp_path / "eval_tasks"), ("token_shards", tmp_path / "shards"),
                           ("rl_tasks", learnable_base["tasks_dir"])):
            url, digest = publish(local, key, "seed")
            instance.report_runless_asset_event(dg.AssetMaterialization(key, metadata={"dagster/uri": url,
                                                                                      "manifest_digest": digest}))
        # sessions served by v0 in two windows, taken in hour by hour
        def renamed(s, w):  # the same work asked for again in the second window, in other words
            msgs = [dict(m) for m in s["messages"]]
            msgs[1]["content"] += f"\n(request {w})"
            return dict(s, messages=msgs, model={"version": v0, "digest": served_digest}, session_id=f"{s['session_id']}-{w}")

        hours = ["2026-11-30-06:00", "2026-11-30-11:00"]
        for w, h in enumerate(hours):
            write_hours(storage, storage.url("traces", "incoming"), [h], [renamed(s, w) for s in promoted_sessions],
                        bad=False)
        traces_job = defs.resolve_job_def("take_in_traces")
        for h in hours:
            assert traces_job.execute_in_process(instance=instance, partition_key=h).success
        schedule = defs.resolve_schedule_def("cycle_schedule")
        job = defs.resolve_job_def("cycle")
        run_config = {"ops": {"cycle_checkpoints": {"config": QUICK_CYCLE}}}

        def cycle(at, config=run_config):
            with dg.build_schedule_context(instance=instance, scheduled_execution_time=at,
                                           repository_def=defs.get_repository_def()) as ctx:
                data = schedule.evaluate_tick(ctx)
            assert data.run_requests, data.skip_message
            (req,) = data.run_requests
            result = job.execute_in_process(instance=instance, partition_key=req.partition_key, run_config=config)
            assert result.success
            mats = result.asset_materializations_for_node("cycle_checkpoints")
            checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
            return req.partition_key, ({k: v.value for k, v in mats[0].metadata.items()} if mats else None), checks, result

        weights = storage.url("serving", "weights")
        key1, m1, checks1, _ = cycle(_utc(2026, 11, 30, 10))
        assert key1 == "2026-11-30-05:00" and checks1 == {"no_candidate_refused": True} and m1["promoted"], m1
        # the servers that serve users follow what the cycles publish: each server reloads every
        # weight version, and the probe scored on it matches the published weights
        fleet = following(weights)

        def servers_serve(version):
            fleet.wait_serving(version, servers=fleet.servers, timeout=180)

        servers_serve(0)
        v1 = m1["version"]
        assert m1["parent"] == v0 and m1["sessions"]["out"] >= 1 and m1["weights_version"] == 0
        # RL from every session of the window, off-policy, each graded again in its task's sandbox
        rl = m1["rl_from_sessions"]
        assert rl["in"] == rl["out"] + sum(rl["dropped"].values()) >= 4 and rl["by_reward_kind"].get("regraded")
        assert rl["updated"] and rl["with_advantage"] >= 2, rl  # the policy's failures and the reference's passes
        assert set(m1["stage_seconds"]) == {"sft", "rl"}
        # the second without the RL stage (its SFT output is the candidate)
        no_rl = {"ops": {"cycle_checkpoints": {"config": {**QUICK_CYCLE, "rl": {"steps": 0}}}}}
        key2, m2, checks2, _ = cycle(_utc(2026, 11, 30, 15), no_rl)
        assert key2 == "2026-11-30-10:00" and checks2 == {"no_candidate_refused": True} and m2["parent"] == v1, m2
        v2 = m2["version"]
        servers_serve(1)
        assert set(m2["stage_seconds"]) == {"sft"} and m2["rl_from_sessions"] == {}
        # the servers' view: each promoted version's weights, rebuilt from storage bit for bit, the
        # second a delta on the first
        for version, meta in ((0, m1), (1, m2)):
            want = load_file(storage.local_path(f"{meta['dagster/uri']}/model.safetensors"))
            got = reconstruct(open_storage(weights), open_storage(weights).root, version)
            assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
        assert version_manifest(open_storage(weights), open_storage(weights).root, 1)["kind"] == "delta"
        assert [e["version"] for e in registry.served_log(storage)] == [v0, v1, v2]
        assert set(registry.known_models(storage)) == {v0, v1, v2}

        # a planted bad candidate (the served model's weights scrambled) is refused: v2 keeps serving
        bad = tmp_path / "bad"
        shutil.copytree(storage.local_path(m2["dagster/uri"]), bad, ignore=shutil.ignore_patterns("manifest.json"))
        state = load_file(str(bad / "model.safetensors"))
        gen = torch.Generator().manual_seed(0)
        save_file({k: torch.randn(v.shape, generator=gen) * 2 if v.is_floating_point() else v for k, v in state.items()},
                  str(bad / "model.safetensors"), metadata={"format": "pt"})
        bad_url, _ = publish(bad, "planted", "bad")
        refused = {"ops": {"cycle_checkpoints": {"config": {**QUICK_CYCLE, "candidate_uri": bad_url}}}}
        key3, m3, checks3, _ = cycle(_utc(2026, 11, 30, 20), refused)
        assert checks3 == {"no_candidate_refused": False} and not m3["promoted"] and m3["served"] == v2, m3
        assert "perplexity" in m3["gate"] and registry.current(storage)["version"] == v2
        assert registry.served_log(storage)[-1]["version"] == v2

        # one cycle at a time: while a cycle run is in progress the schedule requests none
        from dagster._core.storage.dagster_run import DagsterRun, DagsterRunStatus

        busy = instance.add_run(DagsterRun(job_name="cycle", run_id="0" * 8 + "-busy", status=DagsterRunStatus.STARTED))
        with dg.build_schedule_context(instance=instance, scheduled_execution_time=_utc(2026, 12, 1, 1),
                                       repository_def=defs.get_repository_def()) as ctx:
            data = schedule.evaluate_tick(ctx)
        assert not data.run_requests and "one cycle at a time" in data.skip_message
        instance.delete_run(busy.run_id)

        # a window without sessions skips and says why
        key4, m4, checks4, result = cycle(_utc(2026, 12, 1, 1))
        assert m4 is None and checks4 == {"no_candidate_refused": True}
        obs = [e for e in result.all_events if e.event_type == dg.DagsterEventType.ASSET_OBSERVATION]
        assert "0 good sessions" in obs[0].event_specific_data.asset_observation.metadata["skipped"].value

    # one command serves an earlier version again; the registry records since when
    r = subprocess.run([sys.executable, "-m", "composer_dag.cli", "serve", v1, "--storage", str(tmp_path / "artifacts"),
                        "--weights-uri", weights], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert registry.current(storage)["version"] == v1
    last = registry.served_log(storage)[-1]
    assert last["version"] == v1 and last["reason"] == "rollback" and last["weights_version"] == 2
    servers_serve(2)
    want = load_file(storage.local_path(f"{m1['dagster/uri']}/model.safetensors"))
    got = reconstruct(open_storage(weights), open_storage(weights).root, 2)
    assert all(torch.equal(got[k], want[k]) for k in want)
    r = subprocess.run([sys.executable, "-m", "composer_dag.cli", "serve", "v-never", "--storage", str(tmp_path / "artifacts")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "never promoted" in r.stderr and "Traceback" not in r.stderr

    # a user whose sessions the first cycle trained on asks for deletion: both cycles' versions are
    # withdrawn (the second was trained from the first), the clean v0 serves again with its weights
    # published as the next version, and a withdrawn version is never served again
    cat = Catalog(str(tmp_path / "catalog.duckdb"), storage)
    trained = {t for (t,) in cat.query("SELECT task_id FROM sft_trajectories WHERE origin = 'session'")}
    hashes = {h for (h,) in cat.query(f"SELECT DISTINCT user_hash FROM traces WHERE session_id IN "
                                      f"({','.join('?' * len(trained))})", sorted(trained))}
    user = next(u for u in ("user-0", "user-1") if user_hash(u) in hashes)
    delete = [sys.executable, "-m", "composer_dag.cli", "traces", "delete", "--user", user, "--storage",
              str(tmp_path / "artifacts"), "--catalog", str(tmp_path / "catalog.duckdb"), "--weights-uri", weights]
    r = subprocess.run(delete, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert {m1["dagster/uri"], m2["dagster/uri"]} <= {c["uri"] for c in out["checkpoints"]}, out["checkpoints"]
    assert sorted(out["withdrawn"]) == sorted([v1, v2]) and out["served"]["version"] == v0, out
    assert out["served"]["reason"].startswith("withdrawn: trained on sessions of deleted user ")
    assert out["served"]["weights_version"] == 3 and registry.current(storage)["version"] == v0
    want = load_file(storage.local_path(f"{served_url}/model.safetensors"))
    got = reconstruct(open_storage(weights), open_storage(weights).root, 3)
    assert all(torch.equal(got[k], want[k]) for k in want)
    servers_serve(3)
    for srv in fleet.servers:  # every version served in turn, each probe-checked
        assert srv.versions_served == [0, 1, 2, 3] and srv.alive, fleet.summary()
        assert all(x["probe_diff"] <= fleet.cfg.probe_tolerance for x in srv.reloads), srv.reloads
    r = subprocess.run([sys.executable, "-m", "composer_dag.cli", "serve", v2, "--storage", str(tmp_path / "artifacts")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "was withdrawn" in r.stderr and "Traceback" not in r.stderr
    again = json.loads(subprocess.run(delete, capture_output=True, text=True, timeout=120).stdout.strip().splitlines()[-1])
    assert again["withdrawn"] == [] and again["served"] is None and again["sessions"] == 0
    assert registry.served_log(storage)[-1]["version"] == v0
    left = [p.name for p in (tmp_path / "scratch").iterdir() if p.is_dir() and p.name != "composer-cache"]
    assert not left, f"a cycle job's scratch directory was left behind: {left}"


def test_realtime_sessions_as_off_policy_rollouts(rollouts, sessions, learnable_base, tmp_path):
    """A session's rebuilt token stream is the one the policy generated; the trainer's ratio
    against the logged logprobs is 1 for the policy that served it; stale sessions are dropped
    and counted; a session with its starting task is graded again (cheat flags included), one
    without falls back on its recorded outcome."""

    from transformers import AutoTokenizer

    from composer_dag.rl import grpo
    from composer_dag.traces.offpolicy import session_rollouts, token_stream

    tok = AutoTokenizer.from_pretrained(learnable_base["tokenizer_dir"])
    for r, s in zip(rollouts, sessions):
        prompt, ids, mask, lps = token_stream(s, tok)
        assert (prompt, ids, mask) == (r["prompt_ids"], r["completion_ids"], r["loss_mask"]), s["session_id"]
    tdig = sessions[0]["tokenizer_digest"]
    versions = ["v-old", "v-mid", VERSION]
    stale = dict(sessions[0], session_id="stale", model={"version": "v-old", "digest": "x"})
    unknown = dict(sessions[0], session_id="unknown", model={"version": "v-gone", "digest": "x"})
    scrubbed = dict(sessions[0], session_id="scrubbed", generations=[])
    # a session whose start is a task here: graded again; a copy claiming a pass it did not earn
    # (the recorded outcome says accepted) is judged by the grader, not by the claim
    tasks = tmp_path / "tasks"
    shutil.copytree(learnable_base["tasks_dir"], tasks)
    liar = json.loads(json.dumps(sessions[0]))
    liar.update(session_id="liar", outcome={"edits": [{"path": "answer.txt", "accepted": True}], "rating": 1})
    rows = [*sessions, stale, unknown, scrubbed, liar]
    out, summary = session_rollouts(rows, tok, current_version=VERSION, versions=versions, max_staleness=1,
                                    tokenizer_digest=tdig, tasks_dir=tasks)
    assert summary["in"] == len(rows) == summary["out"] + sum(summary["dropped"].values())
    assert summary["dropped"] == {"stale": 2, "no_token_ids": 1}, summary
    assert summary["by_reward_kind"] == {"regraded": len(sessions) + 1}
    by_id = {r["session_id"]: r for r in out}
    assert by_id["liar"]["reward"] == by_id[sessions[0]["session_id"]]["reward"]
    assert [by_id[s["session_id"]]["reward"] > 0 for s in sessions] == [
        r["tests_passed"] > 0 and r["tests_failed"] == 0 for r in rollouts]
    # without the tasks: the recorded outcome, and the kind says so
    out2, summary2 = session_rollouts(sessions, tok, current_version=VERSION, versions=versions, max_staleness=1)
    assert summary2["by_reward_kind"] == {"outcome": len(sessions)}
    assert [r["reward"] for r in out2] == [float(s["outcome"]["rating"] == 1) for s in sessions]

    # the trainer's packing and scoring of the logged tokens under the serving policy: the
    # importance ratio of the GRPO loss is 1 (the cycle's RL job runs the trainer itself)
    from transformers import AutoModelForCausalLM

    policy = out[:3]
    for r in policy:
        r["advantage"] = 1.0
    model = AutoModelForCausalLM.from_pretrained(learnable_base["policy_dir"], dtype=torch.float32).eval()
    b = grpo.pack(policy, tok.pad_token_id)
    with torch.no_grad():
        logp = grpo.token_logprobs(model, b["input_ids"], b["attention_mask"], 1.0, b["loss_mask"])
    m = b["loss_mask"].bool()
    assert m.sum() > 0 and (logp[m] - b["old_logprobs"][m]).abs().max() < 1e-3
    _, stats = grpo.grpo_loss(logp, b["old_logprobs"], b["advantages"], b["loss_mask"].float())
    assert abs(stats["ratio_sum"] / stats["tokens"] - 1.0) < 1e-3 and stats["clip_frac"] == 0


def _session(tok, sid: str, task: Path, files: dict, start: dict) -> dict:
    """A production session whose edits write ``files`` in ``task``'s repository and submit,
    recorded as accepted and rated 1, with the policy's token ids and logprobs."""
    from composer_dag.harness.composer import COMPOSER
    from tests.cheats import task_info

    calls = [{"name": "edit_file", "arguments": {"path": rel, "old": (task / "repo" / rel).read_text(), "new": text}}
             for rel, text in files.items()] + [{"name": "submit", "arguments": {}}]
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": f"Fix {task_info(task)['sol']}."}]
    gens = []
    for c in calls:
        ids = tok(COMPOSER.render_call(c["name"], c["arguments"]) + "<|im_end|>", add_special_tokens=False).input_ids
        gens.append({"message_index": len(messages), "token_ids": ids, "logprobs": [-0.5] * len(ids)})
        messages += [{"role": "assistant", "content": "", "tool_calls": [c]}, {"role": "tool", "content": "Done."}]
    record = {"format": fmt.FORMAT, "session_id": sid, "user_id": "u", "consent": {"training": True},
              "started_at": "2026-11-30T09:00:00+00:00", "ended_at": "2026-11-30T09:05:00+00:00",
              "model": {"version": VERSION, "digest": DIGEST}, "tokenizer_digest": "t",
              "messages": fmt.to_openai(messages), "generations": gens,
              "outcome": {"edits": [{"path": rel, "accepted": True} for rel in files], "rating": 1}, "start": start}
    assert fmt.schema_errors(record) == []
    return record


def test_realtime_sessions_are_graded_again_not_believed(humaneval_tasks, mined_tasks, learnable_base, tmp_path):
    """Production sessions, every one recorded as accepted and rated 1, replayed in their starting
    task's sandbox and graded as any other episode: cheats of both red-team rounds (forged results,
    the keyring race, a kill at import) get 0 and a flag, on a HumanEval task named by its snapshot
    and on a task mined from parse found by its repository and commit (a URL and an abbreviated
    commit); the honest fix from that commit gets 1 unflagged; a commit that is no task here falls
    back on the recorded outcome and is counted."""
    from transformers import AutoTokenizer

    from composer_dag.traces.offpolicy import session_rollouts
    from tests.cheats import CHEATS, ROUND_TWO, task_info

    cheats = {c.name: c for c in CHEATS + ROUND_TWO}
    tasks = tmp_path / "tasks"
    shutil.copytree(Path(humaneval_tasks[0]) / "rl_tasks", tasks)
    mined_out, mined = mined_tasks
    shutil.copytree(mined_out / mined["tasks"][0], tasks / mined["tasks"][0], symlinks=True)
    he, rt = tasks / "humaneval-000", tasks / mined["tasks"][0]
    head = subprocess.run(["git", "-c", "safe.directory=*", "rev-parse", "HEAD"], cwd=rt / "repo", capture_output=True,
                          text=True, check=True).stdout.strip()
    tok = AutoTokenizer.from_pretrained(learnable_base["tokenizer_dir"])
    sol = task_info(rt)["sol"]
    fix = {sol: (rt / "reference" / "files" / sol).read_text()}
    records = [_session(tok, f"he-{n}", he, cheats[n].files(he), {"snapshot": he.name})
               for n in ("results_forge", "keyring_first_run_forges", "sigkill_at_import")]
    records += [
        _session(tok, "repo-fix", rt, fix, {"repository": "https://github.com/r1chardj0n3s/parse.git",
                                            "commit": head[:10]}),
        _session(tok, "repo-keyring", rt, cheats["keyring_first_run_forges"].files(rt),
                 {"repository": "parse", "commit": head}),
        _session(tok, "repo-elsewhere", rt, fix, {"repository": "parse", "commit": "0123456789abcdef0123"})]
    out, summary = session_rollouts(records, tok, current_version=VERSION, versions=[VERSION], max_staleness=0,
                                    tasks_dir=tasks)
    assert summary["by_reward_kind"] == {"regraded": 5, "outcome": 1} and summary["start_unmatched"] == 1, summary
    got = {r["session_id"]: r for r in out}
    for sid in ("he-results_forge", "he-keyring_first_run_forges", "he-sigkill_at_import", "repo-keyring"):
        assert got[sid]["reward"] == 0.0 and got[sid]["flags"], (sid, got[sid]["flags"])
    assert any(f.startswith("unsealed_run") for f in got["he-sigkill_at_import"]["flags"])
    fixed = got["repo-fix"]
    assert (fixed["reward"], fixed["flags"], fixed["task_id"]) == (1.0, [], rt.name) and fixed["tests_passed"] > 0
    assert (got["repo-elsewhere"]["reward"], got["repo-elsewhere"]["reward_kind"]) == (1.0, "outcome")


def test_realtime_withdrawing_every_version_leaves_nothing_served(tmp_path):
    """Withdrawal without a clean version to fall back on: nothing serves (no promoted.json, a
    served-log line with version null), a withdrawn version cannot be served again, and a
    second withdrawal of the same checkpoints changes nothing."""
    from composer_dag.traces import registry

    st = open_storage(str(tmp_path / "artifacts"))
    for name, uri in (("v-a", "file:///ckpt/a"), ("v-b", "file:///ckpt/b")):
        registry.promote(st, {"version": name, "checkpoint_uri": uri, "checkpoint_digest": name}, name)
    out = registry.withdraw(st, {"file:///ckpt/b"}, "test")
    assert out["withdrawn"] == ["v-b"] and out["served"]["version"] == "v-a" and registry.current(st)["version"] == "v-a"
    out = registry.withdraw(st, {"file:///ckpt/a", "file:///ckpt/b"}, "test")
    assert out["withdrawn"] == ["v-a"] and out["served"]["version"] is None
    assert registry.current(st) is None and registry.served_log(st)[-1]["reason"] == "withdrawn: test; no clean version"
    with pytest.raises(ValueError, match="'v-b' was withdrawn \\(test\\)"):
        registry.serve(st, "v-b")
    assert registry.withdraw(st, {"file:///ckpt/a", "file:///ckpt/b"}, "test") == {"withdrawn": [], "served": None}
    assert set(registry.withdrawn(st)) == {"v-a", "v-b"}
