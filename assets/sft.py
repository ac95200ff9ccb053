"""Supervised fine-tuning between mid-training and RL: sft_trajectories -> sft_checkpoint.

``sft_trajectories`` plays the training tasks' reference solutions through real episodes (and
takes the successful, unflagged rollouts of the last RL run, when there is one); the
``sft_checkpoint`` job trains the mid-trained checkpoint on them with the mid-training trainer
(``objective: sft``) on the cluster resource.
"""

import contextlib
import json
import math
import os
import tempfile

import dagster as dg

from assets.common import GPU_STAGE, blocking_checks, RETRY, counts_table, latest_metadata, latest_uri, local_copy, plot_md, run_stage, record_provenance
from assets.train import CHECKPOINT_FILES, midtrained_checkpoint
from composer_dag.sft import trajectories as engine
from composer_dag.sft.run import SFTConfig
from composer_dag.traces.store import good_sessions
from resources import ArtifactStorage, CatalogResource
from resources.cluster import ClusterResource
from resources.dagster_config import dagster_config, engine_config

ORIGINS = ("reference", "rollout", "session")
TrajectoryParams = dagster_config(engine.TrajectoryConfig, module=__name__)
SFTParams = dagster_config(SFTConfig, module=__name__)


def _last_rollouts(context, storage) -> tuple[list, str]:
    """The rollout tables of the newest RL run (none before the first), and its run id."""
    meta = latest_metadata(context.instance, "rl_rollouts")
    if not meta or "dagster/uri" not in meta:
        return [], ""
    base = str(meta["dagster/uri"])
    urls = [u for u in storage.find(base) if u.endswith(".parquet")]
    return [storage.read_parquet(u) for u in urls], base


@contextlib.contextmanager
def _policy_tokenizer(context, storage, cfg):
    """The policy's tokenizer (the ``tokenizer`` asset, which every checkpoint carries) when the
    demonstrations include external harnesses: their messages are kept as the gateway serves
    them, which its chat template decides; None otherwise."""
    if not cfg.harnesses:
        yield None
        return
    from composer_dag.train.tokenizer import load_tokenizer

    with local_copy(storage, latest_uri(context.instance, "tokenizer")) as d:
        yield load_tokenizer(d)


@dg.asset(deps=["rl_tasks", "eval_tasks", "production_traces", "tokenizer"], group_name="sft", kinds={"python", "parquet", "duckdb"},
          retry_policy=RETRY,
          check_specs=[dg.AssetCheckSpec("trajectories_accounted", asset="sft_trajectories", blocking=True,
                                         description="Every task and rollout read is written or counted under a reason.")])
def sft_trajectories(context: dg.AssetExecutionContext, config: TrajectoryParams, artifacts: ArtifactStorage,
                     catalog: CatalogResource):
    """Agent trajectories in the harness's format, each known to succeed: the training tasks'
    reference solutions played through real episodes, plus the last RL run's successful,
    unflagged rollouts; none from or overlapping an evaluation task."""
    record_provenance(context)
    storage = artifacts.get()
    cfg = engine_config(engine.TrajectoryConfig, config)
    url = storage.url("sft_trajectories", context.run.run_id)
    rollouts, rollouts_from = _last_rollouts(context, storage) if cfg.from_rollouts else ([], "")
    sessions = good_sessions(storage, catalog.get()) if cfg.session_share > 0 else []
    with local_copy(storage, latest_uri(context.instance, "rl_tasks")) as rl, \
            local_copy(storage, latest_uri(context.instance, "eval_tasks")) as ev, \
            _policy_tokenizer(context, storage, cfg) as tok, \
            tempfile.TemporaryDirectory(prefix="composer-sft-") as tmp:
        try:
            summary = engine.build(rl, tmp, cfg, rollouts, ev, context.log.info, sessions=sessions, tokenizer=tok)
        except ValueError as exc:
            raise dg.Failure(description=str(exc), allow_retries=False) from None
        rows = engine.read_rows(os.path.join(tmp, "trajectories.parquet"))
        digest = storage.publish_dir(tmp, url)
    catalog.get().insert_records("sft_trajectories", [
        {k: v for k, v in r.items() if k not in ("messages", "tools")} | {"run_id": context.run.run_id, "uri": url} for r in rows])
    skipped = {f"{origin}: {why}": n for origin in ORIGINS
               for why, n in summary[origin]["skipped"].items()}
    yield dg.MaterializeResult(metadata={
        "dagster/uri": url,
        "manifest_digest": digest,
        "dagster/row_count": summary["trajectories"],
        "by_source": counts_table(summary["by_source"], "source", "trajectories"),
        "reference_trajectories": summary["reference"]["out"],
        "rollout_trajectories": summary["rollout"]["out"],
        "session_trajectories": summary["session"]["out"],
        "rollouts_from": rollouts_from or "(no RL run yet)",
        "skipped": counts_table(skipped, "origin: reason", "items"),
        "by_split": dg.MetadataValue.json(summary["by_split"]),
        "by_harness": counts_table(summary["by_harness"], "harness", "trajectories"),
        "example": dg.MetadataValue.md("```json\n" + json.dumps(json.loads(rows[0]["messages"]), indent=1)[:1500] + "\n```"),
    })
    ok = all(summary[o]["in"] == summary[o]["out"] + sum(summary[o]["skipped"].values()) for o in ORIGINS)
    yield dg.AssetCheckResult(check_name="trajectories_accounted", passed=ok, metadata={
        o: dg.MetadataValue.json(summary[o]) for o in ORIGINS})


