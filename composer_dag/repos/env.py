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

Nothing of the repository runs outside a sandbox. Fetching (outside) reads files and takes
wheels only (``pip download --only-binary :all:``); the project's own wheel is built inside the
sandbox with no network, from the fetched build requirements (``pip wheel --no-index``), and
kept in the wheel store once per distribution version; the dependencies are installed inside
the sandbox too, into a layer shared by every environment with the same resolved set.

Inside the sandbox the layer is the project's own virtual environment: ``<project>/.venv`` is a
small skeleton made per sandbox (``pyvenv.cfg``, ``bin/python``), and the layer's site-packages
is bound read-only into it, so the layer does not depend on the persona's user name.

The suite runs three times: twice as it is and once with the clock moved years ahead
(Debian's ``faketime``), another ``PYTHONHASHSEED`` and another ``random`` seed. A test is kept
when it passes every time. Then the package's functions are all replaced by
``raise NotImplementedError``: a kept test that still passes tests nothing of the code and is
left out as vacuous.

A failure has one reason (``REASONS``) and leaves nothing at ``out``.
"""

from __future__ import annotations

import ast
import configparser
import email.parser
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import urllib.request
import zipfile
from dataclasses import asdict, dataclass, field
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from pydantic import Field

from composer_dag.runtime.config import StageConfig
from composer_dag.grading import bytecode
from composer_dag.laptop.image import PYVER, Persona, persona_for
from composer_dag.sandbox.bwrap import Bind, Limits, Sandbox, share_tree

REASONS = ("fetch_failed", "unsupported_layout", "licence_excluded", "install_failed", "needs_network",
           "suite_does_not_start", "no_tests_found", "tests_fail_at_base", "timeout")
CHECKS_DIR = "/var/tmp/checks"  # where the recorded test tree sits in every run, here and at grading
REPORT_DIR = "/var/tmp/cdag-report"
SHIFTED_TIME = "2031-03-14 09:26:53"
_NETWORK = (r"Network is unreachable|Temporary failure in name resolution|Name or service not known|"
            r"No address associated with hostname|Connection refused|ConnectionError|gaierror")
PLUGIN = Path(__file__).with_name("pytest_report.py")
# what the sandbox's Python has already (rootfs.TOOLING and its requirements): not fetched again
PROVIDED = {"pytest", "pluggy", "iniconfig", "packaging", "pip", "exceptiongroup", "tomli", "colorama"}
_SKIP_DIRS = {".git", ".hg", ".tox", ".nox", ".venv", "venv", "build", "dist", "__pycache__", ".pytest_cache",
              ".mypy_cache", "node_modules", ".eggs", "docs", "doc", "examples", "benchmarks", "bench"}


class BootstrapError(Exception):
    def __init__(self, reason: str, message: str):
        assert reason in REASONS, reason
        super().__init__(message)
        self.reason = reason


class BootstrapConfig(StageConfig):
    """How a repository is made into an environment."""

    test_timeout: float = Field(600.0, description="seconds for one run of the suite in the sandbox")
    install_timeout: float = Field(600.0, description="seconds for the wheel build and the layer install")
    shifted_time: str = Field(SHIFTED_TIME, description="the wall clock of the third run (faketime)")
    hash_seeds: tuple[int, int] = Field((0, 4242), description="PYTHONHASHSEED of the plain runs and of the shifted run")
    random_seeds: tuple[int, int] = Field((0, 97), description="random.seed of the plain runs and of the shifted run")
    exclude_licences: tuple[str, ...] = Field((), description="licences (as recorded, case-insensitive) refused")
    store: Optional[str] = Field(None, description="the wheel store and layers (default: $COMPOSER_HOME/wheel-store)")
    max_test_files: int = Field(400, description="test files run at most (the first, by path)")
    test_files: Optional[tuple[str, ...]] = Field(None, description="only the test files matching these globs "
                                                                    "(relative to the project root); None: every one")


# ------------------------------------------------------------------------------------ the source

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
    req = urllib.request.Request(f"{index_url()}/{_norm(name)}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
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
        shutil.copytree(p, out, symlinks=True, ignore=shutil.ignore_patterns(*_SKIP_DIRS - {"docs", "doc", "examples"}))
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
    root = dest / "src" / _norm(dist.metadata["Name"])
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


# ------------------------------------------------------------------------------------ the layout

@dataclass
class Layout:
    name: str
    version: str
    src_dir: str                  # "" (flat) or "src"
    packages: list[str]           # import names: packages (dirs) and modules (.py) under src_dir
    test_paths: list[str]         # test files, relative to the project root
    support: list[str]            # every other file the tests need: test directories' files, conftest.py
    build_requires: list[str]
    requires: list[str]           # runtime and test requirements, as written
    licence: str
    pytest_ini: str               # the project's pytest settings, addopts removed
    config_files: list[str] = field(default_factory=list)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _req_name(req: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    return _norm(m.group(1)) if m else ""


def _usable_req(req: str) -> bool:
    """A requirement line that applies here (no marker excluding this Python, no option, no URL)."""
    req = req.strip()
    if not req or req.startswith(("#", "-", "git+", "http")) or "://" in req:
        return False
    if ";" in req:
        try:
            from packaging.markers import Marker

            return Marker(req.split(";", 1)[1]).evaluate({"extra": ""})
        except Exception:  # noqa: BLE001 - a marker we cannot read: not installed
            return False
    return True


_TEST_GROUPS = ("test", "tests", "testing", "dev")


def _poetry_spec(spec: str) -> str:
    """A poetry version constraint as a PEP 440 specifier: ``^1.2`` is ``>=1.2,<2``, ``~1.2``
    is ``>=1.2,<1.3``, a bare version is ``==`` it, ``*`` is any."""
    out = []
    for part in (p.strip() for p in str(spec).split(",")):
        if not part or part == "*":
            continue
        if part[0] in "^~" and not part.startswith("~="):
            base = part[1:].strip()
            nums = [int(x) if x.isdigit() else 0 for x in re.split(r"[.]", re.match(r"[0-9.]*", base).group(0)
                                                                   .strip(".") or "0")]
            if part[0] == "^":  # the first nonzero component may not change
                i = next((k for k, n in enumerate(nums) if n), len(nums) - 1)
            else:  # tilde: the minor version may not change (the major, when only it is given)
                i = min(1, len(nums) - 1)
            upper = nums[:i] + [nums[i] + 1]
            out += [f">={base}", "<" + ".".join(map(str, upper))]
        elif part[0].isdigit():
            out.append(f"=={part}")
        else:
            out.append(part)
    return ",".join(out)


def _poetry_reqs(table, runtime: bool = False) -> list[str]:
    """``[tool.poetry.*dependencies]`` as requirement lines: paths, git and URL sources, and
    optional runtime entries (extras) left out; a ``python`` or ``markers`` condition kept as a
    marker, so a requirement for another Python is not installed."""
    out = []
    for name, spec in (table or {}).items():
        if name.lower() == "python":
            continue
        for one in spec if isinstance(spec, list) else [spec]:
            if isinstance(one, dict):
                if any(k in one for k in ("path", "git", "url", "file")) or (runtime and one.get("optional")):
                    break
                marks = []
                if one.get("python"):
                    marks += [f'python_version {c.strip()[:2] if c.strip()[1:2] == "=" else c.strip()[:1]} '
                              f'"{c.strip().lstrip("<>=!~^").strip()}"' for c in str(one["python"]).split(",")
                              if c.strip() and c.strip()[0] in "<>=!"]
                if one.get("markers"):
                    marks.append(f"({one['markers']})")
                req = name + _poetry_spec(one.get("version", "*")) + (f"; {' and '.join(marks)}" if marks else "")
            else:
                req = name + _poetry_spec(one)
            if _usable_req(req):  # of several entries (one per Python), the first that applies here
                out.append(req)
                break
    return out


# development tools a project's dev groups and tox environments list, which its tests do not
# import: left out of what those sources add (a test extra or a requirements file keeps them)
_DEV_TOOLS = {"coverage", "pytest-cov", "codecov", "coveralls", "black", "isort", "ruff", "flake8", "pyflakes",
              "pycodestyle", "pydocstyle", "pylint", "mccabe", "bandit", "mypy", "pyright", "pre-commit", "nox",
              "tox", "twine", "build", "wheel", "check-manifest", "bump2version", "bumpversion", "towncrier",
              "changelog-manager", "docutils", "readme-renderer", "ipython", "ipdb", "pdbpp", "sphinx",
              "furo", "myst-parser", "mkdocs", "mkdocs-material", "pip-tools", "setuptools-scm", "poetry"}


def _dev_tool(req: str) -> bool:
    name = _req_name(req)
    return name in _DEV_TOOLS or name.startswith(("sphinx-", "sphinxcontrib-", "flake8-", "types-", "mypy-",
                                                  "mkdocs-"))


def _test_requirements(root: Path, pyproject: dict, poetry: dict) -> list[str]:
    """What the tests need beyond the runtime requirements and the test extra, wherever the
    project declares it: PEP 735 ``[dependency-groups]``, poetry's test and dev groups (and the
    old ``dev-dependencies``), tox's ``deps`` (a ``-r FILE`` line read in turn), and test
    requirements files. Development tools (``_DEV_TOOLS``) from groups and tox are left out."""
    out: list[str] = []
    groups = pyproject.get("dependency-groups") or {}

    def group(name: str, seen: tuple = ()) -> list[str]:
        got = []
        for item in groups.get(name) or []:
            if isinstance(item, str):
                got.append(item)
            elif isinstance(item, dict) and item.get("include-group") and item["include-group"] not in seen:
                got += group(item["include-group"], seen + (name,))
        return got

    for k in _TEST_GROUPS:
        if k in groups:
            out += group(k)
    pgroups = poetry.get("group") or {}
    for k in _TEST_GROUPS:
        out += _poetry_reqs((pgroups.get(k) or {}).get("dependencies"))
    out += _poetry_reqs(poetry.get("dev-dependencies"))

    def req_file(f: Path, depth: int = 0) -> list[str]:
        got = []
        if depth > 3 or not f.is_file() or root.resolve() not in f.resolve().parents:
            return got
        for line in f.read_text(errors="replace").splitlines():
            line = line.split(" #")[0].strip()
            m = re.match(r"-r\s*(\S+)$|--requirement[ =]\s*(\S+)$", line)
            if m:
                got += req_file(f.parent / (m.group(1) or m.group(2)), depth + 1)
            elif line and not line.startswith("#"):
                got.append(line)
        return got

    if (root / "tox.ini").is_file():
        tox = configparser.ConfigParser(interpolation=None)
        try:
            tox.read_string((root / "tox.ini").read_text(errors="replace"))
        except configparser.Error:
            tox = None
        if tox is not None and tox.has_option("testenv", "deps"):
            for line in tox.get("testenv", "deps").splitlines():
                line = line.split(" #")[0].strip()
                if "{" in line:  # a tox substitution: not a requirement here
                    continue
                m = re.match(r"-r\s*(\S+)$", line)
                out += req_file(root / m.group(1)) if m else [line] if line else []
    out = [r for r in out if not _dev_tool(r)]
    for f in sorted(root.glob("requirements*test*.txt")) + sorted(root.glob("requirements/test*.txt")) + \
            sorted(root.glob("test-requirements.txt")):
        out += req_file(f)
    return out


def detect_layout(root: Path) -> Layout:
    pyproject = {}
    if (root / "pyproject.toml").is_file():
        try:
            pyproject = tomllib.loads((root / "pyproject.toml").read_text(errors="replace"))
        except tomllib.TOMLDecodeError as e:
            raise BootstrapError("unsupported_layout", f"pyproject.toml does not parse: {e}") from e
    cfg = configparser.ConfigParser(interpolation=None)
    if (root / "setup.cfg").is_file():
        try:
            cfg.read_string((root / "setup.cfg").read_text(errors="replace"))
        except configparser.Error:
            cfg = configparser.ConfigParser(interpolation=None)
    pkginfo = {}
    if (root / "PKG-INFO").is_file():
        pkginfo = email.parser.Parser().parsestr((root / "PKG-INFO").read_text(errors="replace"))
    project = pyproject.get("project") or {}
    name = (project.get("name") or (pkginfo.get("Name") if pkginfo else None)
            or (cfg.get("metadata", "name", fallback=None)) or root.name)
    version = str(project.get("version") or (pkginfo.get("Version") if pkginfo else None)
                  or cfg.get("metadata", "version", fallback="") or "0")
    if any(root.rglob("*.pyx")) or any(p for p in root.rglob("*.c") if "test" not in p.as_posix()):
        raise BootstrapError("unsupported_layout", "the project has C or Cython sources (compiled extensions)")
    if not any((root / f).is_file() for f in ("pyproject.toml", "setup.py", "setup.cfg")):
        raise BootstrapError("unsupported_layout", "no pyproject.toml, setup.py or setup.cfg: not a Python project")
    src_dir = "src" if (root / "src").is_dir() and any((root / "src").glob("*/__init__.py")) or \
        (root / "src").is_dir() and any((root / "src").glob("*.py")) else ""
    base = root / src_dir
    packages = sorted(p.name for p in base.iterdir() if p.is_dir() and (p / "__init__.py").is_file()
                      and not _is_test_name(p.name) and p.name not in _SKIP_DIRS)
    packages += sorted(p.stem for p in base.glob("*.py") if not _is_test_name(p.name)
                       and p.name not in ("setup.py", "conftest.py", "noxfile.py", "fabfile.py", "tasks.py")
                       and not p.name.startswith(("_version", "versioneer")))
    if not packages:
        raise BootstrapError("unsupported_layout", "no package or module found at the root or under src/")
    tests = _test_files(root, src_dir, packages)
    support = _support_files(root, tests)
    ini, config_files = _pytest_ini(root, pyproject, cfg)
    build = list((pyproject.get("build-system") or {}).get("requires") or ["setuptools>=40.8.0", "wheel"])
    reqs = list(project.get("dependencies") or [])
    if not reqs and pkginfo:
        reqs = [r for r in pkginfo.get_all("Requires-Dist") or [] if "extra ==" not in r]
    if not reqs and cfg.has_option("options", "install_requires"):
        reqs = [l for l in cfg.get("options", "install_requires").splitlines() if l.strip()]
    poetry = (pyproject.get("tool") or {}).get("poetry") or {}
    if not reqs:
        reqs = _poetry_reqs(poetry.get("dependencies"), runtime=True)
    extras = project.get("optional-dependencies") or {}
    for k in ("test", "tests", "testing", "dev"):
        if k in extras:
            reqs += list(extras[k])
            break
    else:
        for k in ("test", "tests", "testing"):
            if cfg.has_option("options.extras_require", k):
                reqs += [l for l in cfg.get("options.extras_require", k).splitlines() if l.strip()]
                break
    reqs += _test_requirements(root, pyproject, poetry)
    reqs = list(dict.fromkeys(r.strip() for r in reqs if _usable_req(r)))
    return Layout(name=str(name), version=version, src_dir=src_dir, packages=packages, test_paths=tests,
                  support=support, build_requires=[r for r in build if _usable_req(r)], requires=reqs,
                  licence=_licence(root, project, pkginfo, cfg), pytest_ini=ini, config_files=config_files)


def _is_test_name(name: str) -> bool:
    return name in ("test", "tests", "testing") or name.startswith("test_") or name.endswith(("_test.py", "_tests"))


def _test_files(root: Path, src_dir: str, packages: list[str]) -> list[str]:
    dirs = [root / d for d in ("tests", "test", "testing") if (root / d).is_dir()]
    dirs += [root / src_dir / p / d for p in packages for d in ("tests", "test") if (root / src_dir / p / d).is_dir()]
    dirs += [root / src_dir / p for p in packages if (root / src_dir / p).is_dir()]  # test modules in the package
    files = [p for d in dirs for p in d.rglob("*.py") if re.match(r"(test_.*|.*_test)\.py$", p.name)]
    files += [p for p in root.glob("*.py") if re.match(r"(test_.*|.*_test)\.py$", p.name)]
    return sorted(dict.fromkeys(p.relative_to(root).as_posix() for p in files
                                if not _SKIP_DIRS & set(p.relative_to(root).parts[:-1])))


def _support_files(root: Path, tests: list[str]) -> list[str]:
    """Every file of the directories holding the tests (helpers, data, conftest.py, __init__.py)
    below the project root, and the root's conftest.py."""
    out = set()
    for t in tests:
        parts = Path(t).parts
        if len(parts) > 1 and parts[0] in ("tests", "test", "testing"):
            for p in (root / parts[0]).rglob("*"):
                if p.is_file() and not _SKIP_DIRS & set(p.relative_to(root).parts[:-1]):
                    out.add(p.relative_to(root).as_posix())
        elif len(parts) > 1:  # tests inside the package: a tests/ directory whole, else only conftest.py
            d = root.joinpath(*parts[:-1])
            if _is_test_name(d.name):
                out.update(p.relative_to(root).as_posix() for p in d.rglob("*") if p.is_file()
                           and "__pycache__" not in p.parts)
            elif (d / "conftest.py").is_file():  # never the package's own modules: they are the code under test
                out.add((d / "conftest.py").relative_to(root).as_posix())
    if (root / "conftest.py").is_file():
        out.add("conftest.py")
    return sorted(out - set(tests))


