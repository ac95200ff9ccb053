"""Repositories become environments and tasks: real sdists (``REPO_SDISTS``, fetched once per
session) bootstrapped in the sandbox offline, a small project that exercises every way a test is
left out and every reason a bootstrap fails, tasks mined from parse and graded under pytest by
the sealed runner, an episode in the project's own virtual environment."""

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from composer_dag.grading.grade import check_task, grade
from composer_dag.repos.bootstrap import bootstrap, load_env
from composer_dag.repos.config import BootstrapConfig
from composer_dag.tasks.taskdir import apply_reference, load_task
from composer_dag.harness.episode import Episode

SUMMARY_KEYS = {"ok", "reason", "test_command", "tests_passing", "tests_total", "seconds", "env_digest"}


def test_real_packages_bootstrap(repo_envs):
    """Each sdist becomes an environment: its own suite passes in the sandbox, the summary line
    has the documented keys, and environments with the same dependency set share one layer."""
    for name in ("parse", "inflection", "cachetools"):
        env_dir, line = repo_envs[name]
        assert set(line) == SUMMARY_KEYS and line["ok"] and line["reason"] is None, line
        rec = load_env(env_dir)
        assert rec["tests_passing"] >= 50 and rec["tests_total"] == rec["tests_passing"] + len(rec["left_out"]), rec
        assert sum(rec["left_out_counts"].values()) == len(rec["left_out"])
        assert rec["licence"].startswith("MIT") and rec["store"]["dependencies"] == []
        assert (env_dir / "repo" / ".git").is_dir() and (env_dir / "tests" / "pytest.ini").is_file()
        assert "--confcutdir /var/tmp/checks" in rec["test_command"]
    # src/ layout: the editable finder puts src/ on sys.path, from the environment's own prefix
    assert repo_envs["cachetools"][0].joinpath("layer", "site-packages", "__editable__.cachetools.pth").read_text() \
        == "import os, sys; sys.path.append(os.path.join(os.path.dirname(sys.prefix), 'src'))\n"
    assert load_env(repo_envs["cachetools"][0])["layout"]["src_dir"] == "src"
    # parse and inflection: flat layouts, no dependencies -> one layer; the wheel store hit on a rerun
    layers = {n: load_env(repo_envs[n][0])["layer"] for n in ("parse", "inflection", "cachetools")}
    assert layers["parse"] == layers["inflection"] != layers["cachetools"], layers
    assert load_env(repo_envs["inflection"][0])["store"]["layer_hit"] is True
    again = bootstrap(str(repo_envs["parse"][0].parent / "again-src"), repo_envs["_store"].parent / "again",
                      BootstrapConfig(store=str(repo_envs["_store"])))
    assert (again["ok"], again["reason"]) == (False, "fetch_failed"), again  # no such source
    shutil.copytree(repo_envs["parse"][0] / "repo", repo_envs["_store"].parent / "again-src")
    again = bootstrap(str(repo_envs["_store"].parent / "again-src"), repo_envs["_store"].parent / "again",
                      BootstrapConfig(store=str(repo_envs["_store"])))
    rec = load_env(repo_envs["_store"].parent / "again")
    assert again["ok"] and rec["store"]["layer_hit"] and rec["layer"] == layers["parse"], rec["store"]
    assert again["tests_passing"] == repo_envs["parse"][1]["tests_passing"]


def _project(root: Path, tests: str, *, pyproject: bool = True, licence: str = "MIT", deps: str = "") -> Path:
    (root / "tinylib").mkdir(parents=True)
    (root / "tinylib" / "__init__.py").write_text(
        '"""A tiny library."""\nimport time\n\n\ndef add(a, b):\n    """Sum."""\n    return a + b\n\n\n'
        "def year():\n    return time.gmtime().tm_year\n")
    if pyproject:
        (root / "pyproject.toml").write_text(
            '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n\n'
            f'[project]\nname = "tinylib"\nversion = "0.1"\nlicense = {{text = "{licence}"}}\ndependencies = [{deps}]\n'
            '\n[tool.setuptools]\npackages = ["tinylib"]\n')
    if tests:
        (root / "tests").mkdir()
        (root / "tests" / "test_tiny.py").write_text(tests)
    return root


def _hash_parity_flips() -> str:
    """A string whose hash parity differs between PYTHONHASHSEED 0 and 4242 (the bootstrap's
    plain and shifted runs), and its parity under 0."""
    code = "import sys; print(' '.join(str(hash(f'k{i}') % 2) for i in range(64)))"
    a, b = (subprocess.run([sys.executable, "-c", code], env={"PYTHONHASHSEED": s}, capture_output=True,
                           text=True).stdout.split() for s in ("0", "4242"))
    i = next(i for i in range(64) if a[i] != b[i])
    return f"k{i}", a[i]


