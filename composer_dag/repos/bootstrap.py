"""A repository becomes a working RL environment: its own tests run in the sandbox, offline.

``bootstrap(src, out)`` takes a directory, a git path or URL at a revision (``PATH@REV``), or an
sdist archive (a file, or an https URL on a package registry), and writes ``out/``::

    env.json       the summary (ok, reason, test_command, tests_passing, tests_total, seconds,
                   env_digest), the layout found, the licence, the tests kept and those left
                   out by reason, the layer's digest
    report.md      the same for a person
    repo/          the project as its owner has it: a git repository at the source's revision
    tests/         the test support as recorded here (every file of the test directories, the
                   root conftest.py): grading runs these, never the workspace's
    pytest.ini     the project's pytest settings (from pytest.ini, pyproject.toml, tox.ini or
                   setup.cfg) without ``addopts``; every run here and at grading uses it
    layer/         site-packages: the dependencies' wheels installed, and the editable finder
                   that puts the project (root or ``src/``) on ``sys.path``

Nothing of the repository runs outside a sandbox. The steps, each in its module: the fetch
(``fetch``), the layout (``layout``), the wheel and the layer (``layers``), the suite's runs that
decide the tests kept (``suite``).

A failure has one reason (``REASONS``) and leaves nothing at ``out``.
"""

from __future__ import annotations

import email.parser
import fnmatch
import hashlib
import json
import re
import shutil
import subprocess
import tempfile
import time
import zipfile
from dataclasses import asdict
from pathlib import Path