PACKAGE_SHIM = '''"""Recorded with the tests: the package under test is the project's own. This file lets
the tests recorded inside the package import as its subpackages (``from .. import x``): it runs the
project's ``__init__.py`` as this package, whose modules are the project's and whose tests are the
recorded ones."""
import os as _os
import sys as _sys

_here = _os.path.dirname(_os.path.abspath(__file__))
for _entry in _sys.path:
    _dir = _os.path.abspath(_os.path.join(_entry or ".", *__name__.split(".")))
    if _dir != _here and _os.path.isfile(_os.path.join(_dir, "__init__.py")):
        break
else:
    raise ImportError(f"the package {__name__} is not on sys.path")
__path__ = [_here, _dir]
__file__ = _os.path.join(_dir, "__init__.py")
if __spec__ is not None:
    __spec__.origin = __file__
del _entry, _dir, _here
with open(__file__, "rb") as _f:
    exec(compile(_f.read(), __file__, "exec"))
'''


def is_package_shim(path: Path) -> bool:
    """Whether ``path`` is a package shim ``record_tests`` wrote (not a file of the project)."""
    return path.name == "__init__.py" and path.is_file() and path.read_bytes() == PACKAGE_SHIM.encode()


def record_tests(root: Path, layout: Layout, dest: Path) -> None:
    """The recorded test tree at ``dest``: the test files and their support as ``root`` has them,
    ``pytest.ini``, and a package shim (``PACKAGE_SHIM``) for every package directory above a
    test inside the package, so that pytest imports such a test as the package's submodule (its
    relative imports work) while the package's code stays the workspace's."""
    for rel in layout.test_paths + layout.support:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, dest / rel)
    (dest / "pytest.ini").write_text(layout.pytest_ini)
    base = Path(layout.src_dir) if layout.src_dir else Path()
    for t in layout.test_paths:
        rel = Path(t)
        try:
            inner = rel.relative_to(base).parts
        except ValueError:
            continue
        if len(inner) < 2 or inner[0] not in layout.packages:
            continue
        for k in range(1, len(inner)):
            d = base.joinpath(*inner[:k])
            if (root / d / "__init__.py").is_file() and not (dest / d / "__init__.py").exists():
                (dest / d).mkdir(parents=True, exist_ok=True)
                (dest / d / "__init__.py").write_text(PACKAGE_SHIM)


