"""The whole graph on the tiny configuration with every artifact on S3 (a moto server) and the
GPU stages (mid-training, RL, evaluation) run as jobs on a real one-node Slurm cluster, each
under bubblewrap: a job sees its scratch directory, the Python environment and the code, never
this process's COMPOSER_HOME, so everything it reads or writes goes through storage URLs."""

from pathlib import Path

import dagster as dg
import pytest

from composer_dag.catalog import Catalog
from composer_dag.definitions import DOWNSTREAM_JOBS, build_defs, materialize_all
from composer_dag.storage import open_storage
from resources import ArtifactStorage, CatalogResource, SourceRegistry
from resources.cluster import ClusterResource
from resources.model_settings import ModelSettings
from tests.conftest import FAKE_KEY, FAKE_SECRET
from tests.leak_scan import scan_instance, scan_tree
from tests.test_graph_data import check_outcomes, make_source
from tests.test_graph_full import TINY_RUN_CONFIG

GPU_STAGES = {"midtrained_checkpoint": "midtrain", "rl_checkpoint": "rl", "rl_rollouts": "rl",
              "evaluated_model": "eval"}


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_slurm_whole_graph_on_s3_with_isolated_jobs(slurm_cluster, s3_bucket, tmp_path: Path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("COMPOSER_HOME", str(home))
    secrets = {"AWS_ACCESS_KEY_ID": FAKE_KEY, "AWS_SECRET_ACCESS_KEY": FAKE_SECRET, "HF_TOKEN": "hf_fakeFAKEfake0123456789"}
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    make_source(tmp_path / "src")
    sources = tmp_path / "sources.yaml"
    sources.write_text(
        f"sources:\n  - name: local\n    kind: local\n    uri: {tmp_path / 'src'}\n"
        "  - name: python\n    kind: python\n    max_total_mb: 2\n"
    )
    root = f"s3://{s3_bucket['bucket']}/composer"
    storage = ArtifactStorage(root=root, endpoint_url=s3_bucket["endpoint"], aws_access_key_id=FAKE_KEY,
                              aws_secret_access_key=FAKE_SECRET)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    cluster = ClusterResource(backend="slurm", nproc_per_node=1, isolate=True, scratch_dir=str(scratch),
                              poll_seconds=0.5)
    resources = {
        "artifacts": storage,
        "catalog": CatalogResource(storage=storage, path=str(tmp_path / "catalog.duckdb")),
        "sources": SourceRegistry(storage=storage, sources_file=str(sources)),
        "model_settings": ModelSettings(config_name="tiny", vocab_size=512, tokenizer_train_mb=2),
        "cluster": cluster,
    }
    (tmp_path / "dagster_home").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster_home")) as instance:
        results = materialize_all(instance=instance, definitions=build_defs(resources), log=print, run_config=TINY_RUN_CONFIG)
        assert [r.success for r in results] == [True] * len(DOWNSTREAM_JOBS)
        checks = check_outcomes(results)
        assert checks and all(checks.values()), {k: v for k, v in checks.items() if not v}
        assert {"midtrained_checkpoint:loss_finite_and_lower", "midtrained_checkpoint:loads_and_generates",
                "rl_checkpoint:published_weights_verified", "evaluated_model:eval_tasks_not_in_training_shards"} <= set(checks)

        def meta(key):
            ev = instance.get_latest_materialization_event(dg.AssetKey(key))
            return {k: v.value for k, v in ev.asset_materialization.metadata.items()}

        stages = dict(GPU_STAGES)
        if instance.get_latest_materialization_event(dg.AssetKey("sft_checkpoint")):
            stages["sft_checkpoint"] = "sft"
        st = open_storage(root)
        for key in stages:
            m = meta(key)
            assert m["dagster/uri"].startswith(root + "/"), m["dagster/uri"]
            # what the job reported is what is on storage, file by file
            digest = m.get("job_manifest_digest", m["manifest_digest"])
            if key != "evaluated_model":
                assert st.manifest_digest(m["dagster/uri"]) == digest
            st.verify_manifest(m["dagster/uri"])
        ckpt = meta("midtrained_checkpoint")
        assert {"config.json", "model.safetensors", "trainer_state.json"} <= set(st.read_manifest(ckpt["dagster/uri"])["files"])
        # the jobs ran through sbatch, and their resumable state is on S3, not on this disk
        logs = [e.user_message for r in results for e in instance.all_logs(r.run_id)]
        submitted = [m for m in logs if "[cluster:slurm] submitted job" in m]
        assert len(submitted) == len(set(stages.values())), submitted  # one job per stage, none retried
        for stage in set(stages.values()):
            assert st.find(f"{root}/work/{stage}"), stage
        assert not (home / "work").exists()
        cat = Catalog(str(tmp_path / "catalog.duckdb"), st)
        assert cat.query("SELECT count(*) FROM rollouts WHERE reward IS NOT NULL")[0][0] == meta("rl_rollouts")["dagster/row_count"]
        assert scan_instance(instance, list(secrets.values())) == []
    assert scan_tree(tmp_path, list(secrets.values())) == []
    left = [p.name for p in scratch.iterdir() if p.is_dir() and p.name != "composer-cache"]
    assert not left, f"a job's scratch directory was left behind: {left}"
