"""The layers hold: the engine runs without Dagster, and every asset's run config is the
engine's stage config (same names, types and defaults), generated, not written twice."""

import json
import pkgutil
import subprocess
import sys
import typing

import pytest

import composer_dag

ROOT_PKG = composer_dag.__name__


def engine_modules() -> list[str]:
    """Every module under ``composer_dag/`` but the code location."""
    names = [m.name for m in pkgutil.walk_packages(composer_dag.__path__, prefix=ROOT_PKG + ".")]
    return sorted(n for n in names if n != f"{ROOT_PKG}.definitions")


def test_engine_modules_do_not_import_dagster():
    mods = engine_modules()
    assert len(mods) > 40 and f"{ROOT_PKG}.runtime.config" in mods and f"{ROOT_PKG}.agent" in mods
    code = (
        "import importlib, json, sys\n"
        f"mods = {mods!r}\n"
        "bad = {}\n"
        "for m in mods:\n"
        "    importlib.import_module(m)\n"
        "    hit = sorted(k for k in sys.modules if k == 'dagster' or k.startswith('dagster.') or k.startswith('dagster_k8s'))\n"
        "    if hit: bad[m] = hit[:3]; break\n"
        "print(json.dumps(bad))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {}, "engine modules pull in dagster"


def test_only_pipes_reports_through_dagster_pipes():
    """``dagster_pipes`` (the payload-side Pipes library, not Dagster) is imported by the engine's
    reporting module only."""
    import re
    from pathlib import Path

    root = Path(composer_dag.__file__).parent
    users = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                   if re.search(r"^\s*(from|import)\s+dagster_pipes\b", p.read_text(), re.M))
    assert users == ["pipes.py"]


def _params():
    from assets import dedup, envs, evals, rl, train
    from composer_dag.dedup import DedupConfig
    from composer_dag.tasks.sources.build import TaskBuildConfig
    from composer_dag.evals.evaluate import EvalConfig
    from composer_dag.rl.run import RLConfig
    from composer_dag.train.data import TokenShardConfig
    from composer_dag.train.midtrain import MidtrainConfig
    from composer_dag.train.model import BaseModelConfig
    from composer_dag.cluster.spec import ClusterConfig
    from resources.cluster import ClusterResource
    from resources.model_settings import ModelSettings

    return [(ClusterConfig, ClusterResource), (DedupConfig, dedup.DedupParams), (TaskBuildConfig, envs.TaskParams), (EvalConfig, evals.EvalParams),
            (RLConfig, rl.RLParams), (MidtrainConfig, train.MidtrainParams), (TokenShardConfig, train.TokenShardParams),
            (BaseModelConfig, ModelSettings)]


def _base(hint):
    """An annotation with tuples as lists and literals as their type, as Dagster's config takes it."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return type(args[0])
    if origin in (tuple, list):
        return ("list", _base(args[0]))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return ("union", tuple(sorted(map(repr, (_base(a) for a in args)))))
    if origin is dict:
        return ("dict", _base(args[0]), _base(args[1]))
    if isinstance(hint, type) and hasattr(hint, "model_fields"):
        return ("model", tuple(sorted(hint.model_fields)))
    return hint


def _plain(v):
    if hasattr(v, "model_dump"):
        return _plain(v.model_dump())
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


@pytest.mark.parametrize("engine_cls,params_cls", _params(), ids=lambda c: c.__name__)
def test_run_config_is_the_engine_config(engine_cls, params_cls):
    """Names, types and defaults match field for field (nested parts too); the fields the
    asset fills in (the engine's required fields: paths) are the only ones left out."""
    def compare(eng, par, where):
        required = {n for n, f in eng.model_fields.items() if f.is_required()}
        assert set(par.model_fields) == set(eng.model_fields) - required, where
        for name, f in par.model_fields.items():
            ef = eng.model_fields[name]
            assert _base(f.annotation) == _base(ef.annotation), (where, name)
            assert _plain(f.get_default(call_default_factory=True)) == _plain(ef.get_default(call_default_factory=True)), (where, name)
            if hasattr(ef.annotation, "model_fields"):
                compare(ef.annotation, f.annotation, f"{where}.{name}")

    compare(engine_cls, params_cls, engine_cls.__name__)


def test_run_config_errors_are_one_line_and_refuse_unknown_fields():
    import dagster as dg

    from composer_dag.rl.run import RLConfig
    from resources.dagster_config import engine_config

    paths = {"policy_dir": "p", "tasks_dir": "t", "out_dir": "o"}
    cfg = engine_config(RLConfig, {"steps": 3, "trainer": {"lr": 0.5}}, **paths)
    assert (cfg.steps, cfg.trainer.lr, cfg.orchestrator.max_turns) == (3, 0.5, RLConfig.model_fields["orchestrator"].default.max_turns)
    for bad, words in (({"steps": "ten"}, "steps"), ({"trainer": {"lrr": 1}}, "trainer.lrr: unknown field"),
                       ({"inference": {"engine": "tgi"}}, "inference.engine")):
        with pytest.raises(dg.Failure) as err:
            engine_config(RLConfig, bad, **paths)
        assert "\n" not in err.value.description and words in err.value.description, err.value.description


def test_every_asset_declares_a_code_version_that_follows_its_code(tmp_path, monkeypatch):
    """An asset's code version is a digest of the code it reaches through its imports (and the
    stage entry points it names), so an engine change marks it stale in the UI, and a change to
    code it never runs does not."""
    from assets import common as _common
    from composer_dag.definitions import defs

    graph = defs.resolve_asset_graph()
    versions = {k.to_user_string(): graph.get(k).code_version for k in graph.get_all_asset_keys()}
    assert versions and all(v and len(v) == 16 for v in versions.values()), versions
    assert versions["rl_rollouts"] == versions["rl_checkpoint"] != versions["code_corpus"]

    (tmp_path / "composer_dag" / "stage").mkdir(parents=True)
    (tmp_path / "assets").mkdir()
    files = {
        "composer_dag/__init__.py": "", "composer_dag/stage/__init__.py": "",
        "composer_dag/stage/run.py": "from ..lower import helper\n",
        "composer_dag/lower.py": "def helper():\n    return 1\n",
        "composer_dag/unrelated.py": "X = 1\n",
        "assets/__init__.py": "",
        "assets/stage.py": "ENTRY = 'composer_dag.stage.run'\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(_common, "REPO_ROOT", tmp_path)

    def version() -> str:
        _common.code_version.cache_clear()
        return _common.code_version(str(tmp_path / "assets" / "stage.py"))

    v0 = version()
    (tmp_path / "composer_dag/unrelated.py").write_text("X = 2\n")
    assert version() == v0
    (tmp_path / "composer_dag/lower.py").write_text("def helper():\n    return 2\n")
    assert version() != v0
    _common.code_version.cache_clear()

