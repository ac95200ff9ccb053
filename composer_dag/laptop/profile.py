"""The reference profile of an ordinary developer laptop, for the realism battery
(``composer_dag.laptop.probes``), generated from a Debian root, never from the sandbox.

    python -m composer_dag.laptop.profile --make-root /var/tmp/laptop-root   # debootstrap, ~10 min
    python -m composer_dag.laptop.profile --root /var/tmp/laptop-root --out composer_dag/laptop/laptop_profile.json \
        --etc-out composer_dag/laptop/laptop_etc.tar.xz

``--make-root`` installs Debian ``SUITE`` with ``PACKAGES`` (what a developer's Debian laptop
runs: systemd, NetworkManager, PipeWire, CUPS, Avahi, Bluetooth, an editor or two, git, a
compiler) from the Debian package registry with ``debootstrap``. The profile then reads that
root: its users and groups, its ``/etc``, the services its packages enable, the user services a
session starts, its mount units, its temporary-file rules, its tools. What a root on disk cannot
show (a booted kernel's ``/dev`` and ``/sys``, a session's environment) comes from the named
documents below, each entry saying which. Every entry is ``{"value": ..., "source": ...}``.

``--etc-out`` packs the same root's ``/etc`` (``pack_etc``), less its secrets and the files that
name one machine (``ETC_PRIVATE``): the sandbox's runtime (``rootfs``) builds its ``/etc`` from it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
PACKAGES = ("systemd", "systemd-sysv", "systemd-timesyncd", "dbus", "dbus-user-session", "network-manager",
            "wpasupplicant", "avahi-daemon", "cups-daemon", "bluez", "pipewire", "pipewire-pulse", "wireplumber",
            "rtkit", "polkitd", "udisks2", "upower", "colord", "xdg-user-dirs", "gnome-keyring", "cron", "anacron",
            "openssh-client", "sudo", "vim", "nano", "git", "curl", "wget", "less", "man-db", "locales", "tzdata",
            "bash-completion", "make", "gcc", "python3", "python3-pip", "python3-venv", "procps", "iproute2",
            "iputils-ping", "file", "unzip", "htop")
TOOLS = ("bash", "git", "vim", "nano", "curl", "wget", "less", "man", "ssh", "make", "gcc", "python3", "pip3",
         "ps", "ip", "ping", "file", "unzip", "htop", "grep", "sed", "awk", "find", "tar", "gzip", "diff", "sudo")
EDITORS = ("vim", "vi", "nano", "emacs", "code")

# Documents for what a Debian root on disk does not contain.
KERNEL_DEVICES = "the kernel's devtmpfs nodes and udev's links on a laptop (Documentation/admin-guide/devices.rst, udev's 50-udev-default.rules)"
DEV_ENTRIES = ["autofs", "block", "bsg", "btrfs-control", "bus", "char", "console", "core", "cpu", "cpu_dma_latency",
               "disk", "dri", "fd", "full", "fuse", "hidraw0", "hpet", "hugepages", "hwrng", "input", "kmsg",
               "log", "loop-control", "loop0", "mapper", "mem", "mqueue", "net", "null", "nvme0", "nvme0n1",
               "nvme0n1p1", "nvme0n1p2", "port", "ppp", "psaux", "ptmx", "pts", "random", "rfkill", "rtc", "rtc0",
               "shm", "snd", "stderr", "stdin", "stdout", "tpm0", "tty", "tty0", "tty1", "tty2", "tty63", "ttyS0",
               "uhid", "uinput", "urandom", "userfaultfd", "vcs", "vcsa", "vfio", "vga_arbiter", "vhost-net", "video0",
               "zero", "zram0"]
SYS_ENTRIES = ["block", "bus", "class", "dev", "devices", "firmware", "fs", "hypervisor", "kernel", "module", "power"]
PAM_SYSTEMD = "pam_systemd(8): the variables a login session gets"
SESSION_ENV = ["HOME", "USER", "LOGNAME", "SHELL", "PATH", "LANG", "TERM", "PWD", "XDG_RUNTIME_DIR",
               "XDG_SESSION_ID", "XDG_SESSION_TYPE", "XDG_SESSION_CLASS", "DBUS_SESSION_BUS_ADDRESS"]
USER_SETUP = "the Debian installer's default groups for the first user (user-setup, passwd/user-default-groups)"
INSTALLER_GROUPS = ["cdrom", "floppy", "sudo", "audio", "dip", "video", "plugdev", "users", "netdev", "bluetooth",
                    "lpadmin", "scanner"]


# left out of the packed /etc: secrets, and what names one machine (the sandbox writes its persona's)
ETC_PRIVATE = re.compile(r"^etc/(shadow|gshadow|shadow-|gshadow-|passwd-|group-|subuid-?|subgid-?|machine-id|hostname|"
                         r"hosts|mailname|resolv\.conf|timezone|localtime|default/locale|ssh/ssh_host_.*|"
                         r"ssl/private/.*|\.pwd\.lock)$")


ETC_MTIME_MAX = 1_704_067_200  # 2024-01-01: files newer than this are dated then


def pack_etc(root: str, out: str) -> dict:
    """``root``/etc as a tar.xz at ``out``, less ``ETC_PRIVATE`` (owners kept numeric): the counts."""
    import tarfile

    kept = dropped = 0

    def keep(info: tarfile.TarInfo):
        nonlocal kept, dropped
        if ETC_PRIVATE.match(info.name):
            dropped += 1
            return None
        kept += 1
        info.mtime = min(info.mtime, ETC_MTIME_MAX)  # the root is made today; a laptop was installed earlier
        info.uname = info.gname = ""
        return info

    with tarfile.open(out, "w:xz", format=tarfile.PAX_FORMAT) as tar:
        tar.add(os.path.join(root, "etc"), arcname="etc", filter=keep, recursive=True)
    return {"kept": kept, "dropped": dropped, "bytes": os.path.getsize(out)}


def make_root(root: str, suite: str = SUITE, mirror: str = MIRROR) -> None:
    """``debootstrap`` Debian ``suite`` with ``PACKAGES`` into ``root`` (needs root and the registry)."""
    cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", suite, root, mirror]
    print(" ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)


def _unit_exec(root: Path, unit: Path) -> str | None:
    """The process name (``comm``, 15 characters) of a unit's ``ExecStart``."""
    try:
        text = unit.read_text(errors="replace")
    except OSError:
        return None
    if re.search(r"^Type=oneshot", text, re.M):
        return None  # runs and exits: not in a process list
    m = re.search(r"^ExecStart=[-@+!:]*(\S+)", text, re.M)
    return os.path.basename(m.group(1))[:15] if m else None


