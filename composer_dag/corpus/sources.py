"""Corpus sources declared as data, and the walkers that list their files.

A walker yields one ``Entry`` per file-like thing it meets, in a deterministic order (names
sorted at every level, depth first). Rules shared by every walker:

* Entries named in ``skip_dirs`` (``.git``, ``.hg``, ``.svn``, ``__pycache__`` by default) are
  pruned whole: neither they nor anything below them is counted as a file.
* Symlinks are never followed. Each one is counted as skipped: ``symlink_loop`` (the link
  cannot be resolved because it loops, or it points at a directory that contains it),
  ``symlink_outside_root`` (it resolves outside the source root), ``unreadable`` (dangling)
  or ``symlink`` (its target is inside the root, where it is ingested under its own path).
* FIFOs, sockets and devices are ``not_regular_file``; they are never opened.
* A name that is not valid UTF-8 or holds a control character (newline, tab, ...) is
  ``bad_filename``; its row shows the name with U+FFFD in place of the offending parts.
* In a git source, each submodule (a gitlink in the tree) is one ``submodule`` entry: its
  contents are not fetched, and the empty directory git leaves for it is not walked.
"""

from __future__ import annotations

import contextlib
import errno
import os
import platform
import re
import stat
import subprocess
import sysconfig
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Union

from pydantic import Field, field_validator, model_validator

from ..runtime.config import ConfigError, StageConfig, one_of
from .languages import LANGUAGES



class CorpusConfig(StageConfig):
    """Filters and limits of one ingest.

    The caps (``max_total_bytes`` of kept text, ``max_files`` kept) stop reading once reached;
    every file met afterwards is counted as ``over_budget`` from its listing alone (the file
    that would overflow ``max_total_bytes`` is the first one). None = no cap (the default: a
    source declares its own cap, as the default ``python`` source does in ``sources.yaml``).
    The ``python`` source walks its parts in order, so 40 MB holds the whole stdlib with its
    tests (about 33 MB for CPython 3.11) and the first packages of site-packages.
    """

    max_file_bytes: int = 1_000_000
    max_total_bytes: Optional[int] = None
    max_files: Optional[int] = None
    languages: Optional[tuple[str, ...]] = Field(None, description="allow-list of language ids; None = all known")
    skip_dirs: tuple[str, ...] = (".git", ".hg", ".svn", "__pycache__")
    python_parts: tuple[str, ...] = ("stdlib", "site-packages")
    shard_bytes: int = Field(64 << 20, description="start a new files-NNNNN.parquet after this much content")
    progress_every: int = 2000

    @field_validator("languages")
    @classmethod
    def _known_languages(cls, langs):
        unknown = set(langs or ()) - LANGUAGES
        if unknown:
            raise ValueError(f"unknown language ids {sorted(unknown)}; known: {sorted(LANGUAGES)}")
        return langs

    @field_validator("python_parts")
    @classmethod
    def _known_parts(cls, parts):
        if set(parts) - {"stdlib", "site-packages"}:
            raise ValueError("python_parts may hold 'stdlib' and 'site-packages' only")
        return parts


SOURCE_KINDS: dict[str, Callable[..., contextlib.AbstractContextManager]] = {}
"""Every source kind with what lists its files (a context manager of the entries: temporary
checkouts live as long as the block), registered with ``@source_kind``. A new kind is one walker
registered so; a kind not here is refused where a source is declared (``sources.yaml``,
``SourceSpec``), never walked as another kind."""


def source_kind(name: str):
    """Register the decorated walker as the source kind ``name``."""
    def register(walker):
        SOURCE_KINDS[name] = walker
        return walker
    return register


@dataclass(frozen=True)
class SourceSpec:
    """One corpus source. ``storage_options`` (S3 endpoint and keys) are never shown in repr."""

    name: str
    kind: str
    uri: str = ""
    rev: str | None = None
    storage_options: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in SOURCE_KINDS:
            raise ValueError(f"source kind must be one of {tuple(SOURCE_KINDS)}, not {self.kind!r}")


SOURCES_FILE_ENV = "COMPOSER_SOURCES"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


