"""Mid-training benchmark: tokenization + packing MB/s, and DeepSpeed trainer tokens/s against a
plain PyTorch loop (same model, batch, sequence length, AdamW, clipping) in the same run.

    python benchmarks/bench_train.py [--corpus-mb 4] [--steps 30] [--append]

--append adds the markdown section to the day's journal file, benchmarks/journal/YYYY-MM-DD.md
(benchmarks/RESULTS.md keeps the current figure of each measurement).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from composer_dag.train.data import TokenShardDataset, pack_documents  # noqa: E402
from composer_dag.train.midtrain import MidtrainConfig, lr_factor, lm_loss  # noqa: E402
from composer_dag.train.model import build_base_model, load_base_model  # noqa: E402
from composer_dag.train.tokenizer import train_tokenizer  # noqa: E402


def stdlib_docs(max_mb: float):
    src = os.path.dirname(os.__file__)
    total = 0
    for path in sorted(glob.glob(src + "/**/*.py", recursive=True)):
        try:
            text = open(path, encoding="utf-8").read()
        except (UnicodeDecodeError, OSError):
            continue
        total += len(text.encode())
        if total > max_mb * 1e6:
            return
        yield os.path.relpath(path, src), text, "stdlib", "Python"


def plain_loop(cfg: MidtrainConfig, steps: int, warmup: int) -> list[float]:
    """Per-step tokens/s of a bare PyTorch loop, after ``warmup`` steps."""
    import torch

    torch.manual_seed(cfg.seed)
    model = load_base_model(cfg.model_dir, dtype="float32")
    model.train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(cfg, steps))
    data = TokenShardDataset(os.path.join(cfg.data_dir, "train"), cfg.seq_len,
                             shuffle_seed=cfg.seed).batches(cfg.micro_batch)
    rates = []
    for i in range(steps):
        t0 = time.perf_counter()
        loss = lm_loss(model, torch.from_numpy(next(data)))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        rates.append(cfg.micro_batch * cfg.seq_len / (time.perf_counter() - t0))
    return rates[warmup:]


def trainer_run(cfg: MidtrainConfig, warmup: int, nproc: int = 1) -> list[float]:
    """Per-step tokens/s of the DeepSpeed trainer (from metrics.jsonl), after warmup."""
    path = os.path.join(cfg.out_dir + ".json")
    with open(path, "w") as f:
        json.dump(cfg.to_dict(), f)
    env = {**os.environ, "PYTHONPATH": ROOT, "DS_ACCELERATOR": "cpu"}
    if nproc == 1:
        cmd = [sys.executable, "-m", "composer_dag.train.midtrain", "--config", path]
    else:
        from composer_dag.cluster.spec import LaunchSpec, local_command

        cmd = local_command(LaunchSpec(entry="composer_dag.train.midtrain",
                                       args=["--config", path], nproc_per_node=nproc))
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    with open(os.path.join(cfg.out_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    shutil.rmtree(cfg.out_dir)
    return [r["tokens_per_s"] for r in recs if "loss" in r and r["step"] > warmup]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus-mb", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved plain/trainer rounds")
    ap.add_argument("--torchrun", action="store_true", help="also time 2 processes")
    ap.add_argument("--append", action="store_true")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="bench_train_")
    docs = list(stdlib_docs(args.corpus_mb))

    t = time.perf_counter()
    tok = train_tokenizer((d[1] for d in docs[:400]), os.path.join(work, "tok"), vocab_size=8192)
    tok_train_s = time.perf_counter() - t
    pack = pack_documents(docs, tok, os.path.join(work, "data"), val_fraction=0.02, seed=0)
    info = build_base_model("tiny", tok, os.path.join(work, "model"), seed=0)

    warmup = 3
    cfg = MidtrainConfig(model_dir=os.path.join(work, "model"), data_dir=os.path.join(work, "data"),
                         out_dir=os.path.join(work, "ds"), seq_len=args.seq_len,
                         micro_batch=args.micro_batch, max_steps=args.steps, warmup_steps=5,
                         eval_every=0, eval_batches=1, save_every=0, log_every=1)
    # The machine is shared: interleave the two and compare per-step medians.
    plain_rates, ds_rates = [], []
    for _ in range(args.rounds):
        plain_rates += plain_loop(cfg, args.steps, warmup)
        ds_rates += trainer_run(cfg, warmup)
    plain, ds = statistics.median(plain_rates), statistics.median(ds_rates)
    res = {"date": datetime.date.today().isoformat(), "corpus_mb": pack["bytes_in"] / 1e6,
           "docs": pack["docs_in"], "tokens": pack["tokens_train"] + pack["tokens_val"],
           "tokenizer_train_s": round(tok_train_s, 2), "pack_mb_per_s": pack["mb_per_s"],
           "params": info["params"], "plain_tok_s": round(plain), "trainer_tok_s": round(ds),
           "plain_best": round(max(plain_rates)), "trainer_best": round(max(ds_rates)),
           "ratio": round(ds / plain, 3), "steps_timed": [len(plain_rates), len(ds_rates)]}
    if args.torchrun:
        cfg2 = cfg.replace(out_dir=os.path.join(work, "ds2"))
        res["trainer_2proc_tok_s"] = round(statistics.median(trainer_run(cfg2, warmup, nproc=2)))
    print(json.dumps(res))

    cmd = "python benchmarks/bench_train.py " + " ".join(sys.argv[1:])
    md = [
        "", "## Mid-training", "",
        f"`{cmd.strip()}` on {res['date']} (2 shared CPU cores, no GPU; torch "
        f"{__import__('torch').__version__}, DeepSpeed {__import__('deepspeed').__version__}).", "",
        "| measure | value |", "|---|---|",
        f"| tokenization + packing (byte-level BPE, vocab 8192, {res['corpus_mb']:.1f} MB of "
        f"stdlib code, {res['docs']} docs, {res['tokens']:,} tokens) | {res['pack_mb_per_s']:.2f} MB/s |",
        f"| tokenizer training (400 files) | {res['tokenizer_train_s']} s |",
        f"| plain PyTorch loop, `tiny` Llama ({res['params'] / 1e6:.1f}M params), seq "
        f"{args.seq_len}, batch {args.micro_batch}, AdamW, fp32: median per step (best) | "
        f"{res['plain_tok_s']:,} tok/s ({res['plain_best']:,}) |",
        f"| DeepSpeed ZeRO-2 trainer (`composer_dag.train.midtrain`), same setup, 1 process: "
        f"median per step (best) | {res['trainer_tok_s']:,} tok/s ({res['trainer_best']:,}) |",
        f"| ratio trainer / plain, medians (target >= 0.9); {args.rounds} interleaved rounds, "
        f"{res['steps_timed'][0]} + {res['steps_timed'][1]} steps timed | {res['ratio']:.2f} |",
    ]
    if "trainer_2proc_tok_s" in res:
        md.append(f"| trainer, `torchrun --nproc-per-node 2` (total) | "
                  f"{res['trainer_2proc_tok_s']:,} tok/s |")
    md.append("")
    text = "\n".join(md)
    print(text)
    if args.append:
        with open(os.path.join(ROOT, "benchmarks", "journal", datetime.date.today().isoformat() + ".md"), "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