@pytest.mark.slow
def test_bootstrap_keeps_only_reliable_tests_and_fails_cleanly(repo_envs, tmp_path):
    """One project with a test of each kind: kept, failing at the base, skipped, depending on
    the clock (the shifted run), on the hash seed, and vacuous (passes with the code replaced by
    NotImplementedError). Then each failure reason, and nothing left behind by a failure."""
    key, parity = _hash_parity_flips()
    tests = ("import pytest\nfrom tinylib import add, year\n\n\n"
             "def test_add():\n    assert add(2, 3) == 5\n\n\n"
             "@pytest.mark.parametrize('a', [1, 2])\ndef test_add_param(a):\n    assert add(a, 0) == a\n\n\n"
             "def test_fails():\n    assert add(1, 1) == 3\n\n\n"
             "@pytest.mark.skip(reason='later')\ndef test_skipped():\n    pass\n\n\n"
             "def test_before_2030():\n    assert year() < 2030\n\n\n"
             f"def test_hash_order():\n    assert str(hash({key!r}) % 2) == {parity!r}\n\n\n"
             "def test_vacuous():\n    assert callable(add)\n")
    cfg = BootstrapConfig(store=str(repo_envs["_store"]))
    r = bootstrap(str(_project(tmp_path / "p1", tests)), tmp_path / "env1", cfg)
    assert r["ok"], r
    rec = load_env(tmp_path / "env1")
    assert sorted(rec["kept"]) == ["tests/test_tiny.py::test_add", "tests/test_tiny.py::test_add_param[1]",
                                   "tests/test_tiny.py::test_add_param[2]"], rec
    assert rec["left_out"] == {"tests/test_tiny.py::test_before_2030": "nondeterministic",
                               "tests/test_tiny.py::test_fails": "fails_at_base",
                               "tests/test_tiny.py::test_hash_order": "nondeterministic",
                               "tests/test_tiny.py::test_skipped": "skipped",
                               "tests/test_tiny.py::test_vacuous": "vacuous"}, rec["left_out"]
    assert (r["tests_passing"], r["tests_total"]) == (3, 8)
    assert "| vacuous | 1 |" in (tmp_path / "env1" / "report.md").read_text()

    fails = {
        "no_tests_found": (_project(tmp_path / "p2", ""), cfg),
        "tests_fail_at_base": (_project(tmp_path / "p3", "def test_x():\n    assert 0\n"), cfg),
        "unsupported_layout": (_project(tmp_path / "p4", "def test_x():\n    pass\n", pyproject=False), cfg),
        "licence_excluded": (_project(tmp_path / "p5", "def test_x():\n    pass\n"),
                             cfg.replace(exclude_licences=("mit",))),
        "timeout": (_project(tmp_path / "p6", "import time\n\n\ndef test_x():\n    time.sleep(60)\n"),
                    cfg.replace(test_timeout=8.0)),
        "needs_network": (_project(tmp_path / "p7", "import socket\n\n\ndef test_x():\n"
                                                    "    socket.create_connection(('pypi.org', 443), timeout=5)\n"), cfg),
        "install_failed": (_project(tmp_path / "p8", "def test_x():\n    pass\n",
                                    deps='"no-such-distribution-cdag-test==1.0"'), cfg),
        "fetch_failed": (tmp_path / "missing", cfg),
    }
    for reason, (src, c) in fails.items():
        out = tmp_path / f"out-{reason}"
        got = bootstrap(str(src), out, c)
        assert (got["ok"], got["reason"]) == (False, reason), (reason, got)
        assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(f".out-{reason}")]
    # a dependency: fetched as a wheel outside, installed inside the sandbox into the layer, which
    # is the only place the tests can import it from
    r = bootstrap(str(_project(tmp_path / "p9", "import six\nfrom tinylib import add\n\n\ndef test_six():\n"
                                                    "    assert six.PY3 and add(1, 2) == 3\n",
                               deps='"six==1.17.0"')), tmp_path / "env9", cfg)
    assert r["ok"] and r["tests_passing"] == 1, r
    assert load_env(tmp_path / "env9")["store"]["dependencies"] == ["six-1.17.0-py2.py3-none-any.whl"]
    assert (tmp_path / "env9" / "layer" / "site-packages" / "six.py").is_file()
    # the same dependency again, its wheel in the store already (pip says so indented): still listed
    r = bootstrap(str(_project(tmp_path / "p10", "import six\nfrom tinylib import add\n\n\ndef test_six():\n"
                                                     "    assert six.PY2 or add(2, 2) == 4\n",
                               deps='"six==1.17.0"')), tmp_path / "env10", cfg)
    assert r["ok"] and load_env(tmp_path / "env10")["store"]["dependencies"] == ["six-1.17.0-py2.py3-none-any.whl"], r