def _bus_activated(root: Path, d: str) -> set[str]:
    """The daemons D-Bus starts on demand (``Exec=`` of ``d``'s service files): a desktop
    session asks for them (polkit, UPower, colord, rtkit, ...), so a laptop runs them."""
    out = set()
    for f in sorted((root / d).glob("*.service")):
        m = re.search(r"^Exec=(\S+)", f.read_text(errors="replace"), re.M)
        if m and not m.group(1).endswith("/bin/false"):
            out.add(os.path.basename(m.group(1))[:15])
    return out


def _resolve(root: Path, link: Path) -> Path:
    target = os.readlink(link)
    return root / target.lstrip("/") if target.startswith("/") else link.parent / target


def _wanted(root: Path, dirs: list[str]) -> list[Path]:
    """The units enabled under ``dirs`` (``*.wants`` directories of targets), resolved in the root."""
    out = []
    for d in dirs:
        for wants in sorted((root / d).glob("*.wants")):
            for link in sorted(wants.iterdir()):
                if link.name.endswith(".service"):
                    out.append(_resolve(root, link) if link.is_symlink() else link)
    return out


def _session_entries(r: Path, src: str, put) -> None:
    """The entries of a user's session on the root ``r``: /sys and /dev, the process's privileges,
    its environment, home, /tmp, tools and kernel."""
    put("sys_entries", SYS_ENTRIES, "sysfs's top level (Documentation/filesystems/sysfs.rst)")
    put("dev_entries", DEV_ENTRIES, KERNEL_DEVICES)
    put("dev_min", 150, KERNEL_DEVICES + ": 150-250 entries")
    put("cgroup_pattern", r"0::/user\.slice/user-\d+\.slice/\S+", "systemd.special(7): a login session's scope")
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text()) if Path("/proc/sys/kernel/cap_last_cap").exists() else 40
    put("no_new_privs", 0, "proc(5): 0 unless a process asked for it")
    put("seccomp", 0, "proc(5): 0 for a process without a filter")
    put("cap_bounding", f"{(1 << (last + 1)) - 1:016x}", f"capabilities(7): the full set up to cap_last_cap {last}")
    put("cap_effective", f"{0:016x}", "capabilities(7): an unprivileged user's")
    put("uid_map_pattern", r"0\s+0\s+4294967295", "user_namespaces(7): the initial namespace")
    put("user_groups", INSTALLER_GROUPS, USER_SETUP)
    put("env_names", SESSION_ENV, PAM_SYSTEMD + ", login(1) and a terminal's")
    put("env_never", r"BWRAP|SANDBOX|CONTAINER|DOCKER|KUBERNETES|COMPOSER|PYTEST|VIRTUAL_ENV|^container$",
        "variables a laptop's session does not set")
    skel = sorted(os.listdir(r / "etc/skel"))
    dirs = [f"{x.split('=', 1)[1].strip()}" for x in (r / "etc/xdg/user-dirs.defaults").read_text().splitlines()
            if "=" in x and not x.startswith("#")] if (r / "etc/xdg/user-dirs.defaults").exists() else []
    put("home_entries", sorted(set(skel) | set(dirs) | {".cache", ".config", ".local", ".bash_history"}),
        f"/etc/skel and xdg-user-dirs' defaults in {src}, and the XDG base directories")
    put("history_min_lines", 20, "a developer's shell history")
    put("config_min", 3, "a session's ~/.config (dconf, pulse, systemd, ...)")
    put("cache_min", 2, "a session's ~/.cache")
    tmp = []
    for f in sorted(r.glob("usr/lib/tmpfiles.d/*.conf")):
        for line in f.read_text(errors="replace").splitlines():
            parts = line.split()
            if len(parts) > 1 and parts[0].rstrip("!-=~+^") in ("d", "D") and parts[1].startswith("/tmp/"):
                tmp.append(parts[1][5:])
    put("tmp_entries", sorted(set(tmp)), f"the tmpfiles.d rules for /tmp in {src}")
    have = [t for t in TOOLS if any((r / d / t).exists() or (r / d / t).is_symlink() for d in ("usr/bin", "bin", "usr/sbin"))]
    put("tools", have, f"the commands {src} has")
    put("editors_min", 2, f"{', '.join(t for t in EDITORS if (r / 'usr/bin' / t).exists())} in {src}")
    put("uptime_min_s", 600, "a laptop in use")
    put("kernel_pattern", r"\d+\.\d+\.\d+-\d+-(amd64|arm64)", "Debian's kernel packages (linux-image-amd64)")


