"""A backend is one class in one file. ``ToyBackend`` below, registered by its name here and
nowhere else, runs a stage's job as a plain subprocess in a working-directory layout of its own
(``<scratch_dir>/toy/<job name>/<n>``, kept after the job) and an array one index after another;
``ClusterResource(backend="toy")`` reaches it through the normal dispatch path (``run_job`` ->
``backend_for`` -> ``launch``). Nothing outside ``composer_dag/cluster/backends`` compares a
backend's name."""

import ast
import itertools
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from composer_dag.cluster import services
from composer_dag.cluster.backends import Backend, backend_for, register_backend
from composer_dag.cluster.spec import ARRAY_INDEX_ENV, JOB_ENTRY, ArrayTask, ClusterConfig
from composer_dag.runtime.config import ConfigError
from composer_dag.storage import open_storage
from resources.cluster import ClusterResource

ROOT = Path(__file__).resolve().parents[2]
_RUNS = itertools.count(1)


@register_backend
class ToyBackend(Backend):
    """Jobs as plain subprocesses on this machine, each in ``<scratch_dir>/toy/<name>/<n>``."""

    name = "toy"
    shares_disk = True
    runs_here = True

    def scratch(self, name: str) -> str:
        return os.path.join(self.cluster.scratch_dir, "toy", name, str(next(_RUNS)))

    def render(self, spec_url, name, env, scratch):
        return [sys.executable, "-m", JOB_ENTRY, "--spec", spec_url, "--scratch", scratch]

    def launch(self, spec_url, name, env, interrupts=(KeyboardInterrupt,)):
        scratch = self.scratch(name)
        os.makedirs(scratch)
        cmd = self.render(spec_url, name, env, scratch)
        self.log(f"[cluster:toy] {' '.join(cmd)}")
        rc = subprocess.run(cmd, env={**os.environ, **env}).returncode
        return (None, None) if rc == 0 else (f"exited with code {rc}", None)

    def run_array(self, cfg):
        tasks = []
        for i in range(cfg.count):
            rc = subprocess.run(cfg.argv, env={**os.environ, **cfg.env, ARRAY_INDEX_ENV: str(i)}).returncode
            tasks.append(ArrayTask(i, rc, "COMPLETED" if rc == 0 else "FAILED"))
        return tasks


def test_a_backend_registered_in_one_file_runs_a_stage_job_through_the_resource(tmp_path):
    root = f"file://{tmp_path}/root"
    job = {"stage": "payload", "entry": "tests.slurm_payload", "launcher": "python",
           "config": {"out_dir": "{scratch}/out", "steps": 2, "step_s": 0.01},
           "env": {"PYTHONPATH": str(ROOT)}, "state_url": f"{root}/work/payload/1",
           "outputs": {"payload": {"url": f"{root}/payload/1",
                                   "files": [["", "hf"], ["metrics.jsonl", "metrics.jsonl"]]}}}

    @dg.asset
    def payload(context: dg.AssetExecutionContext, cluster: ClusterResource):
        result = cluster.run_job(context, open_storage(root), job, name="composer-toy")
        return dg.MaterializeResult(metadata={"result": dg.MetadataValue.json(result)})

    scratch = tmp_path / "scratch"
    res = dg.materialize([payload], resources={"cluster": ClusterResource(backend="toy", scratch_dir=str(scratch))})
    assert res.success
    result = res.get_asset_materialization_events()[0].materialization.metadata["result"].value
    summary = result["summary"]
    assert summary["metrics_steps"] == [1, 2] and summary["checkpoint"] == "step_000002"
    # the stage ran in the toy's own layout, which it keeps
    (run_dir,) = (scratch / "toy" / "composer-toy").iterdir()
    assert summary["cwd"] == str(run_dir) and (run_dir / "out" / "metrics.jsonl").exists()
    out = result["outputs"]["payload"]
    assert open_storage(root).manifest_digest(out["url"]) == out["digest"]


def test_the_toy_backend_by_name_runs_arrays_and_says_what_it_does_not_run(tmp_path):
    cluster = {"backend": "toy", "scratch_dir": str(tmp_path)}
    assert isinstance(backend_for(cluster), ToyBackend)
    argv = [sys.executable, "-c",
            f"import os; open(os.path.join({str(tmp_path)!r}, os.environ['{ARRAY_INDEX_ENV}']), 'w')"]
    tasks = services.run_array(cluster, {"name": "toy-array", "argv": argv, "count": 3})
    assert [t.ok for t in tasks] == [True] * 3 and sorted(p.name for p in tmp_path.iterdir()) == ["0", "1", "2"]
    with pytest.raises(NotImplementedError, match="the toy backend does not run services"):
        services.start_service(cluster, {"name": "web", "argv": ["true"]})
    with pytest.raises(ConfigError, match="unknown backend 'toy2'; registered: 'k8s', 'local', 'slurm', 'toy'"):
        ClusterConfig.load({"backend": "toy2"})


def _name_comparisons(path: Path) -> list[int]:
    """Lines of ``path`` that compare something's ``backend`` with a string (or strings)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any(isinstance(s, ast.Attribute) and s.attr == "backend"
                        or isinstance(s, ast.Name) and s.id == "backend" for s in sides)
            literal = any(isinstance(s, ast.Constant) and isinstance(s.value, str)
                          or isinstance(s, (ast.Tuple, ast.List, ast.Set)) and s.elts
                          and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in s.elts)
                          for s in sides)
            if named and literal:
                found.append(node.lineno)
    return found


def test_nothing_outside_the_backends_dispatches_on_a_backend_name():
    backends = ROOT / "composer_dag" / "cluster" / "backends"
    found = {str(p.relative_to(ROOT)): lines for top in ("composer_dag", "assets", "resources")
             for p in sorted((ROOT / top).rglob("*.py")) if backends not in p.parents
             if (lines := _name_comparisons(p))}
    assert not found, f"branches on a backend's name: {found}"