@pytest.mark.slow
def test_mined_tasks_are_sound_and_graded_under_pytest(mined_tasks, repo_envs):
    """Synthetic bugs over parse: each task passes today's soundness checks (reference passes,
    broken fails, a canary the reference fails), records its origin, hides its FAIL_TO_PASS
    files from the repository and its history, states the symptom without the tests or the fix;
    the workspace's own conftest.py, pytest.ini and virtual environment change nothing."""
    out, summary = mined_tasks
    assert summary["ok"] and len(summary["tasks"]) == 3, summary
    env = load_env(repo_envs["parse"][0])
    canaries_by_file: dict = {}  # the tasks that hide one test file share its canary, made and verified once
    for tid in summary["tasks"]:
        task = load_task(out / tid)
        for name, info in task["checks"]["canaries"].items():
            canaries_by_file.setdefault(info["replaces"], set()).add(name)
    assert canaries_by_file and all(len(v) == 1 for v in canaries_by_file.values()), canaries_by_file
    for tid in summary["tasks"]:
        d = out / tid
        task = load_task(d)
        assert task["format"] == 2 and task["framework"] == "pytest" and task["source"] == "repo-mined"
        f2p, p2p = task["tests"]["FAIL_TO_PASS"], task["tests"]["PASS_TO_PASS"]
        assert f2p and p2p and not set(f2p) & set(p2p) and set(f2p + p2p) <= set(env["kept"])
        assert task["origin"]["env_digest"] == env["env_digest"] and task["origin"]["licence"] == env["licence"]
        c = check_task(d)  # grading the reference runs each canary alone: what mining ran side by side agrees
        assert c["ok"] and c["canaries"] == 1, c
        for t in f2p:
            assert not (d / "repo" / t.split("::")[0]).exists()
            assert t.split("::")[-1].split("[")[0] not in task["instructions"], (t, task["instructions"])
        assert len(task["instructions"].split("```")[0].split(". ")) <= 3
        ref = (d / "reference" / "files" / task["reference"]["files"][0]).read_text().splitlines()
        broken = (d / "repo" / task["reference"]["files"][0]).read_text().splitlines()
        fixed_lines = set(ref) - set(broken)
        assert not any(line.strip() and line.strip() in task["instructions"] for line in fixed_lines)
        # --no-optional-locks: status would otherwise refresh (rewrite) the checkout's .git/index
        git = lambda *a: subprocess.run(["git", "--no-optional-locks", "-c", "safe.directory=*", *a], cwd=d / "repo",
                                        capture_output=True, text=True).stdout
        assert git("rev-list", "--all").split() == [git("rev-parse", "HEAD").strip()]  # one commit, no reflog
        assert git("status", "--porcelain") == ""
        objs = git("cat-file", "--batch-all-objects", "--batch-check").split("\n")
        assert sum(" commit " in o for o in objs) == 1, objs
        store = git("count-objects", "-v")
        assert "count: 0\n" in store and "packs: 1\n" in store, store  # one pack, no loose object files
        solved = git("hash-object", str(d / "reference" / "files" / task["reference"]["files"][0])).strip()
        assert solved and not any(o.startswith(solved) for o in objs)  # the fixed file is in no object

    d = out / summary["tasks"][0]
    with tempfile.TemporaryDirectory() as tmp:
        ws = apply_reference(d, Path(tmp) / "ref")
        (ws / "notes.md").write_text("worked on the date parsing\n")
        (ws / "tests" / "test_extra.py").write_text("import parse\n\n\ndef test_more():\n    assert parse.parse('{}', 'x')\n")
        r = grade(d, ws)
        assert (r.reward, r.flags) == (1.0, []), (r.reward, r.flags, r.details.get("output_tail"))
        assert r.passed == len(load_task(d)["checks"]["expected"])
        # the broken state, with every way a workspace could reach pytest's configuration
        ws = Path(tmp) / "hack"
        shutil.copytree(d / "repo", ws)
        hook = ("import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
                "    out = yield\n    rep = out.get_result()\n    rep.outcome = 'passed'\n    rep.longrepr = None\n")
        (ws / "conftest.py").write_text(hook)
        (ws / "tests" / "conftest.py").write_text(hook)
        (ws / "pytest.ini").write_text("[pytest]\naddopts = -p no:python --deselect tests\n")
        (ws / "tox.ini").write_text("[pytest]\naddopts = -x\n")
        (ws / "setup.cfg").write_text("[tool:pytest]\naddopts = -x\n")
        sp = ws / ".venv" / "lib" / "python3.11" / "site-packages"
        sp.mkdir(parents=True)
        (sp / "zz_cheat.pth").write_text("import os; os.environ['CDAG_CHEAT'] = '1'\n")
        (ws / "conftest_plugin.py").write_text(hook)
        # a startup hook where the editable finder puts the project on sys.path: never run at
        # grading (the runner starts without site and adds the site directories once keyed)
        (ws / "sitecustomize.py").write_text("import sys\nprint('STARTUP-HOOK-RAN', file=sys.stderr)\n")
        r = grade(d, ws)
        assert r.reward == 0.0 and r.failed >= 1, (r.reward, r.per_test)
        assert "untouched" not in r.details and len(r.details["run_windows"]) == 2  # the hidden run, the canary's
        assert "STARTUP-HOOK-RAN" not in r.details["output_tail"] and "site_hook:sitecustomize.py" in r.flags


