"""Writing a task of a source built from files in memory (HumanEval, stdlib bug-fixes, the
learnable family): the task directory (``tasks.format.write_task``) with its repository by the
task's persona, then its canaries."""

from __future__ import annotations

import sys
from pathlib import Path

from composer_dag.grading.canaries import add_canaries
from composer_dag.laptop.image import task_persona
from composer_dag.tasks.format import write_task


def write_checked_task(task_dir: Path, task: dict, repo_commits, hidden: dict[str, str], reference: dict[str, str],
                       masks: dict[str, str] | None = None, canaries: bool = True) -> Path:
    """``write_task`` with the commits by the task's persona (``laptop.image.task_persona``);
    then (``canaries``) the canary tests, verified against the reference in one sandbox run, and
    the record of them and of the hidden tests the reference passes (``task.json`` -> ``checks``)."""
    persona = task_persona(task)
    write_task(task_dir, task, repo_commits, hidden, reference, masks, author=(persona.full_name, persona.email))
    if canaries and hidden and reference:
        try:
            add_canaries(task_dir)
        except Exception as e:  # noqa: BLE001 - a task without canaries is still gradable
            print(f"canaries for {task.get('id')}: {type(e).__name__}: {e}", file=sys.stderr)
    return task_dir
