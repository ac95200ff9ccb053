"""The sandbox's root file system: what a process inside sees as the machine.

Two parts, each built once (cached under ``$XDG_CACHE_HOME/cdag-rt/``, atomically, under a lock)
and bound read-only by every sandbox:

``runtime()``, shared by every persona:

    usr-local/     bound at /usr/local, laid out like the official python images
                   (/usr/local/bin/python3, pip and pytest scripts); the host's Python lib/ and
                   binary are bound over it
    site-packages/ a curated copy of ``TOOLING`` (pytest, pip) and their requirements, shown as
                   ``/usr/local/lib/python3.X/site-packages``
    etc/           a laptop's /etc: the packed /etc of a Debian desktop root
                   (``laptop_etc.tar.xz``, made by ``laptop_profile --etc-out``), with the host's
                   files that must match the host's binaries (``HOST_ETC``: the loader's cache,
                   alternatives, certificates, Python's) laid over it

``persona_runtime(persona)``, one per persona (small: its /etc is hard links into the shared one):

    root/          the skeleton bound at ``/``: mount points, /bin-style links like the host's,
                   and /etc with the persona's passwd, group, shadow, hostname, hosts, time zone,
                   locale, machine-id and resolv.conf
    skel/          the persona's home (dotfiles, XDG directories, ~/.config, ~/.cache), copied
                   per sandbox; ``shell_history`` adds a history that fits the project

``persona_for(seed)`` draws a persona (user, host name, time zone, locale, editor) from the task's
seed, so nothing constant marks the training environment. The venv that runs this code is never
bound: only ``TOOLING`` and its dependencies are copied.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from composer_dag.laptop.session import INIT_SOURCE
from composer_dag.sandbox import volumes
from composer_dag.sandbox.dressing import INIT_DIR
from composer_dag.sandbox.netns import wifi_for

PYVER = f"{sys.version_info.major}.{sys.version_info.minor}"
DISK_USAGE_SOURCE = Path(__file__).parent.parent / "sandbox" / "disk_usage.c"  # the disk cap's walk, built with the runtime
KEEP_PRIVS_SOURCE = Path(__file__).with_name("keep_privs.c")  # bubblewrap's preload: no no_new_privs
TOOLING = ("pytest", "pip")  # distributions visible inside, with their requirements
LAPTOP_ETC = Path(__file__).with_name("laptop_etc.tar.xz")
# the Debian installer's groups for the first user (user-setup's passwd/user-default-groups)
USER_GROUPS = ("cdrom", "floppy", "sudo", "audio", "dip", "video", "plugdev", "users", "netdev", "bluetooth",
               "lpadmin", "scanner")
# locales a persona may have; ``make system-deps`` generates them on the host (``locale -a``). English
# ones, as most developers' machines are wherever they live: another language would translate the
# tools' messages, which the tasks and their graders read in English
LOCALES = ("en_US", "en_GB", "en_IN", "en_CA", "en_AU", "en_IE", "en_NZ", "en_ZA")

@dataclass(frozen=True)
class Persona:
    user: str = "sam"
    full_name: str = "Sam Carter"
    email: str = "sam.carter@fastmail.com"
    hostname: str = "sam-thinkpad"
    uid: int = 1000
    gid: int = 1000
    timezone: str = "Europe/Berlin"
    locale: str = "en_US.UTF-8"
    editor: str = "vim"
    session: int = 2  # the login session's number (XDG_SESSION_ID)

    @property
    def home(self) -> str:
        return f"/home/{self.user}"


# (locale, time zones, weight): where developers' laptops are, roughly
_REGIONS = (("en_US", ("America/New_York", "America/Chicago", "America/Denver", "America/Los_Angeles"), 30),
            ("en_GB", ("Europe/London",), 8), ("en_US", ("Europe/Berlin", "Europe/Paris", "Europe/Amsterdam"), 10),
            ("en_GB", ("Europe/Madrid", "Europe/Warsaw", "Europe/Stockholm", "Europe/Prague"), 8),
            ("en_US", ("America/Sao_Paulo", "America/Mexico_City"), 6), ("en_IN", ("Asia/Kolkata",), 12),
            ("en_CA", ("America/Toronto", "America/Vancouver"), 5), ("en_AU", ("Australia/Sydney", "Australia/Melbourne"), 4),
            ("en_IE", ("Europe/Dublin",), 2), ("en_NZ", ("Pacific/Auckland",), 1), ("en_ZA", ("Africa/Johannesburg",), 2),
            ("en_US", ("Asia/Singapore", "Asia/Tokyo", "Asia/Shanghai"), 5), ("en_US", ("UTC",), 2))
_FIRST = ("alex", "sam", "maria", "david", "anna", "james", "priya", "wei", "lucas", "sofia", "daniel", "emma",
          "omar", "julia", "chris", "nina", "arjun", "laura", "tom", "elena", "ben", "sara", "marco", "kate",
          "jonas", "olga", "ryan", "mei", "pedro", "lena", "felix", "ivan", "noah", "clara", "leo", "hannah")
_LAST = ("carter", "muller", "garcia", "smith", "nguyen", "kowalski", "patel", "rossi", "silva", "jensen",
         "brown", "dubois", "tanaka", "novak", "schmidt", "lopez", "walker", "kumar", "chen", "berg", "fischer",
         "costa", "martin", "weber", "singh", "young", "moreau", "lindqvist", "evans", "ferreira")
_MODELS = ("thinkpad", "xps", "framework", "latitude", "zenbook", "elitebook", "laptop", "x1", "t14", "p14s",
           "yoga", "matebook", "dev", "workstation", "nb")
_MAIL = ("gmail.com", "fastmail.com", "proton.me", "outlook.com", "posteo.de", "hey.com", "icloud.com")


def persona_for(seed) -> Persona:
    """A persona drawn from ``seed`` (a task's id): user name, full name, host name, time zone,
    locale and editor vary; the uid is a first user's (1000), as on a laptop."""
    rng = random.Random(f"persona:{seed}")
    first, last = rng.choice(_FIRST), rng.choice(_LAST)
    user = rng.choice((first, first, first + last[0], first[0] + last, first + last))
    model = rng.choice(_MODELS)
    host = rng.choice((f"{user}-{model}", f"{first}-{model}", model, f"{first}s-{model}", f"{user}-laptop"))
    loc, zones, _ = rng.choices(_REGIONS, weights=[w for *_, w in _REGIONS])[0]
    return Persona(user=user, full_name=f"{first.title()} {last.title()}",
                   email=rng.choice((f"{first}.{last}", f"{first}{last[0]}", f"{first[0]}{last}")) + "@" + rng.choice(_MAIL),
                   hostname=host, timezone=rng.choice(zones), locale=f"{loc}.UTF-8",
                   editor=rng.choices(("vim", "nano"), weights=(3, 2))[0], session=rng.randint(1, 9))


def task_persona(task: dict) -> Persona:
    """A task's persona: its project's owner, so the tasks cut from one repository share one
    laptop, as a developer's several tasks in one checkout would. The same in the repository's
    commits, the task's episodes and its grading."""
    return persona_for(task.get("project") or task.get("id") or "task")


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cdag-rt"


def _dist_closure(names) -> list:
    import importlib.metadata as md
    from packaging.requirements import Requirement

    seen, todo, out = set(), list(names), []
    while todo:
        dist = md.distribution(todo.pop())
        key = dist.metadata["Name"].lower()
        if key in seen:
            continue
        seen.add(key)
        out.append(dist)
        for r in dist.requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return sorted(out, key=lambda d: d.metadata["Name"].lower())


_SCRIPT = "#!/usr/local/bin/python{v}\n# -*- coding: utf-8 -*-\nimport re\nimport sys\nfrom {mod} import {fn}\nif __name__ == '__main__':\n    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n    sys.exit({fn}())\n"

# host /etc entries laid over the laptop's: they must match the host's binaries and libraries
HOST_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "python3", f"python{PYVER}", "ssl",
            "ca-certificates.conf", "ca-certificates")


