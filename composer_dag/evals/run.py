"""Evaluate a checkpoint from a JSON config, without Dagster::

    python -m composer_dag.evals.run --config eval.json [--set key=json_value ...]

The config holds ``checkpoint_dir``, ``tasks_dir``, ``out_dir`` and any ``EvalConfig``
field. The summary goes out through ``pipes.Reporter.result`` (a Pipes message when
launched by Dagster, else the last line of stdout). Started again after being killed, the same
evaluation reuses the batches of tasks it had finished (see ``evaluate``).
"""

from __future__ import annotations


from ..pipes import config_from_args, serve
from ..storage import ArtifactError
from .evaluate import EvalConfig, evaluate


def _parse(d: dict) -> tuple[dict, EvalConfig]:
    paths = ("checkpoint_dir", "tasks_dir", "out_dir")
    if missing := [k for k in paths if not isinstance(d.get(k), str)]:
        raise ValueError(f"config needs checkpoint_dir, tasks_dir and out_dir as strings: {missing} missing")
    return {k: d.pop(k) for k in paths}, EvalConfig.from_dict(d)


def main(argv: list[str] | None = None) -> dict:
    paths, cfg = config_from_args("evaluate a checkpoint on held-out tasks", argv, _parse)
    try:
        return serve(lambda rep: evaluate(paths["checkpoint_dir"], paths["tasks_dir"], paths["out_dir"], cfg, rep))
    except ArtifactError as exc:  # a half-copied or damaged checkpoint: one clear line, no traceback
        raise SystemExit(f"evaluation refused: {exc}") from None

if __name__ == "__main__":
    main()
