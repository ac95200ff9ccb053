"""vLLM engine start on CPU: the engine core in child processes (vLLM's default,
``VLLM_ENABLE_V1_MULTIPROCESSING=1``) against the engine core in the calling process (``=0``,
what ``VLLMEngine`` uses on CPU), each in a fresh process as a job starts it.

    .venv/bin/python benchmarks/bench_engine_start.py [--rounds 3] [--model HF_DIR] [--out results.json]

Per round the two modes run one after the other (the order alternates between rounds), each as
``python benchmarks/bench_engine_start.py --child MODE --model DIR``, which times the import and
``VLLMEngine(...)`` up to the first request, one seeded ``generate`` (4 prompts x 2 samples, 32
tokens), a weight reload, and ``close``; the parent adds the process's whole wall time. Both modes
must return the same tokens and logprobs for the same seeds. Without ``--model`` the model is the
tiny test policy (a fresh ``tiny`` Llama on a BPE trained on the stdlib ``json`` package).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [20, 21]]


def child(mode: str, model: str) -> None:
    t0 = time.perf_counter()
    from composer_dag.inference.engine import Sampling, VLLMEngine

    eng = VLLMEngine(model, max_model_len=512, kv_cache_bytes=64 << 20)
    t1 = time.perf_counter()
    outs = eng.generate(PROMPTS, Sampling(n=2, temperature=1.0, max_tokens=32, seed=11))
    t2 = time.perf_counter()
    reload_s = eng.load_weights(model)
    t3 = time.perf_counter()
    eng.close()
    t4 = time.perf_counter()
    print(json.dumps({"mode": mode, "start_s": t1 - t0, "generate_s": t2 - t1, "reload_s": reload_s,
                      "close_s": t4 - t3, "tokens": [o.token_ids for o in outs],
                      "logprobs": [[round(x, 5) for x in o.logprobs] for o in outs]}))


def run_child(mode: str, model: str) -> dict:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": mode, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, __file__, "--child", mode, "--model", model], env=env, capture_output=True,
                       text=True, timeout=900)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"mode {mode} failed (exit {p.returncode}): {p.stderr[-2000:]}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["process_wall_s"] = wall
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", help="a Hugging Face checkpoint directory (default: the tiny test policy)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.model)
    model = args.model
    if model is None:
        from composer_dag.rl.learnable import make_learnable_setup

        model = make_learnable_setup(tempfile.mkdtemp(prefix="bench-engine-"), n_tasks=2, warmup_steps=0)["policy_dir"]
    runs = {"1": [], "0": []}
    for r in range(args.rounds):
        for mode in (("1", "0") if r % 2 == 0 else ("0", "1")):
            runs[mode].append(run_child(mode, model))
            print(f"round {r + 1} mode {mode}: start {runs[mode][-1]['start_s']:.1f} s, "
                  f"process {runs[mode][-1]['process_wall_s']:.1f} s", flush=True)
    same = all(a["tokens"] == runs["1"][0]["tokens"] and a["logprobs"] == runs["1"][0]["logprobs"]
               for a in runs["1"] + runs["0"])
    med = {m: {k: round(statistics.median(x[k] for x in rs), 2)
               for k in ("start_s", "generate_s", "reload_s", "close_s", "process_wall_s")} for m, rs in runs.items()}
    summary = {"rounds": args.rounds, "model": model, "child_processes": med["1"], "in_process": med["0"],
               "start_ratio": round(med["1"]["start_s"] / med["0"]["start_s"], 2),
               "process_ratio": round(med["1"]["process_wall_s"] / med["0"]["process_wall_s"], 2),
               "same_tokens_and_logprobs": same, "loadavg_end": [round(x, 2) for x in os.getloadavg()]}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
