"""The sandbox's root file system: what a process inside sees as the machine.

Built once per persona and Python (cached under ``$XDG_CACHE_HOME/cdag-rt/<key>``, atomically,
under a lock) and bound read-only by every sandbox:

    root/          the skeleton bound at ``/``: mount points, /bin-style links like the host's,
                   and an /etc with a handful of host files (ld.so.cache, alternatives, ...)
                   plus generated passwd/group/hostname/hosts/resolv.conf/machine-id
    usr-local/     bound at /usr/local, laid out like the official python images
                   (/usr/local/bin/python3, pip and pytest scripts); the host's Python lib/ and
                   binary are bound over it
    site-packages/ a curated copy of ``TOOLING`` (pytest, pip) and their requirements, shown as
                   ``/usr/local/lib/python3.X/site-packages``
    skel/          the persona's home (.bashrc, .profile, .gitconfig, ...), copied per sandbox

The venv that runs this code is never bound: only ``TOOLING`` and its dependencies are copied.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

PYVER = f"{sys.version_info.major}.{sys.version_info.minor}"
TOOLING = ("pytest", "pip")  # distributions visible inside, with their requirements


@dataclass(frozen=True)
class Persona:
    user: str = "sam"
    full_name: str = "Sam Carter"
    email: str = "sam.carter@fastmail.com"
    hostname: str = "sam-thinkpad"
    uid: int = 1000
    gid: int = 1000

    @property
    def home(self) -> str:
        return f"/home/{self.user}"


def _cache_root() -> Path:
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

_BASHRC = """# ~/.bashrc: executed by bash(1) for non-login shells.
case $- in
    *i*) ;;
      *) return;;
esac
HISTCONTROL=ignoreboth
shopt -s histappend
HISTSIZE=1000
HISTFILESIZE=2000
shopt -s checkwinsize
PS1='\\u@\\h:\\w\\$ '
if [ -x /usr/bin/dircolors ]; then
    eval "$(dircolors -b)"
    alias ls='ls --color=auto'
    alias grep='grep --color=auto'
fi
alias ll='ls -alF'
alias la='ls -A'
alias gs='git status'
export EDITOR=vim
"""

_PROFILE = """# ~/.profile: executed by the command interpreter for login shells.
if [ -n "$BASH_VERSION" ]; then
    if [ -f "$HOME/.bashrc" ]; then
        . "$HOME/.bashrc"
    fi
fi
if [ -d "$HOME/.local/bin" ] ; then
    PATH="$HOME/.local/bin:$PATH"
fi
"""

# host /etc entries copied into the sandbox's /etc (those that exist)
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime", "timezone",
        "nsswitch.conf", "bash.bashrc", "inputrc", "profile", "shells", "os-release",
        "debian_version", "issue", "protocols", "services", "mime.types", "magic", "magic.mime",
        "locale.alias", "login.defs", "skel", "terminfo", "vim", "python3", f"python{PYVER}",
        "ssl", "ca-certificates.conf", "gai.conf", "host.conf", "networks", "manpath.config")


def _runtime(persona: Persona) -> Path:
    """Build (once, atomically) the host-side files the sandbox binds: bin, site-packages, etc, skel."""
    dists = _dist_closure(TOOLING)
    key = hashlib.sha256(json.dumps([sys.version, sys.base_prefix, repr(persona),
                                     [(d.metadata["Name"], d.version) for d in dists], 5]).encode()).hexdigest()[:12]
    root = _cache_root() / key
    if (root / ".ok").exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / ".ok").exists():
            return root
        tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=".build-"))
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
        # the root file system: a prebuilt skeleton, bound read-only, with mount points
        fs = tmp / "root"
        for d in ("usr", "proc", "dev", "tmp", "home/" + persona.user, "etc", "var/tmp", "var/lib",
                  "var/log", "var/cache", "opt", "mnt", "media", "srv", "run", "boot", "root"):
            (fs / d).mkdir(parents=True, exist_ok=True)
        (fs / "root").chmod(0o700)
        for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            host = Path("/") / name
            if host.is_symlink():
                (fs / name).symlink_to(os.readlink(host))
            elif host.is_dir():
                (fs / name).mkdir()
        etc = fs / "etc"
        for name in _ETC:
            src = Path("/etc") / name
            if src.is_symlink() or src.is_file():
                shutil.copy2(src, etc / name, follow_symlinks=False)
            elif src.is_dir():
                shutil.copytree(src, etc / name, symlinks=True, ignore_dangling_symlinks=True)
        p = persona
        (etc / "passwd").write_text(
            "root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n"
            "bin:x:2:2:bin:/bin:/usr/sbin/nologin\nsys:x:3:3:sys:/dev:/usr/sbin/nologin\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
            f"{p.user}:x:{p.uid}:{p.gid}:{p.full_name},,,:{p.home}:/bin/bash\n")
        (etc / "group").write_text(
            f"root:x:0:\nadm:x:4:{p.user}\ncdrom:x:24:{p.user}\nsudo:x:27:{p.user}\n"
            f"plugdev:x:46:{p.user}\nusers:x:100:\nnogroup:x:65534:\n{p.user}:x:{p.gid}:\n")
        (etc / "hostname").write_text(p.hostname + "\n")
        (etc / "hosts").write_text(f"127.0.0.1\tlocalhost\n127.0.1.1\t{p.hostname}\n\n"
                                   "::1     localhost ip6-localhost ip6-loopback\n"
                                   "ff02::1 ip6-allnodes\nff02::2 ip6-allrouters\n")
        (etc / "resolv.conf").write_text("nameserver 127.0.0.53\noptions edns0 trust-ad\nsearch lan\n")
        (etc / "machine-id").write_text(hashlib.md5(p.hostname.encode()).hexdigest() + "\n")
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
        skel = tmp / "skel"
        skel.mkdir()
        (skel / ".bashrc").write_text(_BASHRC)
        (skel / ".profile").write_text(_PROFILE)
        (skel / ".bash_logout").write_text("# ~/.bash_logout: executed by bash(1) when login shell exits.\n")
        (skel / ".gitconfig").write_text(
            f"[user]\n\tname = {p.full_name}\n\temail = {p.email}\n[init]\n\tdefaultBranch = main\n"
            "[core]\n\teditor = vim\n[pull]\n\trebase = false\n")
        for d in (".cache", ".config", ".local/bin", ".local/share"):
            (skel / d).mkdir(parents=True)
        (tmp / "empty").touch()
        (tmp / ".ok").touch()
        if root.exists():
            shutil.rmtree(root)
        os.rename(tmp, root)
    return root


def _system_binds() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        p = Path("/") / name
        if p.is_dir() and not p.is_symlink():
            args += ["--ro-bind", str(p), f"/{name}"]
    return args


def _libpython_binds() -> list[str]:
    """The host python finds libpython through an absolute RUNPATH that is not bound; point
    the loader's usual location at the right library instead."""
    libdir = Path(sys.base_prefix) / "lib"
    args = []
    for lib in sorted(libdir.glob(f"libpython{PYVER}*.so.*")):
        for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib"):
            if (Path(d) / lib.name).exists():
                args += ["--ro-bind", str(lib), f"{d}/{lib.name}"]
                break
    return args
