"""Tools and Episode: validation, path confinement, edits, terminal, truncation, a full episode."""

import json
import os

import pytest

from composer_dag.tasks.format import task_dirs
from composer_dag import harness
from composer_dag.harness.base import truncate
from composer_dag.harness.composer import COMPOSER
from composer_dag.harness.episode import Episode, EpisodeConfig


@pytest.fixture(scope="module")
def task(humaneval_tasks):
    out, _ = humaneval_tasks
    return next(d for d in task_dirs(out, "rl_tasks") + task_dirs(out, "eval_tasks") if d.name == "humaneval-000")


@pytest.fixture
def ep(task):
    with Episode(task) as e:
        yield e


def call(name, **args):
    return {"name": name, "arguments": args}


def test_schemas_are_openai_function_specs():
    assert harness.get("composer") is COMPOSER and "composer" in harness.names()
    names = [t["function"]["name"] for t in COMPOSER.tool_schemas()]
    assert names == ["read_file", "list_dir", "search", "edit_file", "run_terminal_cmd", "submit"]
    assert [t.kind for t in COMPOSER.tools] == ["read", "list", "search", "write", "exec", "submit"]
    for t in COMPOSER.tool_schemas():
        assert t["type"] == "function" and t["function"]["parameters"]["type"] == "object"
        json.dumps(t)


@pytest.mark.parametrize("bad", [
    "not a dict", {"name": "rm_rf", "arguments": {}}, {"name": "read_file", "arguments": "{not json"},
    {"name": "read_file", "arguments": {}}, {"name": "read_file", "arguments": {"path": 3}},
    {"name": "read_file", "arguments": {"path": "a", "mode": "w"}},
    {"name": "read_file", "arguments": {"path": "README.md", "start_line": 0}},
    {"name": "edit_file", "arguments": {"path": "x"}}, {"function": {"name": "list_dir", "arguments": [1]}},
])
def test_malformed_calls_give_error_observations(ep, bad):
    obs = ep.step(bad)
    assert obs.is_error and obs.content.startswith("Error:") and not obs.done
    assert ep.log[-1]["ok"] is False


@pytest.mark.parametrize("bad", [
    {"name": ["read_file"], "arguments": {"path": "README.md"}},
    {"name": {"tool": "read_file"}, "arguments": {"path": "README.md"}},
    {"name": None, "arguments": {}}, {"name": 3, "arguments": {}}, {"arguments": {"path": "."}},
    {"function": {"name": ["list_dir"], "arguments": '{"path": "."}'}},
    {"function": {"name": {"a": 1}, "arguments": {}}}, {"function": ["list_dir"]},
    {"name": "list_dir", "arguments": "path=."}, {"name": "list_dir", "arguments": "[1, 2]"},
    {"name": "list_dir", "arguments": ["."]}, {"name": "list_dir", "arguments": '"."'},
    {"name": "list_dir", "arguments": '{"path": ' + "1" * 5000 + "}"},
    {"name": "list_dir", "arguments": "[" * 100_000},
])
def test_calls_with_ill_typed_name_or_arguments_give_error_observations(ep, bad):
    obs = ep.step(bad)
    assert obs.is_error and obs.content.startswith("Error:") and not obs.done
    assert len(obs.content) < 1000
    assert ep.log[-1]["ok"] is False and ep.log[-1]["tool"] is None
    assert not ep.step(call("list_dir", path=".")).is_error  # the episode carries on


def test_openai_style_call_with_json_string(ep):
    obs = ep.step({"type": "function", "function": {"name": "list_dir", "arguments": '{"path": "."}'}})
    assert not obs.is_error and "has_close_elements.py" in obs.content and "tests/" in obs.content


