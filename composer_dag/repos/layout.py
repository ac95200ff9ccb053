"""What a project is, read from its files without running any of it: its name and version, the
packages under test and its test files (``detect_layout``), its build and test requirements
(``pyproject.toml`` with PEP 735 groups, poetry, ``setup.cfg``, ``PKG-INFO``, tox, requirements
files), its pytest settings and its licence; the recorded test tree (``record_tests``) and the
code under test (``package_files``)."""

from __future__ import annotations

import configparser
import email.parser
import re
import shutil
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from composer_dag.repos.config import BootstrapError

SKIP_DIRS = {".git", ".hg", ".tox", ".nox", ".venv", "venv", "build", "dist", "__pycache__", ".pytest_cache",
             ".mypy_cache", "node_modules", ".eggs", "docs", "doc", "examples", "benchmarks", "bench"}


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


def norm_name(name: str) -> str:
    """A distribution's name as PEP 503 compares it: ``Foo_Bar.baz`` is ``foo-bar-baz``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def req_name(req: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    return norm_name(m.group(1)) if m else ""


def usable_req(req: str) -> bool:
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
            if usable_req(req):  # of several entries (one per Python), the first that applies here
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
    name = req_name(req)
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
                      and not _is_test_name(p.name) and p.name not in SKIP_DIRS)
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
    reqs = list(dict.fromkeys(r.strip() for r in reqs if usable_req(r)))
    return Layout(name=str(name), version=version, src_dir=src_dir, packages=packages, test_paths=tests,
                  support=support, build_requires=[r for r in build if usable_req(r)], requires=reqs,
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
                                if not SKIP_DIRS & set(p.relative_to(root).parts[:-1])))


def _support_files(root: Path, tests: list[str]) -> list[str]:
    """Every file of the directories holding the tests (helpers, data, conftest.py, __init__.py)
    below the project root, and the root's conftest.py."""
    out = set()
    for t in tests:
        parts = Path(t).parts
        if len(parts) > 1 and parts[0] in ("tests", "test", "testing"):
            for p in (root / parts[0]).rglob("*"):
                if p.is_file() and not SKIP_DIRS & set(p.relative_to(root).parts[:-1]):
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


def package_files(root: Path, layout: Layout) -> list[str]:
    """The code under test: the package's modules, tests excluded."""
    base = root / layout.src_dir
    out = []
    for name in layout.packages:
        p = base / name
        files = [p.with_suffix(".py")] if p.with_suffix(".py").is_file() and not p.is_dir() else sorted(p.rglob("*.py"))
        out += [f.relative_to(root).as_posix() for f in files
                if not SKIP_DIRS & set(f.relative_to(root).parts) and not any(
                    _is_test_name(part) for part in f.relative_to(base).parts)]
    return out
