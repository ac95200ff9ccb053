"""The whole graph on a tiny configuration, through Dagster, with every asset check required to
pass: the design card's "asset checks in CI"."""

from pathlib import Path

import dagster as dg
import pytest

from composer_dag.catalog import Catalog
from composer_dag.definitions import DOWNSTREAM_JOBS, build_defs, materialize_all
from composer_dag.storage import Storage
from resources import ArtifactStorage, CatalogResource, SourceRegistry
from resources.model_settings import ModelSettings
from resources.cluster import ClusterResource
from tests.conftest import FAKE_KEY, FAKE_SECRET
from tests.leak_scan import scan_instance, scan_tree
from tests.test_graph_data import check_outcomes, make_source

TINY_RUN_CONFIG = {
    "build_tasks": {"ops": {"task_sets": {"config": {"humaneval_limit": 6, "bugfix_count": 2, "eval_fraction": 0.5}}}},
    "train": {
        "ops": {
            "midtrained_checkpoint": {
                "config": {"max_steps": 16, "seq_len": 64, "micro_batch": 4, "warmup_steps": 2,
                           "eval_every": 8, "save_every": 8, "eval_batches": 4, "lr": 2e-3}
            }
        }
    },
}


@pytest.mark.slow
def test_whole_graph_tiny(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("COMPOSER_HOME", str(tmp_path / "home"))
    # Known fake credentials in the environment of every step, subprocess and sandbox: the scan
    # at the end proves none reaches logs, metadata, rollouts, checkpoints or the catalog.
    secrets = {"AWS_ACCESS_KEY_ID": FAKE_KEY, "AWS_SECRET_ACCESS_KEY": FAKE_SECRET, "HF_TOKEN": "hf_fakeFAKEfake0123456789"}
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    make_source(tmp_path / "src")
    sources = tmp_path / "sources.yaml"
    sources.write_text(
        f"sources:\n  - name: local\n    kind: local\n    uri: {tmp_path / 'src'}\n"
        "  - name: python\n    kind: python\n    max_total_mb: 2\n"
    )
    storage = ArtifactStorage(root=str(tmp_path / "artifacts"))
    resources = {
        "artifacts": storage,
        "catalog": CatalogResource(storage=storage, path=str(tmp_path / "catalog.duckdb")),
        "sources": SourceRegistry(storage=storage, sources_file=str(sources)),
        "model_settings": ModelSettings(config_name="tiny", vocab_size=512, tokenizer_train_mb=2),
        "cluster": ClusterResource(nproc_per_node=1),
    }
    (tmp_path / "dagster_home").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster_home")) as instance:
        results = materialize_all(instance=instance, definitions=build_defs(resources), log=print, run_config=TINY_RUN_CONFIG)
        assert [r.success for r in results] == [True] * len(DOWNSTREAM_JOBS)
        checks = check_outcomes(results)
        assert checks and all(checks.values()), {k: v for k, v in checks.items() if not v}
        expected = {
            "code_corpus:files_accounted", "deduped_shards:no_contamination", "rl_tasks:rl_tasks_sound",
            "eval_tasks:eval_tasks_sound", "eval_tasks:split_disjoint", "midtrained_checkpoint:loss_finite_and_lower",
            "midtrained_checkpoint:val_ppl_below_base", "midtrained_checkpoint:loads_and_generates",
            "rl_rollouts:every_rollout_has_reward", "rl_rollouts:staleness_within_bound",
            "rl_checkpoint:loss_has_no_nan", "rl_checkpoint:published_weights_verified",
        }
        assert expected <= set(checks), expected - set(checks)

        def meta(key):
            ev = instance.get_latest_materialization_event(dg.AssetKey(key))
            return {k: v.value for k, v in ev.asset_materialization.metadata.items()}

        ckpt = meta("midtrained_checkpoint")
        assert ckpt["val_ppl_after"] < ckpt["val_ppl_before"]
        assert ckpt["loss_curve"].startswith("![mid-training loss](data:image/png;base64,")
        st = Storage(str(tmp_path / "artifacts"))
        manifest = st.verify_manifest(ckpt["dagster/uri"])
        assert {"config.json", "model.safetensors", "tokenizer.json", "trainer_state.json"} <= set(manifest["files"])
        assert meta("token_shards")["tokens_train"] > 0
        assert meta("deduped_shards")["decontamination_set"] == "HumanEval + eval_tasks"
        cat = Catalog(str(tmp_path / "catalog.duckdb"), st)
        sides = dict(cat.query("SELECT side, count(*) FROM tasks GROUP BY 1"))
        assert sum(sides.values()) == 8
        rollouts = meta("rl_rollouts")
        assert rollouts["dagster/row_count"] == 2 * 2 * 4  # steps x tasks per step x group size
        assert cat.query("SELECT count(*) FROM rollouts WHERE reward IS NOT NULL")[0][0] == rollouts["dagster/row_count"]
        st.verify_manifest(meta("rl_checkpoint")["dagster/uri"])
        assert scan_instance(instance, list(secrets.values())) == []
    assert scan_tree(tmp_path, list(secrets.values())) == []
