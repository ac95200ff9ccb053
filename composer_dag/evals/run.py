"""Evaluate a checkpoint from a JSON config, without Dagster::

    python -m composer_dag.evals.run --config eval.json [--set key=json_value ...]

The config holds ``checkpoint_dir``, ``tasks_dir``, ``out_dir`` and any ``EvalConfig``
field. The summary goes out through ``pipes.Reporter.result`` (a Pipes message when
launched by Dagster, else the last line of stdout).
"""

from __future__ import annotations

import argparse
import json

from ..pipes import Reporter
from .evaluate import EvalConfig, evaluate


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description="evaluate a checkpoint on held-out tasks")
    p.add_argument("--config", required=True, help="JSON: checkpoint_dir, tasks_dir, out_dir + EvalConfig fields")
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON")
    args = p.parse_args(argv)
    with open(args.config) as f:
        d = json.load(f)
    for kv in args.set:
        k, v = kv.split("=", 1)
        try:
            d[k] = json.loads(v)
        except json.JSONDecodeError:
            d[k] = v
    paths = {k: d.pop(k) for k in ("checkpoint_dir", "tasks_dir", "out_dir")}
    cfg = EvalConfig.from_dict(d)
    with Reporter() as rep:
        summary = evaluate(paths["checkpoint_dir"], paths["tasks_dir"], paths["out_dir"], cfg, rep)
        rep.result(summary)
    return summary


if __name__ == "__main__":
    main()
