"""Task building: HumanEval and stdlib bug-fix tasks, the split, and the soundness checks."""

import ast
import json
import subprocess

import pytest

from composer_dag.grading.grade import false_positive_rate
from composer_dag.tasks.format import task_dirs, task_texts
from composer_dag.tasks.sources.build import build_tasks, check_split, check_tasks, split_tasks
from composer_dag.tasks.sources.stdlib_bugfix import apply_mutation, mutation_sites
from composer_dag.harness.episode import Episode

CFG = {"seed": 0, "humaneval_limit": 4, "bugfix_count": 2, "bugfix_modules": ["colorsys", "fnmatch"],
       "max_per_module": 1, "attempts_per_module": 4, "learnable_count": 4}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("tasks")
    summary = build_tasks(out, CFG)
    return out, summary


def _all(out):
    return task_dirs(out, "rl_tasks") + task_dirs(out, "eval_tasks")


def git(repo, *args):
    out = subprocess.run(["git", "--no-optional-locks", "-c", "safe.directory=*", *args], cwd=repo, capture_output=True, check=True)
    return out.stdout.decode(errors="replace")


def test_summary_and_split(built):
    out, s = built
    assert s["tasks"] == 10 and s["by_source"] == {"humaneval": 4, "learnable": 4, "stdlib-bugfix": 2}
    assert s["rl_tasks"] + s["eval_tasks"] == 10 and s["rl_tasks"] and s["eval_tasks"]
    assert s["split_check"]["ok"] and check_split(out)["ok"]
    assert json.loads((out / "summary.json").read_text())["tasks"] == 10
    # the summary's per-source entries use the sources' names, as the tasks do
    assert {"humaneval", "stdlib-bugfix", "learnable", "repo-mined", "swe-instances", "total"} <= set(s["seconds"])
    assert s["bugfix_modules"] and set(s["bugfix_modules"]) <= {"colorsys", "fnmatch"} and s["repositories"] == {}
    print("build seconds:", s["seconds"])


def test_split_is_deterministic_and_grouped_by_source():
    tasks = [{"id": f"t{i}", "source_file": f"src{i % 7}"} for i in range(70)]
    a, b = split_tasks(tasks, 0.3), split_tasks(list(reversed(tasks)), 0.3)
    assert a == b and not set(a["rl_tasks"]) & set(a["eval_tasks"])
    side = {t: k for k, ids in a.items() for t in ids}
    for src in {t["source_file"] for t in tasks}:
        assert len({side[t["id"]] for t in tasks if t["source_file"] == src}) == 1
    assert a["rl_tasks"] and a["eval_tasks"]


def test_a_source_split_on_its_own_gets_its_share_by_whole_files():
    # a repository's tasks: a few modules with many tasks each (networkx's 20 in make run: 9, 5, 4, 2)
    mined = [{"id": f"m{f}{i}", "source": "repo-mined", "source_file": f"nx:mod{f}.py"}
             for f, n in enumerate((9, 5, 4, 2)) for i in range(n)]
    other = [{"id": f"h{i}", "source": "humaneval", "source_file": f"he{i}"} for i in range(30)]
    for salt in "01234567":
        s = split_tasks(other + mined, 0.2, salt=salt, fraction_of={"repo-mined": 0.5})
        ev = {t["source_file"] for t in mined if t["id"] in s["eval_tasks"]}
        rl = {t["source_file"] for t in mined if t["id"] in s["rl_tasks"]}
        assert ev and rl and not ev & rl, (salt, ev, rl)
        assert sum(t["id"] in s["eval_tasks"] for t in mined) >= 10, salt  # the gate's min_tasks
        # the other sources split as before
        assert split_tasks(other, 0.2, salt=salt) == {k: [i for i in v if i.startswith("h")] for k, v in s.items()}
    # one file: all on one side, by its hash like any other source's file
    one = [{"id": f"p{i}", "source": "repo-mined", "source_file": "parse:parse.py"} for i in range(4)]
    sides = {k for salt in "0123456789" for k, v in split_tasks(one, 0.2, salt, {"repo-mined": 0.5}).items() if v}
    assert sides == {"rl_tasks", "eval_tasks"}
    assert all(len(v) in (0, 4) for v in split_tasks(one, 0.2, "0", {"repo-mined": 0.5}).values())