TOUCH_EVERY_S = 3600  # a cached tree's ``.ok`` is touched on use at most this often
"""Its mtime is when the tree was last used (to the hour): what eviction reads."""


def _max_age_s() -> float:
    """How long an unused cached tree is kept (``CDAG_RT_MAX_AGE_DAYS``, default 3 days). Every
    persona and grading uid has its own small tree, so the cache would otherwise grow with every
    new project and every code version for as long as the machine runs."""
    return float(os.environ.get("CDAG_RT_MAX_AGE_DAYS", "3")) * 86400


def _touch(root: Path) -> bool:
    """Mark ``root`` as used now (at most once per ``TOUCH_EVERY_S``); False when it is not built."""
    try:
        if time.time() - (root / ".ok").stat().st_mtime > TOUCH_EVERY_S:
            os.utime(root / ".ok")
        return True
    except FileNotFoundError:
        return False


def _evict(cache: Path, keep: Path) -> list[str]:
    """Remove the cached trees unused for longer than ``_max_age_s()`` and builds left half-made
    by a killed process (an hour old), under the cache's lock. A tree in use is touched on every
    use, so only trees no process has asked for in days go. Returns the names removed."""
    now, max_age, gone = time.time(), _max_age_s(), []
    for entry in cache.iterdir():
        if entry == keep or not entry.is_dir():
            continue
        try:
            if entry.name.startswith(".build-"):
                old = now - entry.stat().st_mtime > TOUCH_EVERY_S
            else:
                old = now - (entry / ".ok").stat().st_mtime > max_age
        except FileNotFoundError:
            continue
        if old:
            for img in entry.glob("*.ext4"):  # a mounted image goes with its tree
                volumes.unmount_image(img)
            shutil.rmtree(entry, ignore_errors=True)
            gone.append(entry.name)
    return gone


