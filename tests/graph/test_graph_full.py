"""The whole graph on a tiny configuration, through Dagster, with every asset check required to
pass (the design card's "asset checks in CI"), its GPU stages as Slurm jobs on a two-node cluster
isolated from this process's disk, every artifact on S3, the RL fleet across both nodes losing
the node that holds only a server; then the promotion gate failing on a worse RL checkpoint."""

import time

import dagster as dg
import pytest

from composer_dag.catalog import Catalog
from composer_dag.definitions import DOWNSTREAM_JOBS, build_defs, materialize_all
from composer_dag.storage import open_storage
from resources import ArtifactStorage, CatalogResource, SourceRegistry
from resources.model_settings import ModelSettings
from resources.cluster import ClusterResource
from tests.conftest import FAKE_KEY, FAKE_SECRET
from tests.leak_scan import scan_instance, scan_tree
from tests.graph.test_graph_data import check_outcomes, make_source

EVAL_CONFIG = {"inference": {"engine": "hf"}, "samples_per_task": 2}  # make run: 8 on vLLM
TINY_RUN_CONFIG = {
    # the soundness checks re-verify a seeded sample of 4 tasks per side (tests/tasks/test_tasks.py
    # checks every task of its sets)
    "build_tasks": {"ops": {"task_sets": {"config": {"humaneval_limit": 6, "bugfix_count": 2, "eval_fraction": 0.5,
                                                     "learnable_count": 24}},
                            "rl_tasks_rl_tasks_sound": {"config": {"sample": 4}},
                            "eval_tasks_eval_tasks_sound": {"config": {"sample": 4}}}},
    "train": {
        "ops": {
            "midtrained_checkpoint": {
                "config": {"max_steps": 16, "seq_len": 64, "micro_batch": 4, "warmup_steps": 2,
                           "eval_every": 8, "save_every": 8, "eval_batches": 4, "lr": 2e-3}
            },
            # the learnable family only: its transcripts are short, so the default 80 steps teach the
            # behaviour (at 60, with a quarter of each micro-batch replayed code, 1 of 16 sampled first
            # turns parsed on one machine; at 80, 13 of 16 on one machine and 7 of 16 on another: the
            # samples are drawn at temperature 1 and the float results differ by CPU, so the check
            # asks for 2 of 16, which a model that never learnt the format does not reach)
            "sft_trajectories": {"config": {"max_per_source": {"humaneval": 0, "stdlib-bugfix": 0}}},
            # at a constant rate: make run's decay to 2e-4 (the default) under-trains this tiny set (18
            # transcripts after a 16-step mid-training): 2 of 16 parsed and held-out pass@1 0 when tried
            # 120 steps, not 80: the tokenizer is trained per run on a corpus sample, and at 80 steps the
            # sampled first turns that parsed ranged from 0 to 10 of 16 across runs of one commit (two
            # of four runs today failed the check); a first turn may take up to 160 new tokens
            "sft_checkpoint": {"config": {"max_steps": 120, "min_lr": 2e-3, "eval_every": 60, "save_every": 60,
                                          "format_samples": 16, "min_format_share": 0.125,
                                          "format_max_new_tokens": 160}},
            # the distributed mode: two vLLM rollout servers started as Slurm service jobs, each
            # taking sft_checkpoint from S3 and following the weights the RL job publishes there;
            # a step's 16 episodes at once, so that each server batches its requests
            # RL on a mix: the learnable family and the tasks mined from a repository (parse),
            # drawn source by source with equal weights
            # one server on each node, addressed by the node's name. Four steps: about a fifth of the
            # SFT model's learnable episodes earn reward, and at two steps (16 learnable episodes) one
            # run in the suite had every reward 0, so no advantage; each later step takes about 4 s
            "rl_run": {"config": {"steps": 4, "tasks_per_step": 4, "group_size": 4,
                                  "task_sources": ["learnable", "repo-mined"],
                                  "source_weights": {"learnable": 1.0, "repo-mined": 1.0},
                                  "fleet": {"servers": 2, "max_sandboxes": 16, "nodes": ["node1", "node2"]}}},
            # transformers' generate for the tiny model: the RL stage above runs vLLM (and reloads
            # its weights); evaluation on vLLM is what `make run` does, at 25 s of engine start per job
            "evaluated_model": {"config": EVAL_CONFIG},
        }
    },
}


