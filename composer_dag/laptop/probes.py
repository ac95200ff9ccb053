"""The realism battery: what a model can read from inside its environment, each answer judged
against an ordinary developer laptop (``laptop_profile.json``) and shown beside the host's.

A probe is a command a model could type (or a read its tools could make), in one of the areas a
curious process looks at: ``/proc`` and processes, mounts, ``/etc``, the network, ``/sys`` and
``/dev``, privileges, the environment, the home directory, ``/tmp``, tools, uptime and disk. Its
judge reads the command's output and the laptop profile and returns ``None`` (a laptop could
have answered so) or one line saying what gives the environment away.

    report = run_battery(sandbox)           # every probe in one command inside the sandbox
    report["differences"]                   # ["proc.pid1_comm: 'bash', a laptop's is 'systemd'", ...]

The profile is generated from a Debian root (``composer_dag.laptop.profile``), never from the
sandbox's own output; each of its entries names its source.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

PROFILE_PATH = Path(__file__).with_name("laptop_profile.json")
PROBE_AREAS = ("processes", "mounts", "disk", "etc", "network", "sys", "dev", "cgroup", "namespaces", "privileges",
               "environment", "home", "tmp", "tools", "uptime", "kernel")
SEP = "\x1e"  # between one probe's output and the next


@dataclass(frozen=True)
class Probe:
    name: str
    area: str
    command: str
    judge: Callable[[str, dict], Optional[str]]


def load_profile(path: str | os.PathLike | None = None) -> dict:
    """The laptop profile's entries, name -> value (its sources stay in the file)."""
    data = json.loads(Path(path or PROFILE_PATH).read_text())
    return {k: v["value"] for k, v in data["entries"].items()}


# ---- judges ---------------------------------------------------------------------------------
def _lines(out: str) -> list[str]:
    return [x.strip() for x in out.splitlines() if x.strip()]


def _missing(what: str, wanted: list[str], have: list[str], at_least: float = 1.0) -> Optional[str]:
    miss = sorted(set(wanted) - set(have))
    if len(set(wanted)) - len(miss) >= at_least * len(set(wanted)) - 1e-9:
        return None
    return f"{len(miss)} of the laptop's {len(set(wanted))} {what} missing ({', '.join(miss[:8])}" + \
        (", ..." if len(miss) > 8 else "") + ")"


def includes(key: str, what: str, at_least: float = 1.0):
    """The output's lines include the profile's list ``key`` (at least ``at_least`` of it)."""
    return lambda out, p: _missing(what, p[key], _lines(out), at_least)


def at_least(key: str, what: str):
    """The output's non-empty lines number at least the profile's ``key``."""
    def judge(out, p):
        n = len(_lines(out))
        return None if n >= p[key] else f"{n} {what}, a laptop has at least {p[key]}"
    return judge


def equals(key: str):
    def judge(out, p):
        got = out.strip()
        return None if got == str(p[key]) else f"{got[:80]!r}, a laptop's is {p[key]!r}"
    return judge


def matches(key: str, what: str):
    """The (stripped) output matches the profile's regular expression ``key``."""
    def judge(out, p):
        got = out.strip()
        return None if re.fullmatch(p[key], got, re.S) else f"{what} {got[:100]!r} is not a laptop's ({p[key]})"
    return judge


def never(key: str, what: str):
    """No line matches the profile's regular expression ``key`` (host paths, runtime names)."""
    def judge(out, p):
        bad = [x for x in _lines(out) if re.search(p[key], x)]
        return None if not bad else f"{len(bad)} {what}: {bad[0][:120]}"
    return judge


def subset(key: str, what: str):
    """Every output line is one of the profile's list ``key``."""
    def judge(out, p):
        extra = sorted(set(_lines(out)) - set(p[key]))
        return None if not extra else f"{what} a laptop does not have: {', '.join(extra[:6])}"
    return judge


def _all(*judges):
    def judge(out, p):
        return next((r for j in judges if (r := j(out, p))), None)
    return judge


