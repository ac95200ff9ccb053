"""A project's tree, fetched: a directory, a git path or URL at a revision, an sdist (a file, an
https URL, or ``pypi:NAME==VERSION`` from the package index's simple API), or a distribution
installed in this Python. Fetching reads and copies files only; nothing of the project runs.
And the project as its owner has it: ``repo/``, a git repository at the source's revision
(``git_snapshot``), its objects in one pack (``pack_objects``)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import urllib.request
import zipfile
from pathlib import Path

from composer_dag.laptop.image import Persona
from composer_dag.repos.config import BootstrapError
from composer_dag.repos.layout import SKIP_DIRS, norm_name


def index_url() -> str:
    """The package index pip is configured with (``PIP_INDEX_URL``, pip's config), else PyPI's."""
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        r = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"], capture_output=True,
                           text=True)
        url = r.stdout.strip() if r.returncode == 0 else ""
    return (url or "https://pypi.org/simple").rstrip("/")


def fetch_sdist(name: str, version: str, dest: Path) -> Path:
    """The sdist of ``name==version`` from the package index's simple API (PEP 691), into
    ``dest`` (kept: a second call reads the file there). Downloads a file; builds nothing."""
    dest.mkdir(parents=True, exist_ok=True)
    pat = re.compile(rf"(?i){re.sub(r'[-_.]+', '[-_.]', name)}-{re.escape(version)}\.(tar\.gz|zip)")
    have = [p for p in dest.iterdir() if pat.fullmatch(p.name)]
    if have:
        return have[0]
    req = urllib.request.Request(f"{index_url()}/{norm_name(name)}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        files = json.load(urllib.request.urlopen(req, timeout=60)).get("files") or []
        f = next(f for f in files if pat.fullmatch(f["filename"]))
        data = urllib.request.urlopen(f["url"], timeout=300).read()
    except StopIteration:
        raise BootstrapError("fetch_failed", f"no sdist of {name} {version} on {index_url()}") from None
    except (OSError, ValueError) as e:
        raise BootstrapError("fetch_failed", f"cannot fetch {name} {version}: {e}") from e
    want = (f.get("hashes") or {}).get("sha256")
    if want and hashlib.sha256(data).hexdigest() != want:
        raise BootstrapError("fetch_failed", f"{f['filename']}: sha256 does not match the index")
    tmp = dest / f".{f['filename']}.part"
    tmp.write_bytes(data)
    tmp.rename(dest / f["filename"])
    return dest / f["filename"]


def fetch_source(src: str, dest: Path) -> tuple[Path, dict]:
    """The project's tree under ``dest`` and where it came from. Reads and copies only.
    ``src``: a directory, a git path or URL (``@REV``), an sdist file or URL, ``pypi:NAME==VERSION``."""
    dest.mkdir(parents=True, exist_ok=True)
    if src.startswith("installed:"):
        return _installed(src[len("installed:"):], dest)
    if src.startswith("pypi:"):
        name, _, version = src[5:].partition("==")
        if not version:
            raise BootstrapError("fetch_failed", f"{src}: give the version, pypi:NAME==VERSION")
        archive = fetch_sdist(name, version, dest / "sdist")
        got, origin = fetch_source(str(archive), dest / "unpacked")
        return got, {**origin, "kind": "sdist", "index": index_url(), "requirement": f"{name}=={version}"}
    path, _, rev = src.partition("@") if not src.startswith(("http://", "https://")) else (src, "", "")
    if re.match(r"^https?://", src) and re.search(r"\.(tar\.gz|tgz|zip)$", src):
        try:
            data = urllib.request.urlopen(src, timeout=120).read()
        except OSError as e:
            raise BootstrapError("fetch_failed", f"cannot download {src}: {e}") from e
        archive = dest / src.rsplit("/", 1)[-1]
        archive.write_bytes(data)
        return _unpack(archive, dest / "src"), {"kind": "sdist", "url": src, "sha256": hashlib.sha256(data).hexdigest()}
    p = Path(path)
    if p.is_file() and re.search(r"\.(tar\.gz|tgz|zip)$", p.name):
        return _unpack(p, dest / "src"), {"kind": "sdist", "path": p.name,
                                         "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
    if (p / ".git").exists() or re.match(r"^(git@|git://|ssh://|https?://)", path):
        out = dest / "src" / (Path(path.rstrip("/")).name.removesuffix(".git") or "project")
        out.mkdir(parents=True)
        git = lambda *a: subprocess.run(["git", "-c", "safe.directory=*", *a], cwd=out, capture_output=True, text=True)
        # only the revision and its ancestors: nothing after it (a later fix) comes along
        git("init", "-q", "-b", "main")
        r = git("fetch", "-q", "--no-tags", str(Path(path).resolve()) if p.exists() else path, rev or "HEAD")
        if r.returncode:
            raise BootstrapError("fetch_failed", f"git fetch {path} {rev or 'HEAD'}: {r.stderr.strip()[-300:]}")
        if git("checkout", "-q", "-B", "main", "FETCH_HEAD").returncode:
            raise BootstrapError("fetch_failed", f"cannot check out {rev or 'HEAD'} of {path}")
        head = git("rev-parse", "HEAD").stdout.strip()
        return out, {"kind": "git", "path": path, "revision": head}
    if p.is_dir():
        out = dest / "src" / p.resolve().name
        shutil.copytree(p, out, symlinks=True, ignore=shutil.ignore_patterns(*SKIP_DIRS - {"docs", "doc", "examples"}))
        return out, {"kind": "directory", "path": str(p.resolve())}
    raise BootstrapError("fetch_failed", f"not a directory, git repository or sdist archive: {src}")


def _installed(name: str, dest: Path) -> tuple[Path, dict]:
    """A distribution installed in this Python (a wheel, already built): its files copied into a
    project tree with a ``pyproject.toml`` from its metadata. Copies only; nothing is imported."""
    import importlib.metadata as md

    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        raise BootstrapError("fetch_failed", f"{name} is not installed in this Python") from None
    root = dest / "src" / norm_name(dist.metadata["Name"])
    n = 0
    for f in dist.files or []:
        rel = Path(str(f))
        if rel.parts[0].endswith((".dist-info", ".data")) or rel.parts[0] in ("..", "bin") or "__pycache__" in rel.parts \
                or rel.suffix in (".pyc", ".so", ".pyd"):
            continue
        src = Path(dist.locate_file(f))
        if src.is_file():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, root / rel)
            n += 1
    if not n:
        raise BootstrapError("fetch_failed", f"{name}: no files recorded for the installed distribution")
    meta = dist.metadata
    lic = (meta.get("License-Expression") or meta.get("License") or "").strip()
    if not lic or len(lic) > 60:
        lic = next((c.rsplit(" :: ", 1)[1] for c in meta.get_all("Classifier") or []
                    if c.startswith("License :: OSI Approved :: ")), "unknown")
    (root / "pyproject.toml").write_text(
        f'[project]\nname = "{meta["Name"]}"\nversion = "{meta["Version"]}"\nlicense = {{text = "{lic}"}}\n'
        "dependencies = []\n")
    return root, {"kind": "installed", "distribution": meta["Name"], "version": meta["Version"]}


def _unpack(archive: Path, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    try:
        if archive.name.endswith(".zip"):
            with zipfile.ZipFile(archive) as z:
                for n in z.namelist():
                    if n.startswith("/") or ".." in Path(n).parts:
                        raise BootstrapError("fetch_failed", f"unsafe path in {archive.name}: {n}")
                z.extractall(dest)
        else:
            with tarfile.open(archive) as t:
                t.extractall(dest, filter="data")
    except (tarfile.TarError, zipfile.BadZipFile, OSError) as e:
        raise BootstrapError("fetch_failed", f"cannot unpack {archive.name}: {e}") from e
    tops = [p for p in dest.iterdir()]
    return tops[0] if len(tops) == 1 and tops[0].is_dir() else dest


def git_snapshot(src: Path, dest: Path, persona: Persona, origin: dict) -> None:
    """``repo/``: the source's own history when it has one, else one commit of its files."""
    if (src / ".git").exists():
        shutil.copytree(src, dest, symlinks=True)
        return
    shutil.copytree(src, dest, symlinks=True, ignore=shutil.ignore_patterns(*SKIP_DIRS - {"docs", "doc", "examples"}))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(dest), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_AUTHOR_NAME": persona.full_name, "GIT_AUTHOR_EMAIL": persona.email,
           "GIT_COMMITTER_NAME": persona.full_name, "GIT_COMMITTER_EMAIL": persona.email,
           "GIT_AUTHOR_DATE": "1714000000 +0100", "GIT_COMMITTER_DATE": "1714000000 +0100"}
    if not (dest / ".gitignore").exists():
        (dest / ".gitignore").write_text("__pycache__/\n*.py[cod]\n.pytest_cache/\n.venv/\n*.egg-info/\nbuild/\ndist/\n")
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", f"Import {origin.get('path') or origin.get('url') or 'sources'}"]):
        subprocess.run(["git", "-c", "safe.directory=*", *args], cwd=dest, env=env, check=True, capture_output=True)
    pack_objects(dest, env)


def pack_objects(repo: Path, env: dict | None = None) -> None:
    """Keep only what the branches reach, in one pack: the reachable objects packed as they are
    (no delta search: a fifth of a second for a networkx tree, where a full ``git gc`` took
    0.4-1.6 s), the rest (an amended commit and its files) dropped. One pack file instead of an
    object file each: a checkout is copied, stored and fetched many times over."""
    for args in (["-c", "pack.compression=1", "repack", "-a", "-d", "-q", "--window=0", "--depth=0"],
                 ["prune", "--expire=now"]):
        subprocess.run(["git", "-c", "safe.directory=*", *args], cwd=repo, env=env, check=True, capture_output=True)
