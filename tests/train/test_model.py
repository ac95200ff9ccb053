import glob
import json
import os

import pytest
import torch

from composer_dag.train.model import CONFIGS, build_base_model, llama_config, load_base_model
from composer_dag.train.tokenizer import load_tokenizer, train_tokenizer


class _Vocab:  # just what llama_config reads from a tokenizer
    bos_token_id = eos_token_id = 0
    pad_token_id = 1

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


def params_of(name, vocab):
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(llama_config(name, _Vocab(vocab))).parameters())


def test_named_config_sizes():
    assert 5e6 <= params_of("tiny", 8192) <= 20e6
    assert 20e6 <= params_of("small", 8192) <= 40e6
    assert 0.8e9 <= params_of("gpu-1b", 32000) <= 1.3e9
    assert set(CONFIGS) >= {"tiny", "small", "gpu-1b"}
    with pytest.raises(ValueError):
        llama_config("huge", _Vocab(10))


def test_build_load_generate(tmp_path):
    src = os.path.dirname(json.__file__)
    texts = [open(f, encoding="utf-8").read() for f in sorted(glob.glob(src + "/*.py"))]
    tok_dir = train_tokenizer(texts, str(tmp_path / "tok"), vocab_size=512)
    info = build_base_model("tiny", tok_dir, str(tmp_path / "model"), seed=1)
    files = set(os.listdir(tmp_path / "model"))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json"} <= files
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]
    cfg = json.load(open(tmp_path / "model" / "config.json"))
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is False
    assert cfg["torch_dtype"] == "float32" and cfg["vocab_size"] == 512
    model = load_base_model(str(tmp_path / "model"))
    assert sum(p.numel() for p in model.parameters()) == info["params"]
    tok = load_tokenizer(str(tmp_path / "model"))
    prompt = tok("def load(fp):", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=6, do_sample=False)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 6
    # same seed, same weights
    again = build_base_model("tiny", tok_dir, str(tmp_path / "again"), seed=1)
    m2 = load_base_model(again["path"])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), m2.parameters()))
