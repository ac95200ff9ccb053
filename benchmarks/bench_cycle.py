"""Production sessions to a served checkpoint: intake per hour, one cycle by stage, the lag.

    .venv/bin/python benchmarks/bench_cycle.py [--out DIR] [--hours 3] [--sessions 12]

A tiny policy (the learnable family's setup, untrained) serves episodes through the harness on
learnable tasks, half answered by it, half by a model that writes the reference; the stand-in
writes them as session files over ``--hours`` hours with one of each bad record. Each hour is
taken in through the ``take_in_traces`` job, then one cycle runs through the ``cycle`` job
(local cluster backend: each stage a process) as its schedule would request it when the window
closes. Prints Markdown tables: records per partition with the drops by reason, the cycle's
seconds per stage, and the lag from the last session file's arrival to the served log's line
for the version trained on it (intake and cycle run back to back; in production the schedule
adds the wait for the window to close, up to the 5-hour cadence).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import tempfile
import time
from pathlib import Path

import dagster as dg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--hours", type=int, default=3)
    ap.add_argument("--sessions", type=int, default=12)
    args = ap.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix="bench-cycle-"))

    from composer_dag.definitions import build_defs
    from composer_dag.laptop.image import task_persona
    from composer_dag.rl.learnable import build_learnable_tasks, make_learnable_setup
    from composer_dag.sft.trajectories import reference_calls
    from composer_dag.storage import open_storage
    from composer_dag.traces import registry
    from composer_dag.traces.standin import serve_episodes, session_from_rollout, tokenizer_digest, write_hours
    from composer_dag.train.data import pack_documents
    from resources import ArtifactStorage, CatalogResource, SourceRegistry
    from resources.cluster import ClusterResource

    t0 = time.perf_counter()
    setup = make_learnable_setup(root / "setup", n_tasks=args.sessions, seed=0, words=("red", "blue"), warmup_steps=0)
    tasks = [p.parent for p in sorted(Path(setup["tasks_dir"]).glob("*/task.json"))]
    rollouts = serve_episodes(setup["policy_dir"], setup["tokenizer_dir"], tasks, len(tasks) // 2, reference_calls)
    print(f"setup and {len(rollouts)} episodes: {time.perf_counter() - t0:.1f} s")

    storage = open_storage(str(root / "artifacts"))
    url = storage.url("rl_checkpoint", "seed")
    digest = storage.publish_dir(setup["policy_dir"], url)
    v0 = registry.new_version(digest)
    registry.promote(storage, {"version": v0, "checkpoint_uri": url, "checkpoint_digest": digest}, v0)
    tdig = tokenizer_digest(setup["tokenizer_dir"])
    sessions = [session_from_rollout(r, session_id=f"s{k}", user_id=f"user-{k % 3}", consent=True,
                                     ended_at=dt.datetime(2026, 11, 30, 6, tzinfo=dt.timezone.utc),
                                     model_version=v0, model_digest=digest, tokenizer_digest=tdig,
                                     persona=task_persona(json.loads((Path(r["task_dir"]) / "task.json").read_text())))
                for k, r in enumerate(rollouts)]
    hours = [f"2026-11-30-{6 + h:02d}:00" for h in range(args.hours)]
    build_learnable_tasks(root / "eval_tasks", 4, seed=1, words=("green", "yellow"), request_file=False)
    docs = [(f"d{i}", p.read_text(), "python", "python") for i, p in enumerate(sorted(Path(json.__file__).parent.glob("*.py")))]
    pack_documents(docs, setup["tokenizer_dir"], str(root / "shards"), val_fraction=0.3, seed=0)

    (root / "sources.yaml").write_text("sources: []\n")
    art = ArtifactStorage(root=str(root / "artifacts"))
    (root / "scratch").mkdir(exist_ok=True)
    defs = build_defs({"artifacts": art, "catalog": CatalogResource(storage=art, path=str(root / "catalog.duckdb")),
                       "sources": SourceRegistry(storage=art, sources_file=str(root / "sources.yaml")),
                       "cluster": ClusterResource(backend="local", scratch_dir=str(root / "scratch"), poll_seconds=0.5)})
    quick = {"sft": {"max_steps": 8, "eval_every": 8, "save_every": 8, "micro_batch": 2, "format_samples": 1, "seq_len": 384},
             "eval": {"samples_per_task": 1, "ks": [1], "max_tasks": 4, "every_task_of": [], "humaneval_ids": [],
                      "ppl_max_batches": 2, "agent": {"max_turns": 2, "max_new_tokens": 32},
                      "inference": {"engine": "hf"}, "gate": {"max_ppl_increase": 0.5}}}
    with dg.instance_for_test() as instance:
        for key, local in (("eval_tasks", root / "eval_tasks"), ("token_shards", root / "shards"),
                           ("rl_tasks", Path(setup["tasks_dir"]))):
            u = storage.url(key, "seed")
            instance.report_runless_asset_event(dg.AssetMaterialization(
                key, metadata={"dagster/uri": u, "manifest_digest": storage.publish_dir(str(local), u)}))
        wrote = write_hours(storage, storage.url("traces", "incoming"), hours, sessions, bad=True)
        arrived = time.time()
        rows = []
        for h in hours:
            t = time.perf_counter()
            res = defs.resolve_job_def("take_in_traces").execute_in_process(instance=instance, partition_key=h)
            m = {k: v.value for k, v in res.asset_materializations_for_node("production_traces")[0].metadata.items()}
            rows.append((h, m["records_in"], m["dagster/row_count"], m["good_sessions"], m["dropped"],
                         time.perf_counter() - t))
        t = time.perf_counter()
        key = "2026-11-30-05:00"
        res = defs.resolve_job_def("cycle").execute_in_process(
            instance=instance, partition_key=key, run_config={"ops": {"cycle_checkpoints": {"config": quick}}})
        total = time.perf_counter() - t
        m = {k: v.value for k, v in res.asset_materializations_for_node("cycle_checkpoints")[0].metadata.items()}
    served = registry.served_log(storage)[-1]
    lag = dt.datetime.fromisoformat(served["since"]).timestamp() - arrived

    print(f"\nsessions written: {sum(wrote['written'].values())} records over {len(hours)} hours, bad {wrote['bad']}\n")
    print("| hour | records | kept | good | dropped by reason | intake s |\n|---|---:|---:|---:|---|---:|")
    for h, n, kept, good, dropped, s in rows:
        reasons = ", ".join(f"{line.split('|')[1].strip()} {line.split('|')[2].strip()}"
                            for line in str(dropped).splitlines()[2:]) or "none"
        print(f"| {h} | {n} | {kept} | {good} | {reasons} | {s:.2f} |")
    st = m["stage_seconds"]
    rest = total - sum(st.values())
    print("\n| cycle stage | seconds |\n|---|---:|")
    for name, s in (("SFT on the good sessions (job)", st.get("sft", 0.0)), ("RL from sessions (job)", st.get("rl", 0.0)),
                    ("evaluation of both, the gate, promotion and publishing", rest), ("the cycle", total)):
        print(f"| {name} | {s:.1f} |")
    print(f"\npromoted: {m['promoted']} ({m['version']}), weights version {m['weights_version']}; RL from sessions: "
          f"{json.dumps(m['rl_from_sessions'])}")
    print(f"lag from the last session file's arrival to the served version trained on it: {lag:.1f} s "
          f"(intake of {len(hours)} hours + the cycle, back to back)")


if __name__ == "__main__":
    main()