GPU_STAGES = {"midtrained_checkpoint": "midtrain", "sft_checkpoint": "sft", "rl_checkpoint": "rl", "rl_rollouts": "rl",
              "evaluated_model": "eval"}


@pytest.fixture(autouse=True)
def graph_env(graph, monkeypatch):
    """The environment the whole graph ran in (S3 endpoint, Slurm, the fake secrets), for this
    module's tests: the session's ``graph`` fixture sets it only while it materializes."""
    for k, v in graph["env"].items():
        monkeypatch.setenv(k, v)


def materialize_graph(tmp_path_factory, two_node_cluster, repo_sdists):
    """The session's ``graph`` fixture (``tests/conftest.py``; the production cycles continue from
    its promoted model): the whole graph materialized once on the tiny configuration (every job of ``make run``),
    with every artifact on S3 (the two-node cluster's moto server, on its bridge) and the GPU
    stages (mid-training, SFT, RL, evaluation) run as jobs on the two-node Slurm cluster, each
    under bubblewrap: a job sees its node's scratch directory, the Python environment and the
    code, never this process's COMPOSER_HOME, so everything it reads or writes goes through
    storage URLs. RL's two rollout servers run one on each node; while the one on the node
    without the RL job has a request in flight, that node loses power (``ServerNodeLoss``), and
    comes back after the run. The tests below read it; the last one adds an evaluation run."""
    import boto3

    from tests.slurm_cluster import ServerNodeLoss

    cluster = two_node_cluster
    s3_server = cluster.s3_endpoint
    tmp_path = tmp_path_factory.mktemp("graph")
    bucket = f"composer-graph-{time.time_ns()}"
    boto3.client("s3", endpoint_url=s3_server, aws_access_key_id=FAKE_KEY, aws_secret_access_key=FAKE_SECRET,
                 region_name="us-east-1").create_bucket(Bucket=bucket)
    root = f"s3://{bucket}/composer"
    # Known fake credentials in the environment of every step, subprocess, job and sandbox (they
    # are the S3 server's): the scans prove none reaches logs, metadata, artifacts or the catalog.
    secrets = {"AWS_ACCESS_KEY_ID": FAKE_KEY, "AWS_SECRET_ACCESS_KEY": FAKE_SECRET, "HF_TOKEN": "hf_fakeFAKEfake0123456789"}
    env = {"COMPOSER_HOME": str(tmp_path / "home"), "COMPOSER_S3_ENDPOINT_URL": s3_server,
           "SLURM_CONF": str(cluster.conf), **secrets}
    make_source(tmp_path / "src")
    sources = tmp_path / "sources.yaml"
    sources.write_text(
        f"sources:\n  - name: local\n    kind: local\n    uri: {tmp_path / 'src'}\n"
        "  - name: python\n    kind: python\n    max_total_mb: 2\n"
        # the repository made into an environment and mined: parse's sdist (the session's
        # download), four tasks
        f"environments:\n  - name: parse\n    src: {repo_sdists['parse']}\n    tasks: 4\n"
    )
    storage = ArtifactStorage(root=root, endpoint_url=s3_server, aws_access_key_id=FAKE_KEY,
                              aws_secret_access_key=FAKE_SECRET)
    resources = {
        "artifacts": storage,
        "catalog": CatalogResource(storage=storage, path=str(tmp_path / "catalog.duckdb")),
        "sources": SourceRegistry(storage=storage, sources_file=str(sources)),
        "model_settings": ModelSettings(config_name="tiny", vocab_size=8192, tokenizer_train_mb=2),
        # service and array-task logs copied to S3 as they end: the nodes share no disk with this process
        "cluster": ClusterResource(backend="slurm", nproc_per_node=1, isolate=True, scratch_dir=cluster.scratch,
                                   log_uri=f"{root}/logs",
                                   poll_seconds=0.5),
    }
    (tmp_path / "dagster_home").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster_home")) as instance:
        with pytest.MonkeyPatch.context() as mp:  # the environment of the materialization only
            for k, v in env.items():
                mp.setenv(k, v)
            defs = build_defs(resources)
            printed = []
            nodes_tmp = {n: cluster.node_dir(n) / "tmp" for n in cluster.names}
            scratch = lambda d: {p.name for p in (d / cluster.scratch.rsplit("/", 1)[1]).glob("*")
                                 if p.is_dir() and p.name != "composer-cache"}
            before = {n: scratch(d) for n, d in nodes_tmp.items()}  # what the session's earlier Slurm tests left
            with ServerNodeLoss(cluster) as loss:
                results = materialize_all(instance=instance, definitions=defs, run_config=TINY_RUN_CONFIG,
                                          log=lambda line: (print(line), printed.append(line)))
            print_step_times(instance, results)
            # what the run's jobs left in each node's scratch (a job's directory left behind), and
            # no secret in what the nodes wrote, before the lost node comes back with an empty /tmp
            try:
                left = {n: sorted(scratch(d) - before[n]) for n, d in nodes_tmp.items()}
                leaks = {n: scan_tree(d, list(secrets.values())) for n, d in nodes_tmp.items()}
            finally:
                if loss.victim:
                    cluster.restart_node(loss.victim[0])
            st = open_storage(root)
        yield {"instance": instance, "defs": defs, "results": results, "tmp": tmp_path, "secrets": secrets,
               "printed": printed, "env": env, "artifacts": storage,
               "root": root, "scratch_left": left, "node_leaks": leaks, "loss": loss, "cluster": cluster,
               "storage": st,
               "catalog": Catalog(str(tmp_path / "catalog.duckdb"), st)}


