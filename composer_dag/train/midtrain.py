"""Mid-training (continued pre-training on code) with DeepSpeed ZeRO.

    python -m composer_dag.train.midtrain --config run.json [--set key=json_value ...]
    torchrun --nproc-per-node N -m composer_dag.train.midtrain --config run.json
    deepspeed --num_gpus N --module composer_dag.train.midtrain --config run.json

On CPU: fp32, ``DS_ACCELERATOR=cpu``, gloo. On GPU: bf16 (when ``bf16`` is null/auto), NCCL.
Everything lands in ``out_dir``::

    metrics.jsonl               one JSON line per log step ({"step","loss","lr","tokens",
                                "tokens_per_s",...}) and per eval ({"step","val_loss","val_ppl"})
    checkpoints/step_0000005/   DeepSpeed engine state (model, ZeRO optimizer partitions, LR
                                scheduler), trainer_state.json (step, samples, rng states,
                                loss and eval history), hf/ (a Hugging Face export)
    checkpoints/step_*/manifest.json
                                size and sha256 of every file of the checkpoint, written once
                                all of them are on disk (a save cut short has none)
    latest                      {"tag","step","samples"}, written last, atomically: the
                                checkpoint to resume from
    hf/                         the final Hugging Face model directory
    result.json                 the run summary (also the last stdout line / Pipes message)

Resume: a run whose ``out_dir`` has ``latest`` loads that checkpoint and continues at the
exact global sample, so an interrupted run ends where an uninterrupted one does. The checkpoint
is read only when it matches its manifest; one that does not (a save cut short, a damaged file)
is skipped with a log line and the newest older checkpoint that does match is used instead.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from typing import Literal, Optional

import numpy as np

from pydantic import Field

from ..pipes import Reporter, entry_point
from ..runtime.config import StageConfig
from .data import TokenShardDataset, TranscriptDataset, mixed_batches
from ..runtime.checkpoint import (atomic_dir, clear_checkpoint, commit_latest, pause_before_seal, per_node_state,
                                  resume_checkpoint,
                                  rng_state, seal_checkpoint, set_rng_state, trim_metrics, write_json_atomic)
from ..runtime.distributed import setup_distributed
from .model import param_count, sample_text, save_hf_dir, supervised_loss


class MidtrainConfig(StageConfig):
    """Continued pre-training. Defaults fit the embedded default (the ``tiny`` model on CPU);
    a GPU run raises ``seq_len``, ``micro_batch`` and ``max_steps`` and lowers ``lr``."""

    model_dir: str                  # Hugging Face directory of the base model (+ tokenizer)
    data_dir: str                   # lm: train.bin/.idx, val.bin/.idx; sft: train.parquet, val.parquet
    out_dir: str
    objective: Literal["lm", "sft"] = Field(
        "lm", description="lm: next-token loss on packed token shards; sft: loss on the assistant's "
                          "tokens of tokenized transcripts (input_ids, loss_mask)")
    seq_len: int = 256
    micro_batch: int = Field(8, description="samples per rank per forward")
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 20
    schedule: Literal["cosine", "wsd"] = Field("cosine", description="wsd: warmup, stable, linear decay")
    decay_frac: float = Field(0.2, description="wsd: the last fraction of steps that decays")
    max_steps: int = Field(80, description="optimizer steps")
    max_tokens: Optional[int] = Field(None, description="if set, also stop after this many tokens")
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    zero_stage: int = 2
    bf16: Optional[bool] = Field(None, description="None: bf16 on a GPU with bf16, fp32 otherwise")
    eval_every: int = Field(50, description="steps; validation also runs at step 0 and at the end")
    eval_batches: int = Field(8, description="micro-batches per rank per validation")
    early_stop_patience: Optional[int] = Field(
        None, description="stop once the validation loss has not improved for this many validations in a "
                          "row (the export is the checkpoint at the stop); None: run every step")
    save_every: int = Field(50, description="steps; a checkpoint is also written at the end")
    keep_checkpoints: int = 2
    log_every: int = 10
    shuffle: bool = Field(True, description="shuffle sample order per epoch (seeded)")
    sample_tokens: int = Field(48, description="> 0: the final checkpoint samples this many tokens (a check)")
    seed: int = 0

    def replay(self) -> Optional[tuple[str, float, int, int]]:
        """``(token shard dir, loss share, windows per micro-batch, window tokens)`` of the
        pre-training replay mixed into each micro-batch, or None (mid-training has none)."""
        return None

    def total_steps(self, world_size: int) -> int:
        if self.max_tokens is None:
            return self.max_steps
        per_step = self.seq_len * self.micro_batch * self.grad_accum * world_size
        return min(self.max_steps, math.ceil(self.max_tokens / per_step))


def lr_factor(cfg: MidtrainConfig, total_steps: int):
    """LR multiplier for LambdaLR: linear warmup, then cosine or WSD down to ``min_lr``."""
    floor = cfg.min_lr / cfg.lr

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "cosine":
            t = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))
        decay_start = max(cfg.warmup_steps, int(total_steps * (1 - cfg.decay_frac)))
        if step < decay_start:
            return 1.0
        t = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
        return 1 - (1 - floor) * t

    return f


def ds_config(cfg: MidtrainConfig, bf16: bool, gpu: bool = False) -> dict:
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": cfg.grad_accum,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage, "contiguous_gradients": True,
                              "overlap_comm": gpu},
        "bf16": {"enabled": bf16},
        "zero_allow_untested_optimizer": True,  # torch AdamW as the client optimizer
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def lm_loss(model, x, labels=None):
    """Mean next-token loss; with ``labels`` (``-100`` where no loss applies), on those tokens only."""
    import torch.nn.functional as F

    if labels is not None:
        return supervised_loss(model, x, labels)
    logits = model(input_ids=x[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))


def _dataset(cfg: "MidtrainConfig", split: str, pad_id: int = 0, **kw):
    if cfg.objective == "sft":
        return TranscriptDataset(os.path.join(cfg.data_dir, f"{split}.parquet"), cfg.seq_len, pad_id, **kw)
    return TokenShardDataset(os.path.join(cfg.data_dir, split), cfg.seq_len, **kw)


def _tokens(batch, pad_id: int) -> int:
    """Tokens a micro-batch feeds the model (padding left out; replay windows counted)."""
    if isinstance(batch, tuple):
        replay = batch[2].shape[0] * (batch[2].shape[1] - 1) if len(batch) == 3 else 0
        return int((batch[0][:, :-1] != pad_id).sum()) + replay
    return int(batch.shape[0] * (batch.shape[1] - 1))


def batch_loss(engine, batch, device, replay_share: float = 0.0):
    """The loss of one micro-batch: packed windows (every token a target), or transcripts (the
    assistant's tokens), or transcripts plus replay windows, weighted ``1 - replay_share`` and
    ``replay_share`` (each part a mean over its own targets, whatever the transcripts' lengths)."""
    import torch

    if not isinstance(batch, tuple):
        return lm_loss(engine, torch.from_numpy(batch).to(device, non_blocking=True))
    x, y = (torch.from_numpy(a).to(device) for a in batch[:2])
    loss = lm_loss(engine, x, y)
    if len(batch) == 3:
        loss = (1 - replay_share) * loss + replay_share * lm_loss(engine, torch.from_numpy(batch[2]).to(device))
    return loss


def _train_batches(cfg: MidtrainConfig, pad_id: int, rank: int, world: int, samples: int):
    """The training micro-batches from global sample ``samples`` on; with a replay, each carries
    its pre-training windows, which resume at the exact window too (``windows`` per ``micro_batch``
    transcripts)."""
    data = _dataset(cfg, "train", pad_id, rank=rank, world_size=world, start_sample=samples,
                    shuffle_seed=cfg.seed if cfg.shuffle else None).batches(cfg.micro_batch)
    spec = cfg.replay()
    if spec is None or spec[1] <= 0:
        return data
    shards, _, windows, seq_len = spec
    replay = TokenShardDataset(os.path.join(shards, "train"), seq_len, rank=rank, world_size=world,
                               start_sample=samples // cfg.micro_batch * windows,
                               shuffle_seed=cfg.seed if cfg.shuffle else None)
    return mixed_batches(data, replay, windows)


def stalled(evals: list[dict], patience: Optional[int]) -> bool:
    """Whether the last ``patience`` validations all failed to beat the best loss before them."""
    losses = [e["val_loss"] for e in evals if e.get("val_loss") is not None]
    if not patience or len(losses) <= patience:
        return False
    return min(losses[-patience:]) >= min(losses[:-patience])


def val_samples_per_rank(cfg: MidtrainConfig, world: int) -> int:
    """How many val samples each rank evaluates (0: no usable validation split)."""
    marker = os.path.join(cfg.data_dir, "val.parquet" if cfg.objective == "sft" else "val.idx")
    if not os.path.exists(marker):
        return 0
    try:
        n = _dataset(cfg, "val").num_samples
    except ValueError:  # fewer than seq_len + 1 tokens, or no transcript
        return 0
    return min(cfg.eval_batches * cfg.micro_batch, n // world)


def _mean_loss(engine, ds, per_rank: int, micro_batch: int, rank: int, world: int, device) -> float:
    """Mean token loss over the first ``per_rank * world`` samples of ``ds``, split over the
    ranks (transcripts: the assistant's tokens)."""
    import torch
    import torch.distributed as dist

    idx = [rank + k * world for k in range(per_rank)]
    total = torch.zeros(2, dtype=torch.float64, device=device)
    engine.eval()
    with torch.no_grad():
        for i in range(0, len(idx), micro_batch):
            batch = ds.collate([ds[g] for g in idx[i:i + micro_batch]])
            if isinstance(batch, tuple):
                x, y = (torch.from_numpy(a).to(device) for a in batch)
                n = int((y[:, 1:] != -100).sum())
            else:
                x, y = torch.from_numpy(batch).to(device), None
                n = x[:, 1:].numel()
            if n:
                total += torch.tensor([lm_loss(engine, x, y).item() * n, n], dtype=torch.float64, device=device)
    engine.train()
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def evaluate(engine, cfg: MidtrainConfig, rank: int, world: int, device, pad_id: int = 0) -> float | None:
    """Mean token loss on the first val samples (same count on every rank; sft: on the
    assistant's tokens); None if no val."""
    per_rank = val_samples_per_rank(cfg, world)
    if per_rank == 0:
        return None
    return _mean_loss(engine, _dataset(cfg, "val", pad_id), per_rank, cfg.micro_batch, rank, world, device)


def code_val_loss(engine, cfg: MidtrainConfig, rank: int, world: int, device) -> float | None:
    """With a replay's token shards: the mean loss on their validation windows (the code the
    model must not forget), at the replay's window length; None without them."""
    spec = cfg.replay()
    if spec is None or not os.path.exists(os.path.join(spec[0], "val.idx")):
        return None
    ds = TokenShardDataset(os.path.join(spec[0], "val"), spec[3])
    per_rank = min(cfg.eval_batches * cfg.micro_batch, ds.num_samples // world)
    return _mean_loss(engine, ds, per_rank, cfg.micro_batch, rank, world, device) if per_rank else None


# ---- the run ---------------------------------------------------------------------------
@dataclass
class _Progress:
    """Where a run is: what a checkpoint's ``trainer_state.json`` holds besides the RNG states."""
    step: int = 0
    samples: int = 0
    tokens: int = 0
    history: list = field(default_factory=list)   # [step, loss] per log step
    evals: list = field(default_factory=list)     # one record per validation
    stopped_early: bool = False                   # set once the validation loss stalls (early_stop_patience)


class _Meter:
    """The loss and throughput between log lines: the loss summed over the updates since the last
    line (every rank's), and the tokens fed and seconds spent in that window and in the run."""

    def __init__(self, device, world: int):
        import torch

        self.world, self.t_start = world, time.perf_counter()
        self.fed = torch.zeros((), dtype=torch.int64, device=device)   # this update's tokens
        self.loss, self.updates = torch.zeros((), device=device), 0
        self.win_time, self.win_tokens, self.train_time, self.run_tokens = 0.0, 0, 0.0, 0

    def step_done(self, run: _Progress, seconds: float) -> None:
        import torch.distributed as dist

        if self.world > 1:
            dist.all_reduce(self.fed)
        run.tokens += int(self.fed.item())
        self.win_tokens += int(self.fed.item())
        self.fed.zero_()
        self.win_time += seconds
        self.updates += 1

    def line(self, run: _Progress, lr: float) -> dict:
        """The log line of the window that ends now (its loss is added to the run's history)."""
        import torch.distributed as dist

        dist.all_reduce(self.loss)
        loss = self.loss.item() / self.world / self.updates
        self.loss.zero_()
        self.updates = 0
        self.train_time, self.run_tokens = self.train_time + self.win_time, self.run_tokens + self.win_tokens
        rec = {"step": run.step, "loss": loss, "lr": lr, "tokens": run.tokens,
               "tokens_per_s": self.win_tokens / self.win_time, "elapsed_s": round(time.perf_counter() - self.t_start, 3)}
        run.history.append([run.step, loss])
        self.win_time, self.win_tokens = 0.0, 0
        return rec


def _engine(cfg: MidtrainConfig, device, bf16: bool, total_steps: int):
    """The model, its AdamW (no decay on vectors) and LR schedule, under DeepSpeed; and its pad id
    and parameter count."""
    import deepspeed
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    deepspeed.utils.logger.setLevel(logging.WARNING)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=torch.float32)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else model.config.eos_token_id or 0
    n_params = param_count(model)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(cfg, total_steps))
    engine, _, _, sched = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                               config=ds_config(cfg, bf16, device.type == "cuda"))
    return engine, sched, pad_id, n_params


def _resume(engine, cfg: MidtrainConfig, ckpt_root: str, metrics_path: str, rank: int, rep: Reporter):
    """Load the newest checkpoint rank 0 verified (every rank loads the same one): its tag and
    progress, or (None, a fresh progress)."""
    import torch.distributed as dist

    found = [resume_checkpoint(cfg.out_dir, ckpt_root, rep.log) if rank == 0 else None]
    dist.broadcast_object_list(found, src=0)
    resumed, run = found[0], _Progress()
    if resumed:
        engine.load_checkpoint(ckpt_root, tag=resumed)
        with open(os.path.join(ckpt_root, resumed, "trainer_state.json")) as f:
            st = json.load(f)
        run = _Progress(st["step"], st["samples"], int(st.get("tokens", st["samples"] * cfg.seq_len)),
                        st["loss_history"], st["evals"], bool(st.get("stopped_early")))
        set_rng_state(st["rng"])
        if rank == 0 and trim_metrics(metrics_path, run.step):
            rep.log(f"dropped torn lines from {metrics_path}")
        rep.log(f"resumed from {resumed}: step {run.step}, sample {run.samples}")
    return resumed, run


def _append_metrics(path: str, rank: int, rec: dict) -> None:
    if rank == 0:
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def _validate(engine, cfg: MidtrainConfig, run: _Progress, rank: int, world: int, device, pad_id: int,
              metrics_path: str, rep: Reporter) -> None:
    """One validation (the held-out split, and the replayed code's when there is one), recorded."""
    loss = evaluate(engine, cfg, rank, world, device, pad_id)
    ppl = None if loss is None else math.exp(min(loss, 50))
    rec = {"step": run.step, "val_loss": loss, "val_ppl": ppl}
    code = code_val_loss(engine, cfg, rank, world, device)
    if code is not None:
        rec.update(val_code_loss=code, val_code_ppl=math.exp(min(code, 50)))
    run.evals.append(rec)
    _append_metrics(metrics_path, rank, rec)
    if loss is not None:
        rep.progress(f"step {run.step:>6} val_loss {loss:.4f} val_ppl {ppl:.2f}"
                     + (f" code_ppl {rec['val_code_ppl']:.2f}" if code is not None else ""))


def _save(engine, cfg: MidtrainConfig, run: _Progress, ckpt_root: str, bf16: bool, rank: int, world: int) -> str:
    """A sealed checkpoint of the run (engine state, trainer state, a Hugging Face export), then
    ``latest`` pointing at it, then the oldest beyond ``keep_checkpoints`` removed."""
    import torch.distributed as dist

    tag = f"step_{run.step:07d}"
    node_sealer = rank != 0 and per_node_state() and int(os.environ.get("LOCAL_RANK", "0")) == 0
    if rank == 0 or node_sealer:
        clear_checkpoint(os.path.join(ckpt_root, tag))
    dist.barrier()
    engine.save_checkpoint(ckpt_root, tag=tag, save_latest=False)
    full = engine._zero3_consolidated_16bit_state_dict() if cfg.zero_stage == 3 else None
    if rank == 0:
        pause_before_seal()
        engine.module.config.dtype = "bfloat16" if bf16 else "float32"
        save_hf_dir(engine.module, os.path.join(ckpt_root, tag, "hf"), tokenizer_dir=cfg.model_dir, state_dict=full)
        write_json_atomic(os.path.join(ckpt_root, tag, "trainer_state.json"), {
            "step": run.step, "samples": run.samples, "tokens": run.tokens,
            "world_size": world, "rng": rng_state(), "loss_history": run.history,
            "evals": run.evals, "stopped_early": run.stopped_early, "config": cfg.to_dict()})
    dist.barrier()  # every rank's optimizer partition is on disk
    if rank == 0 or node_sealer:  # another node's disk: its ranks' partitions sealed there
        seal_checkpoint(os.path.join(ckpt_root, tag))
        commit_latest(cfg.out_dir, ckpt_root, {"tag": tag, "step": run.step, "samples": run.samples},
                      cfg.keep_checkpoints)
    return tag


def _export(cfg: MidtrainConfig, ckpt_root: str, tag: str, result: dict) -> None:
    """Rank 0: the final checkpoint's Hugging Face export as ``out_dir/hf`` (sampled from, as a
    check, when ``sample_tokens``), then ``result.json``."""
    with atomic_dir(result["hf_dir"]) as tmp:
        src = os.path.join(ckpt_root, tag, "hf")
        for name in os.listdir(src):
            shutil.copy2(os.path.join(src, name), os.path.join(tmp, name))
    if cfg.sample_tokens:  # the exported checkpoint loads in transformers and generates
        result["sample"] = sample_text(result["hf_dir"], max_tokens=cfg.sample_tokens)
    write_json_atomic(os.path.join(cfg.out_dir, "result.json"), result)


def train(cfg: MidtrainConfig, rep: Reporter | None = None) -> dict:
    import torch
    import torch.distributed as dist

    rank, world, device = setup_distributed()
    rep = rep or Reporter(rank)
    bf16 = cfg.bf16 if cfg.bf16 is not None else (
        device.type == "cuda" and torch.cuda.is_bf16_supported())
    total_steps = cfg.total_steps(world)
    samples_per_step = cfg.micro_batch * cfg.grad_accum * world
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    engine, sched, pad_id, n_params = _engine(cfg, device, bf16, total_steps)

    ckpt_root = os.path.join(cfg.out_dir, "checkpoints")
    metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl")
    os.makedirs(ckpt_root, exist_ok=True)
    tag, run = _resume(engine, cfg, ckpt_root, metrics_path, rank, rep)
    if run.stopped_early:  # the run had stopped early at this checkpoint: it is complete
        total_steps = run.step
    if not run.evals:
        if val_samples_per_rank(cfg, world) == 0:
            rep.log(f"no usable validation split in {cfg.data_dir}: validation is skipped")
        _validate(engine, cfg, run, rank, world, device, pad_id, metrics_path, rep)
    data = _train_batches(cfg, pad_id, rank, world, run.samples)
    replay_share = (cfg.replay() or ("", 0.0))[1]
    rep.log(f"{'sft' if cfg.objective == 'sft' else 'midtrain'}: {n_params:,} params, world {world}, "
            f"{'bf16' if bf16 else 'fp32'}, ZeRO-{cfg.zero_stage}, steps {run.step}->{total_steps}, "
            f"{samples_per_step * cfg.seq_len} tokens/step")
    meter = _Meter(device, world)
    while run.step < total_steps:
        t0 = time.perf_counter()
        for _ in range(cfg.grad_accum):
            batch = next(data)
            meter.fed += _tokens(batch, pad_id)
            loss = batch_loss(engine, batch, device, replay_share)
            engine.backward(loss)
            engine.step()
            meter.loss += loss.detach() / cfg.grad_accum
        run.step += 1
        run.samples += samples_per_step
        meter.step_done(run, time.perf_counter() - t0)
        if run.step % cfg.log_every == 0 or run.step == total_steps:
            rec = meter.line(run, sched.get_last_lr()[0])
            _append_metrics(metrics_path, rank, rec)
            rep.progress(f"step {run.step:>6}/{total_steps} loss {rec['loss']:.4f} lr {rec['lr']:.2e} "
                         f"tok/s {rec['tokens_per_s']:,.0f}")
        if (cfg.eval_every and run.step % cfg.eval_every == 0) or run.step == total_steps:
            if not run.evals or run.evals[-1]["step"] != run.step:
                _validate(engine, cfg, run, rank, world, device, pad_id, metrics_path, rep)
                if run.step < total_steps and stalled(run.evals, cfg.early_stop_patience):
                    rep.log(f"validation loss not improved in {cfg.early_stop_patience} validations: "
                            f"stopping early at step {run.step} of {total_steps}")
                    run.stopped_early, total_steps = True, run.step
        if (cfg.save_every and run.step % cfg.save_every == 0) or run.step == total_steps:
            tag = _save(engine, cfg, run, ckpt_root, bf16, rank, world)

    if tag is None:  # nothing to train (already done, or max_steps 0): still leave a checkpoint
        tag = _save(engine, cfg, run, ckpt_root, bf16, rank, world)
    evals = run.evals
    result = {
        "steps": run.step, "total_steps": total_steps, "world_size": world,
        "stopped_early": run.stopped_early,
        "tokens_seen": run.tokens, "samples_seen": run.samples, "objective": cfg.objective,
        "tokens_this_run": meter.run_tokens, "train_seconds": round(meter.train_time, 3),
        "tokens_per_s": meter.run_tokens / meter.train_time if meter.train_time else None,
        "val_loss_before": evals[0]["val_loss"], "val_ppl_before": evals[0]["val_ppl"],
        "val_loss_after": evals[-1]["val_loss"], "val_ppl_after": evals[-1]["val_ppl"],
        "loss_curve": run.history, "evals": evals, "hf_dir": os.path.join(cfg.out_dir, "hf"), "checkpoint": tag,
        "params": n_params, "precision": "bf16" if bf16 else "fp32",
        "zero_stage": cfg.zero_stage, "config": cfg.to_dict(),
    }
    if rank == 0:
        _export(cfg, ckpt_root, tag, result)
    dist.barrier()
    return result


def main(argv: list[str] | None = None) -> dict:
    return entry_point(MidtrainConfig, "Mid-training with DeepSpeed", train, argv)

if __name__ == "__main__":
    main()