def _build(name: str, key_parts, make) -> Path:
    """``cdag-rt/<name>-<key>``, made once by ``make(tmpdir)`` (atomically, under a lock); each
    new build evicts what no one has used for ``_max_age_s()``."""
    key = hashlib.sha256(json.dumps(key_parts).encode()).hexdigest()[:12]
    root = cache_root() / f"{name}-{key}"
    if _touch(root):
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _touch(root):
            return root
        _evict(root.parent, keep=root)
        tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=".build-"))
        make(tmp)
        (tmp / ".ok").touch()
        if root.exists():
            shutil.rmtree(root)
        os.rename(tmp, root)
    return root


_RUNTIMES: dict[Path, Path] = {}
"""``runtime()``'s answer per cache root for this process: its key reads every tooling
distribution's metadata (about 20 ms), which every sandbox would pay twice otherwise."""


def runtime() -> Path:
    """The persona-independent part: usr-local, site-packages and the laptop's /etc."""
    known = _RUNTIMES.get(cache_root())
    if known is not None and _touch(known):
        return known
    dists = _dist_closure(TOOLING)
    etc_digest = hashlib.sha256(LAPTOP_ETC.read_bytes()).hexdigest()[:16]
    init_digest = hashlib.sha256(INIT_SOURCE.read_bytes() + DISK_USAGE_SOURCE.read_bytes()
                                 + KEEP_PRIVS_SOURCE.read_bytes()).hexdigest()[:16]
    root = _build("shared", [sys.version, sys.base_prefix, [(d.metadata["Name"], d.version) for d in dists],
                             etc_digest, init_digest, 11], lambda tmp: _make_shared(tmp, dists))
    _RUNTIMES[cache_root()] = root
    return root