def print_step_times(instance, results) -> None:
    """Each step's wall time from Dagster's run records, for profiling the fixture (``-s``)."""
    for r in results:
        for st in instance.get_run_step_stats(r.run_id):
            if st.start_time and st.end_time:
                print(f"step time {r.job_def.name:>14} {st.step_key:<44} {st.end_time - st.start_time:7.1f} s")
    for line in failed_steps(results):
        print(line)


def failed_steps(results) -> list[str]:
    """Each failed step of the runs with its error's message and the last lines of its stack, so a
    failure's cause shows in the test's own report, not only in the run's events."""
    out = []
    for r in results:
        for ev in r.all_events:
            if ev.is_step_failure and ev.step_failure_data and ev.step_failure_data.error:
                err = ev.step_failure_data.error
                while err.cause is not None:  # the innermost cause is the one that names the problem
                    err = err.cause
                stack = "".join(err.stack[-4:]).rstrip()
                out.append(f"step failed {r.job_def.name} {ev.step_key}: {err.message.strip()}\n{stack}")
    return out


def _meta_partition(instance, key, partition):
    from assets.common import latest_metadata

    return dict(latest_metadata(instance, key, partition))


def _meta(instance, key):
    ev = instance.get_latest_materialization_event(dg.AssetKey(key))
    return {k: v.value for k, v in ev.asset_materialization.metadata.items()}