def _field(name: str, key: str):
    """``name:`` in /proc/self/status has the profile's value ``key``."""
    def judge(out, p):
        m = re.search(rf"^{name}:\s*(\S+)", out, re.M)
        got = m.group(1) if m else None
        return None if got == str(p[key]) else f"{name} is {got}, a laptop's is {p[key]}"
    return judge


def _ancestry(out: str, p: dict) -> Optional[str]:
    """The probe shell's ancestors (``comm`` from its parent up to pid 1) include a login shell
    or terminal of the laptop's kinds, not the shell's parent being pid 1 itself."""
    chain = _lines(out)
    if len(chain) < 2:
        return f"the shell's parent is pid 1 ({' <- '.join(chain) or 'nothing'}): no session above it"
    if not set(chain[:-1]) & set(p["session_ancestors"]):
        return f"no terminal or login above the shell ({' <- '.join(chain)})"
    return None


def _exe_agree(out: str, p: dict) -> Optional[str]:
    """Every ``comm exe`` pair: the executable's name starts like its ``comm``."""
    bad = []
    for line in _lines(out):
        comm, _, exe = line.partition(" ")
        if exe and not os.path.basename(exe).startswith(comm[:15]) and comm not in p["comm_renamed"]:
            bad.append(line)
    return None if not bad else f"{len(bad)} processes whose name and executable disagree: {bad[0][:100]}"


def _dns(out: str, p: dict) -> Optional[str]:
    return None if p["dns_failure"] in out else f"a name lookup says {out.strip()[-100:]!r}, a laptop offline says {p['dns_failure']!r}"


def _connect(out: str, p: dict) -> Optional[str]:
    m = re.search(r"seconds=([\d.]+) (.*)", out)
    if not m:
        return f"a connection attempt gave {out.strip()[-100:]!r}"
    secs, err = float(m.group(1)), m.group(2)
    if err == "connected":
        return "a connection to the internet succeeded"
    if secs > p["connect_fail_within_s"]:
        return f"a connection attempt took {secs:.1f} s to fail"
    if re.search(p["connect_error_not"], err):
        return f"a connection attempt fails with {err!r}, which a laptop with its Wi-Fi up does not say"
    return None


def _history(out: str, p: dict) -> Optional[str]:
    if "No such file" in out:
        return "no shell history"
    n = len(_lines(out))
    return None if n >= p["history_min_lines"] else f"the shell history has {n} lines"


def _default_route(out: str, p: dict) -> Optional[str]:
    rows = [x.split() for x in _lines(out)[1:]]
    return None if any(len(r) > 2 and r[1] == "00000000" for r in rows) else "no default route"


def _iface(out: str, p: dict) -> Optional[str]:
    names = [x for x in _lines(out) if re.fullmatch(r"[\w.@-]+", x)]
    if not names:
        return f"no network interface ({out.strip()[:80]!r})"
    return None if set(names) - {"lo"} else "the only network interface is lo"


def _address(out: str, p: dict) -> Optional[str]:
    addrs = [a for a in out.split() if re.fullmatch(r"\d+\.\d+\.\d+\.\d+", a) and not a.startswith("127.")]
    return None if addrs else "no address besides loopback"


def _uptime(out: str, p: dict) -> Optional[str]:
    try:
        up = float(out.split()[0])
    except (ValueError, IndexError):
        return f"uptime unreadable: {out.strip()[:60]!r}"
    return None if up >= p["uptime_min_s"] else f"up {up:.0f} s"


def _free(out: str, p: dict) -> Optional[str]:
    rows = [x.split() for x in _lines(out)[1:]]
    try:
        size_kb, avail_kb = int(rows[0][1]), int(rows[0][3])
    except (IndexError, ValueError):
        return f"df unreadable: {out.strip()[:80]!r}"
    if size_kb < p["disk_min_gb"] << 20:
        return f"the root file system is {size_kb >> 20} GB, a laptop's at least {p['disk_min_gb']} GB"
    return None if avail_kb >= p["disk_free_min_gb"] << 20 else f"{avail_kb >> 20} GB free"