def _make_shared(tmp: Path, dists) -> None:
    sp = tmp / "site-packages"
    sp.mkdir()
    for dist in dists:
        for f in dist.files or []:
            src = Path(dist.locate_file(f))
            rel = os.path.normpath(str(f))
            if rel.startswith("..") or rel.endswith((".pth", ".pyc")) or not src.is_file():
                continue
            (sp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, sp / rel)
    import compileall
    compileall.compile_dir(sp, quiet=2, workers=1)
    with tarfile.open(LAPTOP_ETC) as tar:
        tar.extractall(tmp, filter="tar")
    etc = tmp / "etc"
    for name in HOST_ETC:
        src, dst = Path("/etc") / name, etc / name
        if not (src.exists() or src.is_symlink()):
            continue
        if dst.is_dir() and not dst.is_symlink():
            shutil.rmtree(dst)
        elif dst.exists() or dst.is_symlink():
            dst.unlink()
        if src.is_dir() and not src.is_symlink():
            shutil.copytree(src, dst, symlinks=True, ignore_dangling_symlinks=True)
        else:
            shutil.copy2(src, dst, follow_symlinks=False)
    # /usr/local: the python install's layout; lib/ and the binary are bound over it
    loc = tmp / "usr-local"
    for d in ("bin", "etc", "games", "include", "lib", "sbin", "share", "src"):
        (loc / d).mkdir(parents=True)
    binp = loc / "bin"
    (binp / f"python{PYVER}").touch()  # mount point for the real binary
    for name, target in (("python3", f"python{PYVER}"), ("python", "python3")):
        (binp / name).symlink_to(target)
    scripts = {"pytest": ("pytest", "console_main"), "py.test": ("pytest", "console_main"),
               "pip": ("pip._internal.cli.main", "main"), "pip3": ("pip._internal.cli.main", "main"),
               f"pip{PYVER}": ("pip._internal.cli.main", "main"), "pydoc3": ("pydoc", "cli")}
    for name, (mod, fn) in scripts.items():
        (binp / name).write_text(_SCRIPT.format(v=PYVER, mod=mod, fn=fn))
        (binp / name).chmod(0o755)
    (tmp / "empty").touch()
    _make_init(tmp / "systemd-lib")
    (tmp / "tools").mkdir()
    _compile(DISK_USAGE_SOURCE, tmp / "tools" / "disk_usage")
    _compile(KEEP_PRIVS_SOURCE, tmp / "tools" / "keep_privs.so", shared=True)
    if volumes.available():
        _shared_image(tmp)


def _link_or_copy(src: Path, dst: Path) -> None:
    """``dst``: ``src`` as hard links where they share a file system, else copied."""
    if subprocess.run(["cp", "-al", "--", str(src), str(dst)], capture_output=True).returncode != 0:
        shutil.rmtree(dst, ignore_errors=True)
        subprocess.run(["cp", "-a", "--", str(src), str(dst)], check=True)


