"""Evaluate a checkpoint from a JSON config, without Dagster::

    python -m composer_dag.evals.run --config eval.json [--set key=json_value ...]

The config holds ``checkpoint_dir``, ``tasks_dir``, ``out_dir`` and any ``EvalConfig``
field. The summary goes out through ``pipes.Reporter.result`` (a Pipes message when
launched by Dagster, else the last line of stdout).
"""

from __future__ import annotations


from ..pipes import config_from_args, serve
from .evaluate import EvalConfig, evaluate


def main(argv: list[str] | None = None) -> dict:
    d = config_from_args("evaluate a checkpoint on held-out tasks", argv)
    try:
        paths = {k: d.pop(k) for k in ("checkpoint_dir", "tasks_dir", "out_dir")}
    except KeyError as exc:
        raise SystemExit(f"config needs checkpoint_dir, tasks_dir and out_dir: {exc} is missing") from None
    cfg = EvalConfig.from_dict(d)
    return serve(lambda rep: evaluate(paths["checkpoint_dir"], paths["tasks_dir"], paths["out_dir"], cfg, rep))

if __name__ == "__main__":
    main()