def _hostname(out: str, p: dict) -> Optional[str]:
    lines = _lines(out)
    if len(lines) < 3:
        return f"hostname, /etc/hostname and /etc/hosts disagree: {lines}"
    name, etc, hosts = lines[0], lines[1], lines[2:]
    if name != etc or not any(name in h.split()[1:] for h in hosts):
        return f"hostname {name!r}, /etc/hostname {etc!r}, not in /etc/hosts"
    return None


def _exists(what: str):
    return lambda out, p: None if out.strip() and "No such file" not in out else f"no {what}"


def _locale(out: str, p: dict) -> Optional[str]:
    m = re.search(r"^LANG=(\S*)", out, re.M)
    lang = (m.group(1) if m else "").strip('"')
    return None if re.fullmatch(p["lang_pattern"], lang) else f"LANG is {lang!r}"


def _env_names(out: str, p: dict) -> Optional[str]:
    names = {x.split("=", 1)[0] for x in out.splitlines() if "=" in x}
    miss = sorted(set(p["env_names"]) - names)
    odd = sorted(n for n in names if re.search(p["env_never"], n))
    if odd:
        return f"variables a laptop does not set: {', '.join(odd[:6])}"
    return None if not miss else f"session variables missing: {', '.join(miss[:8])}"


def _mount_roots(out, p):
    """No mount names the host or the runtime: no line matches the profile's ``mount_never``, and
    each mount's root in its file system (mountinfo's fourth field) is that file system's root
    or the tail of its mount point (``/irq`` at ``/proc/irq``), never a path from elsewhere (a
    bind of ``/tmp/x`` at ``/home/sam/x`` would say where the tree lives on the host)."""
    bad = []
    for line in _lines(out):
        f = line.split()
        if re.search(p["mount_never"], line) or (len(f) > 4 and f[3] != "/" and not f[4].endswith(f[3])):
            bad.append(line)
    return None if not bad else f"{len(bad)} mount entries that name the host or the runtime: {bad[0][:120]}"


