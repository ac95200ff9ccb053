"""Evaluate checkpoints from a JSON config, without Dagster::

    python -m composer_dag.evals.run --config eval.json [--set key=json_value ...]

The config holds ``tasks_dir``, ``out_dir``, either ``checkpoint_dir`` (one checkpoint, its
files in ``out_dir``) or ``checkpoints`` (``{name: dir}``, each into ``out_dir/<name>``, all on
one inference engine), and any ``EvalConfig`` field (nested parts as objects:
``{"agent": {"max_turns": 4}}``). The summary (``{name: summary}`` for several) goes out through
``pipes.Reporter.result`` (a Pipes message when launched by Dagster, else the last line of
stdout). Started again after being killed, an evaluation reuses the batches of tasks it had
finished (see ``evaluate``) and the checkpoints it had finished (see ``evaluate_many``).
"""

from __future__ import annotations

from typing import Optional

from pydantic import model_validator

from ..pipes import serve
from ..runtime.config import config_from_args
from ..storage import ArtifactError
from .evaluate import EvalConfig, evaluate, evaluate_many

_PATHS = {"checkpoint_dir", "checkpoints", "tasks_dir", "out_dir"}


class EvalRunConfig(EvalConfig):
    """An ``EvalConfig`` with the paths of one evaluation job."""

    tasks_dir: str
    out_dir: str
    checkpoint_dir: Optional[str] = None
    checkpoints: Optional[dict[str, str]] = None

    @model_validator(mode="after")
    def _one_kind(self) -> "EvalRunConfig":
        if (self.checkpoint_dir is None) == (self.checkpoints is None):
            raise ValueError("give either checkpoint_dir or checkpoints")
        return self


def main(argv: list[str] | None = None) -> dict:
    run = config_from_args(EvalRunConfig, "evaluate checkpoints on held-out tasks", argv)
    cfg = EvalConfig.load(run.model_dump(exclude=_PATHS))
    try:
        if run.checkpoints is not None:
            return serve(lambda rep: evaluate_many(run.checkpoints, run.tasks_dir, run.out_dir, cfg, rep))
        return serve(lambda rep: evaluate(run.checkpoint_dir, run.tasks_dir, run.out_dir, cfg, rep))
    except ArtifactError as exc:  # a half-copied or damaged checkpoint: one clear line, no traceback
        raise SystemExit(f"evaluation refused: {exc}") from None


if __name__ == "__main__":
    main()
