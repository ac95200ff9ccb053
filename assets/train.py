"""Continued pre-training: tokenizer -> token_shards -> base_model -> midtrained_checkpoint.

The training run itself goes to the cluster resource (a local torchrun/DeepSpeed process by
default; k8s or Slurm by config) and reports back through Dagster Pipes.
"""


import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import dagster as dg
from pydantic import field_validator

from assets._common import RETRY, copy_artifact, counts_table, latest_metadata, latest_uri, local_copy, plot_md, publish_dir
from assets.dedup import deduped_shards
from composer_dag.train import data as data_engine
from composer_dag.train import model as model_engine
from composer_dag.train import tokenizer as tok_engine
from resources import ArtifactStorage, composer_home
from resources.cluster import ClusterResource
from resources.config import ClearConfigResource

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class ModelSettings(ClearConfigResource):
    """Where the base model comes from.

    ``base_model``: a Hugging Face directory (local path or ``s3://`` URL) of an open-weights
    model; its own tokenizer is used. Empty: a small Llama is built from ``config_name``
    (``tiny`` ~7M parameters, ``small`` ~34M, ``gpu-1b``) with a BPE tokenizer trained on the
    deduplicated shards.
    """

    base_model: str = ""
    config_name: str = "tiny"
    vocab_size: int = 8192
    tokenizer_train_mb: float = 16.0

    @field_validator("config_name")
    @classmethod
    def _known_config(cls, name: str) -> str:
        if name not in model_engine.CONFIGS:
            raise ValueError(f"unknown model config {name!r}; known: {sorted(model_engine.CONFIGS)}")
        return name


def _shard_urls(context, storage) -> list[str]:
    base = latest_uri(context.instance, "deduped_shards")
    storage.verify_manifest(base)
    return [u for u in storage.find(base) if u.rsplit("/", 1)[-1].startswith("shard-")]


def _iter_docs(storage, urls, columns=("id", "content", "source", "language")):
    for url in urls:
        table = storage.read_parquet(url, columns=list(columns))
        cols = [table.column(c).to_pylist() for c in columns]
        yield from zip(*cols)


def _fetch_base(settings: ModelSettings, dest: str) -> None:
    """Copy the configured base model directory (local or S3) into ``dest``."""
    src = settings.base_model
    if src.startswith("s3://"):
        from composer_dag.cli import storage_for

        st = storage_for(src)
        st.get_dir(st.root, dest)
    elif os.path.isdir(src):
        shutil.copytree(src, dest, dirs_exist_ok=True)
    else:
        raise dg.Failure(description=f"base model {src!r} is neither a directory nor an s3:// URL", allow_retries=False)
    if not os.path.exists(os.path.join(dest, "config.json")):
        raise dg.Failure(description=f"base model {src!r} has no config.json: not a Hugging Face model directory", allow_retries=False)


@dg.asset(deps=[deduped_shards], group_name="pretrain", kinds={"python", "huggingface"}, retry_policy=RETRY)
def tokenizer(context: dg.AssetExecutionContext, artifacts: ArtifactStorage, model_settings: ModelSettings):
    """The base model's own tokenizer when it has one; otherwise a byte-level BPE trained on the
    deduplicated shards, with the harness's special tokens (chat turns, tool calls, end of text)."""
    storage = artifacts.get()
    url = storage.url("tokenizer", context.run.run_id)
    with tempfile.TemporaryDirectory(prefix="composer-tok-") as tmp:
        out = os.path.join(tmp, "tokenizer")
        origin = "trained"
        if model_settings.base_model:
            base = os.path.join(tmp, "base")
            _fetch_base(model_settings, base)
            if os.path.exists(os.path.join(base, "tokenizer.json")) or os.path.exists(os.path.join(base, "tokenizer_config.json")):
                os.makedirs(out)
                for name in os.listdir(base):
                    if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
                        shutil.copy2(os.path.join(base, name), out)
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
        digest = publish_dir(storage, out, url)
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


class TokenShardParams(dg.Config):
    """``mixture``: weights by language, source, ``replay`` (non-code text) or ``*``; the integer
    part is copies, the fraction a deterministic chance of one more. Default: code once, replay
    text at half weight."""

    val_fraction: float = 0.02
    mixture: dict[str, float] = {"*": 1.0, "replay": 0.5}
    seed: int = 0


@dg.asset(deps=[deduped_shards, tokenizer], group_name="pretrain", kinds={"python", "numpy"}, retry_policy=RETRY)
def token_shards(context: dg.AssetExecutionContext, config: TokenShardParams, artifacts: ArtifactStorage):
    """Documents tokenized and packed into Megatron-style .bin/.idx (train and validation),
    joined by end-of-text, split by a hash of the document id, weighted by the mixture."""
    storage = artifacts.get()
    url = storage.url("token_shards", context.run.run_id)
    shards = _shard_urls(context, storage)
    with local_copy(storage, latest_uri(context.instance, "tokenizer")) as tok_dir, \
            tempfile.TemporaryDirectory(prefix="composer-tokens-") as tmp:
        tok = tok_engine.load_tokenizer(tok_dir)
        docs = ((i, c, s, lang) for i, c, s, lang in _iter_docs(storage, shards))
        summary = data_engine.pack_documents(docs, tok, tmp, val_fraction=config.val_fraction, mixture=config.mixture, seed=config.seed)
        digest = publish_dir(storage, tmp, url)
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
        digest = publish_dir(storage, out, url)
    return dg.MaterializeResult(
        metadata={
            "dagster/uri": url,
            "manifest_digest": digest,
            "origin": info["origin"],
            "config_name": info.get("config_name", ""),
            "params": info.get("params") if isinstance(info.get("params"), int) else 0,
        }
    )