def _shared_image(tmp: Path) -> None:
    """``image.ext4``: the shared trees laid out at the paths the sandbox binds them to
    (``/usr/local`` with the interpreter, its library and the curated site-packages,
    ``/usr/lib/systemd``, libpython where the loader looks), so that each bind's root inside
    the image is its mount point and names nothing of the host (``volumes``)."""
    stage = tmp / "image-tree"
    loc = stage / "usr" / "local"
    loc.parent.mkdir(parents=True)
    shutil.copytree(tmp / "usr-local", loc, symlinks=True)
    exe = loc / "bin" / f"python{PYVER}"
    exe.unlink()
    shutil.copy2(Path(sys.base_prefix) / "bin" / f"python{PYVER}", exe)
    lib = Path(sys.base_prefix) / "lib"
    std = loc / "lib" / f"python{PYVER}"
    std.mkdir()
    for e in sorted(lib.iterdir()):
        if e.name != f"python{PYVER}":
            _link_or_copy(e, loc / "lib" / e.name)
    for e in sorted((lib / f"python{PYVER}").iterdir()):
        if e.name != "site-packages":
            _link_or_copy(e, std / e.name)
    _link_or_copy(tmp / "site-packages", std / "site-packages")
    (stage / INIT_DIR.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(tmp / "systemd-lib", stage / INIT_DIR.lstrip("/"), symlinks=True)
    for src, inside in libpython_files():
        (stage / inside.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, stage / inside.lstrip("/"))
    volumes.tree_image(stage, tmp / "image.ext4")
    shutil.rmtree(stage)


def _compile(src: Path, out: Path, shared: bool = False) -> None:
    """``src`` built with the host's C compiler, static where it can be (no loader work per exec),
    or as a shared library to preload (``shared``)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError(f"building {src.name} needs a C compiler (cc or gcc): run `make system-deps`")
    for link in ([["-shared", "-fPIC"]] if shared else [["-static"], []]):
        r = subprocess.run([cc, "-O2", *link, "-o", str(out), str(src)], capture_output=True, text=True)
        if r.returncode == 0:
            return
    raise RuntimeError(f"building {src.name} failed:\n{r.stderr[-2000:]}")


def _make_init(dst: Path) -> None:
    """``/usr/lib/systemd`` as the sandbox shows it: the host's, with the laptop's process 1
    (``laptop_init.c``, built static here) as ``systemd``."""
    if Path(INIT_DIR).is_dir():
        shutil.copytree(INIT_DIR, dst, symlinks=True, ignore_dangling_symlinks=True)
    else:
        dst.mkdir()
    _compile(INIT_SOURCE, dst / "systemd")  # static: no loader work on each of its ~45 forks' parent exec


def persona_runtime(persona: Persona) -> Path:
    """The persona's root skeleton and home skeleton (its /etc hard links into ``runtime()``'s)."""
    shared = runtime()
    return _build("persona", [str(shared), repr(persona), 11], lambda tmp: _make_persona(tmp, shared, persona))


def identity_runtime(persona: Persona, uid: int) -> Path:
    """``persona_runtime(persona)`` with the user's uid and gid set to ``uid``: the same tree
    (hard links: about 35 ms, once per persona and uid) but ``/etc/passwd`` and ``/etc/group``.
    A grading run's identity (``sandbox.identity_lease``): the same laptop, another uid."""
    base = persona_runtime(persona)
    if uid == persona.uid:
        return base
    return _build("identity", [str(base), uid, 5], lambda tmp: _make_identity(tmp, base, persona, uid))


def _make_identity(tmp: Path, base: Path, p: Persona, uid: int) -> None:
    subprocess.run(["cp", "-al", "--", str(base / "root"), str(tmp / "root")], check=True)
    os.symlink(base / "skel", tmp / "skel")
    etc = tmp / "root" / "etc"
    for name, old, new in (("passwd", f"\n{p.user}:x:{p.uid}:{p.gid}:", f"\n{p.user}:x:{uid}:{uid}:"),
                           ("group", f"\n{p.user}:x:{p.gid}:", f"\n{p.user}:x:{uid}:")):
        text = (etc / name).read_text()
        if old not in text:
            raise RuntimeError(f"{base}/root/etc/{name} has no line for {p.user} at {p.uid}")
        _replace(etc / name, text.replace(old, new))


def image_at(tree: Path, inside: str) -> Path:
    """An ext4 image (cached, once per tree and place) holding the immutable tree ``tree`` at
    the path ``inside``, for the sandbox to bind ``<mount>/<inside>`` at ``inside``: its root in
    the image is its mount point, not a host path (``volumes``)."""
    real = Path(os.path.realpath(tree))

    def make(tmp: Path) -> None:
        stage = tmp / "tree"
        (stage / inside.strip("/")).parent.mkdir(parents=True)
        _link_or_copy(real, stage / inside.strip("/"))
        volumes.tree_image(stage, tmp / "image.ext4")
        shutil.rmtree(stage)
    return _build("image", [str(real), inside, real.stat().st_mtime_ns, 3], make) / "image.ext4"


