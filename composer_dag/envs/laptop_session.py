"""The process tree a sandbox shows: a booted Debian laptop's, with the command in its terminal.

``laptop_init.c`` (built once into the runtime, bound at ``/lib/systemd/systemd``) is process 1
and every process of the tree but the command (forks of it, each titled like a laptop's process); this module says which processes, as whom and
with which pids, in the ``LAPTOP_INIT_*`` environment it reads (``init_env``). The services are those
of ``laptop_profile.json``'s ``service_comms`` (a Debian bookworm GNOME laptop's enabled
services), each with the command line its unit starts it with; the session is the user's
manager, its ``(sd-pam)``, the user services and a terminal.
"""

from __future__ import annotations

import random
from pathlib import Path

INIT_DIR = "/usr/lib/systemd"  # bound from the runtime; process 1 is its ``systemd``
INIT_SOURCE = Path(__file__).with_name("laptop_init.c")

# (user, command line): "comm=NAME " first where the process renames itself
SERVICES = (
    ("root", "/lib/systemd/systemd-journald"),
    ("root", "/lib/systemd/systemd-udevd"),
    ("systemd-timesync", "/lib/systemd/systemd-timesyncd"),
    ("root", "/usr/libexec/accounts-daemon"),
    ("avahi", "comm=avahi-daemon avahi-daemon: running [{host}.local]"),
    ("root", "/usr/libexec/bluetooth/bluetoothd"),
    ("root", "/usr/sbin/cron -f"),
    ("messagebus", "/usr/bin/dbus-daemon --system --address=systemd: --nofork --nopidfile --systemd-activation --syslog-only"),
    ("root", "/usr/sbin/NetworkManager --no-daemon"),
    ("polkitd", "/usr/lib/polkit-1/polkitd --no-debug"),
    ("root", "/usr/libexec/power-profiles-daemon"),
    ("root", "/usr/libexec/switcheroo-control"),
    ("root", "/lib/systemd/systemd-logind"),
    ("root", "/usr/libexec/udisks2/udisksd"),
    ("root", "/sbin/wpa_supplicant -u -s -O DIR=/run/wpa_supplicant GROUP=netdev"),
    ("avahi", "comm=avahi-daemon avahi-daemon: chroot helper"),
    ("root", "/usr/sbin/cupsd -l"),
    ("root", "/usr/sbin/ModemManager"),
    ("root", "/usr/libexec/nm-priv-helper"),
    ("root", "/usr/sbin/gdm3"),
    ("root", "/usr/libexec/upowerd"),
    ("rtkit", "/usr/libexec/rtkit-daemon"),
    ("root", "/usr/sbin/anacron -d -q -s"),
    ("colord", "/usr/libexec/colord"),
    ("root", "/usr/libexec/nm-dispatcher"),
    ("root", "comm=gdm-session-wor gdm-session-worker [pam/gdm-password]"),
    ("root", "/sbin/agetty -o -p --noclear - linux"),
)

# the user's: after the manager and its (sd-pam), the user services, then the terminal
SESSION = (
    "comm=(sd-pam) (sd-pam)",
    "/usr/bin/pipewire",
    "/usr/bin/wireplumber",
    "/usr/bin/pipewire-pulse",
    "/usr/bin/dbus-daemon --session --address=systemd: --nofork --nopidfile --systemd-activation --syslog-only",
    "/usr/bin/gnome-keyring-daemon --foreground --components=pkcs11,secrets --control-directory=/run/user/{uid}/keyring",
    "/usr/lib/openssh/agent-launch start",
    "/usr/libexec/gcr-ssh-agent --base-dir /run/user/{uid}/gcr",
    "/usr/libexec/gnome-session-binary --systemd-service --session=gnome",
    "/usr/bin/gnome-shell",
    "/usr/libexec/gsd-power",
    "/usr/libexec/gsd-media-keys",
    "/usr/libexec/xdg-desktop-portal",
)
MANAGER = "/lib/systemd/systemd --user"
TERMINAL = "comm=gnome-terminal- /usr/libexec/gnome-terminal-server"


def _users(etc: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for line in (etc / "passwd").read_text().splitlines():
        f = line.split(":")
        if len(f) > 3:
            out[f[0]] = (int(f[2]), int(f[3]))
    return out


def init_env(persona, etc: Path, groups: str, argv: list[str], cmd_pid: int) -> dict[str, str]:
    """The ``LAPTOP_INIT_*`` variables process 1 reads: the tree for ``persona`` (its users from
    ``etc``, the /etc the sandbox shows), the user's supplementary ``groups``, the command and
    the pid it should get (the tree's own pids are the persona's, as on a machine up a while)."""
    users = _users(etc)
    rng = random.Random(f"pids:{persona!r}")
    fmt = {"host": persona.hostname, "uid": persona.uid}

    def line(user_ids, pid, cmd):
        return f"{user_ids[0]}\t{user_ids[1]}\t{pid}\t{cmd.format(**fmt)}"

    pid, services = 300 + rng.randrange(100), []
    for user, cmd in SERVICES:
        services.append(line(users.get(user, (0, 0)), pid, cmd))
        pid += 1 + rng.randrange(40)
    me = (persona.uid, persona.gid)
    pid = 1100 + rng.randrange(300)
    manager = line(me, pid, MANAGER)
    session = []
    for cmd in SESSION:
        pid += 1 + rng.randrange(30)
        session.append(line(me, pid, cmd))
    terminal = line(me, pid + 600 + rng.randrange(2000), TERMINAL)
    env = {"LAPTOP_INIT_ROLE": "init", "LAPTOP_INIT_UID": str(persona.uid), "LAPTOP_INIT_GID": str(persona.gid), "LAPTOP_INIT_GROUPS": groups,
           "LAPTOP_INIT_SERVICES": "\n".join(services), "LAPTOP_INIT_MANAGER": manager, "LAPTOP_INIT_SESSION": "\n".join(session),
           "LAPTOP_INIT_TERMINAL": terminal, "LAPTOP_INIT_CMD_PID": str(cmd_pid),
           "LAPTOP_INIT_ARGC": str(len(argv))}
    env.update({f"LAPTOP_INIT_ARG{i}": a for i, a in enumerate(argv)})
    return env
