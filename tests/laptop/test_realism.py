"""The realism battery: probes a model could run, judged against a laptop profile generated from
a Debian root; run in the sandbox and on the host; the command that prints the differences."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from composer_dag.laptop.probes import PROBE_AREAS, PROBES, PROFILE_PATH, load_profile, run_battery

ROOT = Path(__file__).resolve().parents[2]


def test_the_battery_covers_every_area_and_the_profile_names_its_sources():
    assert len(PROBES) >= 40 and len({p.name for p in PROBES}) == len(PROBES)
    assert {p.area for p in PROBES} == set(PROBE_AREAS)
    data = json.loads(PROFILE_PATH.read_text())
    assert "debootstrap" in data["source"] and data["packages"]
    assert all(set(v) == {"value", "source"} and v["source"] for v in data["entries"].values())
    profile = load_profile()
    # the profile is a laptop's, read from the Debian root: system users and services of a desktop
    assert {"root", "messagebus", "systemd-network", "avahi"} <= set(profile["passwd_users"])
    assert {"sudo", "plugdev", "netdev"} <= set(profile["group_names"])
    assert "NetworkManager" in profile["service_comms"] and profile["process_min"] >= 20
    assert {".bashrc", ".profile"} <= set(profile["home_entries"])
    assert ".X11-unix" in profile["tmp_entries"]


@pytest.fixture(scope="module")
def realism_cli(tmp_path_factory):
    """One run of ``composer-dag sandbox realism --json``: its stdout and both reports."""
    tmp = tmp_path_factory.mktemp("realism")
    (tmp / "project").mkdir()
    r = subprocess.run([sys.executable, "-m", "composer_dag.cli", "sandbox", "realism", str(tmp / "project"),
                        "--json", str(tmp / "reports.json")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout, json.loads((tmp / "reports.json").read_text())


@pytest.fixture(scope="module")
def reports(realism_cli):
    return realism_cli[1]


def test_every_probe_answers_in_the_sandbox_and_on_the_host(reports):
    for where, rep in reports.items():
        assert set(rep["outputs"]) == {p.name for p in PROBES}, where
        assert rep["count"] == len(rep["differences"]) == sum(bool(v) for v in rep["verdicts"].values())
    # the sandbox's answers never name the host's paths
    text = "\n".join(reports["sandbox"]["outputs"].values())
    assert str(ROOT) not in text and sys.prefix not in text


# What still tells, each with what closes it; the sandbox's differences must be among these, so a
# new tell fails here, and a closed one is struck off.
STILL_OPEN: set[str] = set()
# the tells the issue found in one read: none may be allowed, whatever the host shows
NEVER_ALLOWED = {"mounts.paths", "proc.pid1_cmdline", "proc.pid1_comm", "proc.count", "etc.entries", "etc.passwd",
                 "etc.group", "net.interfaces", "dev.count", "priv.no_new_privs", "tmp.entries", "home.history",
                 "run.user"}


def test_the_allowlist_is_short_and_says_why_and_what_to_do():
    from composer_dag.laptop.probes import ALLOWLIST

    assert len(ALLOWLIST) <= 8 and set(ALLOWLIST) <= {p.name for p in PROBES}
    assert not set(ALLOWLIST) & NEVER_ALLOWED and not set(ALLOWLIST) & STILL_OPEN
    assert all(len(why) > 30 and len(fix) > 20 for why, fix in ALLOWLIST.values())


def test_the_battery_sees_the_tells_a_model_would_see(reports):
    """The tells a model finds in one read: those closed stay closed (process 1 and the process
    list, /dev, the mount points, a laptop's /etc, home, history, /tmp, /run/user, /sys, locale,
    time zone, session variables, groups, tools), the rest are each found by their probe."""
    from composer_dag.laptop.probes import ALLOWLIST, ISOLATION_TRACES, open_tells

    v = reports["sandbox"]["verdicts"]
    assert {d.split(":")[0] for d in open_tells(reports["sandbox"])} <= STILL_OPEN
    # what is allowed shows through from the host (the host's own answer differs the same way), or
    # is what isolation keeps: / read-only and nosuid, where the host's is neither
    for probe in set(ALLOWLIST) & {d.split(":")[0] for d in reports["sandbox"]["differences"]} - ISOLATION_TRACES:
        assert reports["host"]["verdicts"][probe], (probe, v[probe])
    assert ISOLATION_TRACES <= set(ALLOWLIST) and ISOLATION_TRACES == {"mounts.options"}
    assert set(reports["sandbox"]["outputs"]["mounts.options"].strip().split(",")) >= {"ro", "nosuid", "nodev"}
    assert v["mounts.options"] and reports["host"]["verdicts"]["mounts.options"] is None
    for probe in ("proc.pid1_cmdline", "proc.pid1_comm", "proc.count", "proc.services", "proc.session",
                  "proc.ancestry", "proc.exe", "ns.same_as_init", "dev.entries", "dev.count", "mounts.points",
                  "mounts.types",
                  "etc.passwd", "etc.group", "etc.entries", "etc.locale", "etc.timezone", "etc.hostname",
                  "run.user", "tmp.entries", "home.history", "home.dotfiles", "home.config", "home.cache",
                  "env.names", "env.lang", "priv.groups", "tools.installed", "tools.editors", "net.interfaces",
                  "net.address", "net.route", "net.lookup", "net.connect", "priv.no_new_privs", "priv.seccomp",
                  "mounts.paths", "disk.df"):
        assert v[probe] is None, (probe, v[probe], reports["sandbox"]["outputs"][probe][:300])
    out = reports["sandbox"]["outputs"]
    # /sys is there, and is the kernel's as the host has it (at most what the host lacks is missing)
    assert v["sys.top"] is None or "(hypervisor)" in v["sys.top"], v["sys.top"]
    # process 1 is an init, and the probe's shell runs in a terminal of the user's session
    assert out["proc.pid1_cmdline"].strip() == "/sbin/init" and out["proc.pid1_comm"].strip() == "systemd"
    assert out["proc.ancestry"].split()[-3:] == ["gnome-terminal-", "systemd", "systemd"], out["proc.ancestry"]
    # a laptop whose Wi-Fi is up and whose router does not answer
    assert "Temporary failure in name resolution" in out["net.lookup"]
    assert re.search(r"seconds=[0-4]\.\d+ OSError: No route to host", out["net.connect"]), out["net.connect"]


def test_realism_command_prints_each_difference_and_the_count(realism_cli):
    stdout, reports = realism_cli
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["probes"] == len(PROBES) and summary["differences"] == reports["sandbox"]["count"] > 0
    assert summary["open"] == len(STILL_OPEN) == 0 and "allowed: " in stdout
    assert f"{summary['differences']} of {len(PROBES)} probes tell the sandbox from a laptop" in stdout
    assert "kernel.release: " in stdout and "    sandbox: " in stdout and "    host:    " in stdout
    # every mount inside is a file system's root, or sits at its own path in one: no host path
    assert reports["sandbox"]["verdicts"]["mounts.paths"] is None
    assert "/" == reports["sandbox"]["outputs"]["mounts.paths"].split("\n")[0].split()[3]


def test_the_battery_in_a_grading_run_sees_what_the_episode_sees(tmp_path, reports):
    """Grading runs the hidden tests in a sandbox of its own, with the episode's persona under
    an identity of its own (another uid): the battery there finds no tell the episode's sandbox
    does not have."""
    from dataclasses import replace

    from composer_dag.grading.checks import RUNNER, RUNNER_PATH, SCRATCH, grading_sandbox
    from composer_dag.laptop.image import task_persona
    from composer_dag.sandbox import IDENTITY_UIDS, Bind, Limits, identity_lease, scratch, volume_workspace
    from composer_dag.sandbox.volumes import unmounting
    from composer_dag.harness.episode import Episode

    task_dir = tmp_path / "task"
    (task_dir / "repo").mkdir(parents=True)
    (task_dir / "repo" / "app.py").write_text("x = 1\n")
    task = {"id": "shop-1234", "project": "shop", "instructions": "nothing"}
    (task_dir / "task.json").write_text(json.dumps(task))
    persona = task_persona(task)
    with Episode(task_dir) as ep:
        assert ep.sandbox.persona == persona and ep.root == f"/home/{persona.user}/shop"
    # as ``run_checks`` lays a run out: the workspace in a /home of its own, the runner in a /var/tmp of its own
    vol, ws = volume_workspace(persona, "shop", Limits(), tmp_path / "grade")
    var = scratch(tmp_path / "var", Limits())
    shutil.copy2(RUNNER, var / Path(RUNNER_PATH).name)
    with unmounting(str(tmp_path / "var")), identity_lease() as uid, \
            grading_sandbox(task, ws, Limits(), [Bind(var, SCRATCH, writable=True)], uid, volume=vol) as sb:
        assert uid in IDENTITY_UIDS and sb.persona == replace(persona, uid=uid, gid=uid)
        rep = run_battery(sb)
        who = sb.run("whoami; hostname; id -u; id -g; stat -c %u ~ .; ls /run/user").stdout.split()
        assert sb.run(f"test -f {RUNNER_PATH}").exit_code == 0
    vol.close()
    assert who == [persona.user, persona.hostname, str(uid), str(uid), str(uid), str(uid), str(uid)], who
    from composer_dag.laptop.probes import open_tells

    assert {d.split(":")[0] for d in open_tells(rep)} <= STILL_OPEN, rep["differences"]


def test_personas_vary_with_the_seed_and_share_what_does_not_depend_on_them(tmp_path):
    from composer_dag.laptop.image import LOCALES, persona_for, persona_runtime, runtime
    from composer_dag.laptop.desktop import dressing
    from composer_dag.sandbox import Sandbox

    drawn = [persona_for(f"task-{i}") for i in range(200)]
    assert persona_for("task-7") == drawn[7]  # the same task, the same persona
    for field, least in (("user", 25), ("hostname", 60), ("timezone", 12), ("locale", 6), ("editor", 2),
                         ("full_name", 100)):
        assert len({getattr(p, field) for p in drawn}) >= least, field
    assert all(p.uid == 1000 and p.user.isalpha() for p in drawn)
    # every locale a persona can have is generated on this machine (make system-deps)
    have = set(subprocess.run(["locale", "-a"], capture_output=True, text=True).stdout.split())
    assert {f"{x}.utf8" for x in LOCALES} <= have and {p.locale.replace("UTF-8", "utf8") for p in drawn} <= have

    a, b = drawn[1], next(p for p in drawn if p.user != drawn[1].user and p.timezone != drawn[1].timezone)
    ra, rb = persona_runtime(a), persona_runtime(b)
    assert ra != rb and runtime() == runtime()
    # a persona's own files are a few kilobytes: its /etc is hard links into the shared one
    own = sum(f.stat().st_size for f in ra.rglob("*")
              if f.is_file() and not f.is_symlink() and f.stat().st_nlink == 1 and f.suffix != ".ext4")
    assert own < 200_000, own
    # its root image (where the host makes file systems) is a laptop's disk, sparse: megabytes written
    for img in ra.glob("*.ext4"):
        assert img.stat().st_size >= 256 * 10**9 and img.stat().st_blocks * 512 < 64 << 20
    ws = tmp_path / "shop"
    ws.mkdir()
    (ws / "cart.py").write_text("x = 1\n")
    for p in (a, b):
        with Sandbox(ws, dressing=dressing(p)) as sb:
            r = sb.run("whoami; hostname; cat /etc/timezone; echo $LANG; locale >/dev/null; git config user.name; "
                       "grep -c . ~/.bash_history; grep -m1 -o 'cd ~/shop' ~/.bash_history; pwd; id -Gn")
        assert r.exit_code == 0 and r.stderr == "", r.stderr
        lines = r.stdout.splitlines()
        assert lines[:5] == [p.user, p.hostname, p.timezone, p.locale, p.full_name], lines
        assert int(lines[5]) >= 20 and lines[6] == "cd ~/shop" and lines[7] == f"/home/{p.user}/shop"
        assert {"sudo", "plugdev", "netdev"} <= set(lines[8].split())


def test_the_runtime_cache_evicts_what_no_one_has_used_for_days(tmp_path, monkeypatch):
    import os
    import time

    from composer_dag.laptop import image as rootfs

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    made = []

    from composer_dag.sandbox import volumes

    def build(name, image=False):
        def make(tmp):
            made.append(name)
            (tmp / "f").write_text(name)
            if image:  # a tree with an image the sandbox mounts (a persona's root.ext4)
                (tmp / "t").mkdir()
                volumes.tree_image(tmp / "t", tmp / "t.ext4")
        return rootfs._build("persona", [name], make)

    def age(root, seconds):
        t = time.time() - seconds
        os.utime(root / ".ok", (t, t))

    stale, used, fresh = build("stale", image=volumes.available()), build("used"), build("fresh")
    mounted = volumes.image(stale / "t.ext4") if volumes.available() else None
    assert mounted is None or os.path.ismount(mounted)
    age(stale, 4 * 86400)  # unused for four days: past the default three
    age(used, 4 * 86400)
    age(fresh, 2 * 86400)
    half = rootfs.cache_root() / ".build-killed"  # left by a process killed mid-build
    half.mkdir()
    os.utime(half, (time.time() - 7200,) * 2)
    assert build("used") == used and made == ["stale", "used", "fresh"]  # a hit builds nothing...
    assert time.time() - (used / ".ok").stat().st_mtime < 60  # ...and marks the tree used
    new = build("new")
    assert made[-1] == "new" and (new / "f").read_text() == "new"
    assert not stale.exists() and not half.exists()  # the new build evicted the stale tree and the half-made one
    assert mounted is None or not os.path.ismount(mounted)  # and let go of its image's mount
    assert (used / "f").read_text() == "used" and (fresh / "f").read_text() == "fresh"
    monkeypatch.setenv("CDAG_RT_MAX_AGE_DAYS", "1")
    build("newer")
    assert not fresh.exists() and used.exists() and new.exists()


def with_printer(d, tmp_path):
    """A toy realism feature, all in one function of the laptop's side: a laptop's printing as a
    reader sees it (CUPS's runtime directory, the default printer a GNOME session's user set, a
    message of the day that names the office). Nothing in composer_dag/sandbox/ changes for it."""
    from dataclasses import replace

    motd = tmp_path / "motd"
    motd.write_text("Printers: Office_LaserJet (2nd floor)\n")
    return replace(d, overlays=d.overlays + ((motd, "/etc/motd"),),
                   mounts=d.mounts + ("--perms", "0755", "--dir", "/run/cups"),
                   env=dict(d.env, PRINTER="Office_LaserJet"))


def test_a_realism_feature_is_one_function_of_the_laptop_and_shows_in_a_real_sandbox(tmp_path):
    from composer_dag.laptop.desktop import dressing
    from composer_dag.sandbox import Sandbox

    ws = tmp_path / "shop"
    ws.mkdir()
    plain, dressed = dressing(), with_printer(dressing(), tmp_path)
    probe = "cat /etc/motd; stat -c %a /run/cups; echo \"printer=$PRINTER\"; echo $XDG_CURRENT_DESKTOP"
    with Sandbox(ws, dressing=dressed) as sb:
        r = sb.run(probe)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines() == ["Printers: Office_LaserJet (2nd floor)", "755", "printer=Office_LaserJet", "GNOME"]
    with Sandbox(ws, dressing=plain) as sb:  # the laptop without the feature: none of it
        r = sb.run(probe)
    assert "Office_LaserJet" not in r.stdout and "printer=\n" in r.stdout and "GNOME" in r.stdout