def _root_image(tmp: Path, p: Persona) -> None:
    """``root.ext4``: ``root/`` as a file system of its own, which the sandbox mounts at ``/``,
    the size of the persona's laptop's disk (a sparse file: about 13 MB of it is written)."""
    if volumes.available():
        disk = random.Random(f"disk:{p!r}").choice((256, 512, 512, 1000, 1000, 2000)) * 10**9
        volumes.tree_image(tmp / "root", tmp / "root.ext4", size=disk)


def stdlib_test_support() -> Path:
    """The interpreter's ``test`` package without its test modules (``test_*``): ``test.support``
    and the data files, hard links, made once. Grading binds it where the episode showed an empty
    directory, so that the hidden tests can import ``test.support`` while no original copy of a
    hidden test is there to compare a canary with."""
    import sysconfig

    std = Path(sysconfig.get_paths()["stdlib"]) / "test"

    def make(tmp: Path) -> None:
        subprocess.run(["cp", "-al", "--", str(std), str(tmp / "test")], check=True)
        for p in sorted((tmp / "test").rglob("test_*"), reverse=True):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif p.exists() or p.is_symlink():
                p.unlink()

    return _build("stdlib-tests", [str(std), PYVER, 1], make) / "test"


def _link_tree(src: Path, dst: Path) -> None:
    """``dst`` as ``src``'s tree: directories made, symlinks copied, files hard-linked."""
    for d, dirs, files in os.walk(src):
        rel = Path(d).relative_to(src)
        (dst / rel).mkdir(exist_ok=True)
        shutil.copystat(d, dst / rel)
        os.chown(dst / rel, os.stat(d).st_uid, os.stat(d).st_gid)
        for n in dirs + files:
            s, t = Path(d) / n, dst / rel / n
            if s.is_symlink():
                os.symlink(os.readlink(s), t)
                if n in dirs:
                    dirs.remove(n)
            elif n in files:
                os.link(s, t)


def _replace(path: Path, text: str, mode: int = 0o644, gid: int = 0) -> None:
    if path.exists() or path.is_symlink():
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.chmod(path, mode)
    os.chown(path, 0, gid)


def _make_skel(skel: Path, shared: Path, p: Persona, rng: random.Random) -> None:
    """The home directory's skeleton: the laptop's /etc/skel, the persona's editor and git identity,
    the XDG user directories and a desktop session's caches."""
    shutil.copytree(shared / "etc" / "skel", skel, symlinks=True)
    ed = "/usr/bin/vim.basic" if p.editor == "vim" else "/bin/nano"
    (skel / ".selected_editor").write_text(f"# Generated by /usr/bin/select-editor\nSELECTED_EDITOR=\"{ed}\"\n")
    (skel / ".gitconfig").write_text(
        f"[user]\n\tname = {p.full_name}\n\temail = {p.email}\n[init]\n\tdefaultBranch = main\n"
        f"[core]\n\teditor = {p.editor}\n[pull]\n\trebase = {rng.choice(('false', 'true'))}\n")
    if p.editor == "vim":
        (skel / ".vimrc").write_text("syntax on\nset number\nset expandtab shiftwidth=4 tabstop=4\nset hlsearch\n")
    else:
        (skel / ".nanorc").write_text("set autoindent\nset tabsize 4\nset tabstospaces\nset linenumbers\n")
    dirs = ("Desktop", "Documents", "Downloads", "Music", "Pictures", "Public", "Templates", "Videos")
    for d in dirs + (".local/bin", ".local/share/applications", ".local/state", ".config/dconf", ".config/pulse",
                     ".config/systemd/user", ".config/htop", ".cache/pip/http-v2", ".cache/fontconfig",
                     ".cache/mesa_shader_cache", ".ssh"):
        (skel / d).mkdir(parents=True, exist_ok=True)
    (skel / ".ssh").chmod(0o700)
    (skel / ".config" / "user-dirs.dirs").write_text(
        "# This file is written by xdg-user-dirs-update\n" + "".join(
            f'XDG_{k}_DIR="$HOME/{v}"\n' for k, v in (("DESKTOP", "Desktop"), ("DOWNLOAD", "Downloads"),
                                                     ("TEMPLATES", "Templates"), ("PUBLICSHARE", "Public"),
                                                     ("DOCUMENTS", "Documents"), ("MUSIC", "Music"),
                                                     ("PICTURES", "Pictures"), ("VIDEOS", "Videos"))))
    (skel / ".config" / "user-dirs.locale").write_text(p.locale.split(".")[0] + "\n")
    (skel / ".config" / "dconf" / "user").write_bytes(bytes(rng.randrange(256) for _ in range(1024)))