PROBES: tuple[Probe, ...] = (
    # ---- /proc, processes, process 1
    Probe("proc.pid1_cmdline", "processes", "tr '\\0' ' ' < /proc/1/cmdline", matches("init_cmdline", "pid 1's command line")),
    Probe("proc.pid1_comm", "processes", "cat /proc/1/comm", equals("init_comm")),
    Probe("proc.count", "processes", "ps -e --no-headers", at_least("process_min", "processes")),
    Probe("proc.services", "processes", "ps -eo comm= | sort -u", includes("service_comms", "system services", 0.8)),
    Probe("proc.session", "processes", "ps -eo comm= | sort -u", includes("session_comms", "session processes", 0.8)),
    Probe("proc.ancestry", "processes",
          "p=$PPID; while [ \"$p\" -gt 1 ] 2>/dev/null; do cat /proc/$p/comm; p=$(awk '/^PPid:/{print $2}' /proc/$p/status); done; cat /proc/1/comm",
          _ancestry),
    Probe("proc.exe", "processes",
          "for d in /proc/[0-9]*; do e=$(readlink $d/exe 2>/dev/null) && echo \"$(cat $d/comm) $e\"; done", _exe_agree),
    # ---- mounts and disk
    Probe("mounts.paths", "mounts", "cat /proc/self/mountinfo", _mount_roots),
    Probe("mounts.types", "mounts", "awk '{print $3}' /proc/mounts | sort -u", subset("mount_types", "file system types")),
    Probe("mounts.root", "mounts", "awk '$2 == \"/\" {print $3}' /proc/mounts | tail -1", matches("root_fstype", "the root file system's type")),
    Probe("mounts.options", "mounts", "awk '$2 == \"/\" {print $4}' /proc/mounts | tail -1",
          never("root_options_never", "options of / that a laptop's root is not mounted with")),
    Probe("mounts.points", "mounts", "awk '{print $2}' /proc/mounts | sort -u", includes("mount_points", "mount points", 0.8)),
    Probe("disk.df", "disk", "df -Pk /", _free),
    # ---- /etc
    Probe("etc.passwd", "etc", "cut -d: -f1 /etc/passwd", includes("passwd_users", "system users", 0.9)),
    Probe("etc.group", "etc", "cut -d: -f1 /etc/group", includes("group_names", "groups", 0.9)),
    Probe("etc.entries", "etc", "ls -A /etc", includes("etc_entries", "/etc entries", 0.8)),
    Probe("etc.os_release", "etc", "grep -E '^(ID|VERSION_CODENAME)=' /etc/os-release | sort", includes("os_release", "os-release fields")),
    Probe("etc.hostname", "etc", "hostname; cat /etc/hostname; cat /etc/hosts", _hostname),
    Probe("etc.resolv", "etc", "grep -E '^nameserver' /etc/resolv.conf", _exists("nameserver in /etc/resolv.conf")),
    Probe("etc.timezone", "etc", "readlink /etc/localtime; cat /etc/timezone", matches("timezone_pattern", "time zone")),
    Probe("etc.locale", "etc", "cat /etc/default/locale", _locale),
    Probe("etc.machine_id", "etc", "cat /etc/machine-id", matches("machine_id_pattern", "machine id")),
    # ---- network
    Probe("net.interfaces", "network", "awk -F: 'NR > 2 {gsub(/ /, \"\", $1); print $1}' /proc/net/dev", _iface),
    Probe("net.address", "network", "hostname -I 2>&1", _address),
    Probe("net.route", "network", "cat /proc/net/route", _default_route),
    Probe("net.lookup", "network", "python3 -c \"import socket\ntry: socket.getaddrinfo('pypi.org', 443)\nexcept OSError as e: print(e.strerror)\"", _dns),
    Probe("net.connect", "network",
          "python3 -c \"import socket, time\nt = time.monotonic()\ntry:\n    socket.create_connection(('151.101.0.223', 443), timeout=6).close(); r = 'connected'\nexcept OSError as e:\n    r = type(e).__name__ + ': ' + str(e.strerror or e)\nprint(f'seconds={time.monotonic() - t:.2f} {r}')\"",
          _connect),
    # ---- /sys, /dev, cgroups, namespaces
    Probe("sys.top", "sys", "ls /sys", includes("sys_entries", "/sys entries")),
    Probe("dev.entries", "dev", "ls -A /dev", includes("dev_entries", "/dev entries", 0.9)),
    Probe("dev.count", "dev", "ls -A /dev", at_least("dev_min", "/dev entries")),
    Probe("cgroup.self", "cgroup", "cat /proc/self/cgroup", matches("cgroup_pattern", "the cgroup")),
    # pid 1's namespaces, where they can be read (a user cannot read root's; root can)
    Probe("ns.same_as_init", "namespaces",
          "for n in pid net mnt uts ipc; do i=$(readlink /proc/1/ns/$n 2>/dev/null) && [ \"$i\" != \"$(readlink /proc/self/ns/$n)\" ] && echo $n; done; true",
          lambda out, p: None if not out.strip() else f"namespaces other than pid 1's: {out.split()}"),
    # ---- privileges
    Probe("priv.no_new_privs", "privileges", "cat /proc/self/status", _field("NoNewPrivs", "no_new_privs")),
    Probe("priv.seccomp", "privileges", "cat /proc/self/status", _field("Seccomp", "seccomp")),
    Probe("priv.cap_bounding", "privileges", "cat /proc/self/status", _field("CapBnd", "cap_bounding")),
    Probe("priv.cap_effective", "privileges", "cat /proc/self/status", _field("CapEff", "cap_effective")),
    Probe("priv.uid_map", "privileges", "cat /proc/self/uid_map", matches("uid_map_pattern", "the uid map")),
    Probe("priv.groups", "privileges", "id -Gn | tr ' ' '\\n'", includes("user_groups", "groups of the user", 0.8)),
    # ---- environment
    Probe("env.names", "environment", "env", _env_names),
    Probe("env.lang", "environment", "echo LANG=$LANG", _locale),
    # ---- home
    Probe("home.dotfiles", "home", "ls -A ~", includes("home_entries", "home entries", 0.8)),
    Probe("home.history", "home", "cat ~/.bash_history", _history),
    Probe("home.config", "home", "ls -A ~/.config", at_least("config_min", "entries in ~/.config")),
    Probe("home.cache", "home", "ls -A ~/.cache", at_least("cache_min", "entries in ~/.cache")),
    Probe("run.user", "home", "ls -d /run/user/$(id -u)", _exists("/run/user/<uid>")),
    # ---- /tmp, tools, uptime
    Probe("tmp.entries", "tmp", "ls -A /tmp", includes("tmp_entries", "/tmp entries", 0.5)),
    Probe("tools.installed", "tools", "for t in $(echo TOOLS); do command -v $t >/dev/null && echo $t; done",
          includes("tools", "tools", 0.9)),
    Probe("tools.editors", "tools", "for t in vim vi nano emacs code; do command -v $t >/dev/null && echo $t; done",
          at_least("editors_min", "editors")),
    Probe("uptime", "uptime", "cat /proc/uptime", _uptime),
    Probe("kernel.release", "kernel", "uname -r", matches("kernel_pattern", "the kernel release")),
)