class MidtrainParams(dg.Config):
    """Training settings (see composer_dag.train.midtrain.MidtrainConfig for every field)."""

    seq_len: int = 256
    micro_batch: int = 8
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 20
    schedule: str = "cosine"
    max_steps: int = 200
    zero_stage: int = 2
    eval_every: int = 50
    eval_batches: int = 8
    save_every: int = 50
    seed: int = 0


def work_dir(name: str, *inputs: str) -> str:
    """A working directory keyed by the inputs: a retry or re-run with the same inputs and
    settings resumes from its last checkpoint instead of starting over."""
    key = hashlib.sha256("\0".join(inputs).encode()).hexdigest()[:16]
    path = os.path.join(composer_home(), "work", name, key)
    os.makedirs(path, exist_ok=True)
    return path


@dg.asset(
    deps=[token_shards, base_model],
    group_name="pretrain",
    kinds={"pytorch", "deepspeed"},
    pool="gpu",
    retry_policy=dg.RetryPolicy(max_retries=1, delay=5),
    check_specs=[
        dg.AssetCheckSpec("loss_finite_and_lower", asset="midtrained_checkpoint", blocking=True,
                          description="Every logged loss is finite and the last is lower than the first."),
        dg.AssetCheckSpec("val_ppl_below_base", asset="midtrained_checkpoint", blocking=True,
                          description="Validation perplexity after training is below the base model's."),
        dg.AssetCheckSpec("loads_and_generates", asset="midtrained_checkpoint", blocking=True,
                          description="The checkpoint loads in transformers and generates text."),
    ],
)
def midtrained_checkpoint(
    context: dg.AssetExecutionContext, config: MidtrainParams, artifacts: ArtifactStorage, cluster: ClusterResource
):
    """Continued pre-training of the base model on the token shards with DeepSpeed, run on the
    cluster resource; resumes from its last checkpoint when retried with the same inputs."""
    storage = artifacts.get()
    shards_meta = latest_metadata(context.instance, "token_shards") or {}
    base_meta = latest_metadata(context.instance, "base_model") or {}
    params = config.model_dump()
    wd = work_dir("midtrain", str(shards_meta.get("manifest_digest")), str(base_meta.get("manifest_digest")), json.dumps(params, sort_keys=True))
    data_dir, model_dir, out_dir = (os.path.join(wd, d) for d in ("data", "base", "run"))
    for d, key in ((data_dir, "token_shards"), (model_dir, "base_model")):
        if not os.path.exists(os.path.join(d, "manifest.json")):
            copy_artifact(storage, latest_uri(context.instance, key), d)
    cfg = {**params, "model_dir": model_dir, "data_dir": data_dir, "out_dir": out_dir}
    cfg_path = os.path.join(wd, "midtrain.json")
    Path(cfg_path).write_text(json.dumps(cfg, indent=2))
    context.log.info(f"training in {wd} (resumes there if interrupted)")
    result = cluster.run(context, "composer_dag.train.midtrain", ["--config", cfg_path], name="composer-midtrain")

    url = storage.url("midtrained_checkpoint", context.run.run_id)
    hf_dir = os.path.join(out_dir, "hf")
    with tempfile.TemporaryDirectory(prefix="composer-ckpt-") as tmp:
        shutil.copytree(hf_dir, tmp, dirs_exist_ok=True)
        state = os.path.join(out_dir, "checkpoints", result["checkpoint"], "trainer_state.json")
        if os.path.exists(state):
            shutil.copy2(state, os.path.join(tmp, "trainer_state.json"))
        for name in ("result.json", "metrics.jsonl"):
            shutil.copy2(os.path.join(out_dir, name), os.path.join(tmp, name))
        digest = publish_dir(storage, tmp, url)

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
            "work_dir": wd,
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
    sample = _generate(hf_dir)
    served = _vllm_smoke(hf_dir)
    yield dg.AssetCheckResult(
        check_name="loads_and_generates",
        passed=bool(sample["new_tokens"] > 0 and served.get("new_tokens", 0) > 0),
        metadata={
            "transformers_sample": dg.MetadataValue.md("```python\n" + sample["text"][:800] + "\n```"),
            "transformers_new_tokens": sample["new_tokens"],
            "vllm_sample": dg.MetadataValue.md("```python\n" + str(served.get("text", served.get("error")))[:800] + "\n```"),
            "vllm_new_tokens": int(served.get("new_tokens", 0)),
        },
    )


def _vllm_smoke(hf_dir: str) -> dict:
    """Load the checkpoint in vLLM (in its own process: its engine spawns workers) and sample."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "composer_dag.inference.smoke", hf_dir, "--engine", "vllm"],
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        return {"new_tokens": 0, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _generate(hf_dir: str, prompt: str = "def fibonacci(n):\n") -> dict:
    """Load a checkpoint with transformers and sample a continuation."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    ids = tok(prompt, return_tensors="pt")
    torch.manual_seed(0)
    out = model.generate(**ids, max_new_tokens=48, do_sample=True, temperature=0.8, pad_token_id=tok.pad_token_id)
    new = out[0, ids["input_ids"].shape[1]:]
    return {"text": prompt + tok.decode(new, skip_special_tokens=True), "new_tokens": int(new.numel())}