def build(root: str) -> dict:
    """The profile's entries, read from the Debian root at ``root``."""
    r = Path(root)
    src = f"a Debian {SUITE} root made by debootstrap with {len(PACKAGES)} packages ({root})"
    e: dict[str, dict] = {}

    def put(key, value, source):
        e[key] = {"value": value, "source": source}

    passwd = [x.split(":")[0] for x in (r / "etc/passwd").read_text().splitlines() if x]
    put("passwd_users", passwd, f"/etc/passwd of {src}")
    put("group_names", [x.split(":")[0] for x in (r / "etc/group").read_text().splitlines() if x], f"/etc/group of {src}")
    put("etc_entries", sorted(os.listdir(r / "etc")), f"/etc of {src}")
    osr = dict(x.split("=", 1) for x in (r / "etc/os-release").read_text().splitlines() if "=" in x)
    put("os_release", [f"ID={osr['ID']}", f"VERSION_CODENAME={osr['VERSION_CODENAME']}"], f"/etc/os-release of {src}")
    init = os.readlink(r / "sbin/init") if (r / "sbin/init").is_symlink() else "/sbin/init"
    put("init_cmdline", rf"(/sbin/init|{re.escape(init)})( splash| quiet)* ?", f"/sbin/init -> {init} in {src}")
    put("init_comm", os.path.basename(init), f"/sbin/init -> {init} in {src}")
    system = _wanted(r, ["etc/systemd/system", "lib/systemd/system", "usr/lib/systemd/system"])
    services = sorted({c for u in system if (c := _unit_exec(r, u))} | {"systemd-journal", "systemd-udevd",
                                                                          "systemd-logind"}
                      | _bus_activated(r, "usr/share/dbus-1/system-services"))
    put("service_comms", services, f"ExecStart= of the long-running services enabled in {src} (plus journald, "
        "udevd, logind: static), and the daemons D-Bus activates for a session")
    user = _wanted(r, ["etc/systemd/user", "usr/lib/systemd/user"])
    session = sorted({c for u in user if (c := _unit_exec(r, u))} | {"systemd", "(sd-pam)", "bash"})
    put("session_comms", session, f"ExecStart= of the user services enabled in {src}, the user manager and a shell")
    put("process_min", len(services) + len(session) + 4, "the enabled services, the session's processes and "
        "a terminal's (each at least one process)")
    put("session_ancestors", ["bash", "zsh", "sshd", "login", "gnome-terminal-", "konsole", "tmux: server", "code",
                              "kitty", "alacritty", "systemd"], "a terminal, login or editor above a developer's shell")
    put("comm_renamed", ["(sd-pam)", "gnome-terminal-", "tmux: server", "kworker"], "processes that rename themselves")
    mounts = sorted({m.group(1) for u in r.glob("lib/systemd/system/*.mount")
                     if (m := re.search(r"^Type=(\S+)", u.read_text(errors="replace"), re.M))})
    api = ["proc", "sysfs", "devtmpfs", "securityfs", "tmpfs", "devpts", "cgroup2", "pstore", "efivarfs", "bpf"]
    put("mount_types", sorted(set(mounts) | set(api) | {"ext4", "vfat", "autofs", "binfmt_misc", "fuse.portal",
                                                         "fuse.gvfsd-fuse", "nsfs"}),
        f"Type= of the mount units in {src}, systemd's API file systems (mount-setup), ext4 and the EFI partition")
    put("root_fstype", "ext4|btrfs|xfs", "the Debian installer's default root (ext4)")
    put("root_options_never", r"(^|,)(ro|nosuid|nodev|noexec)(,|$)",
        "fstab(5) and the Debian installer's /etc/fstab: / is mounted 'errors=remount-ro' over the defaults (rw, suid, dev, exec)")
    put("mount_points", ["/", "/proc", "/sys", "/dev", "/dev/pts", "/dev/shm", "/run", "/run/lock", "/sys/fs/cgroup",
                         "/boot/efi", "/dev/mqueue", "/dev/hugepages", "/sys/kernel/debug", "/sys/kernel/tracing"],
        "systemd's API mounts and mount units, and an EFI laptop's /boot/efi")
    put("mount_never", r"cdag|bwrap|bubblewrap|newroot|oldroot|pytest|\.venv|pyenv|/work/|/root/|overlay|composer",
        "names a laptop's mount table never has: this machine's paths and the sandbox runtime's")
    put("disk_min_gb", 100, "a laptop's disk (256 GB and up)")
    put("disk_free_min_gb", 5, "a laptop in use")
    put("timezone_pattern", r"(/usr/share/zoneinfo/|\.\./usr/share/zoneinfo/)\S+\n\S+", f"tzdata in {src}")
    put("lang_pattern", r"[a-z]{2,3}_[A-Z]{2}\.UTF-8", f"locales in {src}: a configured locale, not C or POSIX")
    put("machine_id_pattern", r"[0-9a-f]{32}", "machine-id(5)")
    put("dns_failure", "Temporary failure in name resolution", "glibc's gai_strerror(EAI_AGAIN): no upstream DNS")
    put("connect_fail_within_s", 5, "a laptop whose Wi-Fi is up with no upstream: the gateway does not answer")
    put("connect_error_not", r"Network is unreachable|Permission denied|Operation not permitted",
        "what a laptop with a default route never says")
    _session_entries(r, src, put)
    return {"source": src, "suite": SUITE, "packages": list(PACKAGES), "entries": e}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--make-root", help="debootstrap the Debian root here first")
    p.add_argument("--root", help="an existing Debian root")
    p.add_argument("--out", default=str(Path(__file__).with_name("laptop_profile.json")))
    p.add_argument("--etc-out", help="also pack the root's /etc (less its secrets) here")
    a = p.parse_args(argv)
    root = a.make_root or a.root
    if not root:
        p.error("--root or --make-root is needed")
    if a.make_root:
        make_root(a.make_root)
    profile = build(root)
    Path(a.out).write_text(json.dumps(profile, indent=1, sort_keys=True) + "\n")
    print(f"{len(profile['entries'])} entries -> {a.out}")
    if a.etc_out:
        print(f"/etc: {pack_etc(root, a.etc_out)} -> {a.etc_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