class SourceEntry(StageConfig):
    """One entry of ``sources.yaml``: where the files are, and this source's ingest limits."""

    name: str = Field(pattern=NAME_RE.pattern)
    kind: str = Field(description="one of SOURCE_KINDS: python, local, git, s3")
    uri: str = Field("", description="a path, git URL or s3:// prefix (not for kind python)")
    rev: Optional[str] = Field(None, description="git: a branch, tag or commit")
    max_file_mb: float = 1.0
    max_total_mb: Optional[float] = Field(None, description="stop after this much kept text; None: the whole source")
    max_files: Optional[int] = None
    languages: Optional[list[str]] = Field(None, description="allow-list; others are counted as language_excluded")
    environments: Union[bool, dict[str, Any]] = Field(
        False, description="local or git: also an RL environment (a repo_environments partition); a mapping "
        "gives its RepoSpec fields (tasks, test_files)")

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, kind: str) -> str:
        return one_of(kind, SOURCE_KINDS, "source kind")

    @model_validator(mode="after")
    def _needs_uri(self) -> "SourceEntry":
        if self.kind != "python" and not self.uri:
            raise ValueError(f"source {self.name!r} of kind {self.kind} needs a 'uri'")
        if self.environments and self.kind not in ("local", "git"):
            raise ValueError(f"source {self.name!r} of kind {self.kind} cannot be an environment (local or git only)")
        return self

    def spec(self, storage_options: dict[str, Any] | None = None) -> SourceSpec:
        return SourceSpec(name=self.name, kind=self.kind, uri=self.uri or self.kind, rev=self.rev,
                          storage_options=storage_options if self.kind == "s3" else None)

    def corpus_config(self) -> CorpusConfig:

        return CorpusConfig.load({
            "max_file_bytes": int(self.max_file_mb * 1_000_000),
            "max_total_bytes": int(self.max_total_mb * 1_000_000) if self.max_total_mb else None,
            "max_files": self.max_files,
            "languages": self.languages,
        })



def sources_file(path: str | None = None) -> str:
    return path or os.environ.get(SOURCES_FILE_ENV) or "sources.yaml"


def read_sources_doc(path: str) -> Any:
    """The parsed YAML of a sources file; a bad file is one ``ValueError`` line."""
    import yaml

    try:
        with open(path) as f:
            return yaml.safe_load(f) or {}
    except yaml.YAMLError as exc:
        raise ValueError(" ".join(f"{path} is not valid YAML: {exc}".split())) from None


def load_sources(path: str | None = None) -> list[SourceEntry]:
    """The sources declared in ``path`` (default ``$COMPOSER_SOURCES`` or ``sources.yaml``);
    ``DEFAULT_SOURCES`` when the file does not exist. A bad file is one ``ValueError`` line."""
    path = sources_file(path)
    if not os.path.exists(path):
        return list(DEFAULT_SOURCES)
    doc = read_sources_doc(path)
    entries = doc.get("sources") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path} must hold a mapping with a 'sources' list")
    out, seen = [], set()
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or "name" not in e or "kind" not in e:
            raise ValueError(f"{path}: source #{i + 1} needs at least 'name' and 'kind'")
        if e["kind"] not in SOURCE_KINDS:
            raise ValueError(f"{path}: source {e['name']!r} has unknown kind {e['kind']!r} ({', '.join(SOURCE_KINDS)})")
        try:
            entry = SourceEntry.load(e)
        except ConfigError as exc:
            raise ValueError(f"{path}: source #{i + 1}: {exc}") from None
        if entry.name in seen:
            raise ValueError(f"{path}: source name {entry.name!r} is declared twice")
        seen.add(entry.name)
        out.append(entry)
    return out


def default_sources() -> list[SourceSpec]:
    """The embedded default's sources as specs."""
    return [e.spec() for e in DEFAULT_SOURCES]


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:64] or "source"


def _repo_name(uri: str) -> str:
    tail = re.split(r"[/:]", uri.rstrip("/"))[-1]
    return tail[:-4] if tail.endswith(".git") else tail


def _looks_git(text: str) -> bool:
    if text.startswith(("git@", "ssh://", "git://")) or text.rstrip("/").endswith(".git"):
        return True
    path = text[len("file://"):] if text.startswith("file://") else text
    return "://" not in path and os.path.exists(os.path.join(os.path.expanduser(path), ".git"))


def parse_source(text: str, name: str | None = None) -> SourceSpec:
    """A SourceSpec from what a user types: ``python``, ``s3://bucket/prefix``, a directory,
    or a git repository (URL, ``*.git`` path, or a directory holding ``.git``) with an
    optional ``@REV`` suffix. Names default to a slug of the repository or directory name."""
    text = text.strip()
    if text == "python":
        return SourceSpec(name=name or "python", kind="python", uri="python")
    if text.startswith("s3://"):
        return SourceSpec(name=name or slug(text[5:]), kind="s3", uri=text.rstrip("/"))
    uri, rev = text, None
    if "@" in text:
        base, tail = text.rsplit("@", 1)
        if tail and ":" not in tail and _looks_git(base):
            uri, rev = base, tail
    if _looks_git(uri):
        if "://" not in uri and not uri.startswith("git@"):
            uri = os.path.abspath(os.path.expanduser(uri))
        default = slug(_repo_name(uri) + (f"-{rev}" if rev else ""))
        return SourceSpec(name=name or default, kind="git", uri=uri, rev=rev)
    path = os.path.abspath(os.path.expanduser(text))
    if os.path.isdir(path):
        return SourceSpec(name=name or slug(os.path.basename(path)), kind="local", uri=path)
    raise ValueError(f"not a directory, git repository, s3:// prefix or 'python': {text!r}")