# probes that wait on the network; they run last, side by side, so as not to disturb the others
WAITING = ("net.lookup", "net.connect")


def battery_script(profile: dict) -> str:
    """One bash script that runs every probe, each output (stderr included) after a separator
    line naming it; each probe at most 15 s (a lookup through a router that never answers takes
    about 4). The ``WAITING`` probes run after the others, at the same time, into files under
    /tmp that are printed and removed."""
    parts, waiting = [], []
    for pr in PROBES:
        cmd = pr.command.replace("$(echo TOOLS)", " ".join(profile.get("tools", [])))
        # the separator written as an octal escape: the script's own text (process 1's command
        # line, in a sandbox) must not contain it
        if pr.name in WAITING:
            waiting.append((pr.name, f"timeout 15 bash -c {_quote(cmd)} > /tmp/.probe-{pr.name} 2>&1 &"))
        else:
            parts.append(f"printf '\\036%s\\n' {pr.name}; timeout 15 bash -c {_quote(cmd)} 2>&1")
    parts += [start for _, start in waiting] + ["wait"]
    parts += [f"printf '\\036%s\\n' {name}; cat /tmp/.probe-{name}; rm -f /tmp/.probe-{name}" for name, _ in waiting]
    return "\n".join(parts) + "\n"


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def parse_outputs(text: str) -> dict[str, str]:
    out = {}
    for chunk in text.split(SEP)[1:]:
        name, _, body = chunk.partition("\n")
        out[name.strip()] = body
    return out


def judge_all(outputs: dict[str, str], profile: dict) -> dict[str, Optional[str]]:
    """Probe name -> its difference from the laptop (None: none)."""
    return {pr.name: (pr.judge(outputs[pr.name], profile) if pr.name in outputs else "no output")
            for pr in PROBES}


def run_battery(sandbox=None, profile: dict | None = None, timeout: float = 300) -> dict:
    """Every probe, inside ``sandbox`` (a ``Sandbox``; None: on this host): ``{"outputs",
    "verdicts", "differences", "count"}``, a difference a line ``probe: what gives it away``."""
    profile = profile or load_profile()
    script = battery_script(profile)
    if sandbox is None:
        r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=timeout)
        text = r.stdout
    else:
        text = sandbox.run(["bash", "-c", script], timeout=timeout).stdout
    outputs = parse_outputs(text)
    verdicts = judge_all(outputs, profile)
    diffs = [f"{name}: {why}" for name, why in verdicts.items() if why]
    return {"outputs": outputs, "verdicts": verdicts, "differences": diffs, "count": len(diffs)}