@dg.asset(
    deps=[sft_trajectories, midtrained_checkpoint, "token_shards"],
    group_name="sft",
    kinds={"pytorch", "deepspeed"},
    **GPU_STAGE,
    check_specs=blocking_checks("sft_checkpoint", {
        "loss_finite_and_lower": "Every logged loss is finite and the last is lower than the first.",
        "val_loss_lower": "Loss on the held-out trajectories' assistant tokens is lower after training.",
        "loads_and_generates": "The checkpoint loads in transformers and generates.",
        "tool_call_format_parses": "Sampled first turns parse as tool calls in at least min_format_share of cases."}),
)
def sft_checkpoint(context: dg.AssetExecutionContext, config: SFTParams, artifacts: ArtifactStorage,
                   cluster: ClusterResource, catalog: CatalogResource):
    """The mid-trained checkpoint fine-tuned on the trajectories (loss on the assistant's tokens),
    with windows of the pre-training shards replayed in every micro-batch so that it keeps what
    mid-training taught, with the mid-training trainer on the cluster resource; resumes when
    retried with the same inputs."""
    record_provenance(context)
    storage = artifacts.get()
    _, job = run_stage(
        context, storage, cluster, "sft", SFTConfig, config, ["sft_trajectories", "midtrained_checkpoint", "token_shards"],
        lambda d, wd: {"trajectories_dir": d["sft_trajectories"], "model_dir": d["midtrained_checkpoint"],
                       "pretrain_dir": d["token_shards"], "out_dir": os.path.join(wd, "run")},
        "composer_dag.sft.run", outputs={"sft_checkpoint": CHECKPOINT_FILES})
    result = job["summary"]
    out = job["outputs"]["sft_checkpoint"]
    catalog.get().insert_records("checkpoint_inputs", [{  # lineage for deletion requests (traces.store)
        "checkpoint": "sft_checkpoint", "run_id": context.run.run_id, "uri": out["url"], "input": "sft_trajectories",
        "input_uri": latest_uri(context.instance, "sft_trajectories")}],
        where={"checkpoint": "sft_checkpoint", "run_id": context.run.run_id})
    losses = [float(loss) for _, loss in result.get("loss_curve") or []]
    steps = [int(step) for step, _ in result.get("loss_curve") or []]
    evals = [e for e in result.get("evals") or [] if e.get("val_loss") is not None]
    code = [e for e in evals if e.get("val_code_ppl") is not None]
    fc = result.get("format_check") or {"samples": 0, "parsed": 0, "share": 0.0, "ok": False, "new_tokens": 0,
                                         "examples": [], "min_share": 0.0}
    tk = result.get("tokenize") or {}
    yield dg.MaterializeResult(metadata={
        "dagster/uri": out["url"],
        "manifest_digest": out["digest"],
        "loss_curve": plot_md([("train loss", steps, losses),
                               ("val loss", [e["step"] for e in evals], [e["val_loss"] for e in evals]),
                               ("code val loss", [e["step"] for e in code], [e["val_code_loss"] for e in code])],
                              "step", "loss", "SFT loss (assistant tokens; code: the replayed shards' validation)"),
        "code_val_ppl_before": round(float(code[0]["val_code_ppl"]), 2) if code else float("nan"),
        "code_val_ppl_after": round(float(code[-1]["val_code_ppl"]), 2) if code else float("nan"),
        "replay_share": float((result.get("config") or {}).get("pretrain_share") or 0.0),
        "stopped_early": bool(result.get("stopped_early")),
        "tokens_seen": int(result["tokens_seen"]),
        "tokens_per_s": round(float(result.get("tokens_per_s") or 0.0), 1),
        "supervised_tokens": int(tk.get("supervised_tokens") or 0),
        "transcripts": dg.MetadataValue.json({k: tk.get(k) for k in ("train", "val", "skipped", "cut_to_seq_len")}),
        "val_loss_before": round(float(result["val_loss_before"] or float("nan")), 4),
        "val_loss_after": round(float(result["val_loss_after"] or float("nan")), 4),
        "steps": int(result["steps"]),
        "format_share": round(float(fc["share"]), 4),
        "format_examples": dg.MetadataValue.md("\n\n".join("```\n" + t[:400] + "\n```" for t in fc["examples"])),
    })
    finite = bool(losses) and all(math.isfinite(x) for x in losses)
    yield dg.AssetCheckResult(check_name="loss_finite_and_lower", passed=finite and losses[-1] < losses[0],
                              metadata={"first_loss": losses[0] if losses else -1.0, "last_loss": losses[-1] if losses else -1.0})
    before, after = result.get("val_loss_before"), result.get("val_loss_after")
    yield dg.AssetCheckResult(check_name="val_loss_lower", passed=before is not None and after is not None and after < before,
                              metadata={"before": float(before or -1.0), "after": float(after or -1.0)})
    yield dg.AssetCheckResult(check_name="loads_and_generates", passed=int(fc["new_tokens"]) > 0,
                              metadata={"new_tokens": int(fc["new_tokens"])})
    yield dg.AssetCheckResult(check_name="tool_call_format_parses", passed=bool(fc["ok"]),
                              metadata={"parsed": int(fc["parsed"]), "samples": int(fc["samples"]),
                                        "share": float(fc["share"]), "min_share": float(fc["min_share"])})
