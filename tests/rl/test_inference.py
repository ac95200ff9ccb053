"""Inference engines: the vLLM engine's sampled tokens and logprobs agree with the
transformers model scoring the same tokens; weights reload in place; HF engine basics."""

import glob
import json
import os

import sys

import pytest

from composer_dag.inference import HFEngine, Sampling, make_engine
from composer_dag.train.model import build_base_model
from composer_dag.train.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("inf")
    src = os.path.dirname(json.__file__)
    texts = [open(f, encoding="utf-8").read() for f in sorted(glob.glob(src + "/*.py"))]
    tok = train_tokenizer(texts, str(d / "tok"), vocab_size=512)
    a, b = str(d / "a"), str(d / "b")
    build_base_model("tiny", tok, a, seed=1)
    build_base_model("tiny", tok, b, seed=2)
    return a, b


PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 200, 300, 400, 10, 11, 12]]


def _close(engine_outs, scorer, temperature, atol):
    for c in engine_outs:
        ref = scorer.score(c.prompt_ids, c.token_ids, temperature)
        assert len(ref) == len(c.logprobs) == len(c.token_ids) > 0
        assert max(abs(x - y) for x, y in zip(ref, c.logprobs)) < atol


def test_hf_engine_interface(models):
    eng = HFEngine(models[0])
    outs = eng.generate(PROMPTS, Sampling(n=2, temperature=0.8, max_tokens=12, stop_token_ids=(3,), seed=0))
    assert len(outs) == 6 and [o.prompt_ids for o in outs[:2]] == [PROMPTS[0]] * 2
    for o in outs:
        assert o.finish_reason in ("stop", "length") and len(o.token_ids) <= 12
        assert o.finish_reason == "length" or o.token_ids[-1] == 3
    _close(outs, eng, 0.8, 1e-4)
    assert eng.stats.generated_tokens == sum(len(o.token_ids) for o in outs)


@pytest.mark.slow
def test_vllm_matches_hf_and_reloads_weights(models, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process: faster start
    # vLLM's in-process kernel override scans every module's namespace and trips on llvmlite's ffi
    # `lib` (any attribute of it, `__dict__` included, is a foreign function). The dedup tests load
    # it into this process through numba; jobs run vLLM in processes that never import numba, so
    # here those modules are out of sys.modules for the test's duration.
    for name in [n for n in sys.modules if n.split(".")[0] in ("llvmlite", "numba")]:
        monkeypatch.delitem(sys.modules, name)
    hf_a, hf_b = HFEngine(models[0]), HFEngine(models[1])
    eng = make_engine("vllm", models[0], max_model_len=256, kv_cache_bytes=64 << 20, seed=0)
    try:
        params = Sampling(n=2, temperature=1.0, max_tokens=16, seed=123)
        outs = eng.generate(PROMPTS, params)
        assert len(outs) == 6 and all(o.prompt_ids == p for o, p in zip(outs, [p for p in PROMPTS for _ in "ab"]))
        assert all(len(o.token_ids) == 16 and o.finish_reason == "length" for o in outs)
        _close(outs, hf_a, 1.0, 2e-3)
        _close(eng.generate(PROMPTS, Sampling(temperature=0.7, max_tokens=8, seed=5)), hf_a, 0.7, 2e-3)
        assert [o.token_ids for o in eng.generate(PROMPTS, params)] == [o.token_ids for o in outs]  # seeded
        # Seeded prompts that together exceed one step's token budget (24 x 240 > 4096): with
        # chunked prefill on, vLLM's CPU worker dies rewinding a seeded generator.
        long = [[(7 * i + j) % 500 + 3 for j in range(240)] for i in range(24)]
        assert [len(o.token_ids) for o in eng.generate(long, Sampling(max_tokens=4, seed=9))] == [4] * 24
        secs = eng.load_weights(models[1])
        assert secs < 30
        again = eng.generate(PROMPTS, params)
        _close(again, hf_b, 1.0, 2e-3)
        assert [o.logprobs for o in again] != [o.logprobs for o in outs]
    finally:
        eng.close()
