"""A task source declared in one file (here, with ``@task_source``) is built through the normal
build path, split and summarised under its name, with no edit anywhere else."""

import json

import pytest

from composer_dag.runtime.config import ConfigError
from composer_dag.tasks.format import task_dirs
from composer_dag.tasks.registry import SOURCES, task_source
from composer_dag.tasks.sources import declared
from composer_dag.tasks.sources.build import TaskBuildConfig, build_tasks
from composer_dag.tasks.sources.write import write_checked_task

NONE_OF_THE_OTHERS = {"humaneval_limit": 0, "bugfix_count": 0, "learnable_count": 0}


@pytest.fixture
def toy():
    """The source ``toy-double``: implement ``double`` (one task per factor), 4 by default."""

    @task_source(name="toy-double", count=4, rl=True)
    def build(req):
        dirs = []
        for i in range(req.count):
            tid = f"toy-double-{i}"
            task = {"id": tid, "source": "toy-double", "source_file": f"toy:{i}", "project": "doubler",
                    "instructions": "Please implement `double` in `double.py`.", "limits": req.config.limits.to_dict(),
                    "reference": {"files": ["double.py"], "kind": "implementation"}, "sandbox": {"masks": {}}}
            stub = "def double(x):\n    raise NotImplementedError\n"
            hidden = f"from double import double\n\n\ndef test_double():\n    assert double({i + 20}) == {2 * i + 40}\n"
            dirs.append(write_checked_task(req.out / tid, task, [("Initial commit", {"double.py": stub})],
                                           {"test_double.py": hidden}, {"double.py": "def double(x):\n    return 2 * x\n"}))
        return dirs, {"toy_factors": list(range(req.count))}

    yield SOURCES["toy-double"]
    del SOURCES["toy-double"]


def test_a_source_declared_in_one_file_is_built_split_and_summarised(toy, tmp_path):
    s = build_tasks(tmp_path, {**NONE_OF_THE_OTHERS, "eval_fraction": 0.5})
    assert s["tasks"] == 4 and s["by_source"] == {"toy-double": 4}, s
    assert s["rl_tasks"] and s["eval_tasks"] and s["split_check"]["ok"]
    assert "toy-double" in s["seconds"] and s["toy_factors"] == [0, 1, 2, 3]
    written = {side: [json.loads((d / "task.json").read_text()) for d in task_dirs(tmp_path, side)]
               for side in ("rl_tasks", "eval_tasks")}
    assert sorted(t["id"] for side in written.values() for t in side) == [f"toy-double-{i}" for i in range(4)]
    assert all(t["source"] == "toy-double" and t["checks"]["canaries"] for side in written.values() for t in side)
    assert sorted(t["id"] for t in written["eval_tasks"]) == s["split"]["eval_tasks"]
    assert json.loads((tmp_path / "summary.json").read_text())["by_source"] == {"toy-double": 4}
    assert "toy-double" in declared("rl")


def test_a_source_without_a_count_field_takes_its_default_or_counts(toy):
    assert TaskBuildConfig().count(toy) == 4
    assert TaskBuildConfig.load({"counts": {"toy-double": 1}}).count(toy) == 1
    assert TaskBuildConfig().count(SOURCES["humaneval"]) == SOURCES["humaneval"].count == TaskBuildConfig().humaneval_limit


def test_unknown_sources_and_twice_declared_ones_are_refused(toy, tmp_path):
    with pytest.raises(ConfigError, match="no-such-source"):
        build_tasks(tmp_path, {**NONE_OF_THE_OTHERS, "counts": {"no-such-source": 1}})
    with pytest.raises(ValueError, match="declared twice"):
        task_source(name="toy-double")(lambda req: [])
    assert SOURCES["toy-double"] is toy
