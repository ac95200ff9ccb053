"""The process tree a sandbox shows: a booted Debian laptop's, with the commands in its terminal.

``laptop_init.c`` (built once into the runtime, bound at ``/lib/systemd/systemd``) is process 1
and every process of the tree but the command (forks of it, each titled like a laptop's
process); this module says which processes, as whom and with which pids, and which /dev entries,
in the ``LAPTOP_INIT_*`` environment it reads (``init_env``). The services are those
of ``laptop_profile.json``'s ``service_comms`` (a Debian bookworm GNOME laptop's enabled
services), each with the command line its unit starts it with; the session is the user's
manager, its ``(sd-pam)``, the user services and a terminal.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

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


def _ids(etc: Path, table: str) -> dict[str, tuple[int, int]]:
    """Name -> (id, group id) from ``etc/passwd``, or name -> (gid, gid) from ``etc/group``."""
    out = {}
    for line in (etc / table).read_text().splitlines():
        f = line.split(":")
        if len(f) > 3:
            out[f[0]] = (int(f[2]), int(f[3]) if table == "passwd" else int(f[2]))
    return out


def init_env(persona, etc: Path, groups: str, cmd_pid: int, ctl_fd: int) -> dict[str, str]:
    """The ``LAPTOP_INIT_*`` variables process 1 reads: the persona's tree (``tree_env``), the
    pid the first command's shell should get, and the control socket's descriptor."""
    return dict(tree_env(persona, etc, groups), LAPTOP_INIT_CMD_PID=str(cmd_pid), LAPTOP_INIT_CTL=str(ctl_fd))


@functools.lru_cache(maxsize=64)
def tree_env(persona, etc: Path, groups: str) -> dict[str, str]:
    """What does not change from one command to the next (computed once per persona): the tree
    for ``persona`` (its users from ``etc``, the /etc the sandbox shows, the user's supplementary
    ``groups``) at pids of a machine up a while, and its /dev (``dev_entries``). Callers copy it."""
    users = _ids(etc, "passwd")
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
    return {"LAPTOP_INIT_ROLE": "init", "LAPTOP_INIT_UID": str(persona.uid), "LAPTOP_INIT_GID": str(persona.gid),
            "LAPTOP_INIT_GROUPS": groups, "LAPTOP_INIT_SERVICES": "\n".join(services),
            "LAPTOP_INIT_MANAGER": manager, "LAPTOP_INIT_SESSION": "\n".join(session),
            "LAPTOP_INIT_TERMINAL": terminal, "LAPTOP_INIT_DEV": dev_entries(persona, etc)}


def dev_entries(persona, etc: Path) -> str:
    """A laptop's /dev beyond bubblewrap's (which binds null, zero, full, random, urandom and tty
    and mounts pts, shm and mqueue): the nodes a booted NVMe laptop's devtmpfs and udev make
    (Documentation/admin-guide/devices.txt for the numbers, udev's rules for owners and modes),
    one a line: ``c|b|d MODE UID GID MAJOR MINOR PATH`` or ``l TARGET PATH``. The init makes them
    on bubblewrap's /dev, a ``nodev`` tmpfs: they list as a laptop's and none can be opened, not
    even by root ("Permission denied"), so no device of the host is reachable through them."""
    gid = {name: ids[0] for name, ids in _ids(etc, "group").items()}
    rng = random.Random(f"dev:{persona!r}")
    lines: list[str] = []

    def node(kind, mode, major, minor, path, group=None):
        lines.append(f"{kind} {mode:o} 0 {gid.get(group, 0) if group else 0} {major} {minor} {path}")
        if kind in "cb" and "/" not in path:
            lines.append(f"l ../{path} {'char' if kind == 'c' else 'block'}/{major}:{minor}")

    for d in ("block", "bsg", "bus", "bus/usb", "bus/usb/001", "bus/usb/002", "char", "cpu", "cpu/0", "disk",
              "disk/by-id", "disk/by-partuuid", "disk/by-path", "disk/by-uuid", "dma_heap", "dri",
              "input", "mapper", "net", "snd", "vfio"):
        lines.append(f"d 755 0 0 0 0 {d}")
    for i in range(64):
        node("c", 0o620, 4, i, f"tty{i}", "tty")
    for i in range(32):
        node("c", 0o660, 4, 64 + i, f"ttyS{i}", "dialout")
    for name, base in (("vcs", 0), ("vcsu", 64), ("vcsa", 128)):
        for i in range(7):
            node("c", 0o660, 7, base + i, f"{name}{i or ''}", "tty")
    for i in range(8):
        node("b", 0o660, 7, i, f"loop{i}", "disk")
    for name, mode, major, minor, group in (
            ("console", 0o600, 5, 1, None), ("kmsg", 0o644, 1, 11, None), ("mem", 0o640, 1, 1, "kmem"),
            ("port", 0o640, 1, 4, "kmem"), ("autofs", 0o644, 10, 235, None), ("btrfs-control", 0o660, 10, 234, "disk"),
            ("cpu_dma_latency", 0o600, 10, 124, None), ("cuse", 0o600, 10, 203, None), ("ecryptfs", 0o600, 10, 61, None),
            ("fuse", 0o666, 10, 229, None), ("hpet", 0o600, 10, 228, None), ("hwrng", 0o600, 10, 183, None),
            ("kvm", 0o660, 10, 232, "kvm"), ("loop-control", 0o660, 10, 237, "disk"), ("nvram", 0o600, 10, 144, None),
            ("psaux", 0o600, 10, 1, None), ("rfkill", 0o664, 10, 242, "netdev"), ("snapshot", 0o660, 10, 231, "disk"),
            ("udmabuf", 0o660, 10, 125, "kvm"), ("uhid", 0o600, 10, 239, None), ("uinput", 0o600, 10, 223, None),
            ("userfaultfd", 0o600, 10, 126, None), ("vga_arbiter", 0o660, 10, 127, "video"),
            ("vhci", 0o600, 10, 137, None), ("vhost-net", 0o660, 10, 238, "kvm"), ("vhost-vsock", 0o660, 10, 241, "kvm"),
            ("watchdog", 0o600, 10, 130, None), ("watchdog0", 0o600, 248, 0, None), ("rtc0", 0o600, 249, 0, None),
            ("hidraw0", 0o600, 239, 0, None), ("hidraw1", 0o600, 239, 1, None), ("tpm0", 0o660, 10, 224, "tss"),
            ("tpmrm0", 0o660, 253, 65536, "tss"), ("video0", 0o660, 81, 0, "video"), ("video1", 0o660, 81, 1, "video"),
            ("media0", 0o660, 238, 0, "video"), ("ppp", 0o600, 108, 0, None), ("mei0", 0o600, 236, 0, None),
            ("gpiochip0", 0o600, 254, 0, None), ("nvme0", 0o600, 243, 0, None), ("ng0n1", 0o600, 242, 0, None)):
        node("c", mode, major, minor, name, group)
    for i in range(4):
        node("b", 0o660, 259, i, f"nvme0n1{f'p{i}' if i else ''}", "disk")
    node("b", 0o660, 252, 0, "zram0", "disk")
    for name, mode, major, minor, group in (
            ("mapper/control", 0o600, 10, 236, None), ("net/tun", 0o666, 10, 200, None), ("vfio/vfio", 0o666, 10, 196, None),
            ("dri/card0", 0o660, 226, 0, "video"), ("dri/renderD128", 0o666, 226, 128, "render"),
            ("input/mice", 0o660, 13, 63, "input"), ("input/mouse0", 0o660, 13, 32, "input"),
            ("snd/controlC0", 0o660, 116, 11, "audio"), ("snd/hwC0D0", 0o660, 116, 10, "audio"),
            ("snd/pcmC0D0c", 0o660, 116, 3, "audio"), ("snd/pcmC0D0p", 0o660, 116, 2, "audio"),
            ("snd/seq", 0o660, 116, 1, "audio"), ("snd/timer", 0o660, 116, 33, "audio"),
            ("cpu/0/cpuid", 0o444, 203, 0, None), ("cpu/0/msr", 0o600, 202, 0, None),
            ("bus/usb/001/001", 0o664, 189, 0, None), ("bus/usb/002/001", 0o664, 189, 128, None)):
        node("c", mode, major, minor, name, group)
    for i in range(16):
        node("c", 0o660, 13, 64 + i, f"input/event{i}", "input")
    serial = "".join(rng.choice("0123456789ABCDEF") for _ in range(12))
    model = rng.choice(("Samsung_SSD_980_PRO_1TB", "WD_BLACK_SN770_1TB", "KXG60ZNV512G_KIOXIA", "SKHynix_HFS512GDE9X081N",
                        "Micron_2450_MTFDKBA512TFK"))
    uuid = lambda: "-".join("".join(rng.choice("0123456789abcdef") for _ in range(n)) for n in (8, 4, 4, 4, 12))
    for part in ("", "-part1", "-part2", "-part3"):
        target = f"../../nvme0n1{part.replace('-part', 'p')}"
        lines.append(f"l {target} disk/by-id/nvme-{model}_{serial}{part}")
        lines.append(f"l {target} disk/by-path/pci-0000:02:00.0-nvme-1{part}")
        if part:
            lines.append(f"l {target} disk/by-partuuid/{uuid()}")
    lines.append(f"l ../../nvme0n1p1 disk/by-uuid/{uuid()[:4].upper()}-{uuid()[:4].upper()}")
    for p in ("p2", "p3"):
        lines.append(f"l ../../nvme0n1{p} disk/by-uuid/{uuid()}")
    for target, path in (("rtc0", "rtc"), ("/run/systemd/journal/dev-log", "log"), ("/run/initctl", "initctl")):
        lines.append(f"l {target} {path}")
    return "\n".join(lines)
