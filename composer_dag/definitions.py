"""The code location: every asset, check, resource, job, schedule and sensor.

``python -m composer_dag.definitions materialize`` materializes the whole graph on the
configured instance ($DAGSTER_HOME), one run per corpus source and one for the rest, so the
runs show in the UI afterwards; this is what ``make run`` does.
"""

from __future__ import annotations

import os
import sys

import dagster as dg

from assets import corpus, dedup, envs, evals, rl, sensors, train
from resources import ArtifactStorage, CatalogResource, SourceRegistry
from resources.cluster import ClusterResource


def _env(name: str):
    """``dg.EnvVar`` when the variable is set (the UI shows its name, never its value)."""
    return dg.EnvVar(name) if os.environ.get(name) else None


def make_resources() -> dict:
    storage = ArtifactStorage(
        root=os.environ.get("COMPOSER_STORAGE_ROOT", ""),
        endpoint_url=os.environ.get("COMPOSER_S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL"),
        aws_access_key_id=_env("AWS_ACCESS_KEY_ID"),
        aws_secret_access_key=_env("AWS_SECRET_ACCESS_KEY"),
        region_name=os.environ.get("AWS_REGION"),
    )
    return {
        "artifacts": storage,
        "catalog": CatalogResource(storage=storage, path=os.environ.get("COMPOSER_CATALOG", "")),
        "sources": SourceRegistry(storage=storage, watch_s3_prefix=os.environ.get("COMPOSER_WATCH_S3_PREFIX")),
        "model_settings": train.ModelSettings(
            base_model=os.environ.get("COMPOSER_BASE_MODEL", ""),
            config_name=os.environ.get("COMPOSER_MODEL_CONFIG", "tiny"),
        ),
        "cluster": ClusterResource(
            backend=os.environ.get("COMPOSER_CLUSTER_BACKEND", "local"),
            nproc_per_node=int(os.environ.get("COMPOSER_NPROC_PER_NODE", "1")),
            nnodes=int(os.environ.get("COMPOSER_NNODES", "1")),
            gpus_per_node=int(os.environ.get("COMPOSER_GPUS_PER_NODE", "0")),
            image=os.environ.get("COMPOSER_IMAGE"),
            namespace=os.environ.get("COMPOSER_K8S_NAMESPACE", "default"),
            partition=os.environ.get("COMPOSER_SLURM_PARTITION"),
            shared_dir=os.environ.get("COMPOSER_SLURM_SHARED_DIR"),
        ),
    }


tasks_job = dg.define_asset_job(
    "build_tasks",
    selection=dg.AssetSelection.assets("rl_tasks", "eval_tasks"),
    description="Build the RL and held-out evaluation tasks (repositories with hidden tests).",
)
data_job = dg.define_asset_job(
    "data_refresh",
    selection=dg.AssetSelection.assets(dedup.deduped_shards),
    description="Deduplicate all ingested sources into training shards.",
)
train_job = dg.define_asset_job(
    "train",
    selection=dg.AssetSelection.assets(train.tokenizer, train.token_shards, train.base_model, train.midtrained_checkpoint),
    description="Tokenizer, token shards, base model and the mid-training run on the cluster resource.",
)

rl_job = dg.define_asset_job(
    "rl",
    selection=dg.AssetSelection.assets("rl_rollouts", "rl_checkpoint"),
    description="One RL run on the cluster resource: vLLM rollouts in the sandboxes, GRPO, weight sync.",
)

eval_job = dg.define_asset_job(
    "evaluate",
    selection=dg.AssetSelection.assets("evaluated_model", "promoted_model"),
    description="Evaluate base, mid-trained and RL checkpoints on the held-out tasks; promote if the gate passes.",
)

DOWNSTREAM_JOBS = ["build_tasks", "data_refresh", "train", "rl", "evaluate"]
"""Jobs run after every source is ingested, in order: everything that is not a corpus partition."""


def build_defs(resources: dict | None = None) -> dg.Definitions:
    """The Definitions; ``resources`` override those built from the environment (tests pass theirs)."""
    return dg.Definitions(
        assets=[
            corpus.code_corpus,
            dedup.deduped_shards,
            envs.task_sets,
            train.tokenizer,
            train.token_shards,
            train.base_model,
            train.midtrained_checkpoint,
            rl.rl_run,
            evals.evaluated_model,
            evals.promoted_model,
        ],
        asset_checks=[
            dedup.kept_files_unique,
            dedup.no_contamination,
            dedup.no_secrets,
            dedup.files_accounted,
            envs.rl_tasks_sound,
            envs.eval_tasks_sound,
            envs.split_disjoint,
        ],
        jobs=[sensors.ingest_source_job, tasks_job, data_job, train_job, rl_job, eval_job],
        sensors=[sensors.new_source_sensor],
        resources={**make_resources(), **(resources or {})},
    )


defs = build_defs()


def materialize_all(
    instance: dg.DagsterInstance | None = None,
    definitions: dg.Definitions | None = None,
    log=print,
    jobs: list[str] | None = None,
    run_config: dict[str, dict] | None = None,
) -> list[dg.ExecuteInProcessResult]:
    """Add every declared source as a partition, ingest each, then build everything downstream.

    ``jobs`` (default: all of ``DOWNSTREAM_JOBS``) and ``run_config`` (job name -> run config)
    narrow or tune the runs. Returns the run results in order; stops at the first failure.
    """
    instance = instance or dg.DagsterInstance.get()
    definitions = definitions or defs
    registry: SourceRegistry = definitions.resources["sources"]
    names = registry.names()
    existing = set(instance.get_dynamic_partitions(corpus.sources_partitions.name))
    new = [n for n in names if n not in existing]
    if new:
        instance.add_dynamic_partitions(corpus.sources_partitions.name, new)
    quiet = {"loggers": {"console": {"config": {"log_level": os.environ.get("COMPOSER_LOG_LEVEL", "INFO")}}}}

    def config_for(job: str) -> dict:
        return {**quiet, **(run_config or {}).get(job, {})}

    results = []
    for i, name in enumerate(names, 1):
        log(f"[{i}/{len(names)}] code_corpus[{name}]")
        results.append(
            definitions.resolve_job_def("ingest_source").execute_in_process(
                instance=instance, partition_key=name, raise_on_error=False, run_config=config_for("ingest_source")
            )
        )
    for job in DOWNSTREAM_JOBS if jobs is None else jobs:
        if not all(r.success for r in results):
            break
        log(f"job {job}")
        results.append(
            definitions.resolve_job_def(job).execute_in_process(
                instance=instance, raise_on_error=False, run_config=config_for(job)
            )
        )
    ok = all(r.success for r in results)
    log("all assets materialized" if ok else "a step failed: see the run in the UI (make dev)")
    return results


if __name__ == "__main__":
    if sys.argv[1:] != ["materialize"]:
        sys.exit("usage: python -m composer_dag.definitions materialize")
    sys.exit(0 if all(r.success for r in materialize_all()) else 1)