def test_paths_outside_are_refused_and_recorded(ep, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cr3t")
    os.symlink(secret, ep.workspace / "link.txt")
    for path in ["/etc/passwd", "../../../etc/passwd", "link.txt", str(secret), "tests/../../x"]:
        obs = ep.step(call("read_file", path=path))
        assert obs.is_error and "outside the project" in obs.content, path
        assert ep.log[-1]["outside"]
    assert not ep.step(call("read_file", path=f"{ep.root}/README.md")).is_error
    assert not ep.step(call("read_file", path="~/has-close-elements/README.md")).is_error


def test_read_list_search(ep):
    obs = ep.step(call("read_file", path="has_close_elements.py", start_line=1, end_line=2))
    assert obs.content.splitlines()[0].strip().startswith("1") and len(obs.content.splitlines()) == 2
    assert "has_close_elements.py:" in ep.step(call("search", pattern=r"def \w+\(")).content
    assert ep.step(call("search", pattern="(unclosed")).is_error
    assert ep.step(call("search", pattern="zzz_nothing")).content == "No matches."
    assert ep.step(call("read_file", path="nope.py")).is_error


def test_catastrophic_search_pattern_is_stopped(ep):
    """A pattern with exponential backtracking (`(a|a)*$` on a run of a's) is cut off by the
    search's time budget with an error observation, instead of hanging the host worker."""
    import time

    ep.step(call("edit_file", path="evil.txt", old="", new="a" * 40 + "!\n"))
    t0 = time.monotonic()
    obs = ep.step(call("search", pattern=r"(a|a)*$", path="evil.txt"))
    assert obs.is_error and "longer than" in obs.content
    assert time.monotonic() - t0 < 10
    assert "evil.txt:1" in ep.step(call("search", pattern=r"a{40}!", path="evil.txt")).content


def test_edit_file_semantics(ep):
    assert ep.step(call("edit_file", path="has_close_elements.py", old="no such text", new="x")).is_error
    assert "19 times" in ep.step(call("edit_file", path="README.md", old="e", new="E")).content
    assert not ep.step(call("edit_file", path="pkg/new.py", old="", new="VALUE = 1\n")).is_error
    assert ep.step(call("edit_file", path="pkg/new.py", old="", new="again")).is_error
    assert not ep.step(call("edit_file", path="pkg/new.py", old="VALUE = 1", new="VALUE = 2")).is_error
    obs = ep.step(call("run_terminal_cmd", command="python3 -c 'import pkg.new as m; print(m.VALUE)'; echo more >> pkg/new.py"))
    assert "exit code: 0" in obs.content and "\n2" in obs.content
    assert "more" in ep.step(call("read_file", path="pkg/new.py")).content


def test_terminal_errors_and_truncation(task):
    with Episode(task, EpisodeConfig(observation_chars=500, command_timeout=1)) as ep:
        obs = ep.step(call("run_terminal_cmd", command="seq 1 5000"))
        assert "characters truncated ...]" in obs.content and len(obs.content) < 600
        assert "killed: timeout" in ep.step(call("run_terminal_cmd", command="sleep 5")).content
        assert "exit code: 2" in ep.step(call("run_terminal_cmd", command="ls /nonexistent")).content
    assert truncate("x" * 100, 10).count("[... 90 characters truncated ...]") == 1


def test_turn_limit_and_done(task):
    with Episode(task, EpisodeConfig(max_turns=2)) as ep:
        ep.step(call("list_dir", path="."))
        ep.step(call("list_dir", path="."))
        obs = ep.step(call("list_dir", path="."))
        assert obs.is_error and obs.done and "turn limit" in obs.content
    with Episode(task) as ep:
        assert ep.step(call("submit")).done
        assert ep.step(call("list_dir", path=".")).is_error


def test_full_episode_reward(task):
    ref = (task / "reference" / "files" / "has_close_elements.py").read_text()
    with Episode(task) as ep:
        assert "has_close_elements" in ep.prompt()
        stub = (ep.workspace / "has_close_elements.py").read_text()
        body_old = "    raise NotImplementedError\n"
        ep.step(call("edit_file", path="has_close_elements.py", old=body_old, new=ref[len(stub) - len(body_old):]))
        obs = ep.step(call("run_terminal_cmd", command="python -m pytest -q"))
        assert "1 passed" in obs.content, obs.content
        ep.step(call("submit"))
        r = ep.grade()
    assert r.reward == 1.0 and r.flags == [] and r.passed == 1
    with Episode(task) as ep:
        ep.step(call("submit"))
        r = ep.grade()
    assert r.reward == 0.0 and r.failed == 1 and not r.flags


def test_an_episode_copies_its_checkout_only_when_a_call_needs_it(task):
    """Malformed calls and a submit need no workspace: none is copied, the task's checkout is
    graded as it was handed out (and left as it was), with the grade of an episode that looked
    at its own copy and changed nothing."""
    from composer_dag.tasks.taskdir import workspace_digest

    before = workspace_digest(task / "repo")
    with Episode(task) as lazy, Episode(task) as looked:
        for bad in ("not a dict", call("rm_rf"), call("read_file")):
            assert lazy.step(bad).is_error
        assert lazy.step(call("submit")).done
        assert not lazy._ws.exists() and lazy.final_tree == task / "repo"
        assert lazy.root == looked.root and lazy.root in lazy.prompt()
        looked.step(call("list_dir", path="."))
        assert looked._ws.is_dir() and looked.final_tree == looked._ws
        a, b = lazy.grade(), looked.grade()
        assert a.passed + a.failed > 0 and a.reward == 0.0
        assert (a.reward, a.passed, a.failed, a.per_test, a.flags) == (b.reward, b.passed, b.failed, b.per_test, b.flags)
    assert workspace_digest(task / "repo") == before
    with pytest.raises(RuntimeError, match="closed"):
        lazy.workspace
