"""A developer's laptop as the sandbox shows it: the ``sandbox.Dressing`` for a persona.

``dressing(persona)`` is the one call an episode or a grading run makes: the persona's root
image, /usr/local and init (``image``), its process tree (``session``), and a GNOME desktop's
set dressing: the X11/ICE socket directories in /tmp, the EFI partition and /dev/hugepages
mount points, the XDG and D-Bus variables, and first-command pids of a machine up a while.
A new realism feature is a line here (or a module beside it) and its probe (``probes``).
"""

from __future__ import annotations

import random
import sys
from dataclasses import replace
from pathlib import Path

from composer_dag.laptop.image import (PYVER, Persona, cache_root, identity_runtime, image_at, libpython_binds,
                                       libpython_files, persona_runtime, runtime, shell_history, system_binds)
from composer_dag.laptop.session import init_env
from composer_dag.sandbox import volumes
from composer_dag.sandbox.dressing import INIT_DIR, ROOT, Dressing

SOCKET_DIRS = (".ICE-unix", ".X11-unix", ".XIM-unix", ".font-unix")  # a desktop session's, in /tmp
_SYSTEM: dict = {}


def dressing(persona: Persona = Persona(), identity: int | None = None) -> Dressing:
    """The laptop of ``persona``; run as ``identity`` (a grading run's uid, ``sandbox.identity_lease``)
    instead of the persona's, on the same laptop (its passwd and group say so), where given."""
    prt = identity_runtime(persona, identity) if identity is not None else persona_runtime(persona)
    p = replace(persona, uid=identity, gid=identity) if identity is not None else persona
    system = _system(persona, prt)
    image = ROOT in system
    groups = _user_groups(p, prt)
    etc = prt / "root" / "etc"
    return Dressing(
        user=p.user, uid=p.uid, gid=p.gid, home=p.home, hostname=p.hostname, system=system,
        init=lambda pid, fd: init_env(p, etc, groups, pid, fd), disk_usage=runtime() / "tools" / "disk_usage",
        root_image=persona_runtime(persona) / "root.ext4" if image else None,
        # a grading identity's passwd and group (its uid for the persona's user) laid over the
        # persona's root image: an image per persona and uid would be megabytes each
        overlays=tuple((etc / f, f"/etc/{f}") for f in ("passwd", "group")) if image and identity is not None else (),
        mounts=desktop_mounts(), env=desktop_env(p), command_pids=lambda project: command_pids(p, project),
        skel=prt / "skel", history=lambda project, files: shell_history(p, project, files),
        preload=str(runtime() / "tools" / "keep_privs.so"), immutable=(cache_root(),), image_at=image_at,
        network=persona, persona=p)


def desktop_mounts() -> tuple[str, ...]:
    """A laptop's mount points beyond the sandbox's, as its user sees them: /dev/hugepages empty,
    the EFI partition root's alone (Debian mounts it umask=0077); a desktop session's socket
    directories in /tmp."""
    a = ["--perms", "0755", "--size", "4096", "--tmpfs", "/dev/hugepages", "--perms", "0700", "--size", "4096",
         "--tmpfs", "/boot/efi"]
    for d in SOCKET_DIRS:
        a += ["--perms", "1777", "--dir", f"/tmp/{d}"]
    return tuple(a)


def desktop_env(p: Persona) -> dict:
    """The environment of a command in a GNOME session's terminal."""
    return {"HOME": p.home, "USER": p.user, "LOGNAME": p.user, "SHELL": "/bin/bash",
            "PATH": f"{p.home}/.local/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": p.locale, "TERM": "xterm-256color", "EDITOR": p.editor,
            "XDG_RUNTIME_DIR": f"/run/user/{p.uid}", "XDG_SESSION_ID": str(p.session),
            "XDG_SESSION_TYPE": "wayland", "XDG_SESSION_CLASS": "user", "XDG_CURRENT_DESKTOP": "GNOME",
            "DBUS_SESSION_BUS_ADDRESS": f"unix:path=/run/user/{p.uid}/bus"}


def command_pids(p: Persona, project: str):
    """The pid each session start's first command gets: a machine up a while, a little further on
    after each restart (wrapping to 2000 past 30000), drawn from the persona and the project."""
    rng = random.Random(f"{p!r}:{project}")
    pid = 4000 + rng.randrange(20000)
    while True:
        pid = pid + 3 + rng.randrange(60) if pid < 30000 else 2000
        yield pid


def _system(persona: Persona, prt: Path) -> tuple[str, ...]:
    """The laptop's read-only system for this persona and runtime ``prt`` (computed once): its root
    (image or tree), /usr/local with the host's Python, and the laptop's init at ``INIT_DIR``."""
    if (persona, prt) in _SYSTEM:
        return _SYSTEM[(persona, prt)]
    rt = runtime()
    prefix = Path(sys.base_prefix)
    exe = prefix / "bin" / f"python{PYVER}"
    shared = _shared_image(rt, persona_runtime(persona))  # an identity's tree has no image of its own
    if shared is not None:  # each tree the root of a file system, or bound at its own path in one
        a = ["--ro-bind", ROOT, "/"] + system_binds() + ["--ro-bind", f"{shared}/usr/local", "/usr/local"]
        a += [x for _, inside in libpython_files() for x in ("--ro-bind", f"{shared}{inside}", inside)]
        init = f"{shared}{INIT_DIR}"
    else:
        a = ["--ro-bind", str(prt / "root"), "/"] + system_binds()
        a += ["--ro-bind", str(rt / "usr-local"), "/usr/local",
              "--ro-bind", str(prefix / "lib"), "/usr/local/lib",
              "--ro-bind", str(exe), f"/usr/local/bin/python{PYVER}",
              "--ro-bind", str(rt / "site-packages"), f"/usr/local/lib/python{PYVER}/site-packages"]
        a += libpython_binds()
        init = str(rt / "systemd-lib")
    if not Path(INIT_DIR).is_dir():
        raise RuntimeError(f"the sandbox binds its init at {INIT_DIR}, which this host lacks: "
                           f"`mkdir -p {INIT_DIR}` as root (`make system-deps` does)")
    _SYSTEM[(persona, prt)] = tuple(a + ["--ro-bind", init, INIT_DIR])
    return _SYSTEM[(persona, prt)]


def _shared_image(rt: Path, prt: Path) -> Path | None:
    """Where the shared image is mounted, where this host makes file systems for the sandbox
    (``volumes``) and both images are built; None: bind the cached trees themselves."""
    if not (volumes.available() and (prt / "root.ext4").exists() and (rt / "image.ext4").exists()):
        return None
    return volumes.image(rt / "image.ext4")


def _user_groups(persona: Persona, prt: Path) -> str:
    """The persona's supplementary group ids, from its /etc/group ("24,25,27,..."). They
    give nothing on the host: every host path inside is read-only and /dev holds no device
    of those groups."""
    etc = prt / "root" / "etc" / "group"
    gids = [x.split(":")[2] for x in etc.read_text().splitlines()
            if persona.user in x.split(":")[3].split(",") and x.split(":")[2] != str(persona.gid)]
    return ",".join(gids)