def _make_persona(tmp: Path, shared: Path, p: Persona) -> None:
    rng = random.Random(repr(p))
    fs = tmp / "root"
    for d in ("usr", "proc", "dev", "tmp", "home/" + p.user, "var/tmp", "var/lib", "var/log", "var/cache",
              "opt", "mnt", "media", "srv", "run", "boot/efi", "root", "sys"):
        (fs / d).mkdir(parents=True, exist_ok=True)
    (fs / "root").chmod(0o700)
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = Path("/") / name
        if host.is_symlink():
            (fs / name).symlink_to(os.readlink(host))
        elif host.is_dir():
            (fs / name).mkdir()
    etc = fs / "etc"
    _link_tree(shared / "etc", etc)
    passwd = (etc / "passwd").read_text().rstrip("\n").split("\n")
    passwd.append(f"{p.user}:x:{p.uid}:{p.gid}:{p.full_name},,,:{p.home}:/bin/bash")
    _replace(etc / "passwd", "\n".join(passwd) + "\n")
    group = []
    for line in (etc / "group").read_text().splitlines():
        name, pw, gid, members = (line.split(":") + ["", "", ""])[:4]
        if name in USER_GROUPS:
            members = ",".join(filter(None, [members, p.user]))
        group.append(f"{name}:{pw}:{gid}:{members}")
    group.append(f"{p.user}:x:{p.gid}:")
    _replace(etc / "group", "\n".join(group) + "\n")
    gids = {x.split(":")[0]: int(x.split(":")[2]) for x in group}
    day = 19_724 + rng.randrange(300)  # days since the epoch: installed in 2024, after its /etc's files
    salt = "".join(rng.choice("./0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz") for _ in range(22))
    hashed = "".join(rng.choice("./0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz") for _ in range(43))
    shadow = [f"{x.split(':')[0]}:{'*' if x.split(':')[0] != 'root' else '!'}:{day}:0:99999:7:::" for x in passwd[:-1]]
    shadow.append(f"{p.user}:$y$j9T${salt}${hashed}:{day}:0:99999:7:::")
    _replace(etc / "shadow", "\n".join(shadow) + "\n", 0o640, gids.get("shadow", 42))
    _replace(etc / "gshadow", "".join(f"{x.split(':')[0]}:*::{x.split(':')[3]}\n" for x in group), 0o640,
             gids.get("shadow", 42))
    _replace(etc / "hostname", p.hostname + "\n")
    _replace(etc / "hosts", f"127.0.0.1\tlocalhost\n127.0.1.1\t{p.hostname}\n\n"
                            "# The following lines are desirable for IPv6 capable hosts\n"
                            "::1     localhost ip6-localhost ip6-loopback\nff02::1 ip6-allnodes\nff02::2 ip6-allrouters\n")
    router = wifi_for(p).router
    _replace(etc / "resolv.conf", f"# Generated by NetworkManager\nsearch {rng.choice(('lan', 'home', 'fritz.box', 'localdomain'))}\n"
                                  f"nameserver {router}\n")
    _replace(etc / "machine-id", hashlib.md5(f"{p}".encode()).hexdigest() + "\n", 0o444)
    _replace(etc / "timezone", p.timezone + "\n")
    if (etc / "localtime").exists() or (etc / "localtime").is_symlink():
        (etc / "localtime").unlink()
    (etc / "localtime").symlink_to(f"/usr/share/zoneinfo/{p.timezone}")
    _replace(etc / "default" / "locale", f"LANG={p.locale}\n")
    _replace(etc / "locale.gen", "".join(f"{'' if f'{c}.UTF-8' == p.locale else '# '}{c}.UTF-8 UTF-8\n" for c in LOCALES))
    _replace(etc / ".pwd.lock", "", 0o600)
    skel = tmp / "skel"
    _make_skel(skel, shared, p, rng)
    # dated like an install on ``day`` and the weeks of use after it, not like a fresh build
    installed = day * 86400 + rng.randrange(36_000, 72_000)
    for f in ("passwd", "group", "shadow", "gshadow", "hostname", "hosts", "machine-id", "timezone", "localtime",
              "default/locale", "locale.gen", ".pwd.lock"):
        os.utime(etc / f, (installed, installed), follow_symlinks=False)
    for d, dirs, files in os.walk(skel):
        for n in dirs + files:
            t = installed + 600 + rng.randrange(40 * 86400)
            os.utime(os.path.join(d, n), (t, t), follow_symlinks=False)
    os.utime(skel, (installed, installed))
    _root_image(tmp, p)