@dataclass
class Entry:
    """A file met by a walker: skipped already (``skip`` set) or readable through ``read``."""

    path: str  # relative to the source root, POSIX
    repo: str
    revision: str
    size: int
    skip: str | None = None
    detail: str = ""
    read: Callable[[int], bytes] | None = None  # read(limit) returns at most limit bytes


def _read_local(path: str, limit: int) -> bytes:
    # O_NONBLOCK and the fstat check: a file swapped for a FIFO after lstat cannot block us.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError("no longer a regular file")
        return f.read(limit)


def _symlink_reason(path: str, root_real: str) -> tuple[str, str]:
    try:
        target = os.path.realpath(path, strict=True)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "symlink_loop", "the link chain loops"
        return "unreadable", "dangling symlink"
    if os.path.commonpath([target, root_real]) != root_real:
        return "symlink_outside_root", "target outside the source root"
    parent = os.path.realpath(os.path.dirname(path))
    if os.path.isdir(target) and os.path.commonpath([target, parent]) == target:
        return "symlink_loop", "points at a directory that contains it"
    return "symlink", "target inside the root is ingested under its own path"


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _clean(path: str) -> tuple[str, str]:
    """(a printable form of ``path``, why the name is refused or "")."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        path = path.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        return _CONTROL.sub("\ufffd", path), "file name is not valid UTF-8"
    if _CONTROL.search(path):  # a newline or tab in a name breaks line-oriented tools
        return _CONTROL.sub("\ufffd", path), "file name holds a control character"
    return path, ""


def walk_local(
    root: str, repo: str, revision: str, skip_dirs: tuple[str, ...],
    prefix: str = "", prune_top: tuple[str, ...] = (), gitlinks: frozenset[str] = frozenset(),
) -> Iterator[Entry]:
    """Every file under ``root`` (see the module docstring for the rules); ``gitlinks`` are
    the relative paths of submodules."""
    root_real = os.path.realpath(root)

    def walk(dir_path: str, rel_dir: str) -> Iterator[Entry]:
        try:
            with os.scandir(dir_path) as it:
                names = sorted(e.name for e in it)
        except OSError as exc:
            yield Entry(prefix + rel_dir, repo, revision, 0, "unreadable", type(exc).__name__)
            return
        for name in names:
            if name in skip_dirs or (not rel_dir and name in prune_top):
                continue
            rel = f"{rel_dir}/{name}" if rel_dir else name
            full = os.path.join(dir_path, name)
            path, bad_name = _clean(prefix + rel)
            try:
                st = os.lstat(full)
            except OSError as exc:
                yield Entry(path, repo, revision, 0, "unreadable", type(exc).__name__)
                continue
            if stat.S_ISDIR(st.st_mode) and rel in gitlinks:
                yield Entry(path, repo, revision, 0, "submodule", "git submodule, not fetched")
                continue
            if stat.S_ISDIR(st.st_mode):
                yield from walk(full, rel)
                continue
            entry = Entry(path, repo, revision, st.st_size)
            if bad_name:
                entry.skip, entry.detail = "bad_filename", bad_name
            elif stat.S_ISLNK(st.st_mode):
                entry.skip, entry.detail = _symlink_reason(full, root_real)
            elif not stat.S_ISREG(st.st_mode):
                entry.skip, entry.detail = "not_regular_file", "fifo, socket or device"
            else:
                entry.read = lambda limit, p=full: _read_local(p, limit)
            yield entry

    yield from walk(root, "")


def walk_python(parts: tuple[str, ...], skip_dirs: tuple[str, ...]) -> Iterator[Entry]:
    """The running interpreter's source: ``stdlib/...`` (with its test suite, without its
    site-packages / dist-packages folder) then ``site-packages/...`` (purelib)."""
    paths = sysconfig.get_paths()
    roots = {"stdlib": paths["stdlib"], "site-packages": paths["purelib"]}
    revision = "python-" + platform.python_version()
    for part in parts:
        if os.path.isdir(roots[part]):
            prune = ("site-packages", "dist-packages") if part == "stdlib" else ()
            yield from walk_local(roots[part], part, revision, skip_dirs, part + "/", prune)


def _git(*args: str, cwd: str | None = None) -> str:
    env = {**os.environ, "GIT_LFS_SKIP_SMUDGE": "1", "GIT_TERMINAL_PROMPT": "0"}
    cmd = ["git", "-c", "submodule.recurse=false", "-c", "advice.detachedHead=false", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode:
        err = re.sub(r"://[^/@\s]+@", "://***@", " ".join(proc.stderr.split()))  # hide URL credentials
        raise RuntimeError(f"git {args[0]} failed: {err[-500:]}")
    return proc.stdout.strip()


@contextlib.contextmanager
def git_checkout(uri: str, rev: str | None) -> Iterator[tuple[str, str]]:
    """Clone ``uri`` (no submodules, LFS pointers left as they are) into a temporary
    directory checked out at ``rev``; yields (directory, commit sha)."""
    with tempfile.TemporaryDirectory(prefix="corpus-git-") as tmp:
        dest = os.path.join(tmp, "repo")
        _git("clone", "--no-checkout", "--quiet", uri, dest)
        sha = None
        for candidate in [rev, f"origin/{rev}"] if rev else ["HEAD"]:
            with contextlib.suppress(RuntimeError):
                sha = _git("rev-parse", "--verify", "--quiet", candidate + "^{commit}", cwd=dest)
                break
        if not sha:
            raise ValueError(f"revision {rev or 'HEAD'!r} not found in {_repo_name(uri)}")
        _git("checkout", "--quiet", "--detach", sha, cwd=dest)
        yield dest, sha


def _gitlinks(dest: str, sha: str) -> frozenset[str]:
    """Paths of the submodules (tree entries of mode 160000) at commit ``sha``."""
    out = _git("ls-tree", "-r", "-z", "--full-tree", sha, cwd=dest)
    return frozenset(line.split("\t", 1)[1] for line in out.split("\0")
                     if line.startswith("160000 ") and "\t" in line)


def walk_s3(spec: SourceSpec, skip_dirs: tuple[str, ...]) -> Iterator[Entry]:
    from ..storage import filesystem

    fs = filesystem("s3", spec.storage_options)
    base = spec.uri[len("s3://"):].rstrip("/")
    repo = base
    infos = fs.find(base, detail=True)
    for key in sorted(infos):
        info = infos[key]
        rel = key[len(base):].lstrip("/")
        if not rel or key.endswith("/") or info.get("type") == "directory":
            continue
        if any(part in skip_dirs for part in rel.split("/")):
            continue
        yield Entry(rel, repo, "", int(info.get("size") or 0),
                    read=lambda limit, k=key: fs.cat_file(k, start=0, end=limit))


@source_kind("python")
@contextlib.contextmanager
def _python_entries(spec: SourceSpec, skip_dirs: tuple[str, ...], python_parts: tuple[str, ...]):
    yield walk_python(python_parts, skip_dirs)


@source_kind("local")
@contextlib.contextmanager
def _local_entries(spec: SourceSpec, skip_dirs: tuple[str, ...], python_parts: tuple[str, ...]):
    root = os.path.abspath(os.path.expanduser(spec.uri))
    if not os.path.isdir(root):
        raise ValueError(f"source {spec.name}: not a directory: {root}")
    yield walk_local(root, os.path.basename(root), "", skip_dirs)


@source_kind("git")
@contextlib.contextmanager
def _git_entries(spec: SourceSpec, skip_dirs: tuple[str, ...], python_parts: tuple[str, ...]):
    with git_checkout(spec.uri, spec.rev) as (dest, sha):
        yield walk_local(dest, _repo_name(spec.uri), sha, skip_dirs, gitlinks=_gitlinks(dest, sha))


@source_kind("s3")
@contextlib.contextmanager
def _s3_entries(spec: SourceSpec, skip_dirs: tuple[str, ...], python_parts: tuple[str, ...]):
    yield walk_s3(spec, skip_dirs)


def open_entries(spec: SourceSpec, skip_dirs: tuple[str, ...],
                 python_parts: tuple[str, ...]) -> contextlib.AbstractContextManager[Iterator[Entry]]:
    """The entries of a source, from its kind's walker."""
    if spec.kind not in SOURCE_KINDS:
        raise ValueError(f"source {spec.name}: unknown kind {spec.kind!r} (known: {', '.join(SOURCE_KINDS)})")
    return SOURCE_KINDS[spec.kind](spec, skip_dirs, python_parts)


DEFAULT_SOURCES = (SourceEntry(name="python", kind="python", max_total_mb=40),)
"""The embedded default when no sources file exists: the running interpreter's stdlib (with its
tests) and site-packages, capped at 40 MB to keep ``make run`` to minutes."""
