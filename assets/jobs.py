"""Jobs and schedules: what operators launch by name, and when the graph refreshes itself.

- ``data_refresh``: every ``code_corpus`` partition (one run: the asset's single-run backfill
  policy) and then ``deduped_shards``; nightly by ``nightly_data_refresh``.
- ``train``: mid-training through evaluation (tokenizer, token shards, base model, the
  mid-training run, the SFT trajectories and run, the RL run, evaluation and promotion); weekly by ``weekly_train``, which is
  off until an operator turns it on (it holds the GPU pool for hours on a real cluster).
- ``everything``: the whole graph after the corpus: tasks, shards, training, RL, evaluation.
- ``midtrain``, ``sft``, ``rl``, ``evaluate``, ``build_tasks``: one stage each, to rerun a part.
- ``bootstrap_repository``: one declared repository (a partition) made into an environment and mined;
  ``new_repository_sensor`` runs it for every repository newly declared in ``sources.yaml``.

A new source between two nightly runs does not wait for the night: ``new_source_sensor`` ingests
it at once and ``deduped_shards`` (automation condition ``eager``, evaluated by the
``rebuild_shards_after_ingest`` sensor, on by default) rebuilds after it.
"""

import dagster as dg

from assets import corpus, dedup, evals, sft, train
from assets.corpus import sources_partitions

RANGE_START, RANGE_END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"

TRAIN_ASSETS = dg.AssetSelection.assets(
    train.tokenizer, train.token_shards, train.base_model, train.midtrained_checkpoint,
    sft.sft_trajectories, sft.sft_checkpoint, "rl_rollouts", "rl_checkpoint", evals.evaluated_model,
    evals.promoted_model,
)

repo_environments_job = dg.define_asset_job(
    "bootstrap_repository",
    selection=dg.AssetSelection.assets("repo_environments"),
    description="Make one declared repository (a repo_environments partition) into an environment and mine its tasks.",
)
tasks_job = dg.define_asset_job(
    "build_tasks",
    selection=dg.AssetSelection.assets("rl_tasks", "eval_tasks"),
    description="Build the RL and held-out evaluation tasks (repositories with hidden tests).",
)
data_job = dg.define_asset_job(
    "data_refresh",
    selection=dg.AssetSelection.assets(corpus.code_corpus, dedup.deduped_shards),
    description="Ingest the selected sources (a range of code_corpus partitions, in one run), then "
    "deduplicate every ingested source into training shards.",
)
train_job = dg.define_asset_job(
    "train",
    selection=TRAIN_ASSETS,
    description="Mid-training through evaluation: tokenizer, token shards, base model, the mid-training "
    "run, the RL run, evaluation and promotion.",
)
midtrain_job = dg.define_asset_job(
    "midtrain",
    selection=dg.AssetSelection.assets(train.tokenizer, train.token_shards, train.base_model, train.midtrained_checkpoint),
    description="Tokenizer, token shards, base model and the mid-training run on the cluster resource.",
)
sft_job = dg.define_asset_job(
    "sft",
    selection=dg.AssetSelection.assets(sft.sft_trajectories, sft.sft_checkpoint),
    description="SFT trajectories from the training tasks (and the last RL run), and the SFT run on the cluster resource.",
)
rl_job = dg.define_asset_job(
    "rl",
    selection=dg.AssetSelection.assets("rl_rollouts", "rl_checkpoint"),
    description="One RL run on the cluster resource: vLLM rollouts in the sandboxes, GRPO, weight sync.",
)
eval_job = dg.define_asset_job(
    "evaluate",
    selection=dg.AssetSelection.assets(evals.evaluated_model, evals.promoted_model),
    description="Evaluate base, mid-trained, SFT and RL checkpoints on the held-out tasks; promote if the gate passes.",
)
everything_job = dg.define_asset_job(
    "everything",
    selection=dg.AssetSelection.all() - dg.AssetSelection.assets(corpus.code_corpus, "repo_environments",
                                                                 "production_traces", "cycle_checkpoints"),
    description="The whole graph after ingestion (and after the repository environments): tasks, shards, training, "
    "RL, evaluation, promotion.",
)

JOBS = [repo_environments_job, tasks_job, data_job, train_job, midtrain_job, sft_job, rl_job, eval_job, everything_job]


def all_sources_tags(instance: dg.DagsterInstance) -> dict[str, str] | None:
    """Run tags selecting every ``code_corpus`` partition (one single-run range), or None if none."""
    keys = instance.get_dynamic_partitions(sources_partitions.name)
    return {RANGE_START: keys[0], RANGE_END: keys[-1]} if keys else None


@dg.schedule(
    job=data_job,
    cron_schedule="0 2 * * *",
    execution_timezone="UTC",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Every night at 02:00 UTC: re-ingest every source and rebuild the deduplicated shards.",
)
def nightly_data_refresh(context: dg.ScheduleEvaluationContext):
    tags = all_sources_tags(context.instance)
    if tags is None:
        return dg.SkipReason("no source partition yet: new_source_sensor adds one per declared source")
    return dg.RunRequest(run_key=f"nightly-{context.scheduled_execution_time:%Y-%m-%d}", tags=tags)


weekly_train = dg.ScheduleDefinition(
    name="weekly_train",
    job=train_job,
    cron_schedule="0 4 * * 0",
    execution_timezone="UTC",
    default_status=dg.DefaultScheduleStatus.STOPPED,
    description="Sundays at 04:00 UTC: mid-training through evaluation on the newest shards. Off by default.",
)

SCHEDULES = [nightly_data_refresh, weekly_train]

shards_automation = dg.AutomationConditionSensorDefinition(
    "rebuild_shards_after_ingest",
    target=dg.AssetSelection.assets(dedup.deduped_shards),
    default_status=dg.DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=60,
    description="Evaluates deduped_shards' automation condition (eager): after a source is ingested "
    "and none is still in progress, the shards are rebuilt.",
)
