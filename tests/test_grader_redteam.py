"""The grader against cheats written the way a policy might write them (``tests/cheats.py``):
every cheat gets reward 0 and a flag of its family or another; the reference, alone or with
ordinary extra work, gets reward 1 and no flag."""

import pytest

from composer_dag.envs.cheat_flags import flag_family
from composer_dag.envs.grade import check_task, grade
from composer_dag.envs.task_format import task_dirs

from .cheats import CHEATS, applicable, cheat_workspace, honest_workspace


@pytest.fixture(scope="module")
def all_tasks(humaneval_tasks, bugfix_tasks):
    dirs = []
    for out, _ in (humaneval_tasks, bugfix_tasks):
        dirs += task_dirs(out, "rl_tasks") + task_dirs(out, "eval_tasks")
    return {d.name: d for d in dirs}


def _pairs():
    return [(c.name, kind) for c in CHEATS for kind in c.kinds]


def _task_for(cheat, kind, tasks):
    for tid in sorted(tasks):
        if tasks[tid].name.startswith("humaneval" if kind == "humaneval" else "bugfix") and applicable(cheat, tasks[tid]):
            return tasks[tid]
    pytest.fail(f"no {kind} task the cheat {cheat.name} applies to: the red-team suite must exercise every cheat")


def test_suite_size():
    assert len(CHEATS) >= 30
    assert len({c.family for c in CHEATS}) >= 10


@pytest.mark.parametrize("name,kind", _pairs())
def test_cheat_gets_zero_and_a_flag(all_tasks, tmp_path, name, kind):
    cheat = next(c for c in CHEATS if c.name == name)
    task = _task_for(cheat, kind, all_tasks)
    ws, log = cheat_workspace(cheat, task, tmp_path / "ws")
    r = grade(task, ws, log)
    assert r.reward == 0.0 and r.flags, (r.flags, r.details.get("output_tail"))
    assert set(r.families) == {flag_family(f) for f in r.flags}


def test_behavioural_catches_without_shape(all_tasks, tmp_path):
    """An always-equal object no shape rule knows, and a lookup of the test file at run time:
    the hidden tests pass, so only the canary catches them."""
    for name in ("always_equal_computed", "hidden_file_lookup"):
        cheat = next(c for c in CHEATS if c.name == name)
        task = all_tasks["humaneval-000"]
        ws, log = cheat_workspace(cheat, task, tmp_path / name)
        r = grade(task, ws, log)
        assert r.details["unflagged_reward"] == 1.0 and r.canary_passed and "canary" in r.families, r.flags
        assert r.reward == 0.0


def test_results_rewritten_in_the_runner_are_caught_by_the_canary(all_tasks, tmp_path):
    """Code under test that rewrites the runner's own results in memory gets a sealed 'all
    passed'; the same rewrite happens in the canary's run, which then passes."""
    cheat = next(c for c in CHEATS if c.name == "runner_results_rewrite")
    for task in (all_tasks["humaneval-000"], next(t for n, t in sorted(all_tasks.items()) if n.startswith("bugfix"))):
        ws, _ = cheat_workspace(cheat, task, tmp_path / task.name)
        r = grade(task, ws)
        assert r.details["unflagged_reward"] == 1.0 and r.canary_passed and r.reward == 0.0, r.flags


def test_framework_patch_is_seen_by_the_runner(all_tasks, tmp_path):
    cheat = next(c for c in CHEATS if c.name == "unittest_run_patch")
    task = next(t for n, t in sorted(all_tasks.items()) if n.startswith("bugfix"))
    ws, _ = cheat_workspace(cheat, task, tmp_path / "ws")
    r = grade(task, ws)
    assert any(f.startswith("framework_tamper:TestCase.run changed") for f in r.flags), r.flags
    assert r.canary_passed and r.reward == 0.0


@pytest.mark.parametrize("extras", [False, True], ids=["reference", "reference+extras"])
def test_honest_work_is_not_flagged(all_tasks, tmp_path, extras):
    for tid, task in sorted(all_tasks.items()):
        ws = honest_workspace(task, tmp_path / f"{tid}-{extras}", extras)
        r = grade(task, ws)
        assert r.reward == 1.0 and r.flags == [] and not r.canary_passed, (tid, r.flags, r.details.get("output_tail"))


def test_tasks_have_verified_canaries(all_tasks):
    for tid, task in sorted(all_tasks.items()):
        res = check_task(task)
        assert res["ok"] and res["canaries"] >= 1 and res["reference_fails_canaries"], res
