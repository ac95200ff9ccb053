"""The wheel store, the dependency layers and the project's ``.venv``: what other packages bind
into a sandbox to run a repository's code (``venv_binds``).

Fetching (outside the sandbox) takes wheels only (``pip download --only-binary :all:``); the
project's own wheel is built inside the sandbox with no network, from the fetched build
requirements (``pip wheel --no-index``), and kept in the wheel store once per distribution
version; the dependencies are installed inside the sandbox too, into a layer shared by every
environment with the same resolved set.

Inside the sandbox the layer is the project's own virtual environment: ``<project>/.venv`` is a
small skeleton made per sandbox (``pyvenv.cfg``, ``bin/python``), and the layer's site-packages
is bound read-only into it, so the layer does not depend on the persona's user name."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from composer_dag.laptop.image import PYVER, Persona
from composer_dag.repos.config import NETWORK_ERRORS, BootstrapConfig, BootstrapError
from composer_dag.repos.layout import Layout, norm_name, req_name
from composer_dag.laptop.desktop import dressing
from composer_dag.sandbox import Bind, Limits, Sandbox

# what the sandbox's Python has already (rootfs.TOOLING and its requirements): not fetched again
PROVIDED = {"pytest", "pluggy", "iniconfig", "packaging", "pip", "exceptiongroup", "tomli", "colorama"}


def store_root(cfg: BootstrapConfig) -> Path:
    if cfg.store:
        return Path(cfg.store)
    return Path(os.environ.get("COMPOSER_HOME") or Path.home() / ".composer") / "wheel-store"


def provided_version(name: str) -> str | None:
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
    have = provided_version(r.name) if norm_name(r.name) in PROVIDED and r.specifier else None
    return have is not None and not r.specifier.contains(have, prereleases=True)


def fetch_wheels(reqs: list[str], dest: Path, timeout: float = 600) -> list[Path]:
    """Wheels only (nothing is built), with their requirements, into ``dest``: pip resolves
    from the wheels' metadata. Returns the wheels of this resolution. What the sandbox provides
    is left out, unless a requirement asks for another version of it (``own_tooling``): then the
    resolution's wheels of the provided distributions are kept too, for that version's needs."""
    own = any(own_tooling(r) for r in reqs)
    reqs = [r for r in reqs if req_name(r) not in PROVIDED or own_tooling(r)]
    if not reqs:
        return []
    dest.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--only-binary", ":all:", "--dest", str(dest),
                        "--progress-bar", "off", *reqs], capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or [""]
        raise BootstrapError("install_failed", f"no wheel for {', '.join(reqs)}: {tail[0][-300:]}")
    got = re.findall(r"^\s*(?:Saved|File was already downloaded) (\S+\.whl)\s*$", r.stdout, re.M)
    return sorted({Path(g) for g in got if own or norm_name(Path(g).name.split("-")[0]) not in PROVIDED})


def _digest_files(paths) -> str:
    h = hashlib.sha256()
    for p in sorted(paths, key=lambda p: Path(p).name):
        h.update(Path(p).name.encode() + b"\0" + hashlib.sha256(Path(p).read_bytes()).digest())
    return h.hexdigest()


def repo_sandbox(workspace: Path, persona: Persona, binds: list[Bind], timeout: float, chown: bool = True) -> Sandbox:
    """The sandbox a repository's code runs in (its wheel's build, the layer's install, its
    tests): ``timeout`` seconds, a minute more of CPU, 4 GiB of disk."""
    return Sandbox(workspace, Limits(timeout=timeout, cpu_seconds=int(timeout) + 60, max_disk_bytes=4 << 30),
                   project=workspace.name, binds=binds, dressing=dressing(persona), chown=chown)


def _pip(workspace: Path, persona: Persona, wheelhouse: Path, out: Path, args: list[str], cfg: BootstrapConfig):
    """``python3 -m pip ARGS`` in a sandbox with no network: ``wheelhouse`` read-only at
    /var/tmp/wheelhouse, ``out`` writable at /var/tmp/out, the workspace as the working directory."""
    with repo_sandbox(workspace, persona, [Bind(wheelhouse, "/var/tmp/wheelhouse"), Bind(out, "/var/tmp/out", writable=True)],
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
            reason = "needs_network" if re.search(NETWORK_ERRORS + r"|Could not find a version that satisfies", text) \
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
        (sp / f"__editable__.{norm_name(layout.name).replace('-', '_')}.pth").write_text(pth)
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
