"""A cheat detector added in one file: registered here with ``@detector``, it runs in every
grading (no edit anywhere else), its flag counts under its family, and it is gone again once
unregistered."""

import shutil

import pytest

from composer_dag.grading.flags.registry import FAMILIES, detector, flag, unregister
from composer_dag.grading.grade import grade
from composer_dag.tasks.format import task_dirs


@pytest.fixture(scope="module")
def task(humaneval_tasks):
    out, _ = humaneval_tasks
    return {d.name: d for d in task_dirs(out, "rl_tasks")}["humaneval-000"]


@pytest.fixture
def toy():
    """A solution that leaves a ``NOTES.cheat`` file behind is flagged ``toy_note``."""
    @detector(family="toy", flags=("toy_note",), phase="tree")
    def cheat_notes(ws):
        return [flag("toy_note", rel) for rel in ws.changed if rel.endswith(".cheat")]

    yield cheat_notes
    unregister(cheat_notes)


def _reference_workspace(task, tmp_path):
    ws = tmp_path / "ws"
    shutil.copytree(task / "repo", ws)
    shutil.copy(next((task / "reference" / "files").glob("*.py")), ws)
    return ws


def test_a_toy_detector_registered_in_one_file_flags_a_grading(task, tmp_path, toy):
    ws = _reference_workspace(task, tmp_path)
    assert grade(task, ws).flags == [] and grade(task, ws).reward == 1.0  # honest: the toy finds nothing
    (ws / "NOTES.cheat").write_text("the answers\n")
    r = grade(task, ws)
    assert r.flags == ["toy_note:NOTES.cheat"] and r.families == ["toy"] and r.reward == 0.0, r.flags
    unregister(toy)
    assert "toy_note" not in FAMILIES and grade(task, ws).flags == []
