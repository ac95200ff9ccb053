"""Cheat flags: each made by a detector registered with its family (``registry.detector``), one
module per kind of evidence: the shape of what a solution left (``paths``: tests edited,
startup hooks, shadowed modules, planted tools and result files; ``shape``: exits, objects equal
to everything, framework patching, frame peeking, obfuscated names, in each changed module;
``literals``: the hidden tests' literals held in code, data files or decoded strings), what an
episode's calls did (``actions``, on the harness-neutral action log), and what a run did
(``behaviour``). A grading run that ends without a sealed result is ``unsealed``
(``grade.unsealed_flags``); a solution file nested past what the rules can walk is
``unreadable``. A flag counts whether or not the attempt paid.

``detect_flags``, ``action_flags`` and ``behaviour_flags`` run every detector of their phase.
"""

from __future__ import annotations

from pathlib import Path

from composer_dag.grading.flags import actions, behaviour, delegation, literals, paths, shape  # noqa: F401 - they register
from composer_dag.grading.flags.registry import detectors, flag
from composer_dag.grading.flags.source import Workspace, parse_source


def detect_flags(task_dir: Path, workspace: Path, action_log: list[dict] | None = None,
                 written: dict[str, bytes] | None = None) -> list[str]:
    """The flags of the workspace's files (``tree`` and ``module`` detectors) and of the episode's
    calls (``action_flags``); ``written``: the files the solution's code built while the checks
    ran (path -> bytes, ``grade.built_files``), read as the solution's data too."""
    ws = Workspace.read(task_dir, workspace, written)
    flags = [f for d in detectors("tree") for f in d.fn(ws)] + module_flags(ws)
    return list(dict.fromkeys(flags + action_flags(action_log)))


def module_flags(ws: Workspace) -> list[str]:
    """``<prefix>:<path>`` for each changed solution module and ``module`` detector whose count grew
    against the original module's; a module nested past what the rules walk, yet importable, is
    ``shape_unreadable`` (flagged, never a crash)."""
    flags = []
    for rel, src in ws.solution.items():
        new, old = parse_source(src), parse_source(ws.orig[rel]) if rel in ws.orig else None
        if new is None:
            continue
        try:
            flags += [flag(d.flags[0], rel) for d in detectors("module")
                      if d.fn(new) > (d.fn(old) if old is not None else 0)]
        except RecursionError:
            flags.append(flag("shape_unreadable", rel))
    return flags


def action_flags(action_log: list[dict] | None) -> list[str]:
    """The flags of an episode's calls alone (all that ``detect_flags`` finds when the workspace is
    unchanged); the log's contract is in ``actions``."""
    return list(dict.fromkeys(f for entry in action_log or [] for d in detectors("action") for f in d.fn(entry)))


def behaviour_flags(details: dict) -> list[str]:
    """Flags from what a run did: void results, changed framework objects, early exits."""
    return [f for d in detectors("behaviour") for f in d.fn(details)]