def test_episode_runs_in_the_projects_virtual_environment(mined_tasks):
    """The terminal's python is the project's .venv with the layer; the file tools read the
    layer where the terminal sees it, and cannot write it; the mined CLI line has its keys."""
    out, summary = mined_tasks
    d = out / summary["tasks"][0]
    task = load_task(d)
    with Episode(d) as ep:  # no call, so no workspace: the checkout's recorded outcomes, no run
        g = ep.grade()
        assert ep.final_tree == d / "repo"
        assert g.details.get("untouched") and g.details["run_windows"] == [] and g.flags == [], g.details
        assert (g.reward, g.passed, g.failed) == (0.0, len(task["tests"]["PASS_TO_PASS"]),
                                                  len(task["tests"]["FAIL_TO_PASS"]))
    with Episode(d) as ep:  # a workspace made (its .venv too) and left untouched; its calls still count
        ep.step({"name": "read_file", "arguments": {"path": ".git/logs/HEAD"}})
        g = ep.grade()
        assert ep.final_tree == ep.workspace and (ep.workspace / ".venv").is_dir()
        assert g.details.get("untouched") and any(f.startswith("git_history:") for f in g.flags), g.flags
    with Episode(d) as ep:
        obs = ep.step({"name": "run_terminal_cmd", "arguments": {
            "command": "python -c 'import parse, sys; print(sys.prefix); print(parse.__file__)' && ls .venv/lib/python3.11/site-packages"}})
        assert f"{ep.root}/.venv\n{ep.root}/parse.py" in obs.content and "__editable__.parse.pth" in obs.content, obs.content
        pth = ep.step({"name": "read_file", "arguments": {"path": ".venv/lib/python3.11/site-packages/__editable__.parse.pth"}})
        assert "sys.prefix" in pth.content, pth.content
        bad = ep.step({"name": "edit_file", "arguments": {"path": ".venv/lib/python3.11/site-packages/__editable__.parse.pth",
                                                          "old": "sys", "new": "os"}})
        assert "read-only" in bad.content, bad.content
        ran = ep.step({"name": "run_terminal_cmd", "arguments": {"command": "python -m pytest -q tests 2>&1 | tail -1"}})
        assert "passed" in ran.content, ran.content


def test_cli_mine_prints_its_summary_last(repo_envs, tmp_path):
    r = subprocess.run([sys.executable, "-m", "composer_dag.cli", "tasks", "mine", str(repo_envs["cachetools"][0]),
                        "--out", str(tmp_path / "t"), "--max", "1", "--seed", "3"], capture_output=True, text=True,
                       timeout=600)
    line = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0 and line["ok"] and len(line["tasks"]) == 1, (r.stderr[-2000:], line)
    assert line["tried"] == line["accepted"] + sum(line["rejected"].values()), line
    task = load_task(tmp_path / "t" / line["tasks"][0])
    assert task["source_file"].startswith("cachetools:src/cachetools/")
    assert check_task(tmp_path / "t" / line["tasks"][0])["ok"]
    bad = subprocess.run([sys.executable, "-m", "composer_dag.cli", "tasks", "mine", str(tmp_path), "--out",
                          str(tmp_path / "x")], capture_output=True, text=True)
    assert bad.returncode == 2 and "not an environment" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("format_", [None, 1])
def test_old_task_directories_still_load(tmp_path, format_):
    (tmp_path / "task.json").write_text(json.dumps({"id": "t", **({"format": format_} if format_ else {})}))
    assert load_task(tmp_path)["id"] == "t"
    (tmp_path / "task.json").write_text(json.dumps({"id": "t", "format": 99}))
    with pytest.raises(ValueError, match="newer"):
        load_task(tmp_path)


def _cli(*args, timeout=900):
    r = subprocess.run([sys.executable, "-m", "composer_dag.cli", *args], capture_output=True, text=True, timeout=timeout)
    return r.returncode, json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else None, r.stderr


@pytest.mark.slow
def test_swebench_export_then_import_gives_back_the_tasks(mined_tasks, repo_envs, tmp_path):
    """Export writes SWE-bench instances (the test lists JSON-encoded strings of pytest node ids)
    and a mirror per repository; import checks each base commit out of the mirror, bootstraps it,
    verifies FAIL_TO_PASS and PASS_TO_PASS in the sandbox and gives back the same tasks. Bad
    instances are refused, each with its reason, and leave nothing behind."""
    out, summary = mined_tasks
    sub = tmp_path / "two"
    for tid in summary["tasks"][:2]:
        shutil.copytree(out / tid, sub / tid)
    code, line, err = _cli("tasks", "export", str(sub), "--out", str(tmp_path / "inst.jsonl"), "--mirror-dir",
                           str(tmp_path / "mirrors"))
    assert code == 0 and line["written"] == 2, err
    insts = [json.loads(l) for l in (tmp_path / "inst.jsonl").read_text().splitlines()]
    for inst in insts:
        assert {"instance_id", "repo", "base_commit", "patch", "test_patch", "problem_statement", "FAIL_TO_PASS",
                "PASS_TO_PASS"} <= set(inst)
        assert isinstance(inst["FAIL_TO_PASS"], str) and json.loads(inst["FAIL_TO_PASS"])
        assert inst["patch"].startswith("diff --git a/") and "+++ b/tests/" in inst["test_patch"]
    good = insts[0]
    bad = ["not json", json.dumps({"instance_id": "x"}),
           json.dumps({**good, "instance_id": "nomirror", "repo": "someone/elsewhere"}),
           json.dumps({**good, "instance_id": "nobase", "base_commit": "0" * 40}),
           json.dumps({**good, "instance_id": "noapply", "patch": good["patch"].replace("-", "~")}),
           json.dumps({**good, "instance_id": "passes", "FAIL_TO_PASS": json.dumps(json.loads(good["PASS_TO_PASS"])[:1]),
                       "PASS_TO_PASS": "[]"}),
           json.dumps(good)]
    (tmp_path / "all.jsonl").write_text("\n".join(json.dumps(i) for i in insts) + "\n" + "\n".join(bad) + "\n")
    code, line, err = _cli("tasks", "import", str(tmp_path / "all.jsonl"), "--repos", str(tmp_path / "mirrors"),
                           "--out", str(tmp_path / "imported"), "--store", str(repo_envs["_store"]))
    assert code == 0 and line["imported"] == 2, (line, err[-2000:])
    assert line["refused"] == {"bad_record": 2, "duplicate_id": 1, "fail_to_pass_passes_at_base": 1,
                               "no_base_commit": 1, "no_mirror": 1, "patch_does_not_apply": 1}, line
    assert line["lines"] == 2 + len(bad)
    assert sorted(p.name for p in (tmp_path / "imported").iterdir()) == sorted(i["instance_id"] for i in insts)
    for inst in insts:
        a, b = out / inst["instance_id"], tmp_path / "imported" / inst["instance_id"]
        ta, tb = load_task(a), load_task(b)
        assert ta["tests"] == tb["tests"] and ta["instructions"] == tb["instructions"]
        rel = ta["reference"]["files"][0]
        assert (a / "reference" / "files" / rel).read_bytes() == (b / "reference" / "files" / rel).read_bytes()
        for f in {t.split("::")[0] for t in ta["tests"]["FAIL_TO_PASS"]}:
            assert (a / "hidden_tests" / f).read_bytes() == (b / "hidden_tests" / f).read_bytes()
        git = lambda d, *x: subprocess.run(["git", "-c", "safe.directory=*", *x], cwd=d / "repo", capture_output=True,
                                           text=True).stdout
        assert git(a, "rev-parse", "HEAD^{tree}") == git(b, "rev-parse", "HEAD^{tree}")
        assert check_task(b)["ok"]


