"""The realism battery: probes a model could run, judged against a laptop profile generated from
a Debian root; run in the sandbox and on the host; the command that prints the differences."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from composer_dag.envs.probes import PROBE_AREAS, PROBES, PROFILE_PATH, load_profile, run_battery, sandbox_realism

ROOT = Path(__file__).resolve().parent.parent


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
def reports():
    return {"sandbox": sandbox_realism(), "host": run_battery(None)}


def test_every_probe_answers_in_the_sandbox_and_on_the_host(reports):
    for where, rep in reports.items():
        assert set(rep["outputs"]) == {p.name for p in PROBES}, where
        assert rep["count"] == len(rep["differences"]) == sum(bool(v) for v in rep["verdicts"].values())
    # the sandbox's answers never name the host's paths
    text = "\n".join(reports["sandbox"]["outputs"].values())
    assert str(ROOT) not in text and sys.prefix not in text


def test_the_battery_sees_the_tells_a_model_would_see(reports):
    """The tells a model finds in one read today, each found by its probe (the count falls to the
    allowlist as they are closed)."""
    v = reports["sandbox"]["verdicts"]
    for probe in ("proc.pid1_comm", "proc.count", "proc.ancestry", "etc.passwd", "etc.group", "etc.entries",
                  "net.interfaces", "net.route", "sys.top", "dev.count", "run.user", "priv.no_new_privs",
                  "tmp.entries", "home.history"):
        assert v[probe], (probe, reports["sandbox"]["outputs"][probe][:300])
    assert re.search(r"only network interface is lo", v["net.interfaces"])


def test_realism_command_prints_each_difference_and_the_count(tmp_path):
    r = subprocess.run([sys.executable, "-m", "composer_dag.cli", "sandbox", "realism", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["probes"] == len(PROBES) and summary["differences"] > 0
    assert f"{summary['differences']} of {len(PROBES)} probes tell the sandbox from a laptop" in r.stdout
    assert "proc.pid1_comm: " in r.stdout and "    sandbox: " in r.stdout and "    host:    " in r.stdout
