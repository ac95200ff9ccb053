"""Continued pre-training: tokenizer -> token_shards -> base_model -> midtrained_checkpoint.

The training run itself goes to the cluster resource (a local torchrun/DeepSpeed process by
default; k8s or Slurm by config) and reports back through Dagster Pipes.
"""


import json
import math
import os
import tempfile
from pathlib import Path

import dagster as dg

from assets.common import GPU_STAGE, blocking_checks, RETRY, counts_table, latest_uri, local_copy, plot_md, run_stage, record_provenance
from assets.dedup import deduped_shards
from composer_dag.train import data as data_engine
from composer_dag.train import model as model_engine
from composer_dag.train import tokenizer as tok_engine
from composer_dag.train.midtrain import MidtrainConfig
from resources import ArtifactStorage
from resources.cluster import ClusterResource
from resources.dagster_config import dagster_config, engine_config
from resources.model_settings import ModelSettings

CHECKPOINT_FILES = [["", "hf"], ["trainer_state.json", "checkpoints/{checkpoint}/trainer_state.json"],
                    ["result.json", "result.json"], ["metrics.jsonl", "metrics.jsonl"]]
"""What a training job publishes as its checkpoint artifact (``[dest, src]``, ``src`` in the
stage's ``out_dir``): the Hugging Face export plus the trainer state, result and metrics."""

TokenShardParams = dagster_config(data_engine.TokenShardConfig, module=__name__)
MidtrainParams = dagster_config(MidtrainConfig, module=__name__)


def _shard_urls(context, storage) -> list[str]:
    base = latest_uri(context.instance, "deduped_shards")
    storage.verify_manifest(base)
    return [u for u in storage.find(base) if u.rsplit("/", 1)[-1].startswith("shard-")]


def _iter_docs(storage, urls, columns=("id", "content", "source", "language")):
    for url in urls:
        table = storage.read_parquet(url, columns=list(columns))
        cols = [table.column(c).to_pylist() for c in columns]
        yield from zip(*cols)


def _fetch_base(settings, dest: str) -> None:
    try:
        model_engine.fetch_base_model(settings.base_model, dest)
    except ValueError as exc:
        raise dg.Failure(description=str(exc), allow_retries=False) from None


@dg.asset(deps=[deduped_shards], group_name="pretrain", kinds={"python", "huggingface"}, retry_policy=RETRY)
def tokenizer(context: dg.AssetExecutionContext, artifacts: ArtifactStorage, model_settings: ModelSettings):
    """The base model's own tokenizer when it has one; otherwise a byte-level BPE trained on the
    deduplicated shards, with the harness's special tokens (chat turns, tool calls, end of text)."""
    record_provenance(context)
    storage = artifacts.get()
    url = storage.url("tokenizer", context.run.run_id)
    with tempfile.TemporaryDirectory(prefix="composer-tok-") as tmp:
        out = os.path.join(tmp, "tokenizer")
        origin = "trained"
        if model_settings.base_model:
            base = os.path.join(tmp, "base")
            _fetch_base(model_settings, base)
            if model_engine.copy_tokenizer(base, out):
                origin = f"base model {model_settings.base_model}"
        if origin == "trained":
            budget = int(model_settings.tokenizer_train_mb * 1e6)

            def texts():
                used = 0
                for _, content, _, _ in _iter_docs(storage, _shard_urls(context, storage)):
                    if used >= budget:
                        return
                    used += len(content)
                    yield content

            context.log.info(f"training a byte-level BPE (vocab {model_settings.vocab_size}) on up to {model_settings.tokenizer_train_mb} MB")
            tok_engine.train_tokenizer(texts(), out, vocab_size=model_settings.vocab_size)
        tok = tok_engine.load_tokenizer(out)
        digest = storage.publish_dir(out, url)
    sample = "def add(a, b):\n    return a + b\n"
    return dg.MaterializeResult(
        metadata={
            "dagster/uri": url,
            "manifest_digest": digest,
            "origin": origin,
            "vocab_size": len(tok),
            "eos_token": str(tok.eos_token),
            "special_tokens": dg.MetadataValue.json(sorted(map(str, tok.all_special_tokens))),
            "tokens_for_sample_function": len(tok(sample)["input_ids"]),
        }
    )


