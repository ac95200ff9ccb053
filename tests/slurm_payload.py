"""A tiny resumable stage for the cluster-job tests (seconds, not minutes): ``steps`` steps of
``step_s`` seconds, each sealed as a checkpoint with the project's checkpoint helpers and
recorded in ``metrics.jsonl``; resumes from the newest sealed checkpoint in ``out_dir``;
``hold_after``/``hold_s`` make it wait after a given step (where a test stops it from outside).
The result says which of ``probe`` paths the process could see (isolation), how many input
files it got."""

import json
import os
import time
from typing import Optional

from composer_dag.pipes import entry_point
from composer_dag.runtime.checkpoint import (read_latest, resume_checkpoint, seal_checkpoint, trim_metrics,
                                             write_json_atomic)
from composer_dag.runtime.config import StageConfig


class PayloadConfig(StageConfig):
    out_dir: str
    input_dir: Optional[str] = None
    steps: int = 5
    step_s: float = 0.2
    fail_at: int = 0
    hold_after: int = 0   # after sealing this step, wait ``hold_s`` (to be stopped from outside there)
    hold_s: float = 0.0
    probe: list[str] = []


def work(cfg: PayloadConfig, rep) -> dict:
    started_at = time.time()
    ckpt_root = os.path.join(cfg.out_dir, "checkpoints")
    metrics = os.path.join(cfg.out_dir, "metrics.jsonl")
    tag = resume_checkpoint(cfg.out_dir, ckpt_root, rep.log)
    start = int(tag.split("_")[1]) if tag else 0
    trim_metrics(metrics, start)
    if tag:
        rep.log(f"resumed from {tag}")
    for step in range(start + 1, cfg.steps + 1):
        time.sleep(cfg.step_s)
        if step == cfg.fail_at:
            raise ValueError(f"planted failure at step {step}")
        with open(metrics, "a") as f:
            f.write(json.dumps({"step": step}) + "\n")
        d = os.path.join(ckpt_root, f"step_{step:06d}")
        os.makedirs(d, exist_ok=True)
        write_json_atomic(os.path.join(d, "state.json"), {"step": step})
        seal_checkpoint(d)
        write_json_atomic(os.path.join(cfg.out_dir, "latest"), {"tag": f"step_{step:06d}", "step": step})
        rep.progress(f"step {step}")
        if step == cfg.hold_after:
            time.sleep(cfg.hold_s)
    os.makedirs(os.path.join(cfg.out_dir, "hf"), exist_ok=True)
    with open(os.path.join(cfg.out_dir, "hf", "weights.txt"), "w") as f:
        f.write(f"steps={cfg.steps}\n")
    with open(metrics) as f:
        steps = [json.loads(line)["step"] for line in f if line.strip()]
    return {"steps": cfg.steps, "resumed_from": tag, "metrics_steps": steps,
            "checkpoint": read_latest(cfg.out_dir)["tag"],
            "input_files": sorted(os.listdir(cfg.input_dir)) if cfg.input_dir else [],
            "visible": [p for p in cfg.probe if os.path.exists(p)], "cwd": os.getcwd(),
            "started_at": started_at, "finished_at": time.time()}


def main(argv=None):
    return entry_point(PayloadConfig, "tiny resumable payload", work, argv)


if __name__ == "__main__":
    main()
