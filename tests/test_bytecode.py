"""The grader's bytecode cache (composer_dag/envs/bytecode.py): compiled once from a trusted tree,
laid into a run's copy only beside sources of the same bytes, never through a link, and never
standing for other code than the source beside it."""

import os
import subprocess
import sys

from composer_dag.envs import bytecode


def _tree(root, body="def f():\n    return 1\n"):
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "mod.py").write_text(body)
    (root / "pkg" / "sub" / "__init__.py").write_text("")
    (root / "pkg" / "sub" / "deep.py").write_text("X = 7\n")
    return root


def _run(ws, code):
    """``code`` in a fresh interpreter with -B (as the sandboxes run), verbose imports on stderr."""
    return subprocess.run([sys.executable, "-B", "-v", "-c", code], cwd=ws, capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"]})


def test_bytecode_is_used_for_unchanged_sources_only(tmp_path):
    cache = tmp_path / "cache"
    trusted = _tree(tmp_path / "trusted")
    assert bytecode.warm(trusted, cache) == {"files": 4, "compiled": 3, "failed": 0}  # two empty files, one entry
    assert bytecode.warm(trusted, cache)["compiled"] == 0  # once per content

    ws = _tree(tmp_path / "ws")
    (ws / "pkg" / "mod.py").write_text("def f():\n    return 2\n")  # the policy's change
    assert bytecode.lay(ws, cache) == 3  # both __init__ files and deep.py; not the changed file
    assert not (ws / "pkg" / "__pycache__" / f"mod.{sys.implementation.cache_tag}.pyc").exists()
    r = _run(ws, "import pkg.mod, pkg.sub.deep; print(pkg.mod.f(), pkg.sub.deep.X)")
    assert r.stdout.split() == ["2", "7"], r.stderr[-2000:]
    assert "code object from" in r.stderr and f"deep.{sys.implementation.cache_tag}.pyc" in r.stderr


def test_a_laid_file_changed_afterwards_runs_its_source(tmp_path):
    """The .pyc is checked against its source's hash at every import: bytecode of the original
    never runs for a source that no longer has the original's bytes."""
    cache = tmp_path / "cache"
    bytecode.warm(_tree(tmp_path / "trusted"), cache)
    ws = _tree(tmp_path / "ws")
    assert bytecode.lay(ws, cache) == 4
    (ws / "pkg" / "mod.py").write_text("def f():\n    return 3\n")
    r = _run(ws, "import pkg.mod; print(pkg.mod.f())")
    assert r.stdout.split() == ["3"], r.stderr[-2000:]


def test_nothing_is_laid_through_a_link_or_over_a_workspace_file(tmp_path):
    cache = tmp_path / "cache"
    bytecode.warm(_tree(tmp_path / "trusted"), cache)
    outside = _tree(tmp_path / "outside")
    ws = tmp_path / "ws"
    (ws / "pkg").mkdir(parents=True)
    (ws / "pkg" / "__init__.py").write_text("")
    (ws / "pkg" / "sub").symlink_to(outside / "pkg" / "sub")  # a directory link out of the copy
    (ws / "pkg" / "mod.py").symlink_to(outside / "pkg" / "mod.py")  # a file link
    (ws / "pkg" / "__pycache__").write_text("not a directory")
    assert bytecode.lay(ws, cache) == 0
    assert not (outside / "pkg" / "sub" / "__pycache__").exists()
    assert (ws / "pkg" / "__pycache__").read_text() == "not a directory"