def _pytest_ini(root: Path, pyproject: dict, cfg) -> tuple[str, list[str]]:
    opts, files = {}, []
    tool = ((pyproject.get("tool") or {}).get("pytest") or {}).get("ini_options")
    if (root / "pytest.ini").is_file():
        c = configparser.ConfigParser(interpolation=None)
        c.read_string((root / "pytest.ini").read_text(errors="replace"))
        opts, files = dict(c["pytest"]) if c.has_section("pytest") else {}, ["pytest.ini"]
    elif tool is not None:
        opts = {k: "\n".join(map(str, v)) if isinstance(v, list) else str(v) for k, v in tool.items()}
        files = ["pyproject.toml"]
    elif (root / "tox.ini").is_file() and "[pytest]" in (root / "tox.ini").read_text(errors="replace"):
        c = configparser.ConfigParser(interpolation=None)
        try:
            c.read_string((root / "tox.ini").read_text(errors="replace"))
            opts, files = dict(c["pytest"]), ["tox.ini"]
        except configparser.Error:
            pass
    elif cfg.has_section("tool:pytest"):
        opts, files = dict(cfg["tool:pytest"]), ["setup.cfg"]
    keep = {k: v for k, v in opts.items() if k not in ("addopts", "testpaths", "norecursedirs", "minversion",
                                                        "required_plugins", "cache_dir", "rootdir")}
    lines = ["[pytest]"] + [f"{k} =" + "".join(f"\n    {l}" for l in str(v).splitlines() if l.strip())
                            if "\n" in str(v) else f"{k} = {v}" for k, v in sorted(keep.items())]
    return "\n".join(lines) + "\n", files


