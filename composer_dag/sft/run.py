"""The SFT job: tokenize the trajectories, train with the mid-training trainer (``objective:
sft``), and check that the result writes parseable tool calls.

    python -m composer_dag.sft.run --config CONFIG.json [--set key=json_value ...]
    torchrun --nproc-per-node N -m composer_dag.sft.run --config CONFIG.json

Each trajectory becomes one token stream exactly as the agent loop builds it: the rendered
prompt (system + user), then per assistant turn its text (``<tool_call>`` blocks and
``<|im_end|>``, loss mask 1) followed by a newline and the tool's answer (mask 0). Everything
else is mid-training's: DeepSpeed ZeRO, sealed checkpoints, resume, ``result.json``; the
summary adds the tokenization counts and ``format_check``.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from typing import Literal, Optional

from pydantic import Field

from composer_dag import harness as harnesses
from composer_dag.harness.base import defang
from ..pipes import Reporter, entry_point
from ..runtime.checkpoint import atomic_dir, write_json_atomic
from ..train.midtrain import MidtrainConfig, train


class SFTConfig(MidtrainConfig):
    """Supervised fine-tuning on agent trajectories, with windows of the pre-training shards
    replayed in every micro-batch. The trainer's settings are mid-training's; the defaults fit the
    embedded default (the ``tiny`` model on CPU, about a minute and a half) and were chosen by the
    sweep in benchmarks/RESULTS.md ("The recipe"): of the settings tried, the one that kept the
    code perplexity within 1.3x the mid-trained checkpoint's with held-out learnable pass@1 above 0.5."""

    trajectories_dir: str            # holds trajectories.parquet (see composer_dag.sft.trajectories)
    data_dir: str = Field("", description="where the tokenized transcripts go (default out_dir/data)")
    objective: Literal["lm", "sft"] = "sft"
    seq_len: int = Field(512, description="tokens per transcript; longer ones are cut (and counted)")
    micro_batch: int = 8
    lr: float = 2e-3
    min_lr: float = Field(2e-4, description="the floor the learning rate decays to (cosine, over max_steps) after "
                                            "the warmup; equal to lr: a constant rate")
    warmup_steps: int = 10
    weight_decay: float = 0.0
    beta2: float = 0.999
    max_steps: int = Field(80, description="optimizer steps at most (the learning-rate schedule's length); early "
                                           "stopping on the held-out trajectories ends it sooner")
    eval_every: int = 20
    early_stop_patience: Optional[int] = 1
    save_every: int = 40
    eval_batches: int = 4
    sample_tokens: int = 0
    system_style: Literal["full", "compact"] = Field("compact", description="the agent's system prompt style")
    format_samples: int = Field(16, description="first turns sampled after training to check the call format")
    format_max_new_tokens: int = 96
    min_format_share: float = Field(0.25, description="share of sampled first turns (temperature 1) that must parse as a tool call")
    pretrain_dir: str = Field("", description="token shards (train.bin/.idx, val.bin/.idx) to replay and to measure "
                                              "forgetting on; the asset gives token_shards")
    pretrain_share: float = Field(0.25, ge=0.0, lt=1.0, description="the replay's weight in each micro-batch's loss "
                                                                  "(0: transcripts only)")
    pretrain_windows: int = Field(2, ge=1, description="replay windows per micro-batch")
    pretrain_seq_len: int = Field(256, description="tokens per replay window (also the code validation's)")

    def replay(self):
        return (self.pretrain_dir, self.pretrain_share, self.pretrain_windows, self.pretrain_seq_len) \
            if self.pretrain_dir else None


