"""SFT beside mid-training: the same DeepSpeed trainer, two objectives, on the same tiny model.

Mid-training reads packed Megatron shards of the standard library (every position a target);
SFT reads tokenized agent trajectories of the learnable task family (one transcript per sample,
padded to the longest in its micro-batch, loss on the assistant's tokens). Both run through
their entry points (``composer_dag.train.midtrain``, ``composer_dag.sft.run``) with the same
micro-batch, in alternating rounds; tokens/s is the trainer's own count (padding excluded).

    python benchmarks/bench_sft.py [--steps 30] [--rounds 2] [--words 64] [--append]

--append adds the markdown section to the day's journal file, benchmarks/journal/YYYY-MM-DD.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench_train import stdlib_docs  # noqa: E402
from composer_dag.tasks.sources.learnable import WORD_POOL, build_learnable_tasks  # noqa: E402
from composer_dag.sft import trajectories  # noqa: E402
from composer_dag.train.data import pack_documents  # noqa: E402
from composer_dag.train.model import build_base_model  # noqa: E402
from composer_dag.train.tokenizer import train_tokenizer  # noqa: E402


def job(module: str, cfg: dict, tmp: str, name: str) -> dict:
    path = os.path.join(tmp, f"{name}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    env = {**os.environ, "PYTHONPATH": ROOT, "DS_ACCELERATOR": "cpu"}
    p = subprocess.run([sys.executable, "-m", module, "--config", path], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        sys.exit(f"{module} failed: {p.stderr[-2000:]}")
    return json.loads(open(os.path.join(cfg["out_dir"], "result.json")).read())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--words", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--append", action="store_true")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-sft-") as tmp:
        docs = list(stdlib_docs(4.0))
        tok = train_tokenizer([d[1] for d in docs], os.path.join(tmp, "tok"), vocab_size=8192)
        pack_documents(docs, tok, os.path.join(tmp, "shards"), val_fraction=0.05, seed=0)
        model = os.path.join(tmp, "model")
        build_base_model("tiny", tok, model, seed=0)
        build_learnable_tasks(os.path.join(tmp, "tasks"), args.words, words=WORD_POOL, canaries=False, workers=2)
        summary = trajectories.build(os.path.join(tmp, "tasks"), os.path.join(tmp, "traj"), {"val_fraction": 0.1})
        common = {"model_dir": model, "micro_batch": args.micro_batch, "max_steps": args.steps, "warmup_steps": 5,
                  "eval_every": 0, "save_every": args.steps, "log_every": 5, "sample_tokens": 0, "seed": 0}
        rates: dict[str, list[float]] = {"mid-training": [], "SFT": []}
        sft_tokens = {}
        for r in range(args.rounds):
            mid = job("composer_dag.train.midtrain", {**common, "data_dir": os.path.join(tmp, "shards"), "seq_len": 256,
                                                      "out_dir": os.path.join(tmp, f"mid{r}")}, tmp, f"mid{r}")
            rates["mid-training"].append(mid["tokens_per_s"])
            sft = job("composer_dag.sft.run", {**common, "trajectories_dir": os.path.join(tmp, "traj"),
                                               "out_dir": os.path.join(tmp, f"sft{r}"), "format_samples": 4}, tmp, f"sft{r}")
            rates["SFT"].append(sft["tokens_per_s"])
            sft_tokens = sft["tokenize"]
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratio = med["SFT"] / med["mid-training"]
    lines = [
        f"\n## SFT beside mid-training ({datetime.date.today()})\n",
        f"`python benchmarks/bench_sft.py --steps {args.steps} --rounds {args.rounds} --words {args.words} "
        f"--micro-batch {args.micro_batch}`: the `tiny` model (vocab 8192), DeepSpeed ZeRO-2 on CPU, one process, "
        f"micro-batch {args.micro_batch}, {args.steps} steps per run, rounds alternating. Mid-training: packed "
        f"stdlib shards at sequence length 256. SFT: {summary['trajectories']} learnable-family trajectories, "
        f"{sft_tokens.get('tokens', 0) // max(1, sft_tokens.get('train', 1) + sft_tokens.get('val', 0))} tokens each "
        f"on average, {sft_tokens.get('supervised_tokens', 0)} of {sft_tokens.get('tokens', 0)} supervised.\n",
        "| objective | tokens/s per run | median |",
        "|---|---|---:|",
        *[f"| {k} | {', '.join(f'{x:,.0f}' for x in v)} | {med[k]:,.0f} |" for k, v in rates.items()],
        "",
        f"SFT runs at {ratio:.2f}x mid-training's tokens/s (padding to the longest transcript of each micro-batch "
        "is not counted).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.append:
        with open(os.path.join(ROOT, "benchmarks", "journal", datetime.date.today().isoformat() + ".md"), "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