@dg.asset(deps=[deduped_shards, tokenizer], group_name="pretrain", kinds={"python", "numpy"}, retry_policy=RETRY)
def token_shards(context: dg.AssetExecutionContext, config: TokenShardParams, artifacts: ArtifactStorage):
    """Documents tokenized and packed into Megatron-Core .bin/.idx (train and validation),
    joined by end-of-text, split by a hash of the document id, weighted by the mixture; or
    shards made elsewhere (``external_prefix``), checked against the tokenizer."""
    record_provenance(context)
    storage = artifacts.get()
    cfg = engine_config(data_engine.TokenShardConfig, config)
    url = storage.url("token_shards", context.run.run_id)
    with local_copy(storage, latest_uri(context.instance, "tokenizer")) as tok_dir, \
            tempfile.TemporaryDirectory(prefix="composer-tokens-") as tmp:
        tok = tok_engine.load_tokenizer(tok_dir)
        if cfg.external_prefix:
            try:
                summary = data_engine.import_external_shards(cfg, tok, tmp)
            except ValueError as exc:
                raise dg.Failure(description=str(exc), allow_retries=False) from None
        else:
            docs = _iter_docs(storage, _shard_urls(context, storage))
            summary = data_engine.pack_documents(docs, tok, tmp, val_fraction=cfg.val_fraction, mixture=cfg.mixture,
                                                 seed=cfg.seed)
        digest = storage.publish_dir(tmp, url)
    context.log.info(f"packed {summary.get('docs_in')} documents at {summary.get('mb_per_s')} MB/s")
    scalars = {k: v for k, v in summary.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
    tokens_by_lang = summary.get("tokens_per_language") or summary.get("tokens_by_language") or {}
    return dg.MaterializeResult(
        metadata={
            "dagster/uri": url,
            "manifest_digest": digest,
            **scalars,
            "tokens_per_language": counts_table(tokens_by_lang, "language", "tokens"),
            "summary": dg.MetadataValue.json(summary),
        }
    )


@dg.asset(deps=[tokenizer], group_name="pretrain", kinds={"python", "huggingface"}, retry_policy=RETRY)
def base_model(context: dg.AssetExecutionContext, artifacts: ArtifactStorage, model_settings: ModelSettings):
    """The open-weights starting point: a Hugging Face directory from a path or s3:// URL, or a
    small Llama built from a named config (no model hub is needed)."""
    record_provenance(context)
    storage = artifacts.get()
    url = storage.url("base_model", context.run.run_id)
    with tempfile.TemporaryDirectory(prefix="composer-base-") as tmp:
        out = os.path.join(tmp, "model")
        if model_settings.base_model:
            _fetch_base(model_settings, out)
            info = {"origin": model_settings.base_model, "config_name": "external"}
            cfg = json.loads(Path(out, "config.json").read_text())
            info["params"] = cfg.get("num_parameters", "see config.json")
        else:
            with local_copy(storage, latest_uri(context.instance, "tokenizer")) as tok_dir:
                info = model_engine.build_base_model(model_settings.config_name, tok_dir, out)
            info["origin"] = f"built from config {model_settings.config_name!r}"
        digest = storage.publish_dir(out, url)
    return dg.MaterializeResult(
        metadata={
            "dagster/uri": url,
            "manifest_digest": digest,
            "origin": info["origin"],
            "config_name": info.get("config_name", ""),
            "params": info.get("params") if isinstance(info.get("params"), int) else 0,
        }
    )


@dg.asset(
    deps=[token_shards, base_model],
    group_name="pretrain",
    kinds={"pytorch", "deepspeed"},
    **GPU_STAGE,
    check_specs=blocking_checks("midtrained_checkpoint", {
        "loss_finite_and_lower": "Every logged loss is finite and the last is lower than the first.",
        "val_ppl_below_base": "Validation perplexity after training is below the base model's.",
        "loads_and_generates": "The checkpoint loads in transformers and generates text."}),
)
def midtrained_checkpoint(
    context: dg.AssetExecutionContext, config: MidtrainParams, artifacts: ArtifactStorage, cluster: ClusterResource
):
    """Continued pre-training of the base model on the token shards with DeepSpeed, run on the
    cluster resource; resumes from its last checkpoint when retried with the same inputs."""
    record_provenance(context)
    storage = artifacts.get()
    _, job = run_stage(
        context, storage, cluster, "midtrain", MidtrainConfig, config, ["token_shards", "base_model"],
        lambda d, wd: {"data_dir": d["token_shards"], "model_dir": d["base_model"], "out_dir": os.path.join(wd, "run")},
        "composer_dag.train.midtrain", outputs={"midtrained_checkpoint": CHECKPOINT_FILES})
    result = job["summary"]
    url, digest = job["outputs"]["midtrained_checkpoint"]["url"], job["outputs"]["midtrained_checkpoint"]["digest"]

    curve = result.get("loss_curve") or []
    losses = [float(p[1]) if isinstance(p, (list, tuple)) else float(p.get("loss")) for p in curve]
    steps = [int(p[0]) if isinstance(p, (list, tuple)) else int(p.get("step")) for p in curve]
    finite = bool(losses) and all(math.isfinite(x) for x in losses)
    evals = result.get("evals") or []
    yield dg.MaterializeResult(
        metadata={
            "dagster/uri": url,
            "manifest_digest": digest,
            "loss_curve": plot_md(
                [("train loss", steps, losses), ("val loss", [e["step"] for e in evals], [e["val_loss"] for e in evals])],
                "step", "loss", "mid-training loss"),
            "tokens_seen": int(result["tokens_seen"]),
            "tokens_per_s": round(float(result.get("tokens_per_s") or 0.0), 1),
            "val_ppl_before": round(float(result["val_ppl_before"]), 3),
            "val_ppl_after": round(float(result["val_ppl_after"]), 3),
            "val_loss_after": round(float(result["val_loss_after"]), 4),
            "params": int(result.get("params") or 0),
            "steps": int(result["steps"]),
            "world_size": int(result.get("world_size") or 1),
            "precision": str(result.get("precision")),
        }
    )
    yield dg.AssetCheckResult(
        check_name="loss_finite_and_lower",
        passed=finite and losses[-1] < losses[0],
        metadata={"first_loss": losses[0] if losses else -1.0, "last_loss": losses[-1] if losses else -1.0},
    )
    yield dg.AssetCheckResult(
        check_name="val_ppl_below_base",
        passed=float(result["val_ppl_after"]) < float(result["val_ppl_before"]),
        metadata={"before": float(result["val_ppl_before"]), "after": float(result["val_ppl_after"])},
    )
    # Sampled in the job by transformers; vLLM loads this checkpoint as the RL policy next (and
    # fails that step if it cannot), so no second engine is started here just to try it.
    sample = result.get("sample") or {"new_tokens": 0, "text": "(the job sampled nothing: sample_tokens is 0)"}
    yield dg.AssetCheckResult(
        check_name="loads_and_generates",
        passed=bool(sample["new_tokens"] > 0),
        metadata={
            "transformers_sample": dg.MetadataValue.md("```python\n" + sample["text"][:800] + "\n```"),
            "transformers_new_tokens": int(sample["new_tokens"]),
        },
    )