def test_task_layout_and_clean_history(built):
    out, _ = built
    for d in _all(out):
        task = json.loads((d / "task.json").read_text())
        assert {"id", "source", "source_file", "instructions", "limits", "reference"} <= set(task)
        assert (d / "hidden_tests").is_dir() and list((d / "hidden_tests").glob("test_*.py"))
        repo = d / "repo"
        assert len(git(repo, "log", "--oneline").splitlines()) == 2
        assert git(repo, "status", "--porcelain") == ""
        assert git(repo, "stash", "list") == ""
        objects = git(repo, "cat-file", "--batch-all-objects", "--batch")
        for ref in (d / "reference" / "files").rglob("*.py"):
            solved = ref.read_text()
            # the solved file never appears in any git object (history, reflog, dangling)
            assert solved not in objects
            assert (repo / ref.name).read_text() != solved


def test_reference_passes_broken_fails_no_flags(built):
    out, _ = built
    res = check_tasks(_all(out))
    assert res["ok"], res["failed"]
    fp = false_positive_rate(_all(out))
    assert fp["rate"] == 0.0, fp


def test_humaneval_visible_example(built):
    out, _ = built
    d = next(p for p in _all(out) if p.name == "humaneval-000")
    src = (d / "repo" / "tests" / "test_example.py").read_text()
    assert "assert has_close_elements(" in src
    assert "raise NotImplementedError" in (d / "repo" / "has_close_elements.py").read_text()


def test_bugfix_episode_hides_originals(built):
    out, _ = built
    d = next(p for p in _all(out) if p.name.startswith("bugfix-"))
    mod = json.loads((d / "task.json").read_text())["reference"]["files"][0].removesuffix(".py")
    with Episode(d) as ep:
        obs = ep.step({"name": "run_terminal_cmd", "arguments": {"command":
            f"ls /usr/local/lib/python3.11/test | wc -l; find / -name 'test_{mod}*' -not -path '/proc/*' 2>/dev/null | wc -l; "
            f"diff -q /usr/local/lib/python3.11/{mod}.py {mod}.py && echo same; cd /tmp && python3 -c 'import {mod}; print({mod}.__file__)'"}})
        lines = obs.content.splitlines()
        assert lines[1:4] == ["0", "0", "same"], obs.content
        assert lines[4] == f"/usr/local/lib/python3.11/{mod}.py"


def test_hidden_tests_import_the_repo_copy(built):
    out, _ = built
    d = next(p for p in _all(out) if p.name.startswith("bugfix-"))
    src = next((d / "hidden_tests").glob("*.py")).read_text()
    assert "_sys.modules.pop(" in src and "_importlib.import_module(" in src


def test_task_texts(built):
    out, _ = built
    texts = task_texts(task_dirs(out, "eval_tasks")[0])
    assert len(texts) >= 4 and all(isinstance(t, str) for t in texts)


def test_mutations():
    src = "def f(a, b):\n    if a < b:\n        a = a + 1\n    x = [a, b]\n    return x[0] and not b\n"
    kinds = {k for k, _ in mutation_sites(src)}
    assert {"comparison", "operator", "off_by_one", "boolean", "negation"} <= kinds
    for kind, node in mutation_sites(src):
        mutant = apply_mutation(src, kind, node)
        assert ast.dump(ast.parse(mutant)) != ast.dump(ast.parse(src)), kind


def test_held_out_learnable_words_are_never_trained_on(built):
    out, _ = built
    words = {side: {json.loads((d / "task.json").read_text())["reference"]["word"] for d in task_dirs(out, side)
                    if json.loads((d / "task.json").read_text())["source"] == "learnable"}
             for side in ("rl_tasks", "eval_tasks")}
    assert words["rl_tasks"] and words["eval_tasks"], words
    assert not words["rl_tasks"] & words["eval_tasks"]


def test_tasks_without_a_behavioural_check_are_left_out_and_counted(tmp_path, monkeypatch):
    """A task with no canary (no behavioural check: an in-process forgery of its results would
    pay) is used neither for RL nor for eval; the summary counts it by source."""
    import composer_dag.tasks.sources.learnable as learnable
    from composer_dag.grading.grade import check_task

    real = learnable.build_learnable_tasks
    monkeypatch.setattr(learnable, "build_learnable_tasks", lambda *a, **k: real(*a, **{**k, "canaries": False}))
    s = build_tasks(tmp_path, {"humaneval_limit": 0, "bugfix_count": 0, "learnable_count": 3})
    assert s["tasks"] == 0 and s["rl_tasks"] == s["eval_tasks"] == 0
    assert sorted(s["left_out_no_behavioural_check"]) == ["learnable"] and \
        len(s["left_out_no_behavioural_check"]["learnable"]) == 3
    # and the soundness check says so of such a task
    real(tmp_path / "loose", 1, seed=1, canaries=False)
    res = check_task(next((tmp_path / "loose").iterdir()))
    assert res["canaries"] == 0 and not res["ok"] and res["reference_passes"], res
