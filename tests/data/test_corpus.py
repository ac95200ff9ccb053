"""Unit tests of corpus ingestion on real files (tmp_path trees, real git repositories)."""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from pathlib import Path

import pytest

from composer_dag.corpus import (
    FILES_SCHEMA, SKIPPED_SCHEMA, CorpusConfig, SourceSpec, default_sources, detect_language,
    file_id, ingest, parse_source,
)
from composer_dag.corpus.ingest import _examine
from composer_dag.corpus.sources import walk_local
from composer_dag.storage import Storage
from tests.corpus_fixtures import (
    MAX_FILE_BYTES, VALID_FILES, VALID_LANGUAGES, make_git_repo, make_hostile_tree,
)


def local(root: Path) -> SourceSpec:
    # The hostile tree holds a .git folder (to test pruning), so parse_source would say git.
    return SourceSpec(name="src", kind="local", uri=str(root))


def read_rows(storage: Storage, urls: list[str]) -> list[dict]:
    return [row for url in urls for row in storage.read_parquet(url).to_pylist()]


@pytest.fixture
def storage(tmp_path: Path) -> Storage:
    return Storage(str(tmp_path / "store"))


@pytest.fixture
def hostile(tmp_path: Path) -> tuple[Path, dict[str, int]]:
    root = tmp_path / "src"
    return root, make_hostile_tree(root, tmp_path / "outside")


def test_hostile_tree_counts_every_reason(hostile, storage):
    root, expected = hostile
    lines: list[str] = []
    cfg = CorpusConfig(max_file_bytes=MAX_FILE_BYTES, progress_every=5)
    res = ingest(local(root), storage, storage.url("corpus", "r1"), cfg, lines.append)

    assert res.skipped == dict(sorted(expected.items()))
    assert res.files_ingested == len(VALID_FILES) == res.rows
    assert res.files_seen == res.files_ingested + sum(res.skipped.values())
    assert res.languages == dict(sorted(VALID_LANGUAGES.items()))
    assert res.bytes_ingested == sum(len(t.encode()) for t in VALID_FILES.values())
    assert sum(res.bytes_per_language.values()) == res.bytes_ingested
    assert lines and lines[-1].startswith("done:") and "skipped" in lines[0]

    rows = read_rows(storage, res.parquet_urls)
    assert {r["path"]: r["content"] for r in rows} == VALID_FILES
    for r in rows:
        assert r["source"] == "src" and r["repo"] == "src" and r["revision"] == ""
        assert r["id"] == file_id("src", r["path"]) and len(r["id"]) == 32
        assert r["sha256"] == hashlib.sha256(r["content"].encode()).hexdigest()
    assert storage.read_parquet(res.parquet_urls[0]).schema.equals(FILES_SCHEMA)

    skipped = storage.read_parquet(res.skipped_url)
    assert skipped.schema.equals(SKIPPED_SCHEMA)
    by_path = {r["path"]: r["reason"] for r in skipped.to_pylist()}
    assert len(by_path) == sum(expected.values())
    assert by_path["data/pipe"] == "not_regular_file"
    assert by_path["data/escape.py"] == "symlink_outside_root"
    assert by_path["data/self_dir"] == "symlink_loop"
    assert by_path["data/dangling.py"] == "unreadable"
    assert by_path["data/bad\ufffdname.py"] == "bad_filename"
    assert not any(p.startswith((".git", ".hg")) or "__pycache__" in p for p in by_path)
    storage.verify_manifest(storage.url("corpus", "r1"))
    assert res.manifest_digest == storage.manifest_digest(storage.url("corpus", "r1"))


def test_same_input_gives_identical_bytes(hostile, storage):
    root, _ = hostile
    cfg = CorpusConfig(max_file_bytes=MAX_FILE_BYTES, shard_bytes=40)
    a = ingest(local(root), storage, storage.url("corpus", "a"), cfg)
    b = ingest(local(root), storage, storage.url("corpus", "b"), cfg)
    assert len(a.parquet_urls) > 1  # rolled over
    assert a.manifest_digest == b.manifest_digest
    for ua, ub in zip([*a.parquet_urls, a.skipped_url], [*b.parquet_urls, b.skipped_url]):
        assert storage.read_bytes(ua) == storage.read_bytes(ub)
    assert len(read_rows(storage, a.parquet_urls)) == a.files_ingested


def test_rerun_into_same_dir_replaces_old_output(hostile, storage):
    root, _ = hostile
    out = storage.url("corpus", "r")
    ingest(local(root), storage, out, CorpusConfig(shard_bytes=10))
    res = ingest(local(root), storage, out, CorpusConfig())
    assert [u.rsplit("/", 1)[1] for u in storage.find(out)] == [
        "files-00000.parquet", "manifest.json", "skipped.parquet"]
    assert len(res.parquet_urls) == 1