_LICENCES = (("Apache", "Apache-2.0"), ("GNU LESSER", "LGPL"), ("GNU GENERAL PUBLIC LICENSE", "GPL"),
             ("Mozilla Public License", "MPL-2.0"), ("Permission is hereby granted, free of charge", "MIT"),
             ("Redistribution and use in source and binary forms", "BSD"), ("ISC License", "ISC"),
             ("Python Software Foundation", "PSF-2.0"), ("This is free and unencumbered", "Unlicense"))


def _licence(root: Path, project: dict, pkginfo, cfg) -> str:
    lic = project.get("license")
    if isinstance(lic, str) and lic.strip():
        return lic.strip()
    if isinstance(lic, dict) and lic.get("text") and len(lic["text"]) < 60:
        return lic["text"].strip()
    if pkginfo:
        for k in ("License-Expression", "License"):
            v = (pkginfo.get(k) or "").strip()
            if v and v.upper() != "UNKNOWN" and len(v) < 60:
                return v
        for c in pkginfo.get_all("Classifier") or []:
            if c.startswith("License :: OSI Approved :: "):
                return c.rsplit(" :: ", 1)[1]
    v = cfg.get("metadata", "license", fallback="").strip()
    if v and len(v) < 60:
        return v
    for f in sorted(root.glob("LICEN[CS]E*")) + sorted(root.glob("COPYING*")):
        text = f.read_text(errors="replace")[:4000]
        for needle, name in _LICENCES:
            if needle.lower() in text.lower():
                return name
    return "unknown"


# ------------------------------------------------------------------------------------ the store

def store_root(cfg: BootstrapConfig) -> Path:
    if cfg.store:
        return Path(cfg.store)
    return Path(os.environ.get("COMPOSER_HOME") or Path.home() / ".composer") / "wheel-store"


def _provided_version(name: str) -> str | None:
    """The version of a ``PROVIDED`` distribution inside the sandbox (a copy of this
    interpreter's, ``rootfs.TOOLING``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def own_tooling(req: str) -> bool:
    """A requirement on a ``PROVIDED`` distribution (pytest, pluggy, ...) that the sandbox's
    version does not satisfy (``pytest<9``): the layer gets that version, ahead of the sandbox's."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        r = Requirement(req)
    except InvalidRequirement:
        return False
    have = _provided_version(r.name) if _norm(r.name) in PROVIDED and r.specifier else None
    return have is not None and not r.specifier.contains(have, prereleases=True)


