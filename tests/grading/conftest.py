"""The grading tests' shared task set."""

from __future__ import annotations

import pytest

from composer_dag.tasks.format import task_dirs


@pytest.fixture(scope="module")
def all_tasks(humaneval_tasks, bugfix_tasks):
    """The session's HumanEval and stdlib bug-fix tasks, both sides of the split, by name."""
    dirs = []
    for out, _ in (humaneval_tasks, bugfix_tasks):
        dirs += task_dirs(out, "rl_tasks") + task_dirs(out, "eval_tasks")
    return {d.name: d for d in dirs}