def transcript(messages: list[dict], tok, system_style: str = "compact",
               harness="composer", tools: list | None = None) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of one trajectory, piece by piece as the agent loop encodes it
    (the prompt, calls and results as ``harness`` renders them)."""
    if harness not in harnesses.names():  # an external harness's own messages: as the gateway serves them
        from ..gateway.chat import Renderer

        return Renderer(tok).conversation(messages, tools)
    h = harnesses.get(harness)
    enc = lambda text: tok(text, add_special_tokens=False).input_ids
    if not messages or messages[0].get("role") != "user":
        raise ValueError("a trajectory starts with the user's message")
    control = h.control(tok)
    ids = enc(h.render_prompt(tok, messages[0]["content"], system_style))
    mask = [0] * len(ids)
    i = 1
    while i < len(messages):
        m = messages[i]
        if m["role"] != "assistant":
            raise ValueError(f"message {i}: expected an assistant turn, found {m['role']!r}")
        text = h.render_turn(m.get("content") or "", m.get("tool_calls") or []) + "<|im_end|>"
        piece = enc(text)
        ids, mask = ids + piece, mask + [1] * len(piece)
        i += 1
        tools = []
        while i < len(messages) and messages[i]["role"] == "tool":
            tools.append(h.result_message(defang(messages[i]["content"], control)))
            i += 1
        if tools:
            piece = enc("\n") + enc(tok.apply_chat_template(tools, tokenize=False, add_generation_prompt=True))
            ids, mask = ids + piece, mask + [0] * len(piece)
    return ids, mask


def tokenize(trajectories_dir: str, model_dir: str, out_dir: str, seq_len: int, system_style: str = "compact") -> dict:
    """Write ``train.parquet`` and ``val.parquet`` (input_ids, loss_mask, trajectory_id) under
    ``out_dir``; a trajectory longer than ``seq_len + 1`` tokens is kept, cut, and counted."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ..train.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    rows = pq.read_table(os.path.join(trajectories_dir, "trajectories.parquet")).to_pylist()
    splits: dict[str, list[dict]] = {"train": [], "val": []}
    skipped, cut, lengths = Counter(), 0, []
    for r in rows:
        try:
            ids, mask = transcript(json.loads(r["messages"]), tok, system_style, r.get("harness") or "composer",
                                   json.loads(r["tools"]) if r.get("tools") else None)
        except (ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
            skipped[f"malformed:{type(e).__name__}"] += 1
            continue
        cut += len(ids) > seq_len + 1
        lengths.append(len(ids))
        splits[r["split"] if r["split"] in splits else "train"].append(
            {"trajectory_id": r["trajectory_id"], "input_ids": ids, "loss_mask": mask})
    if not splits["train"]:
        if not splits["val"]:
            raise ValueError(f"no usable trajectory in {trajectories_dir} (skipped {dict(skipped)})")
        splits["train"] = splits["val"]  # too few tasks to hold some out: train on all, validate on the same
    schema = pa.schema([("trajectory_id", pa.string()), ("input_ids", pa.list_(pa.int32())),
                        ("loss_mask", pa.list_(pa.int8()))])
    with atomic_dir(out_dir) as tmp:
        for split, items in splits.items():
            if items:
                pq.write_table(pa.Table.from_pylist(items, schema=schema), os.path.join(tmp, f"{split}.parquet"))
        summary = {"trajectories_in": len(rows), "train": len(splits["train"]), "val": len(splits["val"]),
                   "skipped": dict(skipped), "cut_to_seq_len": cut,
                   "tokens": sum(lengths), "max_tokens": max(lengths, default=0),
                   "supervised_tokens": sum(sum(x["loss_mask"]) for s in splits.values() for x in s)}
        write_json_atomic(os.path.join(tmp, "summary.json"), summary)
    return summary


def format_check(model_dir: str, trajectories_dir: str, cfg: SFTConfig) -> dict:
    """Sample the first assistant turn on ``format_samples`` prompts (validation trajectories
    first, then training ones) and count the turns whose text parses as at least one tool call
    with no malformed block."""
    import pyarrow.parquet as pq

    from ..inference.engine import Sampling, make_engine
    from ..train.tokenizer import load_tokenizer

    rows = pq.read_table(os.path.join(trajectories_dir, "trajectories.parquet")).to_pylist()
    rows = ([r for r in rows if r["split"] == "val"] + [r for r in rows if r["split"] != "val"])[:cfg.format_samples]
    tok = load_tokenizer(model_dir)
    h = harnesses.get("composer")
    prompts = [tok(h.render_prompt(tok, json.loads(r["messages"])[0]["content"], cfg.system_style),
                   add_special_tokens=False).input_ids for r in rows]
    eng = make_engine("hf", model_dir)
    try:
        stops = (tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id)
        outs = eng.generate(prompts, Sampling(1, 1.0, 1.0, cfg.format_max_new_tokens, stops, cfg.seed))
    finally:
        eng.close()
    texts = [tok.decode(o.token_ids, skip_special_tokens=False) for o in outs]
    parsed = [bool(calls) and not errors for calls, errors, _ in map(h.parse, texts)]
    share = sum(parsed) / len(parsed) if parsed else 0.0
    return {"samples": len(parsed), "parsed": sum(parsed), "share": share, "min_share": cfg.min_format_share,
            "ok": bool(parsed) and share >= cfg.min_format_share,
            "new_tokens": sum(len(o.token_ids) for o in outs), "examples": texts[:4]}


def run(cfg: SFTConfig, rep: Reporter | None = None) -> dict:
    rep = rep or Reporter()
    rank = int(os.environ.get("RANK", "0"))
    data_dir = cfg.data_dir or os.path.join(cfg.out_dir, "data")
    summary_path = os.path.join(data_dir, "summary.json")
    if rank == 0 and not os.path.exists(summary_path):
        t0 = time.perf_counter()
        tk = tokenize(cfg.trajectories_dir, cfg.model_dir, data_dir, cfg.seq_len, cfg.system_style)
        rep.log(f"sft: tokenized {tk['train']} train / {tk['val']} val transcripts, {tk['tokens']:,} tokens "
                f"({tk['supervised_tokens']:,} supervised) in {time.perf_counter() - t0:.1f} s")
    deadline = time.monotonic() + 600
    while not os.path.exists(summary_path):  # other ranks wait for rank 0's tokenization
        if time.monotonic() > deadline:
            raise TimeoutError(f"no tokenized transcripts at {data_dir} after 600 s")
        time.sleep(0.5)
    result = train(cfg.replace(data_dir=data_dir), rep)
    if rank == 0:
        with open(summary_path) as f:
            result["tokenize"] = json.load(f)
        result["format_check"] = format_check(result["hf_dir"], cfg.trajectories_dir, cfg)
        fc = result["format_check"]
        rep.log(f"sft: {fc['parsed']}/{fc['samples']} sampled first turns parse as tool calls")
        write_json_atomic(os.path.join(cfg.out_dir, "result.json"), result)
    return result


def main(argv: list[str] | None = None) -> dict:
    return entry_point(SFTConfig, "Supervised fine-tuning on agent trajectories", run, argv)


if __name__ == "__main__":
    main()