def fetch_wheels(reqs: list[str], dest: Path, timeout: float = 600) -> list[Path]:
    """Wheels only (nothing is built), with their requirements, into ``dest``: pip resolves
    from the wheels' metadata. Returns the wheels of this resolution. What the sandbox provides
    is left out, unless a requirement asks for another version of it (``own_tooling``): then the
    resolution's wheels of the provided distributions are kept too, for that version's needs."""
    own = any(own_tooling(r) for r in reqs)
    reqs = [r for r in reqs if _req_name(r) not in PROVIDED or own_tooling(r)]
    if not reqs:
        return []
    dest.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--only-binary", ":all:", "--dest", str(dest),
                        "--progress-bar", "off", *reqs], capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or [""]
        raise BootstrapError("install_failed", f"no wheel for {', '.join(reqs)}: {tail[0][-300:]}")
    got = re.findall(r"^\s*(?:Saved|File was already downloaded) (\S+\.whl)\s*$", r.stdout, re.M)
    return sorted({Path(g) for g in got if own or _norm(Path(g).name.split("-")[0]) not in PROVIDED})


def _digest_files(paths) -> str:
    h = hashlib.sha256()
    for p in sorted(paths, key=lambda p: Path(p).name):
        h.update(Path(p).name.encode() + b"\0" + hashlib.sha256(Path(p).read_bytes()).digest())
    return h.hexdigest()


def _sandbox(workspace: Path, persona: Persona, binds: list[Bind], timeout: float, chown: bool = True) -> Sandbox:
    return Sandbox(workspace, Limits(timeout=timeout, cpu_seconds=int(timeout) + 60, max_disk_bytes=4 << 30),
                   project=workspace.name, binds=binds, persona=persona, chown=chown)


def _pip(workspace: Path, persona: Persona, wheelhouse: Path, out: Path, args: list[str], cfg: BootstrapConfig):
    """``python3 -m pip ARGS`` in a sandbox with no network: ``wheelhouse`` read-only at
    /var/tmp/wheelhouse, ``out`` writable at /var/tmp/out, the workspace as the working directory."""
    with _sandbox(workspace, persona, [Bind(wheelhouse, "/var/tmp/wheelhouse"), Bind(out, "/var/tmp/out", writable=True)],
                  cfg.install_timeout) as sb:
        shutil.chown(out, sb.persona.uid, sb.persona.gid)
        return sb.run(["python3", "-m", "pip", *args], cwd=sb.root)


def build_wheel(root: Path, layout: Layout, store: Path, persona: Persona, cfg: BootstrapConfig,
                key: str) -> tuple[Path, bool]:
    """The project's wheel, built once per distribution version (``key``) in the sandbox with no
    network from the fetched build requirements. (wheel, hit)."""
    done = store / "wheels" / key
    if done.is_dir() and list(done.glob("*.whl")):
        return next(done.glob("*.whl")), True
    backend = store / "fetched"
    fetch_wheels(layout.build_requires, backend, cfg.install_timeout)
    with tempfile.TemporaryDirectory(prefix="cdag-build-") as tmp:
        ws = Path(tmp) / layout.name
        shutil.copytree(root, ws, symlinks=True, ignore=shutil.ignore_patterns(".git"))
        out = Path(tmp) / "out"
        out.mkdir()
        r = _pip(ws, persona, backend, out, ["wheel", "-q", "--no-deps", "--no-index", "--find-links",
                                              "/var/tmp/wheelhouse", "--wheel-dir", "/var/tmp/out", "."], cfg)
        wheels = list(out.glob("*.whl"))
        if r.timed_out:
            raise BootstrapError("timeout", f"building the wheel took over {cfg.install_timeout:.0f} s")
        if r.exit_code or not wheels:
            text = (r.stderr + r.stdout)
            reason = "needs_network" if re.search(_NETWORK + r"|Could not find a version that satisfies", text) \
                else "install_failed"
            raise BootstrapError(reason, f"the wheel did not build: {text.strip()[-400:]}")
        staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=_mkdir(store / "wheels")))
        shutil.copy2(wheels[0], staging / wheels[0].name)
        try:
            staging.rename(done)
        except OSError:  # built meanwhile by another bootstrap
            shutil.rmtree(staging, ignore_errors=True)
        return next(done.glob("*.whl")), False


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def editable_pth(layout: Layout) -> str:
    """The editable finder: the project's source (root or ``src/``) on ``sys.path``, found from
    the environment's own prefix (``<project>/.venv``), so one layer serves any home directory."""
    sub = f", {layout.src_dir!r}" if layout.src_dir else ""
    return f"import os, sys; sys.path.append(os.path.join(os.path.dirname(sys.prefix){sub}))\n"