@pytest.mark.slow
@pytest.mark.timeout(2700)  # the graph's materialization (the fixture) counts here
def test_slurm_whole_graph_on_s3_with_isolated_jobs(graph):
    instance, results, tmp_path, secrets = graph["instance"], graph["results"], graph["tmp"], graph["secrets"]
    st, cat, root = graph["storage"], graph["catalog"], graph["root"]
    assert [r.success for r in results] == [True] * len(DOWNSTREAM_JOBS), "\n".join(failed_steps(results))
    checks = check_outcomes(results)
    assert checks and all(checks.values()), {k: v for k, v in checks.items() if not v}
    expected = {
        "repo_environments:bootstrapped", "code_corpus:files_accounted", "deduped_shards:no_contamination", "rl_tasks:rl_tasks_sound",
        "eval_tasks:eval_tasks_sound", "eval_tasks:split_disjoint", "midtrained_checkpoint:loss_finite_and_lower",
        "midtrained_checkpoint:val_ppl_below_base", "midtrained_checkpoint:loads_and_generates",
        "sft_trajectories:trajectories_accounted", "sft_checkpoint:loss_finite_and_lower",
        "sft_checkpoint:val_loss_lower", "sft_checkpoint:loads_and_generates", "sft_checkpoint:tool_call_format_parses",
        "rl_rollouts:every_rollout_has_reward", "rl_rollouts:staleness_within_bound",
        "rl_checkpoint:loss_has_no_nan", "rl_checkpoint:published_weights_verified",
        "evaluated_model:rl_not_worse_than_sft", "evaluated_model:eval_tasks_not_in_training_shards",
    }
    assert expected <= set(checks), expected - set(checks)

    def meta(key):
        return _meta(instance, key)

    ckpt = meta("midtrained_checkpoint")
    assert ckpt["val_ppl_after"] < ckpt["val_ppl_before"]
    assert ckpt["loss_curve"].startswith("![mid-training loss](data:image/png;base64,")
    manifest = st.verify_manifest(ckpt["dagster/uri"])
    assert {"config.json", "model.safetensors", "tokenizer.json", "trainer_state.json"} <= set(manifest["files"])
    assert meta("token_shards")["tokens_train"] > 0
    assert meta("deduped_shards")["decontamination_set"] == "HumanEval + eval_tasks"
    sides = dict(cat.query("SELECT side, count(*) FROM tasks GROUP BY 1"))
    assert sum(sides.values()) == 8 + 24 + 4
    # the mined source: parse bootstrapped and mined as its repo_environments partition, taken in
    # by task_sets, shown in the UI, and trained on
    env = _meta_partition(instance, "repo_environments", "parse")
    assert env["ok"] and env["tasks"] == 4 and env["tests_kept"] > 0 and env["licence"] == "MIT License", env
    assert env["test_command"] and "parse" in env["sample_mined_task"]
    assert st.verify_manifest(env["dagster/uri"]) and "env.json" in st.read_manifest(env["dagster/uri"])["files"]
    tasks_meta = meta("rl_tasks")
    assert "| parse | ok |" in tasks_meta["repositories"] and tasks_meta["repositories_refused_by_reason"] == {}
    assert "parse" in tasks_meta["sample_mined_task"] and tasks_meta["repositories_by_licence"] == {"MIT License": 1}
    mined = dict(cat.query("SELECT side, count(*) FROM tasks WHERE source = 'repo-mined' GROUP BY 1"))
    assert mined.get("rl_tasks") and sum(mined.values()) == 4, mined
    trained = cat.query("SELECT count(*) FROM rollouts r JOIN tasks t ON r.task_id = t.task_id "
                        "WHERE t.source = 'repo-mined' AND t.side = 'rl_tasks'")[0][0]
    assert trained > 0, "RL drew no mined task"
    rollouts = meta("rl_rollouts")
    assert rollouts["dagster/row_count"] == 4 * 4 * 4  # steps x tasks per step x group size
    assert cat.query("SELECT count(*) FROM rollouts WHERE reward IS NOT NULL")[0][0] == rollouts["dagster/row_count"]
    # RL in the distributed mode: the rollout servers were the step's Slurm services, took the
    # model from S3, served every published version (digest and probe checked) and were stopped
    # RL across the two nodes: one server on each, each addressed by its node's name; the node
    # that held only a server lost power while that server had a request in flight. Its episodes
    # moved to the other server: every rollout is there once, those retried ran on the survivor,
    # none was masked as an infrastructure failure, and the lost server is reported down.
    loss = graph["loss"]
    assert loss.victim and not loss.error, loss.error
    lost_node, lost_service = loss.victim
    lost, kept = f"s{lost_service.split('-')[1]}", f"s{1 - int(lost_service.split('-')[1])}"
    logs = [e.user_message for r in results for e in instance.all_logs(r.run_id)]
    up = next(m for m in logs if "rl: 2 rollout servers up: " in m)
    assert [u.rsplit(":", 1)[0] for u in up.split("up: ", 1)[1].split(", ")] == ["http://node1", "http://node2"], up
    assert rollouts["rl_mode"] == "fleet" and rollouts["servers_serving_every_version"] == 1, rollouts
    assert rollouts["retried_episodes"] > 0 and rollouts["infra_masked_episodes"] == 0, rollouts
    assert rollouts["staleness_max"] <= 1
    assert cat.query("SELECT step, group_id, sample_index FROM rollouts GROUP BY ALL HAVING count(*) > 1") == []
    assert cat.query("SELECT count(*) FROM rollouts WHERE attempts > 1 AND server_id <> ?", [kept])[0][0] == 0
    row = next(l for l in rollouts["rollout_servers"].splitlines() if l.startswith(f"| {lost} |"))
    assert "| no | 1 |" in row, rollouts["rollout_servers"]  # down at the end, one death
    assert len(meta("rl_checkpoint")["published_weights"].splitlines()) == 2 + 5  # versions 0-4

    # The GPU stages ran as Slurm jobs that share no disk with this process: every output is on
    # S3 under the root, and what each job reported is what is there, file by file.
    for key in GPU_STAGES:
        m = meta(key)
        assert m["dagster/uri"].startswith(root + "/"), m["dagster/uri"]
        if key != "evaluated_model":  # its artifact adds the report to what the job published
            assert st.manifest_digest(m["dagster/uri"]) == m.get("job_manifest_digest", m["manifest_digest"])
        st.verify_manifest(m["dagster/uri"])
    submitted = [m for m in logs if "[cluster:slurm] submitted job" in m]
    assert len(submitted) == len(set(GPU_STAGES.values())), submitted  # one job per stage, none retried
    for name in ("rollout-0", "rollout-1"):  # each server one Slurm job, cancelled with its step
        started = [m for m in logs if f"[service:slurm] {name}: submitted job" in m]
        assert len(started) == 1 and any(f"[service:slurm] {name}: job {started[0].split()[-1]} cancelled" in m
                                         for m in logs), (name, started)
    # the dedup map ran as one array across the nodes; each element's log left its node for S3
    shipped = sorted(u.rsplit("/", 1)[1] for u in st.find(f"{root}/logs") if "/dedup-map-" in u)
    assert [n.rsplit("_", 1)[1] for n in shipped] == ["0.out", "1.out"], shipped
    for stage in set(GPU_STAGES.values()):  # resumable state on S3, not on this disk
        assert st.find(f"{root}/work/{stage}"), stage
    assert not (tmp_path / "home" / "work").exists()
    assert graph["scratch_left"] == {"node1": [], "node2": []}, "a job's scratch directory was left behind"
    assert graph["cluster"].node_state(lost_node) in ("idle", "mixed", "allocated")  # back in service

    # Each stage does its job. SFT teaches the learnable family's behaviour: pass@1 on held-out
    # words, never seen in training, rises above the mid-trained model's.
    ev = meta("evaluated_model")
    assert ev["sft_checkpoint.pass@1.learnable"] > ev["midtrained_checkpoint.pass@1.learnable"], ev
    held_out = cat.query("SELECT count(*) FROM tasks WHERE side = 'eval_tasks' AND source = 'learnable'")[0][0]
    evaluated = cat.query("SELECT count(DISTINCT task_id) FROM eval_results WHERE source = 'learnable'")[0][0]
    assert held_out > 0 and evaluated == held_out  # every held-out learnable task, not a first-N sample
    # RL moved the policy: at least one step had a nonzero advantage, and its perplexity differs
    assert cat.query("SELECT count(*) FROM rollouts WHERE advantage <> 0")[0][0] > 0
    ppl = dict(cat.query("SELECT checkpoint, val_ppl FROM eval_summaries"))
    assert ppl["rl_checkpoint"] != ppl["sft_checkpoint"], ppl
    # SFT (with its replay of the pre-training shards) and RL (with its KL term) keep what
    # mid-training taught: code perplexity at most 1.3 times the mid-trained checkpoint's
    assert max(ppl["sft_checkpoint"], ppl["rl_checkpoint"]) <= 1.3 * ppl["midtrained_checkpoint"], ppl
    # the end of the run is a short table, not the jobs' JSON: a row per checkpoint, the verdict
    end = "\n".join(graph["printed"][graph["printed"].index("all assets materialized") + 1:])
    assert [l.split()[0] for l in end.splitlines()[:5]] == ["checkpoint", "base", "mid-trained", "SFT", "RL"], end
    assert "gate: passed, RL promoted" in end and "/report.md" in end and "make dev" in end, end
    by_source = dict(cat.query("SELECT checkpoint, pass_at_1_learnable FROM eval_summaries"))
    assert set(by_source) == {"base_model", "midtrained_checkpoint", "sft_checkpoint", "rl_checkpoint"}
    # the lineage a deletion request follows: the SFT set -> SFT -> RL -> the promoted entry,
    # which names the version sessions served by it carry
    from composer_dag.traces.registry import known_models, served_log
    from composer_dag.traces.store import trained_on

    chain = trained_on(cat, {meta("sft_trajectories")["dagster/uri"]})
    assert [c["checkpoint"] for c in chain] == ["sft_checkpoint", "rl_checkpoint", "promoted_model"], chain
    assert chain[1]["uri"] == meta("rl_checkpoint")["dagster/uri"]
    promoted = meta("promoted_model")
    assert known_models(st)[promoted["version"]] == meta("rl_checkpoint")["manifest_digest"]
    assert served_log(st)[-1]["version"] == promoted["version"]
    assert scan_instance(instance, list(secrets.values())) == []
    assert scan_tree(tmp_path, list(secrets.values())) == []
    assert graph["node_leaks"] == {"node1": [], "node2": []}