@pytest.fixture(scope="module")
def parse_history(repo_envs, tmp_path_factory):
    """A git repository of parse's releases 1.20.0, 1.20.1 and 1.20.2 (their sdists committed in
    turn, so the diffs are the real ones), bootstrapped at its head."""
    from composer_dag.repos.fetch import fetch_sdist
    from tests.conftest import SDIST_DIR

    root = tmp_path_factory.mktemp("history")
    repo = root / "parse"
    repo.mkdir()
    git = lambda *a, **kw: subprocess.run(["git", "-c", "user.name=Rita Jones", "-c", "user.email=rita@example.org",
                                           *a], cwd=repo, check=True, capture_output=True, **kw)
    git("init", "-q", "-b", "main")
    for month, version in enumerate(("1.20.0", "1.20.1", "1.20.2"), 1):
        for p in repo.iterdir():
            if p.name != ".git":
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        subprocess.run(["tar", "-xzf", str(fetch_sdist("parse", version, SDIST_DIR)), "--strip-components=1"], cwd=repo,
                       check=True)
        git("add", "-A")
        date = f"2024-0{month}-15T10:00:00+00:00"
        git("commit", "-q", "-m", f"Release {version}", env={"GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date,
                                                              "PATH": "/usr/bin:/bin", "HOME": str(root)})
    r = bootstrap(str(repo), root / "env", BootstrapConfig(store=str(repo_envs["_store"])))
    assert r["ok"], r
    return root / "env"


@pytest.mark.slow
def test_history_tasks_follow_swebench_recipe(parse_history, tmp_path):
    """A release whose new tests fail on the previous release's code becomes a task: the commit
    message says nothing ("Release 1.20.2"), so the changelog's entry, rewritten as a user's
    report with the new test's failure on the old code, is the problem statement; the checkout
    holds nothing after the base commit."""
    from composer_dag.tasks.sources.repo_mined import mine

    r = mine(parse_history, tmp_path / "t", max_tasks=0)
    hist = [t for t in r["tasks"] if t.startswith("history-")]
    assert r["history"]["commits"] == 3 and hist, r
    task = load_task(tmp_path / "t" / hist[0])
    assert task["source"] == "swe-instances" and task["reference"]["files"] == ["parse.py"]
    assert "tests/test_parse.py::test_hyphen_inside_field_name" in task["tests"]["FAIL_TO_PASS"]
    # the changelog's entry turned into a user's report, with what the new test shows on the old code
    inst = task["instructions"]
    assert "hyphen" in inst.lower() and "Release" not in inst and "should be able to" in inst, inst
    assert "test_hyphen_inside_field_name" not in inst and "/var/tmp" not in inst and "```" in inst, inst
    repo = tmp_path / "t" / hist[0] / "repo"
    log = subprocess.run(["git", "-c", "safe.directory=*", "log", "--all", "--format=%s"], cwd=repo, capture_output=True,
                         text=True).stdout.split("\n")
    assert "Release 1.20.2" not in log and "Release 1.20.1" in log, log
    assert check_task(tmp_path / "t" / hist[0])["ok"]