def make_layer(wheels: list[Path], layout: Layout, store: Path, persona: Persona,
               cfg: BootstrapConfig) -> tuple[str, Path, bool]:
    """The dependencies installed once per resolved set (and editable finder): (digest, dir, hit)."""
    pth = editable_pth(layout)
    digest = hashlib.sha256((_digest_files(wheels) + "\0" + pth).encode()).hexdigest()[:24]
    done = store / "layers" / digest
    if (done / "site-packages").is_dir():
        return digest, done, True
    staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=_mkdir(store / "layers")))
    sp = staging / "site-packages"
    sp.mkdir()
    try:
        if wheels:
            with tempfile.TemporaryDirectory(prefix="cdag-layer-") as tmp:
                whl = Path(tmp) / "wheels"
                whl.mkdir()
                for w in wheels:
                    shutil.copy2(w, whl / w.name)
                ws = Path(tmp) / "layer"
                ws.mkdir()
                r = _pip(ws, persona, whl, sp, ["install", "-q", "--no-index", "--no-deps", "--no-compile", "--target",
                                                "/var/tmp/out", *[f"/var/tmp/wheelhouse/{w.name}" for w in wheels]], cfg)
                if r.exit_code:
                    raise BootstrapError("install_failed", f"the dependencies did not install: "
                                                           f"{(r.stderr + r.stdout).strip()[-400:]}")
                for junk in sp.glob("bin"):
                    shutil.rmtree(junk, ignore_errors=True)
        (sp / f"__editable__.{_norm(layout.name).replace('-', '_')}.pth").write_text(pth)
        for p in [staging, *staging.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        staging.rename(done)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (done / "site-packages").is_dir():
            raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return digest, done, False


def venv_binds(workspace: Path, layer: Path, inside: str) -> list[Bind]:
    """The per-sandbox skeleton of ``<workspace>/.venv`` (written into the workspace) and the
    bind of the shared site-packages into it (``inside``: the workspace's path in the sandbox)."""
    venv = workspace / ".venv"
    if venv.exists() or venv.is_symlink():
        shutil.rmtree(venv) if venv.is_dir() and not venv.is_symlink() else venv.unlink()
    (venv / "bin").mkdir(parents=True)
    sp = venv / "lib" / f"python{PYVER}" / "site-packages"
    sp.mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text(f"home = /usr/local/bin\ninclude-system-site-packages = true\n"
                                     f"version = {sys.version.split()[0]}\nexecutable = /usr/local/bin/python{PYVER}\n"
                                     f"command = /usr/local/bin/python3 -m venv .venv\n")
    for n in ("python", "python3", f"python{PYVER}"):
        (venv / "bin" / n).symlink_to(f"/usr/local/bin/python{PYVER}")
    (venv / "bin" / "activate").write_text(_ACTIVATE)
    (venv / ".gitignore").write_text("*\n")
    (venv / "lib64").symlink_to("lib")
    return [Bind(layer / "site-packages", f"{inside}/{sp.relative_to(workspace).as_posix()}", shared=True)]


_ACTIVATE = """# This file must be used with "source bin/activate" *from bash*
deactivate () {
    if [ -n "${_OLD_VIRTUAL_PATH:-}" ] ; then PATH="${_OLD_VIRTUAL_PATH:-}"; export PATH; unset _OLD_VIRTUAL_PATH; fi
    if [ -n "${_OLD_VIRTUAL_PS1:-}" ] ; then PS1="${_OLD_VIRTUAL_PS1:-}"; export PS1; unset _OLD_VIRTUAL_PS1; fi
    unset VIRTUAL_ENV VIRTUAL_ENV_PROMPT
    hash -r 2> /dev/null
    if [ ! "${1:-}" = "nondestructive" ] ; then unset -f deactivate; fi
}
deactivate nondestructive
VIRTUAL_ENV="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export VIRTUAL_ENV
_OLD_VIRTUAL_PATH="$PATH"
PATH="$VIRTUAL_ENV/bin:$PATH"
export PATH
VIRTUAL_ENV_PROMPT="(.venv) "
export VIRTUAL_ENV_PROMPT
_OLD_VIRTUAL_PS1="${PS1:-}"
PS1="(.venv) ${PS1:-}"
export PS1
hash -r 2> /dev/null
"""


# ------------------------------------------------------------------------------------ test runs

def pytest_args(ini: str, paths: list[str]) -> list[str]:
    """The arguments of every run of a repository's tests, here and at grading: the recorded
    settings, the recorded tree as the root, no cache, no conftest or ini file above it."""
    return ["-c", ini, "--rootdir", CHECKS_DIR, "--confcutdir", CHECKS_DIR, "-p", "no:cacheprovider",
            "-o", "addopts=", "-q", "-rN", "--color=no", *[f"{CHECKS_DIR}/{p}" for p in paths]]


def suite_command(layout: Layout) -> str:
    return " ".join([".venv/bin/python", "-m", "pytest", *pytest_args(f"{CHECKS_DIR}/pytest.ini", layout.test_paths[:3]),
                     "..." if len(layout.test_paths) > 3 else ""]).strip()


def run_tests(project: Path, tests_tree: Path, layer: Path, persona: Persona, paths: list[str], timeout: float,
              hash_seed: int = 0, random_seed: int = 0, shifted_time: str | None = None,
              changes: dict[str, str] | None = None) -> tuple[dict, dict]:
    """Run ``paths`` of the recorded test tree against a copy of ``project`` in one sandbox, with
    ``changes`` (path: new text) written into the copy.
    (outcomes by node id, details: seconds, exit code, timed_out, output tail)."""
    with tempfile.TemporaryDirectory(prefix="cdag-rt-") as tmp:
        ws = Path(tmp) / project.name
        # the project's files hard-linked, read-only to the run (it may replace them, never write
        # into them): a copy of networkx's 600 files cost as much as its tests' run
        share_tree(project, ws, persona.uid, persona.gid, skip=frozenset((".git", "__pycache__", ".venv")))
        for rel, text in (changes or {}).items():
            (ws / rel).unlink(missing_ok=True)  # never through the link into the project
            (ws / rel).write_text(text)
            os.lchown(ws / rel, persona.uid, persona.gid)
        keys: dict[str, str] = {}
        bytecode.warm(project, keys=keys)
        bytecode.lay(ws, keys={k: v for k, v in keys.items() if k not in (changes or {})})
        report = Path(tmp) / "report"
        report.mkdir()
        shutil.copy2(PLUGIN, report / "cdag_pytest_report.py")
        binds = venv_binds(ws, layer, f"{persona.home}/{ws.name}") + [Bind(tests_tree, CHECKS_DIR), Bind(report, REPORT_DIR, writable=True)]
        with _sandbox(ws, persona, binds, timeout, chown=False) as sb:
            shutil.chown(report, sb.persona.uid, sb.persona.gid)
            argv = [f"{sb.root}/.venv/bin/python", "-B", "-m", "pytest", "-p", "cdag_pytest_report",
                    *pytest_args(f"{CHECKS_DIR}/pytest.ini", paths)]
            if shifted_time:
                argv = ["faketime", shifted_time, *argv]
            env = {"PYTHONHASHSEED": str(hash_seed), "CDAG_RANDOM_SEED": str(random_seed),
                   "CDAG_PYTEST_REPORT": f"{REPORT_DIR}/results.json", "PYTHONPATH": REPORT_DIR,
                   "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}
            r = sb.run(argv, timeout=timeout, cwd=sb.root, env=env)
        try:
            results = json.loads((report / "results.json").read_text())
            messages = json.loads((report / "results.json.messages").read_text())
        except (OSError, ValueError):
            results, messages = {}, {}
    return results, {"seconds": round(r.seconds, 2), "exit_code": r.exit_code, "timed_out": r.timed_out,
                     "output_tail": (r.stdout + r.stderr)[-2000:], "messages": messages}


def stub_functions(source: str) -> str | None:
    """Every function and method body replaced by ``raise NotImplementedError`` (docstrings
    kept); None when the module does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = node.body[:1] if node.body and isinstance(node.body[0], ast.Expr) and isinstance(
                getattr(node.body[0], "value", None), ast.Constant) and isinstance(node.body[0].value.value, str) else []
            node.body = doc + [ast.Raise(exc=ast.Name(id="NotImplementedError", ctx=ast.Load()), cause=None)]
    return ast.unparse(ast.fix_missing_locations(tree))


def package_files(root: Path, layout: Layout) -> list[str]:
    """The code under test: the package's modules, tests excluded."""
    base = root / layout.src_dir
    out = []
    for name in layout.packages:
        p = base / name
        files = [p.with_suffix(".py")] if p.with_suffix(".py").is_file() and not p.is_dir() else sorted(p.rglob("*.py"))
        out += [f.relative_to(root).as_posix() for f in files
                if not _SKIP_DIRS & set(f.relative_to(root).parts) and not any(
                    _is_test_name(part) for part in f.relative_to(base).parts)]
    return out


# ------------------------------------------------------------------------------------ bootstrap

def _classify(runs: list[dict]) -> tuple[list[str], dict[str, str]]:
    ids = sorted(set().union(*[set(r) for r in runs]))
    kept, out = [], {}
    for t in ids:
        seen = [r.get(t) for r in runs]
        if all(s == "passed" for s in seen):
            kept.append(t)
        elif "passed" in seen:
            out[t] = "nondeterministic"
        elif any(s == "collect_error" for s in seen):
            out[t] = "collection_error"
        elif all(s in ("skipped", "xfailed") for s in seen):
            out[t] = "skipped"
        else:
            out[t] = "fails_at_base"
    return kept, out


def _git_snapshot(src: Path, dest: Path, persona: Persona, origin: dict) -> None:
    """``repo/``: the source's own history when it has one, else one commit of its files."""
    if (src / ".git").exists():
        shutil.copytree(src, dest, symlinks=True)
        return
    shutil.copytree(src, dest, symlinks=True, ignore=shutil.ignore_patterns(*_SKIP_DIRS - {"docs", "doc", "examples"}))
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


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if ".git" in rel.parts or not p.is_file() or p.is_symlink():
            continue
        h.update(rel.as_posix().encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def reliable_tests(project: Path, tests: Path, layer: Path, persona: Persona, layout: Layout, cfg: BootstrapConfig,
                   work: Path, log) -> tuple[list[str], dict[str, str], float]:
    """(kept, left out by reason, the suite's longest run): three runs (the third with the clock
    shifted, another hash seed and random seed), then the hack probe on what passed every time."""
    paths = layout.test_paths[:cfg.max_test_files]
    runs, suite_seconds = [], 0.0

    def suite(shifted):
        return run_tests(project, tests, layer, persona, paths, cfg.test_timeout,
                         hash_seed=cfg.hash_seeds[bool(shifted)], random_seed=cfg.random_seeds[bool(shifted)],
                         shifted_time=shifted)

    # two runs at a time (each one process on one core): the first two, then the third beside the
    # hack probe, which is given five times the first two's time
    pool = ThreadPoolExecutor(2)
    try:
        futures = [pool.submit(suite, shifted) for shifted in (None, None)]
        stubbed_run = None
        for i, shifted in enumerate((None, None, cfg.shifted_time)):
            if i == 2:
                futures.append(pool.submit(suite, shifted))
            res, det = futures[i].result()
            log(f"run {i + 1}/3{' (clock shifted)' if shifted else ''}: {sum(v == 'passed' for v in res.values())} "
                f"of {len(res)} passed in {det['seconds']} s")
            if det["timed_out"]:
                raise BootstrapError("timeout", f"the suite ran over {cfg.test_timeout:.0f} s")
            if not res:
                text = det["output_tail"]
                if re.search(_NETWORK, text):
                    raise BootstrapError("needs_network", f"the suite needs the network: {text[-300:]}")
                if det["exit_code"] in (1, 2, 3, 4) and re.search(r"Error|error:", text):
                    # pytest stopped before any test: a conftest or a setting this pytest refuses
                    raise BootstrapError("suite_does_not_start", f"pytest stopped before any test: {text[-400:]}")
                raise BootstrapError("no_tests_found", f"pytest reported no test: {text[-300:]}")
            runs.append(res)
            suite_seconds = max(suite_seconds, det["seconds"])
            if i == 0:
                first_messages = det["messages"]
            if i == 1:
                stubbed_run = pool.submit(_vacuous_run, project, tests, layer, persona, layout, paths, work,
                                          min(cfg.test_timeout, max(30.0, 5 * suite_seconds)))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    kept, left = _classify(runs)
    if not kept and any(re.search(_NETWORK, m) for m in first_messages.values()):
        raise BootstrapError("needs_network", "the tests that fail at the base revision fail on the network: "
                                              + next(m for m in first_messages.values() if re.search(_NETWORK, m))[-300:])
    if not kept and left and set(left.values()) == {"collection_error"}:
        why = next(iter(first_messages.values()), "")
        raise BootstrapError("suite_does_not_start", f"no test module imports in the sandbox: {why[-400:]}")
    if not kept:
        raise BootstrapError("tests_fail_at_base", f"no test passes reliably at the base revision "
                                                   f"({len(left)} left out: {_counts(left.values())})")
    res = stubbed_run.result()
    for t in kept:
        if res.get(t) == "passed":
            left[t] = "vacuous"
    kept = [t for t in kept if left.get(t) != "vacuous"]
    if not kept:
        raise BootstrapError("tests_fail_at_base", "every passing test still passes with the code replaced by "
                                                   "NotImplementedError (vacuous)")
    return kept, left, suite_seconds


def _vacuous_run(project: Path, tests: Path, layer: Path, persona: Persona, layout: Layout, paths: list[str],
                 work: Path, timeout: float) -> dict:
    """The hack probe's outcomes: the suite against the code under test replaced by
    ``NotImplementedError``. Stubs can make a suite loop (a retry loop around a call that now
    raises): ``timeout`` is five times the suite's time; tests that had not passed by then are
    not vacuous."""
    stubbed = work / "stubbed" / project.name
    shutil.copytree(project, stubbed, symlinks=True, ignore=shutil.ignore_patterns(".git"))
    try:
        for rel in package_files(stubbed, layout):
            s = stub_functions((stubbed / rel).read_text(errors="replace"))
            if s is not None:
                (stubbed / rel).write_text(s)
        return run_tests(stubbed, tests, layer, persona, paths, timeout)[0]
    finally:
        shutil.rmtree(work / "stubbed", ignore_errors=True)


def bootstrap(src: str, out: Path, cfg: BootstrapConfig = BootstrapConfig(), log=lambda m: None) -> dict:
    """Make the environment at ``out`` (see the module's docstring); the summary, also written
    as ``out/env.json``. On failure nothing is left at ``out`` and the summary says why."""
    t0 = time.monotonic()
    out = Path(out)
    summary = {"ok": False, "reason": None, "test_command": None, "tests_passing": 0, "tests_total": 0,
               "seconds": 0.0, "env_digest": None, "source": src}
    parent = _mkdir(out.resolve().parent)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    try:
        root, origin = fetch_source(src, work / "fetch")
        layout = detect_layout(root)
        summary.update(name=layout.name, version=layout.version, licence=layout.licence, origin=origin)
        if layout.licence.lower() in {l.lower() for l in cfg.exclude_licences}:
            raise BootstrapError("licence_excluded", f"licence {layout.licence} is excluded by the policy")
        if cfg.test_files:
            import fnmatch

            layout.test_paths = [t for t in layout.test_paths if any(fnmatch.fnmatch(t, g) for g in cfg.test_files)]
            keep_dirs = {str(Path(t).parent) for t in layout.test_paths}
            layout.support = [f for f in layout.support if str(Path(f).parent) in keep_dirs or Path(f).name == "conftest.py"
                              and any(d.startswith(str(Path(f).parent)) for d in keep_dirs)]
        if not layout.test_paths:
            raise BootstrapError("no_tests_found", "no test files (test_*.py, *_test.py) in tests/, test/, the "
                                                   "package or the root")
        persona = persona_for(_norm(layout.name))
        store = _mkdir(store_root(cfg))
        log(f"{layout.name} {layout.version}: {len(layout.packages)} package(s), {len(layout.test_paths)} test files")
        key = f"{_norm(layout.name)}-{layout.version}-{(origin.get('sha256') or tree_digest(root))[:16]}"
        if origin["kind"] == "installed":  # installed from its wheel already: nothing to build or fetch
            wheel, wheel_hit, deps = None, None, []
        else:
            wheel, wheel_hit = build_wheel(root, layout, store, persona, cfg, key)
            log(f"wheel {wheel.name} ({'store hit' if wheel_hit else 'built'})")
            deps = fetch_wheels(_all_requires(layout, wheel), store / "fetched", cfg.install_timeout)
        layer_digest, layer, layer_hit = make_layer(deps, layout, store, persona, cfg)
        log(f"layer {layer_digest}: {len(deps)} wheel(s) ({'hit' if layer_hit else 'installed'})")

        env = work / "env"
        _git_snapshot(root, env / "repo", persona, origin)
        tests = env / "tests"
        record_tests(root, layout, tests)
        project = env / "repo"
        pytest_pin = next((r for r in layout.requires if _req_name(r) == "pytest" and own_tooling(r)), None)
        while True:
            try:
                kept, left, suite_seconds = reliable_tests(project, tests, layer, persona, layout, cfg, work, log)
                break
            except BootstrapError as e:
                older = _older_pytest(e, pytest_pin)
                if older is None:
                    raise
                log(f"the suite does not start under pytest {_provided_version('pytest')} "
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
                  "left_out_counts": _counts(left.values()), "layer": layer_digest,
                  "store": {"wheel": wheel.name if wheel else None, "wheel_hit": wheel_hit, "layer_hit": layer_hit,
                            "dependencies": [w.name for w in deps]},
                  "persona_seed": _norm(layout.name), "suite_seconds": suite_seconds,
                  "pytest": _layer_pytest(deps) or _provided_version("pytest")}
        shutil.copytree(layer, env / "layer", symlinks=True)
        (env / "env.json").write_text(json.dumps(record, indent=2, sort_keys=True))
        (env / "report.md").write_text(_report(record))
        if out.exists():
            shutil.rmtree(out)
        env.rename(out)
        return summary
    except BootstrapError as e:
        summary.update(reason=e.reason, error=str(e)[:1000])
    except subprocess.TimeoutExpired as e:
        summary.update(reason="timeout", error=str(e)[:300])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary["seconds"] = round(time.monotonic() - t0, 2)
    return summary


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
    have = int((_provided_version("pytest") or "0").split(".")[0])
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
        if _norm(parts[0]) == "pytest" and len(parts) > 1:
            return parts[1]
    return None


def _wheel_requires(wheel: Path) -> list[str]:
    """Requires-Dist of a built wheel (read from its METADATA, nothing run), extras left out."""
    with zipfile.ZipFile(wheel) as z:
        meta = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA")), None)
        if meta is None:
            return []
        msg = email.parser.Parser().parsestr(z.read(meta).decode(errors="replace"))
    return [r for r in msg.get_all("Requires-Dist") or [] if "extra ==" not in r and _usable_req(r)]


def _counts(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items()))


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