# SFT made to forget: the old schedule's learning rate, higher, with no replay of the pre-training
# shards; a one-process RL step from it on transformers, so its candidate carries what SFT lost
FORGET_CONFIG = {
    "ops": {
        "sft_checkpoint": {"config": {"max_steps": 6, "log_every": 3, "lr": 8e-3, "min_lr": 8e-3, "warmup_steps": 1,
                                      "pretrain_share": 0.0, "early_stop_patience": None, "eval_every": 6,
                                      "save_every": 6, "format_samples": 2, "min_format_share": 0.0}},
        "rl_run": {"config": {"steps": 1, "tasks_per_step": 1, "group_size": 2, "async_generation": False,
                              "inference": {"engine": "hf"}, "orchestrator": {"max_turns": 1}}},
        "evaluated_model": {"config": EVAL_CONFIG},
    }
}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_gate_fails_on_perplexity_when_sft_forgets(graph):
    """SFT made to forget on purpose (a large learning rate, no replay), from the session's
    mid-trained checkpoint, then RL from it and the evaluation: the gate fails on the perplexity
    row against the mid-trained checkpoint, the report names the row and its threshold, and
    promoted_model is not materialized. Nothing upstream of SFT runs again."""
    instance, defs = graph["instance"], graph["defs"]
    promoted = instance.get_latest_materialization_event(dg.AssetKey("promoted_model"))
    mid_before = instance.get_latest_materialization_event(dg.AssetKey("midtrained_checkpoint"))
    result = defs.resolve_job_def("train").execute_in_process(
        instance=instance, raise_on_error=False, run_config=FORGET_CONFIG,
        asset_selection=[dg.AssetKey(k) for k in ("sft_checkpoint", "rl_rollouts", "rl_checkpoint",
                                                  "evaluated_model", "promoted_model")])
    print_step_times(instance, [result])
    ran = {e.asset_key.to_user_string() for e in result.get_asset_materialization_events()}
    assert ran == {"sft_checkpoint", "rl_rollouts", "rl_checkpoint", "evaluated_model"}, ran  # promotion did not happen
    assert instance.get_latest_materialization_event(dg.AssetKey("midtrained_checkpoint")).run_id == mid_before.run_id
    sft = _meta(instance, "sft_checkpoint")
    assert sft["replay_share"] == 0.0 and sft["code_val_ppl_after"] > 1.3 * sft["code_val_ppl_before"], sft
    gate = next(e for e in result.get_asset_check_evaluations() if e.check_name == "rl_not_worse_than_sft")
    assert not gate.passed
    assert "val perplexity" in gate.metadata["failed_rows"].value
    reasons = gate.metadata["reasons"].value
    row = next(r for r in reasons if r.startswith("val perplexity") and r.endswith("[against midtrained_checkpoint]"))
    assert "by more than 30%" in row and "threshold" in row, reasons
    ev = _meta(instance, "evaluated_model")
    assert ev["rl_checkpoint.val_ppl"] > 1.3 * ev["midtrained_checkpoint.val_ppl"], ev
    assert "| val perplexity | midtrained_checkpoint |" in ev["comparison"] and "**FAIL**" in ev["comparison"]
    latest = instance.get_latest_materialization_event(dg.AssetKey("promoted_model"))
    assert (latest.run_id, latest.timestamp) == (promoted.run_id, promoted.timestamp)
