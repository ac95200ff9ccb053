"""Base model: a small Llama built from a named config, saved as a Hugging Face directory.

The directory (config.json, model.safetensors, generation_config.json, tokenizer files) loads
with ``transformers.AutoModelForCausalLM.from_pretrained`` and with vLLM (Llama architecture,
untied embeddings).
"""

from __future__ import annotations

import json
import os
import shutil

from pydantic import field_validator

from ..runtime.checkpoint import atomic_dir
from ..runtime.config import StageConfig, one_of

CONFIGS: dict[str, dict] = {
    # ~7.4M parameters at vocab 8192 (embeddings 4.2M, 4 blocks of 0.79M)
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, intermediate_size=688, max_position_embeddings=2048),
    # ~34M parameters at vocab 8192
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=8, intermediate_size=1376, max_position_embeddings=1024),
    # ~1B parameters at vocab 32k: the scale-out shape for GPU nodes
    "gpu-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
                   num_key_value_heads=8, intermediate_size=5504, max_position_embeddings=4096,
                   rope_theta=500000.0),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt",
                   "added_tokens.json")


class BaseModelConfig(StageConfig):
    """Where the base model and its tokenizer come from.

    ``base_model``: a Hugging Face directory (local path or ``s3://`` URL) of an open-weights
    model; its own tokenizer is used. Empty: a small Llama is built from ``config_name``
    (``tiny`` ~7M parameters, ``small`` ~34M, ``gpu-1b``) with a byte-level BPE tokenizer of
    ``vocab_size`` trained on the first ``tokenizer_train_mb`` of the deduplicated shards.
    """

    base_model: str = ""
    config_name: str = "tiny"
    vocab_size: int = 8192
    tokenizer_train_mb: float = 8.0

    @field_validator("config_name")
    @classmethod
    def _known_config(cls, name: str) -> str:
        return one_of(name, sorted(CONFIGS), "model config")


def fetch_base_model(src: str, dest: str) -> None:
    """Copy a Hugging Face model directory (local path or ``s3://`` URL) into ``dest``;
    ``ValueError`` in one line when it is not one."""
    from ..storage import open_storage

    if src.startswith("s3://"):
        st = open_storage(src)
        st.get_dir(st.root, dest)
    elif os.path.isdir(src):
        shutil.copytree(src, dest, dirs_exist_ok=True)
    else:
        raise ValueError(f"base model {src!r} is neither a directory nor an s3:// URL")
    if not os.path.exists(os.path.join(dest, "config.json")):
        raise ValueError(f"base model {src!r} has no config.json: not a Hugging Face model directory")


def copy_tokenizer(model_dir: str, dest: str) -> bool:
    """Copy a model directory's own tokenizer files into ``dest``; False when it has none."""
    names = [n for n in os.listdir(model_dir) if n.startswith(("tokenizer", "special_tokens", "vocab", "merges",
                                                                  "chat_template"))]
    if not any(n in ("tokenizer.json", "tokenizer_config.json") for n in names):
        return False
    os.makedirs(dest, exist_ok=True)
    for name in names:
        shutil.copy2(os.path.join(model_dir, name), dest)
    return True


def default_dtype() -> str:
    import torch

    return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"


def llama_config(config_name: str, tokenizer, dtype: str | None = None, **overrides):
    from transformers import LlamaConfig

    if config_name not in CONFIGS:
        raise ValueError(f"unknown model config {config_name!r}; known: {sorted(CONFIGS)}")
    cfg = dict(CONFIGS[config_name], vocab_size=len(tokenizer), tie_word_embeddings=False,
               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id, rms_norm_eps=1e-5, attention_dropout=0.0,
               hidden_act="silu", initializer_range=0.02)
    cfg.update(overrides)
    config = LlamaConfig(**cfg)
    config.dtype = dtype or default_dtype()
    return config


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def copy_tokenizer_files(src_dir: str, dst_dir: str) -> None:
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(src_dir, name)):
            shutil.copy2(os.path.join(src_dir, name), os.path.join(dst_dir, name))


def _legacy_config_keys(path: str) -> None:
    """Also spell dtype and rope theta the way older transformers and vLLM readers expect."""
    with open(path) as f:
        cfg = json.load(f)
    if "dtype" in cfg:
        cfg.setdefault("torch_dtype", cfg["dtype"])
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None:
        cfg.setdefault("rope_theta", theta)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def save_hf_dir(model, out_dir: str, tokenizer_dir: str | None = None, tokenizer=None,
                state_dict=None) -> str:
    """Write ``model`` (weights, config, generation config) and tokenizer files atomically."""
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp, state_dict=state_dict)
        _legacy_config_keys(os.path.join(tmp, "config.json"))
        if tokenizer_dir:
            copy_tokenizer_files(tokenizer_dir, tmp)
        elif tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return out_dir


def build_base_model(config_name: str, tokenizer, out_dir: str, seed: int = 0,
                     dtype: str | None = None, **overrides) -> dict:
    """Build a freshly initialised Llama from ``CONFIGS[config_name]`` and save it to ``out_dir``.

    ``tokenizer`` is a tokenizer directory (its files are copied as they are) or a tokenizer
    object. ``overrides`` go into the ``LlamaConfig``. Returns path, param count and config.
    """
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    from .tokenizer import load_tokenizer

    tok_dir = tokenizer if isinstance(tokenizer, str) else None
    tok = load_tokenizer(tok_dir) if tok_dir else tokenizer
    config = llama_config(config_name, tok, dtype, **overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, config.dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, do_sample=True, temperature=0.8, top_p=0.95,
        max_new_tokens=256)
    save_hf_dir(model, out_dir, tokenizer_dir=tok_dir, tokenizer=None if tok_dir else tok)
    return {"path": out_dir, "params": param_count(model), "config_name": config_name,
            "config": config.to_dict()}


def load_base_model(path: str, dtype: str | None = None):
    """A causal LM from a local Hugging Face directory (float32 on CPU unless told)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype or default_dtype()))


def sample_text(model_dir: str, prompt: str = "def fibonacci(n):\n", max_tokens: int = 32, seed: int = 0) -> dict:
    """Load a saved checkpoint in transformers and sample a short continuation (temperature 0.8):
    the check that an exported checkpoint loads and generates. Returns the new token count and text."""
    import torch
    from transformers import AutoModelForCausalLM

    from .tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([tok(prompt)["input_ids"]])
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=0.8, top_p=1.0,
                             max_new_tokens=max_tokens, pad_token_id=model.config.pad_token_id or 0)
    new = out[0, ids.shape[1]:].tolist()
    return {"engine": "hf", "new_tokens": len(new), "text": prompt + tok.decode(new, skip_special_tokens=True)}


def supervised_loss(model, x, labels):
    """Mean next-token loss of ``model`` (a Hugging Face causal LM, or a DeepSpeed engine around
    one) on ``x`` where ``labels`` is not ``-100``. The output layer runs on those positions only:
    the rest of an agent transcript (prompt, tool output, padding: about four fifths of it) would
    each cost a row of logits over the whole vocabulary and give no loss, so an SFT step takes
    0.6-0.7x the time of full logits with ``ignore_index``, for the same loss and gradients."""
    import torch.nn.functional as F

    module = getattr(model, "module", model)
    hidden = module.get_decoder()(input_ids=x[:, :-1], use_cache=False).last_hidden_state
    targets = labels[:, 1:]
    keep = targets != -100
    logits = module.get_output_embeddings()(hidden[keep])
    return F.cross_entropy(logits.float(), targets[keep])
