"""The GRPO trainer: a DeepSpeed engine over the policy, one optimizer update per batch of
groups; weights out as a state dict or a ``model.safetensors`` directory."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Literal, Optional

import torch

from pydantic import Field, field_validator

from ..runtime.config import StageConfig, one_of
from . import grpo


class TrainerConfig(StageConfig):
    """The GRPO trainer (DeepSpeed). The batch size, sampling temperature and seed come from
    the run: ``tasks_per_step * group_size``, the orchestrator's temperature, the run's seed."""

    loss: str = Field("grpo", description="the policy loss, one of rl.grpo.LOSSES: grpo (the clipped surrogate), "
                                          "reinforce (no ratio, no clip: on-policy only)")
    lr: float = 1e-5
    warmup_steps: int = Field(0, ge=0, description="updates over which the learning rate rises linearly to lr "
                                                   "(Adam's first update moves every weight by about lr)")
    clip_eps: float = 0.2
    clip_eps_high: Optional[float] = None
    kl_coef: float = Field(0.0, description="> 0 loads a frozen copy of the initial policy as reference")
    normalize_std: bool = Field(True, description="divide advantages by the group's reward std")
    loss_norm: Literal["token", "sequence"] = Field(
        "token", description="token: the batch's loss is a mean over all its sampled tokens; sequence: over rollouts, "
                             "each a mean over its own tokens (a long failed episode counts as much as a short success)")
    negative_weight: float = Field(1.0, ge=0.0, description="negative advantages are multiplied by this (W-REINFORCE's "
                                                           "lambda): below 1, what failed is pushed down less than "
                                                           "what succeeded is pushed up")
    uniform_groups: bool = Field(True, description="also train on groups whose samples all earned the same reward "
                                                   "(advantage 0: only the KL term and the loss's denominator see "
                                                   "them); off, they are left out of the update (DAPO's filter)")
    micro_batch: int = 8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.99
    zero_stage: int = 2

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, name: str) -> str:
        from .grpo import LOSSES

        return one_of(name, LOSSES, "RL loss")


class GRPOTrainer:
    def __init__(self, model_dir: str, cfg: TrainerConfig, batch_size: int, temperature: float = 1.0, seed: int = 0):
        from transformers import AutoModelForCausalLM

        from ..runtime.distributed import setup_distributed
        from ..train.tokenizer import load_tokenizer

        self.cfg, self.batch_size, self.temperature, self.seed = cfg, batch_size, temperature, seed
        self.rank, self.world, self.device = setup_distributed()
        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        torch.manual_seed(seed)
        self.bf16 = self.device.type == "cuda" and torch.cuda.is_bf16_supported()
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.pad_id = load_tokenizer(model_dir).pad_token_id
        self.grad_accum = max(1, math.ceil(batch_size / cfg.micro_batch))
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                weight_decay=cfg.weight_decay)
        ds = {"train_micro_batch_size_per_gpu": cfg.micro_batch, "gradient_accumulation_steps": self.grad_accum,
              "gradient_clipping": cfg.grad_clip, "zero_optimization": {"stage": cfg.zero_stage},
              "bf16": {"enabled": self.bf16}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 1 << 30, "wall_clock_breakdown": False}
        warm = cfg.warmup_steps
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warm) if warm else 1.0)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=ds)
        self.ref = None
        if cfg.kl_coef:
            self.ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(self.device).eval()
            self.ref.requires_grad_(False)
        self.version = 0
        self.nan_skipped = 0

    # -- the update
    def _zero_loss(self) -> torch.Tensor:
        return sum((p * 0).sum() for p in self.engine.module.parameters() if p.requires_grad)

    def train_step(self, rollouts: list[dict]) -> dict:
        """One optimizer update on ``rollouts`` (each with ``advantage`` set); bumps ``version``."""
        cfg, t0 = self.cfg, time.perf_counter()
        episodes = [r for r in rollouts if len(r.get("completion_ids") or []) or r.get("segments")]
        if len(episodes) > self.batch_size:
            raise ValueError(f"{len(episodes)} rollouts exceed batch_size {self.batch_size}")
        rollouts = [row for r in episodes for row in grpo.training_rows(r) if len(row["completion_ids"])]
        seq = cfg.loss_norm == "sequence"
        total = float(len(episodes) if seq else sum(sum(r["loss_mask"]) for r in rollouts)) or 1.0
        # rows of multi-segment episodes beyond micro_batch * grad_accum: wider micro-batches, the
        # same number of them (DeepSpeed steps the optimizer every grad_accum backward passes)
        size = max(cfg.micro_batch, math.ceil(len(rollouts) / self.grad_accum))
        chunks = [rollouts[i:i + size] for i in range(0, len(rollouts), size)]
        chunks += [[]] * (self.grad_accum - len(chunks))
        agg = {"loss": 0.0, "clip_frac": 0.0, "ratio_sum": 0.0, "tokens": 0.0, "kl_sum": 0.0}
        lr = self.engine.get_lr()[0]  # this update's (where the warm-up stands)
        nan = 0
        self.engine.train()
        for chunk in chunks:
            if chunk:
                b = {k: v.to(self.device) for k, v in grpo.pack(chunk, self.pad_id).items()}
                b["advantages"] = grpo.weigh_negatives(b["advantages"], cfg.negative_weight)
                logp = grpo.token_logprobs(self.engine, b["input_ids"], b["attention_mask"], self.temperature,
                                           b["loss_mask"])
                ref = None
                if self.ref is not None:
                    with torch.no_grad():
                        ref = grpo.token_logprobs(self.ref, b["input_ids"], b["attention_mask"], self.temperature,
                                                 b["loss_mask"])
                loss, st = grpo.LOSSES[cfg.loss](logp, b["old_logprobs"], b["advantages"], b["loss_mask"], cfg.clip_eps,
                                          cfg.clip_eps_high, ref, cfg.kl_coef, denom=total,
                                          weight=grpo.sequence_weights(b["loss_mask"], b["episode_tokens"]) if seq else None)
                if torch.isfinite(loss):
                    agg["loss"] += loss.item()
                    for k in ("clip_frac", "ratio_sum", "tokens", "kl_sum"):
                        agg[k] += st[k]
                else:
                    nan += 1
                    loss = self._zero_loss()
            else:
                loss = self._zero_loss()
            # DeepSpeed divides by the accumulation steps; the loss is already a batch mean
            self.engine.backward(loss * self.grad_accum)
            self.engine.step()
        self.nan_skipped += nan
        self.version += 1
        n = agg["tokens"] or 1.0
        return {"loss": agg["loss"], "lr": lr, "clip_frac": agg["clip_frac"] / n, "ratio_mean": agg["ratio_sum"] / n,
                "kl": agg["kl_sum"] / n, "train_tokens": int(agg["tokens"]), "nan_skipped": nan,
                "grad_norm": _float(self.engine.get_global_grad_norm()), "train_seconds": time.perf_counter() - t0}

    # -- weights out
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in self.engine.module.state_dict().items()}

    def save_weights(self, out_dir: str, state_dict=None) -> str:
        """``model.safetensors`` only (what an inference engine reloads), written atomically."""
        from safetensors.torch import save_file

        os.makedirs(out_dir, exist_ok=True)
        tmp = os.path.join(out_dir, f".model.safetensors.tmp-{os.getpid()}")
        save_file(state_dict or self.state_dict(), tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(out_dir, "model.safetensors"))
        return out_dir

    def export_hf(self, out_dir: str, tokenizer_dir: str) -> str:
        from ..train.model import save_hf_dir

        self.engine.module.config.dtype = "float32"
        return save_hf_dir(self.engine.module, out_dir, tokenizer_dir=tokenizer_dir)

    # -- checkpoints
    def save_checkpoint(self, ckpt_root: str, tag: str, tokenizer_dir: str, state: dict) -> str:
        """DeepSpeed state, ``hf/`` and ``trainer_state.json`` under ``ckpt_root/tag``, sealed
        with a ``manifest.json`` once every file is written (a save cut short has none)."""
        from ..runtime.checkpoint import (clear_checkpoint, pause_before_seal, rng_state, seal_checkpoint,
                                      write_json_atomic)

        path = os.path.join(ckpt_root, tag)
        clear_checkpoint(path)
        self.engine.save_checkpoint(ckpt_root, tag=tag, save_latest=False)
        pause_before_seal()
        self.export_hf(os.path.join(path, "hf"), tokenizer_dir)
        write_json_atomic(os.path.join(path, "trainer_state.json"), {
            **state, "version": self.version, "nan_skipped": self.nan_skipped, "rng": rng_state(),
            "trainer_config": self.cfg.to_dict()})
        seal_checkpoint(path)
        return path

    def commit_checkpoint(self, out_dir: str, tokenizer_dir: str, state: dict, keep: int) -> str:
        """Save version ``self.version`` as ``out_dir/checkpoints/step_N``, then commit it: point
        ``out_dir/latest`` at it (what a resumed run reads) and drop all but the newest ``keep``
        checkpoints. Returns the tag."""
        from ..runtime.checkpoint import commit_latest

        ckpt_root, tag = os.path.join(out_dir, "checkpoints"), f"step_{self.version:07d}"
        self.save_checkpoint(ckpt_root, tag, tokenizer_dir, {"step": self.version, **state})
        commit_latest(out_dir, ckpt_root, {"tag": tag, "step": self.version}, keep)
        return tag

    def load_checkpoint(self, ckpt_root: str, tag: str) -> dict:
        from ..runtime.checkpoint import set_rng_state

        self.engine.load_checkpoint(ckpt_root, tag=tag)
        with open(os.path.join(ckpt_root, tag, "trainer_state.json")) as f:
            st = json.load(f)
        self.version, self.nan_skipped = st["version"], st["nan_skipped"]
        set_rng_state(st["rng"])
        return st


def _float(x):
    try:
        return float(x) if x is not None else None
    except (TypeError, ValueError):
        return None
