"""How realistic the sandbox looks from inside: fingerprint what a curious process can see,
diff it against the host's, and find strings that would give the game away."""

from __future__ import annotations

import json
import os
import re
import subprocess

from composer_dag.sandbox import Sandbox

_FINGERPRINT = r'''
import json, os, pwd, socket, subprocess, sys
def ver(*cmd):
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
        return (out.stdout or out.stderr).splitlines()[0].strip()
    except Exception as e:
        return f"unavailable: {type(e).__name__}"
def ls(d):
    try:
        return sorted(os.listdir(os.path.expanduser(d)))
    except OSError as e:
        return [f"<{e.strerror}>"]
mounts = []
with open("/proc/self/mountinfo") as f:
    for line in f:
        p = line.split()
        mounts.append(f"{p[4]} <- {p[3]} ({p[p.index('-') + 1]})")
uid = os.getuid()
print(json.dumps({
    "env": sorted(os.environ),
    "env_values": {k: os.environ.get(k) for k in ("HOME", "USER", "LOGNAME", "SHELL", "PATH", "LANG", "TERM")},
    "hostname": socket.gethostname(),
    "uid": uid, "user": pwd.getpwuid(uid).pw_name,
    "versions": {"python3": ver("python3", "--version"), "git": ver("git", "--version"),
                 "bash": ver("bash", "--version"), "ls": ver("ls", "--version"),
                 "grep": ver("grep", "--version"), "sed": ver("sed", "--version"),
                 "pytest": ver("python3", "-m", "pytest", "--version")},
    "python": {"executable": sys.executable, "prefix": sys.prefix, "path": sys.path[1:]},
    "layout": {d: ls(d) for d in ("/", "/home", "~", "/usr/local/bin", "/tmp", "/etc")},
    "mounts": mounts,
    "pid1": open("/proc/1/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")[:200],
    "processes": sorted({open(f"/proc/{p}/comm").read().strip() for p in os.listdir("/proc") if p.isdigit()
                         and os.path.exists(f"/proc/{p}/comm")}),
    "cgroup": open("/proc/self/cgroup").read().strip(),
}))
'''

TELL_TALES = re.compile(r"sandbox|bwrap|bubblewrap|container|docker|episode|\brl\b|rl_|_rl\b|reward|"
                        r"hidden|grader|rollout|composer|policy|(?<!ssh-)\bagent(?!-launch)", re.I)
"""Words that give the game away. A laptop's SSH agent (``gcr-ssh-agent``, ``agent-launch``) is not
one of them; a coding agent is."""


def fingerprint(sandbox: Sandbox | None = None) -> dict:
    """What a curious process can see: env names, tool versions, layout, hostname, uid, mounts."""
    if sandbox is None:
        out = subprocess.run(["python3", "-c", _FINGERPRINT], capture_output=True, text=True, timeout=60,
                             env={k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"})
        return json.loads(out.stdout)
    r = sandbox.run(["python3", "-c", _FINGERPRINT], timeout=60)
    if r.exit_code:
        raise RuntimeError(f"fingerprint failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout)


def realism_diff(host: dict, sandbox: dict) -> list[str]:
    """Every difference between two fingerprints, one line each."""
    out = []

    def walk(a, b, path):
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                walk(a.get(k), b.get(k), f"{path}.{k}" if path else k)
        elif isinstance(a, list) and isinstance(b, list) and all(isinstance(x, str) for x in a + b):
            only_h, only_s = sorted(set(a) - set(b)), sorted(set(b) - set(a))
            if only_h:
                out.append(f"{path}: only on host: {', '.join(only_h)}")
            if only_s:
                out.append(f"{path}: only in sandbox: {', '.join(only_s)}")
        elif a != b:
            out.append(f"{path}: host={a!r} sandbox={b!r}")

    walk(host, sandbox, "")
    return out


def tell_tales(fp: dict) -> list[str]:
    """Strings in a fingerprint that would give the game away."""
    hits = []

    def walk(x, path):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(k, path + "/key")
                walk(v, f"{path}.{k}")
        elif isinstance(x, list):
            for v in x:
                walk(v, path)
        elif isinstance(x, str) and TELL_TALES.search(x):
            hits.append(f"{path}: {x}")

    walk(fp, "")
    return hits