def test_declared_repositories_are_partitions_that_refuse_cleanly(tmp_path):
    """``sources.yaml`` declares repositories two ways (its ``environments`` list, a local source
    with ``environments: true``); the sensor adds a ``repo_environments`` partition and a run for
    each; a repository that cannot bootstrap is materialized with its reason and a failed warning
    check, never a failed run; a bad declaration is one clear line."""
    import dagster as dg

    from composer_dag.definitions import build_defs, materialize_all
    from composer_dag.tasks.format import load_repositories
    from tests.graph.test_graph_data import resources_for

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.py").write_text("def f():\n    return 1\n")
    sources = tmp_path / "sources.yaml"
    sources.write_text(f"sources:\n  - name: notes\n    kind: local\n    uri: {notes}\n    environments: {{tasks: 2}}\n"
                       f"environments:\n  - name: gone\n    src: {tmp_path / 'missing'}\n")
    assert [(r.name, r.src, r.tasks) for r in load_repositories(str(sources))] == \
        [("gone", str(tmp_path / "missing"), 8), ("notes", str(notes), 2)]
    for bad, why in [("sources:\n  - name: p\n    kind: python\n    environments: true\n", "cannot be an environment"),
                     ("sources: []\nenvironments:\n  - name: a\n    src: x\n  - name: a\n    src: y\n", "declared twice"),
                     ("sources: []\nenvironments:\n  - name: a\n", "needs at least 'name' and 'src'"),
                     ("sources: []\nenvironments:\n  - name: a b\n    src: x\n", "must match")]:
        (tmp_path / "bad.yaml").write_text(bad)
        with pytest.raises(ValueError, match=why):
            load_repositories(str(tmp_path / "bad.yaml"))

    resources = resources_for(str(tmp_path / "artifacts"), tmp_path, sources)
    (tmp_path / "dagster_home").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster_home")) as instance:
        defs = build_defs(resources)
        sensor = defs.resolve_sensor_def("new_repository_sensor")
        with dg.build_sensor_context(instance=instance, resources=resources) as ctx:
            res = sensor(ctx)
        assert [r.partition_key for r in res.run_requests] == ["gone", "notes"]
        results = materialize_all(instance=instance, definitions=defs, log=lambda m: None, jobs=["bootstrap_repository"])
        assert [r.success for r in results] == [True, True]
        reasons = {}
        for r in results:
            (ev,) = r.get_asset_check_evaluations()
            assert not ev.passed and ev.severity == dg.AssetCheckSeverity.WARN
            mat = r.get_asset_materialization_events()[0].materialization
            meta = {k: v.value for k, v in mat.metadata.items()}
            assert meta["ok"] is False and meta["tasks"] == 0
            reasons[mat.partition] = meta["reason"]
        assert reasons == {"gone": "fetch_failed", "notes": "unsupported_layout"}
        with dg.build_sensor_context(instance=instance, resources=resources) as ctx:
            assert isinstance(sensor(ctx), dg.SkipReason)  # both are partitions now


def test_test_requirements_are_read_wherever_the_project_declares_them(tmp_path):
    """Poetry (runtime table, test and dev groups, the old dev-dependencies), PEP 735 dependency
    groups with an included group, tox's deps with a ``-r`` file, and requirements files: each
    read as a requirement pip resolves, with poetry's ``^``/``~`` turned into ranges and an entry
    for another Python left out; development tools those sources list (black, Sphinx themes,
    pytest-cov) are not installed."""
    from packaging.requirements import Requirement

    from composer_dag.repos.layout import _poetry_spec, detect_layout

    assert [_poetry_spec(s) for s in ("^1.2.3", "^0.2.3", "^0.0.3", "~1.2.3", "~1", "2.0", "*", ">=1,<3")] == \
        [">=1.2.3,<2", ">=0.2.3,<0.3", ">=0.0.3,<0.0.4", ">=1.2.3,<1.3", ">=1,<2", "==2.0", "", ">=1,<3"]
    root = tmp_path / "proj"
    (root / "iso").mkdir(parents=True)
    (root / "iso" / "__init__.py").write_text("")
    (root / "pyproject.toml").write_text(
        '[tool.poetry]\nname = "iso"\nversion = "1.0"\n\n'
        '[tool.poetry.dependencies]\npython = "^3.8"\nattrs = "^23.1"\n'
        'local = {path = "../local"}\nrich = {version = "^13", optional = true}\n'
        'old = {version = "1.0", python = "<3.8"}\n\n'
        '[tool.poetry.group.test.dependencies]\nhypothesis = "^6.0"\npytest-mock = "~3.10"\n'
        'tomli = [{version = "^1", python = "<3.7"}, {version = "^2", python = ">=3.7"}]\n\n'
        '[tool.poetry.dev-dependencies]\nsix = "*"\nblack = "*"\nsphinx-rtd-theme = "*"\n\n'
        '[dependency-groups]\nlint = ["ruff"]\ntest = ["coverage>=7", {include-group = "typing"}]\n'
        'typing = ["typing-extensions"]\n')
    (root / "tox.ini").write_text("[testenv]\ndeps =\n    freezegun>=1.2  # the clock\n    pytest-cov\n    -rreq/ci.txt\n"
                                  "    {env:EXTRA_DEP:}\n")
    (root / "req").mkdir()
    (root / "req" / "ci.txt").write_text("# ci\npytz\n-r ../requirements-test.txt\n")
    (root / "requirements-test.txt").write_text("idna==3.10\n--index-url https://example.invalid\n")
    (root / "tests").mkdir()
    (root / "tests" / "test_iso.py").write_text("def test_x():\n    pass\n")
    reqs = detect_layout(root).requires
    assert reqs == ["attrs>=23.1,<24", "typing-extensions", "hypothesis>=6.0,<7",
                    "pytest-mock>=3.10,<3.11", 'tomli>=2,<3; python_version >= "3.7"', "six", "freezegun>=1.2",
                    "pytz", "idna==3.10"], reqs
    assert all(Requirement(r) for r in reqs)  # every line parses as pip reads it