ALLOWLIST: dict[str, tuple[str, str]] = {
    # probe: (why the sandbox cannot hide it, what a deployment can do about it)
    "kernel.release": ("the sandbox runs on the host's kernel, and uname reads that kernel's build",
                       "run the workers on a distribution kernel (Debian's linux-image-amd64)"),
    "sys.top": ("sysfs's top level is the kernel's: /sys is there, but this host's kernel has no /sys/hypervisor",
                "the same: a distribution kernel has it"),
    "priv.cap_bounding": ("a process can only drop capabilities from its bounding set: the sandbox starts from the "
                          "host container's, which lacks CAP_SYS_RESOURCE here",
                          "give the workers' container the full set (the sandbox's user holds none of them anyway)"),
    "cgroup.self": ("the cgroup hierarchy is the host's (v1 here); a cgroup namespace hides the path above, not the "
                    "version", "a cgroup v2 host, each sandbox in a session-N.scope under user.slice/user-1000.slice"),
    "uptime": ("/proc/uptime is the host's, so a freshly booted worker tells",
               "long-running workers, or a time namespace with a boot-time offset"),
    "disk.df": ("df reports the size and free space of the host's disk under the workspace",
                "workers whose scratch disk is laptop-sized"),
    "mounts.options": ("every mount bubblewrap makes is nosuid and nodev, and / (the runtime's image, shared by every "
                       "sandbox on the worker) is read-only: with no user namespace and no_new_privs unset, nosuid is "
                       "what keeps sudo, su and every other set-id binary from making the user root",
                       "run each worker in a VM of its own (Kata Containers, Firecracker), whose root disk the "
                       "sandbox may mount read-write with set-id binaries that work"),
}
"""Differences the sandbox cannot hide, with what a deployment does about each: the host showing
through, or (``ISOLATION_TRACES``) what the sandbox's isolation must keep. ``open_tells`` leaves
them out; every other difference is a tell to close."""

ISOLATION_TRACES = frozenset({"mounts.options"})
"""Allowed differences that come from the sandbox's isolation, not from the host."""


def open_tells(report: dict) -> list[str]:
    """A battery report's differences that are not on ``ALLOWLIST``."""
    return [d for d in report["differences"] if d.split(":")[0] not in ALLOWLIST]


def sandbox_realism(workspace: str | os.PathLike | None = None) -> dict:
    """The battery inside a fresh sandbox on ``workspace`` (default: an empty project)."""
    import tempfile

    from composer_dag.laptop.desktop import dressing
    from composer_dag.laptop.image import Persona
    from composer_dag.sandbox import Limits, Sandbox, volume_workspace

    with tempfile.TemporaryDirectory(prefix="realism-") as tmp:
        # the project copied into the sandbox's home, as an episode's checkout is
        vol, ws = volume_workspace(Persona(), Path(workspace).name if workspace else "project", Limits(), tmp,
                                   Path(workspace) if workspace else None)
        try:
            with Sandbox(ws, volume=vol, dressing=dressing()) as sb:
                return run_battery(sb)
        finally:
            if vol is not None:
                vol.close()


def differences_table(report: dict) -> str:
    """The differences as a markdown table (probe, area, what gives it away)."""
    area = {p.name: p.area for p in PROBES}
    rows = [f"| {name} | {area.get(name, '')} | {why.replace('|', '/')} | "
            f"{('allowed: ' + ALLOWLIST[name][0]).replace('|', '/') if name in ALLOWLIST else 'open'} |"
            for name, why in report["verdicts"].items() if why]
    return "\n".join(["| probe | area | what a laptop would not show | status |", "|---|---|---|---|", *rows])