def test_language_allow_list(hostile, storage):
    root, expected = hostile
    cfg = CorpusConfig(max_file_bytes=MAX_FILE_BYTES, languages=("python", "shell"))
    res = ingest(local(root), storage, storage.url("c", "1"), cfg)
    assert res.languages == {"python": 2, "shell": 1}
    assert res.skipped["language_excluded"] == 4  # js, Makefile, markdown, blob.txt (unread)
    assert res.files_seen == res.files_ingested + sum(res.skipped.values())
    with pytest.raises(ValueError):
        CorpusConfig(languages=("klingon",))
    with pytest.raises(ValueError):
        CorpusConfig(python_parts=("stdlib", "dist"))


def test_file_swapped_after_listing_is_unreadable_and_never_blocks(tmp_path):
    (tmp_path / "a.py").write_text("A = 1\n")
    (tmp_path / "b.py").write_text("B = 1\n")
    entries = list(walk_local(str(tmp_path), "t", "", (".git",)))
    os.unlink(tmp_path / "a.py")
    os.unlink(tmp_path / "b.py")
    os.mkfifo(tmp_path / "b.py")  # opening this for reading would block without O_NONBLOCK
    for entry in entries:
        reason, detail, _ = _examine(entry, CorpusConfig())
        assert reason == "unreadable" and str(tmp_path) not in detail


def test_empty_source_still_writes_tables(tmp_path, storage):
    (tmp_path / "empty").mkdir()
    res = ingest(parse_source(str(tmp_path / "empty")), storage, storage.url("c", "e"))
    assert res.files_seen == 0 and len(res.parquet_urls) == 1
    assert storage.read_parquet(res.parquet_urls[0]).num_rows == 0


@pytest.mark.parametrize("path, text, lang", [
    ("a/b.py", None, "python"), ("x.pyi", None, "python"), ("m.js", None, "javascript"),
    ("m.tsx", None, "typescript"), ("A.java", None, "java"), ("x.c", None, "c"),
    ("x.hpp", None, "cpp"), ("x.cs", None, "csharp"), ("main.go", None, "go"),
    ("lib.rs", None, "rust"), ("x.rb", None, "ruby"), ("i.php", None, "php"),
    ("v.swift", None, "swift"), ("k.kt", None, "kotlin"), ("s.scala", None, "scala"),
    ("run.sh", None, "shell"), ("q.SQL", None, "sql"), ("i.html", None, "html"),
    ("s.css", None, "css"), ("README.md", None, "markdown"), ("p.json", None, "json"),
    ("c.yml", None, "yaml"), ("pyproject.toml", None, "toml"), ("a.R", None, "r"),
    ("x.lua", None, "lua"), ("x.pl", None, "perl"), ("Main.hs", None, "haskell"),
    ("Makefile", None, "makefile"), ("rules.mk", None, "makefile"),
    ("Dockerfile", None, "dockerfile"), ("Dockerfile.dev", None, "dockerfile"),
    ("CMakeLists.txt", None, "cmake"), ("home/.bashrc", None, "shell"),
    ("index.rst", None, "rst"), ("notes.txt", None, "text"),
    ("bin/tool", "#!/usr/bin/env python3\n", "python"),
    ("bin/tool", "#!/usr/bin/python3.11 -u\n", "python"),
    ("bin/tool", "#!/bin/sh\nset -e\n", "shell"),
    ("bin/tool", "#!/usr/bin/env -S node --harmony\n", "javascript"),
    ("bin/tool", "#!/usr/bin/env bash\n", "shell"),
    ("bin/tool", "plain words\n", None), ("x.unknownext", None, None), (".gitignore", None, None),
])
def test_language_detection(path, text, lang):
    assert detect_language(path, text) == lang


def test_git_source_at_first_commit(tmp_path, storage):
    repo = tmp_path / "myrepo"
    first, second = make_git_repo(repo)
    spec = parse_source(f"{repo}@{first}")
    assert (spec.kind, spec.uri, spec.rev) == ("git", str(repo), first)
    res = ingest(spec, storage, storage.url("c", "g1"))
    rows = read_rows(storage, res.parquet_urls)
    assert [r["path"] for r in rows] == ["src/a.py"]
    assert rows[0]["revision"] == first and rows[0]["repo"] == "myrepo"
    assert res.skipped == {"lfs_pointer": 1}  # .git is pruned, not counted

    for text in (str(repo), f"file://{repo}"):  # HEAD, through a path and a file:// URL
        res = ingest(parse_source(text), storage, storage.url("c", "g2"))
        rows = read_rows(storage, res.parquet_urls)
        assert [r["path"] for r in rows] == ["src/a.py", "src/b.py"]
        assert {r["revision"] for r in rows} == {second}

    res = ingest(parse_source(f"{repo}@v1"), storage, storage.url("c", "g3"))  # a tag
    assert [r["path"] for r in read_rows(storage, res.parquet_urls)] == ["src/a.py"]
    with pytest.raises(ValueError, match="not found"):
        ingest(parse_source(f"{repo}@no-such-rev"), storage, storage.url("c", "g4"))


