"""Task sources, each declared once, in its own module under ``tasks/sources/``::

    @task_source(name="toy", count=3, rl=True)
    def build(req: BuildRequest) -> list[Path]:
        ...  # write req.count task directories under req.out, each task.json's source "toy"

The name is the one spelling everywhere: ``task.json``'s ``source``, the build summary's keys
(``by_source``, ``seconds``) and the configs that name sources. The declaration says how the
source builds (the decorated function), how it splits (``eval_share``) and its defaults for RL,
evaluation and SFT; ``build_tasks`` (``tasks.sources.build``) loops over ``SOURCES``, and the
configs take their default source lists from it (``tasks.sources.declared``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class BuildRequest:
    """What a source's builder is given."""

    out: Path                       # write each task under out/<task id>/ (a staging directory)
    config: Any                     # the TaskBuildConfig: seed, limits, workers, the sources' own fields
    count: Optional[int]            # how many tasks (None: every task the source has; 0: none)
    environments: dict[str, Path]   # repository name -> a directory ``repo_environment`` wrote


@dataclass(frozen=True)
class TaskSource:
    """A task source's declaration (``task_source``)."""

    name: str
    build: Callable[[BuildRequest], Any]
    """-> the task directories written, or (directories, entries for the build summary)."""
    count: Optional[int] = 0
    """tasks built by default (None: all there are)"""
    count_field: Optional[str] = None
    """the ``TaskBuildConfig`` field that sets the count (else ``TaskBuildConfig.counts[name]``)"""
    eval_share: Optional[float] = None
    """split on its own: this share of its tasks go to eval_tasks, whole source files at a time
    (None: its source files split with the other sources', by ``eval_fraction``)"""
    rl: bool = False
    """RL trains on it by default (``RLConfig.task_sources``)"""
    eval_every_task: bool = False
    """evaluated in full, whatever ``max_tasks`` (``EvalConfig.every_task_of``)"""
    eval_samples: Optional[int] = None
    """samples per task in evaluation (``EvalConfig.samples_of_source``; None: ``samples_per_task``)"""
    sft_demos: Optional[int] = None
    """SFT reference trajectories drawn from it (``TrajectoryConfig.max_per_source``; None: every task)"""
    gain: bool = False
    """the source on which the gate measures RL's gain over its parent (``GateConfig.gain_source``)"""


SOURCES: dict[str, TaskSource] = {}
"""The registered sources by name, in registration order (the order they are built in)."""


def task_source(name: str, **declared) -> Callable:
    """Register the decorated function as the builder of the task source ``name``; ``declared``
    are the other ``TaskSource`` fields."""

    def register(build: Callable[[BuildRequest], Any]) -> Callable[[BuildRequest], Any]:
        if name in SOURCES:
            raise ValueError(f"task source {name!r} is declared twice")
        SOURCES[name] = TaskSource(name=name, build=build, **declared)
        return build

    return register
