"""The grader's bytecode cache (composer_dag/repos/bytecode.py): compiled once from a trusted tree,
laid into a run's copy only beside sources of the same bytes, never through a link, and never
standing for other code than the source beside it."""

import os
import subprocess
import sys

from composer_dag.repos import bytecode


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


def test_a_shared_tree_links_what_the_run_cannot_write_into(tmp_path):
    """``sandbox.share_tree``: a sandboxed run's tree made of hard links to the trusted tree's
    files, read-only to the run's user (uid 1000), who may replace them but never write into
    them; what others may write, or what carries a set-id bit, is copied and given to the user.
    The bytecode laid beside it is linked from the cache and runs."""
    import shutil
    import stat
    import tempfile
    from pathlib import Path

    from composer_dag.sandbox import share_tree

    base = Path(tempfile.mkdtemp(prefix="cdag-share-"))  # under /tmp: the user can reach it
    try:
        _shared_tree_checks(base, share_tree, stat)
    finally:
        shutil.rmtree(base)


def _shared_tree_checks(tmp_path, share_tree, stat):
    os.chmod(tmp_path, 0o755)
    cache = tmp_path / "cache"
    trusted = _tree(tmp_path / "trusted")
    (trusted / "open.txt").write_text("anyone may write me\n")
    os.chmod(trusted / "open.txt", 0o666)
    (trusted / "tool").write_text("#!/bin/sh\n")
    os.chmod(trusted / "tool", 0o4755)
    (trusted / ".git").mkdir()
    (trusted / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (trusted / "link.py").symlink_to("pkg/mod.py")
    keys: dict = {}
    bytecode.warm(trusted, cache, keys=keys)
    ws = tmp_path / "ws"
    share_tree(trusted, ws, 1000, 1000, skip=frozenset({".git"}))
    assert not (ws / ".git").exists() and os.readlink(ws / "link.py") == "pkg/mod.py"
    same = lambda rel: os.stat(ws / rel).st_ino == os.stat(trusted / rel).st_ino  # noqa: E731
    assert same("pkg/mod.py") and same("pkg/sub/deep.py")
    assert not same("open.txt") and not same("tool") and os.stat(ws / "open.txt").st_uid == 1000
    assert not os.stat(ws / "tool").st_mode & stat.S_ISUID
    assert all(os.stat(d).st_uid == 1000 for d in (ws, ws / "pkg", ws / "pkg" / "sub"))

    assert "pkg/sub/deep.py" in keys and "open.txt" not in keys
    assert bytecode.lay(ws, cache, keys={k: v for k, v in keys.items() if k != "pkg/sub/deep.py"}) == 4
    pyc = ws / "pkg" / "sub" / "__pycache__" / f"deep.{sys.implementation.cache_tag}.pyc"
    assert pyc.stat().st_nlink == 2 and oct(pyc.stat().st_mode & 0o777) == "0o644"  # the cache's, linked
    as_user = dict(user=1000, group=1000, extra_groups=[], cwd=ws, capture_output=True, text=True,
                   env={"PATH": os.environ["PATH"]})
    write_in = "open('pkg/mod.py', 'a').write('X = 1\\n')"
    py = "/usr/bin/python3"  # the system's interpreter (this one lies where uid 1000 cannot reach), same version
    r = subprocess.run([py, "-c", write_in], **as_user)
    assert r.returncode != 0 and "PermissionError" in r.stderr, r.stderr
    replace = "import os; os.unlink('pkg/mod.py'); open('pkg/mod.py', 'w').write('def f():\\n    return 5\\n')"
    r = subprocess.run([py, "-c", replace], **as_user)
    assert r.returncode == 0, r.stderr
    assert (trusted / "pkg" / "mod.py").read_text() == "def f():\n    return 1\n"  # the trusted tree as it was
    r = subprocess.run([py, "-B", "-v", "-c", "import pkg.mod, pkg.sub.deep; print(pkg.mod.f())"],
                       **as_user)
    assert r.stdout.split() == ["5"] and f"deep.{sys.implementation.cache_tag}.pyc" in r.stderr, r.stderr[-2000:]