def test_python_source_with_small_cap(storage):
    cfg = CorpusConfig(max_total_bytes=300_000)
    res = ingest(default_sources()[0], storage, storage.url("c", "py"), cfg)
    assert res.files_ingested > 0 and res.bytes_ingested <= 300_000
    assert res.skipped["over_budget"] > 0
    assert res.files_seen == res.files_ingested + sum(res.skipped.values())
    rows = read_rows(storage, res.parquet_urls)
    assert {r["repo"] for r in rows} <= {"stdlib", "site-packages"} and "python" in res.languages
    assert all(r["path"].startswith(("stdlib/", "site-packages/")) for r in rows)
    assert rows[0]["revision"] == f"python-{platform.python_version()}"
    assert not any("/site-packages/" in r["path"] for r in rows if r["repo"] == "stdlib")

    res = ingest(default_sources()[0], storage, storage.url("c", "py2"),
                 CorpusConfig(max_files=6, max_total_bytes=None, python_parts=("stdlib",)))
    assert res.files_ingested == 6 and res.skipped["over_budget"] > 100
    res = ingest(default_sources()[0], storage, storage.url("c", "py3"),
                 CorpusConfig(max_files=3, python_parts=("site-packages",)))
    assert {r["repo"] for r in read_rows(storage, res.parquet_urls)} == {"site-packages"}


def test_parse_source_forms(tmp_path):
    plain = tmp_path / "Plain Dir"
    plain.mkdir()
    assert parse_source(str(plain)) == SourceSpec("plain-dir", "local", str(plain))
    assert parse_source("python").kind == "python"
    s3 = parse_source("s3://bucket/code/", name="mine")
    assert (s3.name, s3.kind, s3.uri) == ("mine", "s3", "s3://bucket/code")
    assert parse_source("s3://bucket/code").name == "bucket-code"
    for text, uri, rev in [
        ("https://github.com/org/proj.git", "https://github.com/org/proj.git", None),
        ("https://github.com/org/proj.git@v1.2", "https://github.com/org/proj.git", "v1.2"),
        ("git@github.com:org/proj.git", "git@github.com:org/proj.git", None),
        ("git@github.com:org/proj.git@main", "git@github.com:org/proj.git", "main"),
        ("file:///srv/proj.git", "file:///srv/proj.git", None),
    ]:
        spec = parse_source(text)
        assert (spec.kind, spec.uri, spec.rev) == ("git", uri, rev)
        assert spec.name.startswith("proj")
    with pytest.raises(ValueError):
        parse_source(str(tmp_path / "missing"))
    secret = SourceSpec("s", "s3", "s3://b/p", storage_options={"secret": "hunter2"})
    assert "hunter2" not in repr(secret)
    with pytest.raises(ValueError):
        SourceSpec("x", "ftp", "ftp://x")


def test_a_source_kind_is_one_registered_walker(tmp_path, storage, monkeypatch):
    """A new kind is a walker registered in SOURCE_KINDS: sources.yaml and SourceSpec accept it
    and ingestion lists its files through it; a kind not registered is refused where the source is
    declared, never walked as another kind."""
    import contextlib

    from composer_dag.corpus import sources

    root = tmp_path / "mirror"
    root.mkdir()
    (root / "a.py").write_text("print('a')\n")
    walked = []

    @contextlib.contextmanager
    def mirror(spec, skip_dirs, python_parts):
        walked.append(spec.uri)
        yield walk_local(spec.uri, "mirror", "", skip_dirs)

    yaml = tmp_path / "sources.yaml"
    yaml.write_text(f"sources:\n  - name: m\n    kind: mirror\n    uri: {root}\n")
    with pytest.raises(ValueError, match="unknown kind 'mirror'"):
        sources.load_sources(str(yaml))
    with pytest.raises(ValueError, match="unknown source kind 'mirror'"):
        sources.SourceEntry.load({"name": "m", "kind": "mirror", "uri": str(root)})
    monkeypatch.setitem(sources.SOURCE_KINDS, "mirror", mirror)
    entry = sources.load_sources(str(yaml))[0]
    res = ingest(entry.spec(), storage, storage.url("corpus", "m"), entry.corpus_config())
    assert walked == [str(root)] and res.files_ingested == 1


def test_engine_does_not_import_dagster():
    import subprocess

    code = "import composer_dag.corpus, sys; assert 'dagster' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.getcwd())
