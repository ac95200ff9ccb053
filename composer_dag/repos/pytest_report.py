"""A pytest plugin (standard library only, loaded by name with ``-p``) that writes each test's
outcome by node id to the JSON file named by ``CDAG_PYTEST_REPORT``, and seeds ``random`` from
``CDAG_RANDOM_SEED`` before collection. Used by repository bootstrap runs, where the repository's
own code decides nothing but which of its tests are kept (grading uses the sealed runner, which
loads a copy of this file only for ``outcome_of``: one mapping of a report to its outcome).

Outcomes: ``passed``, ``failed``, ``error`` (setup or teardown failed), ``skipped``, ``xfailed``,
``xpassed``; a module that fails to collect is ``collect_error`` under its node id.
"""

import json
import os
import random


_results = {}
_messages = {}


def pytest_configure(config):
    seed = os.environ.get("CDAG_RANDOM_SEED")
    if seed:
        random.seed(int(seed))


def outcome_of(report):
    if report.skipped:
        return "xfailed" if hasattr(report, "wasxfail") else "skipped"
    if report.failed:
        return "failed" if report.when == "call" else "error"
    return "xpassed" if hasattr(report, "wasxfail") else "passed"


def pytest_runtest_logreport(report):
    if report.when != "call" and report.passed:
        return
    if _results.get(report.nodeid) in ("failed", "error"):
        return
    _results[report.nodeid] = outcome_of(report)
    if report.failed:
        # the failure as pytest shows it: its "E" lines (the assertion, the call, the values)
        text = str(report.longrepr)
        # and the line of the test that made the failing call (the first ">" line)
        lines = text.splitlines()
        call = next((l[1:].strip() for l in lines if l.startswith(">")), "")
        errors = [l[1:].strip() for l in lines if l.startswith("E ")]
        _messages[report.nodeid] = "\n".join(([call] if call else []) + errors[:12])[:2000] or text[-1000:]


def pytest_collectreport(report):
    if report.failed:
        _results[report.nodeid or "<collection>"] = "collect_error"
        lines = [l[1:].strip() for l in str(report.longrepr).splitlines() if l.startswith("E ")]
        _messages[report.nodeid or "<collection>"] = "\n".join(lines[-6:])[:1000] or str(report.longrepr)[-600:]


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("CDAG_PYTEST_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(_results, f, sort_keys=True)
        with open(path + ".messages", "w") as f:
            json.dump(_messages, f, sort_keys=True)