from composer_dag.laptop.image import persona_for
from composer_dag.repos.config import BootstrapConfig, BootstrapError
from composer_dag.repos.fetch import fetch_source, git_snapshot
from composer_dag.repos.layers import build_wheel, fetch_wheels, make_layer, own_tooling, provided_version, store_root
from composer_dag.repos.layout import Layout, detect_layout, norm_name, record_tests, req_name, usable_req
from composer_dag.repos.suite import reason_counts, reliable_tests, suite_command


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if ".git" in rel.parts or not p.is_file() or p.is_symlink():
            continue
        h.update(rel.as_posix().encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def bootstrap(src: str, out: Path, cfg: BootstrapConfig = BootstrapConfig(), log=lambda m: None) -> dict:
    """Make the environment at ``out`` (see the module's docstring); the summary, also written
    as ``out/env.json``. On failure nothing is left at ``out`` and the summary says why."""
    t0 = time.monotonic()
    out = Path(out)
    summary = {"ok": False, "reason": None, "test_command": None, "tests_passing": 0, "tests_total": 0,
               "seconds": 0.0, "env_digest": None, "source": src}
    parent = out.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    try:
        root, origin = fetch_source(src, work / "fetch")
        layout = detect_layout(root)
        summary.update(name=layout.name, version=layout.version, licence=layout.licence, origin=origin)
        _apply_policy(layout, cfg)
        persona = persona_for(norm_name(layout.name))
        store = store_root(cfg)
        store.mkdir(parents=True, exist_ok=True)
        log(f"{layout.name} {layout.version}: {len(layout.packages)} package(s), {len(layout.test_paths)} test files")
        key = f"{norm_name(layout.name)}-{layout.version}-{(origin.get('sha256') or tree_digest(root))[:16]}"
        if origin["kind"] == "installed":  # installed from its wheel already: nothing to build or fetch
            wheel, wheel_hit, deps = None, None, []
        else:
            wheel, wheel_hit = build_wheel(root, layout, store, persona, cfg, key)
            log(f"wheel {wheel.name} ({'store hit' if wheel_hit else 'built'})")
            deps = fetch_wheels(_all_requires(layout, wheel), store / "fetched", cfg.install_timeout)
        layer_digest, layer, layer_hit = make_layer(deps, layout, store, persona, cfg)
        log(f"layer {layer_digest}: {len(deps)} wheel(s) ({'hit' if layer_hit else 'installed'})")

        env = work / "env"
        git_snapshot(root, env / "repo", persona, origin)
        tests = env / "tests"
        record_tests(root, layout, tests)
        project = env / "repo"
        pytest_pin = next((r for r in layout.requires if req_name(r) == "pytest" and own_tooling(r)), None)
        while True:
            try:
                kept, left, suite_seconds = reliable_tests(project, tests, layer, persona, layout, cfg, work, log)
                break
            except BootstrapError as e:
                older = _older_pytest(e, pytest_pin)
                if older is None:
                    raise
                log(f"the suite does not start under pytest {provided_version('pytest')} "
                    f"({_OLD_PYTEST.search(str(e)).group(0)}): again with {older} in the layer")
                pytest_pin = older
                deps = fetch_wheels(_all_requires(layout, wheel) + [older], store / "fetched", cfg.install_timeout)
                layer_digest, layer, layer_hit = make_layer(deps, layout, store, persona, cfg)
        seconds = round(time.monotonic() - t0, 2)
        env_digest = hashlib.sha256(json.dumps([tree_digest(project), tree_digest(tests), layer_digest, kept],
                                               sort_keys=True).encode()).hexdigest()[:32]
        summary.update(ok=True, test_command=suite_command(layout), tests_passing=len(kept),
                       tests_total=len(kept) + len(left), seconds=seconds, env_digest=env_digest)
        record = {**summary, "layout": asdict(layout), "kept": kept, "left_out": dict(sorted(left.items())),
                  "left_out_counts": reason_counts(left.values()), "layer": layer_digest,
                  "store": {"wheel": wheel.name if wheel else None, "wheel_hit": wheel_hit, "layer_hit": layer_hit,
                            "dependencies": [w.name for w in deps]},
                  "persona_seed": norm_name(layout.name), "suite_seconds": suite_seconds,
                  "pytest": _layer_pytest(deps) or provided_version("pytest")}
        _publish(env, layer, record, out)
        return summary
    except BootstrapError as e:
        summary.update(reason=e.reason, error=str(e)[:1000])
    except subprocess.TimeoutExpired as e:
        summary.update(reason="timeout", error=str(e)[:300])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary["seconds"] = round(time.monotonic() - t0, 2)
    return summary


def _apply_policy(layout: Layout, cfg: BootstrapConfig) -> None:
    """The licence policy, then the test files the config names (``test_files``) and their
    support: ``layout`` keeps only those. Raises ``licence_excluded``, or ``no_tests_found``
    when no test file is left."""
    if layout.licence.lower() in {l.lower() for l in cfg.exclude_licences}:
        raise BootstrapError("licence_excluded", f"licence {layout.licence} is excluded by the policy")
    if cfg.test_files:
        layout.test_paths = [t for t in layout.test_paths if any(fnmatch.fnmatch(t, g) for g in cfg.test_files)]
        keep_dirs = {str(Path(t).parent) for t in layout.test_paths}
        layout.support = [f for f in layout.support if str(Path(f).parent) in keep_dirs or Path(f).name == "conftest.py"
                          and any(d.startswith(str(Path(f).parent)) for d in keep_dirs)]
    if not layout.test_paths:
        raise BootstrapError("no_tests_found", "no test files (test_*.py, *_test.py) in tests/, test/, the "
                                               "package or the root")


def _publish(env: Path, layer: Path, record: dict, out: Path) -> None:
    """``env`` completed (``env.json``, ``report.md``, the layer's copy) and moved to ``out``,
    in place of what was there."""
    shutil.copytree(layer, env / "layer", symlinks=True)
    (env / "env.json").write_text(json.dumps(record, indent=2, sort_keys=True))
    (env / "report.md").write_text(_report(record))
    if out.exists():
        shutil.rmtree(out)
    env.rename(out)


# what a pytest newer than the project's refuses before any test runs: a hook argument it no
# longer has (``pytest_ignore_collect(path, config)``), a name it no longer exports
_OLD_PYTEST = re.compile(r"PluginValidationError|are declared in the hookimpl but can not be found in the hookspec|"
                         r"module 'pytest' has no attribute '\w+'")


def _older_pytest(e: BootstrapError, pin: str | None) -> str | None:
    """The next older pytest major to try when the suite stopped on something only newer pytests
    refuse (``_OLD_PYTEST``): ``pytest<9`` under pytest 9, then ``pytest<8``; None otherwise, or
    after two steps, or when the project pins its pytest already."""
    if e.reason not in ("suite_does_not_start", "no_tests_found") or not _OLD_PYTEST.search(str(e)):
        return None
    have = int((provided_version("pytest") or "0").split(".")[0])
    if pin is None:
        return f"pytest<{have}"
    m = re.fullmatch(r"pytest<(\d+)", pin)
    return f"pytest<{int(m.group(1)) - 1}" if m and int(m.group(1)) - 1 > have - 2 else None


def _all_requires(layout: Layout, wheel: Path | None) -> list[str]:
    """What the layer resolves: the project's runtime and test requirements and its built wheel's
    (none for a project installed from its wheel already)."""
    return [] if wheel is None else layout.requires + _wheel_requires(wheel)


def _layer_pytest(wheels: list[Path]) -> str | None:
    """The version of the pytest wheel a layer installs (None: the sandbox's own)."""
    for w in wheels:
        parts = w.name.split("-")
        if norm_name(parts[0]) == "pytest" and len(parts) > 1:
            return parts[1]
    return None


def _wheel_requires(wheel: Path) -> list[str]:
    """Requires-Dist of a built wheel (read from its METADATA, nothing run), extras left out."""
    with zipfile.ZipFile(wheel) as z:
        meta = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA")), None)
        if meta is None:
            return []
        msg = email.parser.Parser().parsestr(z.read(meta).decode(errors="replace"))
    return [r for r in msg.get_all("Requires-Dist") or [] if "extra ==" not in r and usable_req(r)]


def _report(rec: dict) -> str:
    lines = [f"# Environment: {rec['name']} {rec['version']}", "",
             f"- source: {json.dumps(rec['origin'])}", f"- licence: {rec['licence']}",
             f"- test command: `{rec['test_command']}`", f"- environment digest: `{rec['env_digest']}`",
             f"- layer: `{rec['layer']}` ({len(rec['store']['dependencies'])} dependencies)",
             f"- pytest: {rec.get('pytest')}", f"- bootstrap: {rec['seconds']} s", "",
             f"## Tests: {rec['tests_passing']} kept of {rec['tests_total']}", "",
             "| left out because | tests |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in rec["left_out_counts"].items()]
    lines += ["", "### Left out", ""] + [f"- `{t}`: {why}" for t, why in list(rec["left_out"].items())[:200]]
    return "\n".join(lines) + "\n"


def load_env(env_dir: Path) -> dict:
    return json.loads((Path(env_dir) / "env.json").read_text())
