"""Prompt extension per external harness: how often a call's prompt continues the previous call's
prompt and completion token for token (so the episode trains as one segment), and why not.

    .venv/bin/python benchmarks/bench_extension.py --out /tmp/bench_extension [--tasks 6] [--episodes 4]

For each declared external harness (mini-swe-agent, openai-agents):

- ``demonstrations``: every learnable task's reference actions played through the harness by a
  scripted policy (well-formed replies, as a trained policy gives): the harness keeps its
  history, so every pair of calls should extend;
- ``sampled``: ``--episodes`` episodes of an untrained tiny model (4,096 positions, transformers)
  sampling its own replies at temperature 1: malformed replies, cut-off turns and format errors
  are frequent, and each miss is tallied by the reason the gateway gives.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tally(summaries: list[dict]) -> dict:
    pairs = sum(s["rollout"]["extension"]["pairs"] for s in summaries)
    ext = sum(s["rollout"]["extension"]["extended"] for s in summaries)
    # the gateway's reason with its numbers and the message's role taken out: one count per kind
    why = Counter(re.sub(r"\d+", "N", re.sub(r" \([^)]*\)", "", m["why"]))
                  for s in summaries for m in s["rollout"]["extension"]["misses"])
    return {"episodes": len(summaries), "calls": sum(s["calls"] for s in summaries), "pairs": pairs, "extended": ext,
            "rate": ext / pairs if pairs else None, "misses_by_reason": dict(why.most_common()),
            "rewards": [s["reward"] for s in summaries]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tasks", type=int, default=6)
    ap.add_argument("--episodes", type=int, default=4)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    from composer_dag.gateway.core import Gateway
    from composer_dag.gateway.server import GatewayServer
    from composer_dag.gateway.upstream import InProcess
    from composer_dag.harness.external import declared, demonstrate, install, run_episode
    from composer_dag.inference.engine import HFEngine
    from composer_dag.rl.learnable import TEST_MODEL, make_learnable_setup
    from composer_dag.sft.trajectories import reference_actions
    from composer_dag.tasks.taskdir import load_task
    from composer_dag.train.model import build_base_model
    from composer_dag.train.tokenizer import load_tokenizer

    work = Path(tempfile.mkdtemp(prefix="bench-ext-"))
    setup = make_learnable_setup(work / "setup", n_tasks=a.tasks, seed=0, words=("red", "blue"), warmup_steps=0)
    model = work / "model"
    build_base_model("tiny", setup["tokenizer_dir"], str(model), **{**TEST_MODEL, "max_position_embeddings": 4096})
    tok = load_tokenizer(str(model))
    tasks = sorted(Path(setup["tasks_dir"]).glob("*/task.json"))[:a.tasks]
    results = {}
    for spec in declared():
        install(spec)
        demos = []
        for t in tasks:
            d = t.parent
            _, why, s = demonstrate(spec, d, reference_actions(d, load_task(d)), tok, work / spec.name / "demo" / d.name)
            demos.append(s)
        engine = HFEngine(str(model))
        gw = Gateway(InProcess(engine, "0"), tok, "policy", max_model_len=4096, default_max_tokens=64)
        sampled = []
        with GatewayServer(gw) as server:
            for k in range(a.episodes):
                d = tasks[k % len(tasks)].parent
                s = run_episode(spec, d, server, "policy", work / spec.name / "sampled" / f"{k}", timeout_s=300)
                sampled.append(s)
        results[spec.name] = {"version": spec.version, "demonstrations": _tally(demos), "sampled": _tally(sampled)}
        print(json.dumps({spec.name: results[spec.name]}), flush=True)
    (out / "extension.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