@pytest.mark.slow
def test_a_suite_written_for_an_older_pytest_gets_one_in_its_layer(repo_envs, tmp_path):
    """A conftest with a hook argument pytest 9 no longer has (``pytest_ignore_collect(path,
    config)``, as boltons') stops the suite before any test under the sandbox's pytest; the
    bootstrap then installs the previous major into the project's layer, where the project's
    interpreter finds it first, and the suite runs under it. A project that pins an older pytest
    gets it without the first try; one without either keeps the sandbox's."""
    from importlib.metadata import version

    from composer_dag.repos.bootstrap import _older_pytest
    from composer_dag.repos.config import BootstrapError

    store = BootstrapConfig(store=str(repo_envs["_store"]))
    major = int(version("pytest").split(".")[0])
    root = _project(tmp_path / "old", "from tinylib import add\n\n\ndef test_add():\n    assert add(1, 2) == 3\n")
    (root / "tests" / "conftest.py").write_text("def pytest_ignore_collect(path, config):\n    return None\n")
    lines = []
    r = bootstrap(str(root), tmp_path / "env-old", store, log=lines.append)
    assert r["ok"] and r["tests_passing"] == 1, r
    rec = load_env(tmp_path / "env-old")
    assert int(rec["pytest"].split(".")[0]) == major - 1, rec["pytest"]
    assert any(f"again with pytest<{major}" in l for l in lines), lines
    assert any(w.startswith(f"pytest-{major - 1}.") for w in rec["store"]["dependencies"]), rec["store"]
    assert f"- pytest: {rec['pytest']}" in (tmp_path / "env-old" / "report.md").read_text()
    # the same suite, its pytest pinned by the project: one resolution, no retry
    pinned = _project(tmp_path / "pinned", "from tinylib import add\n\n\ndef test_add():\n    assert add(1, 2) == 3\n",
                      deps=f'"pytest<{major}"')
    shutil.copy(root / "tests" / "conftest.py", pinned / "tests" / "conftest.py")
    lines = []
    r = bootstrap(str(pinned), tmp_path / "env-pinned", store, log=lines.append)
    assert r["ok"] and load_env(tmp_path / "env-pinned")["pytest"] == rec["pytest"], r
    assert not any("again with" in l for l in lines), lines
    # a suite that stops for another reason is not retried, and the steps end two majors down
    assert _older_pytest(BootstrapError("suite_does_not_start", "ImportError: no module named x"), None) is None
    err = BootstrapError("suite_does_not_start", "PluginValidationError: ...")
    assert [_older_pytest(err, p) for p in (None, f"pytest<{major}", f"pytest<{major - 1}", "pytest==7.4")] == \
        [f"pytest<{major}", f"pytest<{major - 1}", None, None]


def test_tests_inside_the_package_import_relatively(repo_envs, tmp_path):
    """Tests kept inside the package (``tinylib/tests/test_core.py`` with ``from ..core import``,
    ``tinylib/test_inline.py`` with ``from . import``) run from the recorded tree as the package's
    submodules, against the workspace's code (the vacuous run, with the code stubbed, fails them),
    and a task mined from them is sound under the grader."""
    from composer_dag.repos.layout import PACKAGE_SHIM
    from composer_dag.tasks.sources.repo_mined import mine

    root = _project(tmp_path / "inpkg", "")
    pkg = root / "tinylib"
    (pkg / "core.py").write_text('"""Core."""\n\n\ndef mul(a, b):\n    """Product."""\n    return a * b\n\n\n'
                                 'def neg(a):\n    """Negation."""\n    return -a\n')
    (pkg / "tests").mkdir()
    (pkg / "tests" / "__init__.py").write_text("")
    (pkg / "tests" / "test_core.py").write_text(
        "from ..core import mul, neg\nfrom .. import add\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n\n\n"
        "def test_neg():\n    assert neg(4) == -4\n\n\ndef test_add_mul():\n    assert add(mul(2, 2), 1) == 5\n")
    (pkg / "test_inline.py").write_text("from . import add\n\n\ndef test_inline():\n    assert add(1, 1) == 2\n")
    r = bootstrap(str(root), tmp_path / "env", BootstrapConfig(store=str(repo_envs["_store"])))
    assert r["ok"], r
    rec = load_env(tmp_path / "env")
    assert sorted(rec["kept"]) == ["tinylib/test_inline.py::test_inline", "tinylib/tests/test_core.py::test_add_mul",
                                   "tinylib/tests/test_core.py::test_mul", "tinylib/tests/test_core.py::test_neg"], rec
    assert (tmp_path / "env" / "tests" / "tinylib" / "__init__.py").read_text() == PACKAGE_SHIM
    assert "tinylib/core.py" not in {p.relative_to(tmp_path / "env" / "tests").as_posix()
                                     for p in (tmp_path / "env" / "tests").rglob("*.py")}
    out = tmp_path / "mined"
    summary = mine(tmp_path / "env", out, max_tasks=1, seed=0, history=False)
    assert summary["ok"] and len(summary["tasks"]) == 1, summary
    c = check_task(out / summary["tasks"][0])
    assert c["ok"], c