def shell_history(persona: Persona, project: str, files: list[str]) -> str:
    """A ``.bash_history`` that fits a developer working on ``project`` (``files``: some of its
    files), drawn from the persona: about 40 ordinary commands, none of them about the task."""
    rng = random.Random(f"history:{persona}:{project}")
    py = [f for f in files if f.endswith(".py")] or ["main.py"]
    editor = persona.editor
    work = [f"cd ~/{project}", "git status", "git log --oneline | head -20", "git diff", "git pull", "ls", "ls -la",
            f"{editor} {rng.choice(py)}", f"{editor} {rng.choice(py)}", f"less {rng.choice(files or py)}",
            "python3 -m pytest -q", "python3 -m pytest -x -q", f"python3 {rng.choice(py)}", "git stash", "git stash pop",
            "grep -rn TODO .", "git branch -a", "git checkout main", "git fetch origin", "python3",
            "pip list --user", "cd ..", "tree -L 2", "git add -p", "git log -p -1"]
    life = ["sudo apt update", "sudo apt upgrade", "htop", "df -h", "free -h", "ping -c 3 deb.debian.org",
            "ls ~/Downloads", "cd ~", "ip a", "uptime", "man git-rebase", f"{editor} ~/.bashrc", "source ~/.bashrc",
            "ssh-add -l", "nmcli device wifi list", "cal", "history | tail", "clear", "exit"]
    lines = [rng.choice(work if rng.random() < 0.65 else life) for _ in range(rng.randint(36, 60))]
    lines.insert(rng.randrange(len(lines) // 3), f"cd ~/{project}")
    return "\n".join(lines) + "\n"


def system_binds() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        p = Path("/") / name
        if p.is_dir() and not p.is_symlink():
            args += ["--ro-bind", str(p), f"/{name}"]
    return args


def libpython_files() -> list[tuple[Path, str]]:
    """The host python finds libpython through an absolute RUNPATH that is not bound; the
    loader's usual location gets the right library instead: (the library, where it goes)."""
    libdir = Path(sys.base_prefix) / "lib"
    out = []
    for lib in sorted(libdir.glob(f"libpython{PYVER}*.so.*")):
        for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib"):
            if (Path(d) / lib.name).exists():
                out.append((lib, f"{d}/{lib.name}"))
                break
    return out


def libpython_binds() -> list[str]:
    return [x for src, inside in libpython_files() for x in ("--ro-bind", str(src), inside)]


def image_roots() -> list[str]:
    """Where the shared image every sandbox reads its interpreter and tools from is mounted
    (mounted now if it is not yet): what the grader's page-cache pinning watches beside ``/usr``.
    Empty where the sandbox binds the cached trees instead."""
    img = runtime() / "image.ext4"
    return [str(volumes.image(img))] if volumes.available() and img.exists() else []
