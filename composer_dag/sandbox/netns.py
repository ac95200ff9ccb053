"""A sandbox's network: a laptop whose Wi-Fi is up and whose router does not answer.

Each ``Network`` is a network namespace of its own (``ip netns``, named ``cdag-<pid>-<n>``) with
loopback and one interface named like a laptop's wireless card, holding the persona's address
and a default route through its router. The interface is one end of a veth pair; the other end
sits in ``cdag-void``, a namespace shared by every sandbox's far end that has no address, no
route, no IPv6 and no forwarding, and no bridge between the ends. So a packet leaves the
sandbox's interface and goes nowhere:

- a connection fails in about 1 s with "No route to host" (the router never answers ARP, which
  is asked once, not the default three times: each unanswered attempt costs a second);
- a name lookup fails with "Temporary failure in name resolution" (two attempts per name, and
  the search domain's name after it: about 4 s);
- no sandbox reaches another, the host, or the host's loopback.

Each namespace also gets its own sysfs (``sysfs``: mounted from inside it, so /sys/class/net
lists its interfaces, not the host's), which the sandbox shows read-only at /sys.

Sandboxes join the namespace with ``nsenter --net``; ``close()`` deletes it (the veth pair goes
with it) and unmounts its sysfs. Namespaces and sysfs mounts left by a process that died are
removed by the next one to start a network.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import random
import shutil
import subprocess
import threading
from dataclasses import dataclass

IP = shutil.which("ip") or "/usr/sbin/ip"
NSENTER = shutil.which("nsenter") or "/usr/bin/nsenter"
SYSCTL = shutil.which("sysctl") or "/usr/sbin/sysctl"
VOID = "cdag-void"
SYSFS_DIR = "/run/cdag-sys"  # one sysfs per namespace, at SYSFS_DIR/<name>
_COUNT = itertools.count()
_LOCK = threading.Lock()
_SWEPT: list[int] = []
_LIBC = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class Wifi:
    interface: str
    address: str  # with its prefix length
    router: str


def wifi_for(persona) -> Wifi:
    """The persona's wireless interface, address and router (the same in /etc/resolv.conf)."""
    rng = random.Random(f"wifi:{persona!r}")
    net = rng.choice(("192.168.1", "192.168.0", "192.168.178", "10.0.0", "192.168.86"))
    router = f"{net}.{rng.choice((1, 1, 1, 254))}"
    return Wifi(interface=rng.choice(("wlp2s0", "wlp3s0", "wlp0s20f3", "wlp1s0", "wlan0")),
                address=f"{net}.{rng.randrange(20, 200)}/24", router=router)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([IP, *args], capture_output=True, text=True)
    if check and r.returncode:
        raise OSError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def _batch(netns: str, commands: str) -> None:
    r = subprocess.run([IP, "-n", netns, "-batch", "-"], input=commands, capture_output=True, text=True)
    if r.returncode:
        raise OSError(f"ip -n {netns} -batch: {r.stderr.strip()}")


def _names() -> list[str]:
    return [x.split()[0] for x in _ip("netns", "list", check=False).stdout.splitlines() if x.strip()]


def _dead(name: str) -> bool:
    parts = name.split("-")
    return len(parts) == 3 and parts[0] == "cdag" and parts[1].isdigit() and not os.path.exists(f"/proc/{parts[1]}")


def _unmount(path: str) -> None:
    if os.path.ismount(path) and _LIBC.umount2(path.encode(), 2) != 0:  # MNT_DETACH
        subprocess.run(["umount", "-l", path], capture_output=True)
    with contextlib.suppress(OSError):
        os.rmdir(path)


def _sweep() -> None:
    """Delete the namespaces (and sysfs mounts) of processes that are gone; make the void once."""
    names = _names()
    for n in names:
        if _dead(n):
            _ip("netns", "delete", n, check=False)
    with contextlib.suppress(OSError):
        for n in os.listdir(SYSFS_DIR):
            if _dead(n):
                _unmount(os.path.join(SYSFS_DIR, n))
    if VOID not in names:
        _ip("netns", "add", VOID, check=False)
        for key in ("all", "default"):
            with contextlib.suppress(OSError):
                _ip("netns", "exec", VOID, "sysctl", "-qw", f"net.ipv6.conf.{key}.disable_ipv6=1")
        _ip("netns", "exec", VOID, "sysctl", "-qw", "net.ipv4.ip_forward=0")


class Network:
    """A network namespace with the persona's Wi-Fi (see the module's docstring)."""

    def __init__(self, persona):
        with _LOCK:
            if not _SWEPT or _SWEPT[0] != os.getpid():
                _sweep()
                _SWEPT[:] = [os.getpid()]
        n = next(_COUNT)
        self.name = f"cdag-{os.getpid()}-{n}"
        self.sysfs = None
        self.wifi = wifi_for(persona)
        self.peer = peer = f"v{os.getpid() % 100000}x{n}"[:15]
        w = self.wifi
        try:
            _ip("netns", "add", self.name)
            _ip("link", "add", w.interface, "netns", self.name, "type", "veth", "peer", "name", peer, "netns", VOID)
            _ip("-n", VOID, "link", "set", peer, "addrgenmode", "none", "up")
            _batch(self.name, f"link set lo up\naddr add {w.address} dev {w.interface}\n"
                              f"link set {w.interface} up\nroute add default via {w.router}\n")
            # one ARP probe, not three: the unanswered router costs a second, not three, per attempt;
            # and the namespace's own sysfs, mounted from inside it
            self.sysfs = os.path.join(SYSFS_DIR, self.name)
            os.makedirs(self.sysfs, mode=0o755)
            r = subprocess.run([NSENTER, f"--net=/run/netns/{self.name}", "--", "/bin/sh", "-c",
                                f'{SYSCTL} -qw net.ipv4.neigh.{w.interface}.mcast_solicit=1 && '
                                f'mount -t sysfs -o nosuid,nodev,noexec sysfs "$0"', self.sysfs],
                               capture_output=True, text=True)
            if r.returncode:
                raise OSError(f"sysctl and sysfs in {self.name}: {r.stderr.strip()}")
        except OSError:
            self.close()
            raise
        self.path = f"/run/netns/{self.name}"

    def enter(self) -> list[str]:
        """The argv prefix that runs a command in this namespace."""
        return [NSENTER, f"--net={self.path}", "--"]

    def close(self) -> None:
        if self.sysfs:
            _unmount(self.sysfs)
        if os.path.exists(f"/run/netns/{self.name}"):
            _ip("-n", VOID, "link", "delete", self.peer, check=False)  # the pair goes now, not when the kernel gets to it
            _ip("netns", "delete", self.name, check=False)