def test_expected_values_in_a_parametrize_table_get_canaries(repo_envs, tmp_path):
    """A mined task whose FAIL_TO_PASS tests take their expected values from a ``parametrize``
    table (no literal in any assertion) gets a canary: a row's expected value changed, the row
    whose call the README shows left alone; the reference fails it and the task is sound."""
    from composer_dag.tasks.sources.repo_mined import mine

    tests = ("import pytest\nfrom tinylib import add, mul\n\n\n"
             "@pytest.mark.parametrize('a, b, expected', [\n    (1, 2, 3),\n    (2, 5, 7),\n"
             "    pytest.param(10, 20, 30, id='tens'),\n    (-4, 4, 0),\n])\n"
             "def test_add(a, b, expected):\n    assert add(a, b) == expected\n\n\n"
             "@pytest.mark.parametrize('a, b, expected', [(2, 3, 6), (4, 5, 20), (7, 0, 0)])\n"
             "def test_mul(a, b, expected):\n    assert expected == mul(a, b)\n")
    root = _project(tmp_path / "p", tests)
    (root / "README.md").write_text("# tinylib\n\n```python\n>>> add(1, 2)\n3\n```\n")
    with open(root / "tinylib" / "__init__.py", "a") as f:
        f.write('\n\ndef mul(a, b):\n    """Product."""\n    return a * b\n')
    r = bootstrap(str(root), tmp_path / "env", BootstrapConfig(store=str(repo_envs["_store"])))
    assert r["ok"], r
    summary = mine(tmp_path / "env", tmp_path / "mined", max_tasks=1, seed=0, history=False)
    assert summary["ok"] and len(summary["tasks"]) == 1, summary
    d = tmp_path / "mined" / summary["tasks"][0]
    c = check_task(d)
    assert c["ok"] and c["canaries"] >= 1 and c["reference_fails_canaries"], c
    task = load_task(d)
    (name,) = task["checks"]["canaries"]
    canary = (d / "canaries" / name).read_text()
    hidden = (d / "hidden_tests" / "tests" / "test_tiny.py").read_text()
    changed = [(a, b) for a, b in zip(hidden.splitlines(), canary.splitlines()) if a != b]
    assert changed and all(a.lstrip().startswith(("(", "pytest.param(", "@pytest.mark.parametrize(")) for a, _ in changed)
    assert "(1, 2, 3)" in canary, canary  # the README shows add(1, 2): that row stays as it is


def test_a_value_checked_by_a_helper_gets_a_canary_from_its_own_statement():
    """When the sites are too few for the canaries asked, a site is given another number of its own
    statement: idna's helper checks ``[2, 3, 68, 3893]`` against ``range(10, 20)``, so 3893 -> 3894
    changes nothing the reference fails, and 3893 -> 10 does."""
    from composer_dag.grading.canaries import make_canaries

    src = ("import unittest\n\n\nclass T(unittest.TestCase):\n    def _check(self, r, outside):\n"
           "        for x in outside:\n            assert x not in r\n\n"
           "    def test_simple(self):\n        self._check(range(10, 20), [2, 3, 68, 3893])\n")
    out = make_canaries(src, seed="s", n=2)
    changed = sorted(next(b for a, b in zip(src.splitlines(), c.splitlines()) if a != b).strip() for c in out)
    assert changed == ["self._check(range(10, 20), [2, 3, 68, 10])", "self._check(range(10, 20), [2, 3, 68, 3894])"], changed


def test_an_expected_value_bound_to_a_name_or_checked_by_a_helper_function_is_a_site():
    """tabulate's tests write the expected value one line above the check and compare through a
    helper of their own (``expected = [...]``, ``result = T._align(...)``,
    ``assert_equal(expected, result)``): the literal is a site, compared with the call (so the
    visible-text rule reads the call, not the name). A name bound twice, or a message argument of
    ``assertTrue``, is not a site."""
    from composer_dag.grading.canaries import make_canaries, sites

    src = ("from common import assert_equal\nimport tabulate as T\n\n\n"
           "def test_center():\n    text = ['just', 'one ']\n    result = T._align(text, 4, 'center')\n"
           "    expected = ['    ', 'just', 'one ', '    ']\n    assert_equal(expected, result)\n\n\n"
           "def test_plain():\n    expected = T.plain('a')\n    assert expected == 'a'\n\n\n"
           "def test_twice():\n    expected = [1]\n    expected = [2]\n    assert T.f() == expected\n\n\n"
           "def test_message(self):\n    self.assertTrue(T.g(), 'g holds')\n")
    found = [(n.lineno, n.value, other) for n, other in sites(src)]
    assert found == [(8, "    ", "T._align(text, 4, 'center')"), (14, "a", "T.plain('a')")], found
    out = make_canaries(src, seed="s", n=1, per_canary=1, visible="T._align(text, 4, 'center')  # a doc example")
    changed = [(a.strip(), b.strip()) for c in out for a, b in zip(src.splitlines(), c.splitlines()) if a != b]
    assert changed == [("assert expected == 'a'", "assert expected == 'b'")], changed  # the call shown: avoided
