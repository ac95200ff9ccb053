"""The code location: every asset, check, resource, job, schedule and sensor.

``python -m composer_dag.definitions materialize`` materializes the whole graph on the
configured instance ($DAGSTER_HOME), one run per corpus source and one for the rest, so the
runs show in the UI afterwards; this is what ``make run`` does.
"""

from __future__ import annotations

import os
import sys

import dagster as dg

from assets import corpus, dedup, envs, evals, rl, sensors, sft, traces, train
from assets import jobs as jobs_module
from assets.common import code_version
from resources import ArtifactStorage, CatalogResource, SourceRegistry
from resources.cluster import ClusterResource
from resources.model_settings import ModelSettings


def _env(name: str):
    """``dg.EnvVar`` when the variable is set (the UI shows its name, never its value)."""
    return dg.EnvVar(name) if os.environ.get(name) else None


def _int_env(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be a whole number, not {value!r}") from None


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
        "model_settings": ModelSettings(
            base_model=os.environ.get("COMPOSER_BASE_MODEL", ""),
            config_name=os.environ.get("COMPOSER_MODEL_CONFIG", "tiny"),
        ),
        "cluster": ClusterResource(
            backend=os.environ.get("COMPOSER_CLUSTER_BACKEND", "local"),
            nproc_per_node=_int_env("COMPOSER_NPROC_PER_NODE", 1),
            nnodes=_int_env("COMPOSER_NNODES", 1),
            gpus_per_node=_int_env("COMPOSER_GPUS_PER_NODE", 0),
            image=os.environ.get("COMPOSER_IMAGE"),
            namespace=os.environ.get("COMPOSER_K8S_NAMESPACE", "default"),
            partition=os.environ.get("COMPOSER_SLURM_PARTITION"),
            account=os.environ.get("COMPOSER_SLURM_ACCOUNT"),
            container_image=os.environ.get("COMPOSER_CONTAINER_IMAGE"),
            scratch_dir=os.environ.get("COMPOSER_SCRATCH_DIR", "/tmp"),
            secret_name=os.environ.get("COMPOSER_K8S_SECRET"),
            isolate=os.environ.get("COMPOSER_ISOLATE_JOBS", "") == "1",
        ),
    }


def versioned(*groups) -> list[dg.AssetsDefinition]:
    """Each ``(module, *assets)``'s assets with the code version of their module: a digest of the
    code it runs (``assets.common.code_version``)."""
    out = []
    for module, *assets_defs in groups:
        version = code_version(module.__file__)
        out += dg.map_asset_specs(lambda spec: spec.replace_attributes(code_version=version), assets_defs)
    return out


DOWNSTREAM_JOBS = ["bootstrap_repository", "build_tasks", "data_refresh", "train"]
"""Jobs ``materialize_all`` runs in order: every declared repository's environment (a run per
partition), the tasks, then every source and the shards in one run, then mid-training through
evaluation."""


def build_defs(resources: dict | None = None) -> dg.Definitions:
    """The Definitions; ``resources`` override those built from the environment (tests pass theirs)."""
    return dg.Definitions(
        assets=versioned(
            (corpus, corpus.code_corpus),
            (dedup, dedup.deduped_shards),
            (envs, envs.repo_environments, envs.task_sets),
            (train, train.tokenizer, train.token_shards, train.base_model, train.midtrained_checkpoint),
            (sft, sft.sft_trajectories, sft.sft_checkpoint),
            (rl, rl.rl_run),
            (evals, evals.evaluated_model, evals.promoted_model),
            (traces, traces.production_traces, traces.cycle_checkpoints),
        ),
        asset_checks=[
            dedup.kept_files_unique,
            dedup.no_contamination,
            dedup.no_secrets,
            dedup.files_accounted,
            envs.rl_tasks_sound,
            envs.eval_tasks_sound,
            envs.split_disjoint,
        ],
        jobs=[sensors.ingest_source_job, traces.traces_job, traces.cycle_job, *jobs_module.JOBS],
        schedules=[*jobs_module.SCHEDULES, traces.cycle_schedule],
        sensors=[sensors.new_source_sensor, sensors.new_repository_sensor, sensors.record_run_failures,
                 jobs_module.shards_automation, traces.production_traces_sensor],
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
    """Add every declared source and repository as a partition, then run ``jobs`` in order
    (default ``DOWNSTREAM_JOBS``): a ``bootstrap_repository`` run per repository, the tasks, every
    source and the shards in one ``data_refresh`` run (the corpus's single-run backfill policy),
    then mid-training through evaluation.

    ``run_config`` (job name -> run config) tunes the runs. Returns the run results in order;
    stops after the first job with a failed run (each repository's run is tried first).
    """
    instance = instance or dg.DagsterInstance.get()
    definitions = definitions or defs
    registry: SourceRegistry = definitions.resources["sources"]
    names = registry.names()
    existing = set(instance.get_dynamic_partitions(corpus.sources_partitions.name))
    new = [n for n in names if n not in existing]
    if new:
        instance.add_dynamic_partitions(corpus.sources_partitions.name, new)
    repositories = [r.name for r in registry.repositories()]
    existing = set(instance.get_dynamic_partitions(envs.repositories_partitions.name))
    if [n for n in repositories if n not in existing]:
        instance.add_dynamic_partitions(envs.repositories_partitions.name, [n for n in repositories if n not in existing])
    quiet = {"loggers": {"console": {"config": {"log_level": os.environ.get("COMPOSER_LOG_LEVEL", "INFO")}}}}

    results = []
    for job in DOWNSTREAM_JOBS if jobs is None else jobs:
        job_def = definitions.resolve_job_def(job)
        if job_def.partitions_def == envs.repositories_partitions:  # one run per repository
            for name in repositories:
                log(f"job {job} (repository {name})")
                results.append(job_def.execute_in_process(
                    instance=instance, raise_on_error=False, partition_key=name,
                    run_config={**quiet, **(run_config or {}).get(job, {})}))
            if not all(r.success for r in results):
                break
            continue
        tags = jobs_module.all_sources_tags(instance) if job_def.partitions_def is not None else None
        log(f"job {job}" + (f" (sources {tags[jobs_module.RANGE_START]} ... {tags[jobs_module.RANGE_END]})" if tags else ""))
        result = job_def.execute_in_process(
            instance=instance, raise_on_error=False, tags=tags, run_config={**quiet, **(run_config or {}).get(job, {})}
        )
        results.append(result)
        if not result.success:
            break
    ok = all(r.success for r in results)
    log("all assets materialized" if ok else "a step failed: see the run in the UI (make dev)")
    evaluated = instance.get_latest_materialization_event(dg.AssetKey("evaluated_model"))
    if evaluated is not None and any(evaluated.run_id == r.run_id for r in results):
        log(evals.terminal_summary({k: v.value for k, v in evaluated.asset_materialization.metadata.items()}))
    return results


MAKE_RUN_CONFIG = {"train": {"ops": {"evaluated_model": {"config": {"harnesses": ["mini-swe-agent"]}}}}}
"""What ``make run`` adds to the defaults: the SFT and RL checkpoints also play the first held-out
tasks through mini-swe-agent (installed by ``make harnesses``), so the final table shows
pass@1 per harness."""


if __name__ == "__main__":
    if sys.argv[1:] != ["materialize"]:
        sys.exit("usage: python -m composer_dag.definitions materialize")
    sys.exit(0 if all(r.success for r in materialize_all(run_config=MAKE_RUN_CONFIG)) else 1)
