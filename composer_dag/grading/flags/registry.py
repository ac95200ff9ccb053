"""The registry of cheat detectors and of the flag prefixes they make, each with its family.

A detector is a function registered with ``@detector(family=..., flags=(...), phase=...)``: the
family it counts under, the flag prefixes it makes (what comes before ``:``) and the phase it
runs in, which says what it is given and what it returns:

- ``tree``: the workspace's files (a ``source.Workspace``: the task's original tree, the final
  tree, the changed paths, the hidden tests); returns flags.
- ``module``: one changed solution module's AST; returns a count, and the module is flagged
  ``<prefix>:<path>`` (its one prefix) when the count grew against the original module's.
- ``action``: one entry of the episode's action log (``actions``' contract); returns flags.
- ``behaviour``: one run's details as the runner and the grader saw them; returns flags.

Flags that the grader's own steps make, not a detector (a canary passed, a run left unsealed,
a source the rules cannot walk), are registered with ``register``. ``flag(prefix, detail)``
refuses a prefix not registered, and ``flag_family`` refuses one too: no flag is ever counted
under a family by accident.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

PHASES = ("tree", "module", "action", "behaviour")

FAMILIES: dict[str, str] = {}
"""Every flag prefix with its family."""

DETECTORS: list["Detector"] = []
"""The registered detectors, in the order they run."""

_STEP_PREFIXES: set[str] = set()  # registered by ``register``, not by a detector


@dataclass(frozen=True)
class Detector:
    fn: Callable
    family: str
    flags: tuple[str, ...]
    phase: str

    @property
    def name(self) -> str:
        return self.fn.__name__


def _claim(family: str, prefix: str) -> None:
    if FAMILIES.get(prefix, family) != family:
        raise ValueError(f"flag prefix {prefix!r} is registered twice ({FAMILIES[prefix]}, {family})")
    FAMILIES[prefix] = family


def register(family: str, *prefixes: str) -> None:
    """Register ``prefixes`` (what the grader's own steps put before ``:``) as the family ``family``;
    a prefix is registered once: again under another family is an error."""
    for prefix in prefixes:
        if prefix in FAMILIES:
            raise ValueError(f"flag prefix {prefix!r} is registered twice ({FAMILIES[prefix]}, {family})")
        FAMILIES[prefix] = family
        _STEP_PREFIXES.add(prefix)


def detector(*, family: str, flags: tuple[str, ...], phase: str):
    """Register the decorated function as a detector of ``family`` that makes ``flags`` (prefixes)
    in ``phase``; several detectors may make one prefix, always under one family."""
    if phase not in PHASES:
        raise ValueError(f"detector phase {phase!r} is none of {PHASES}")
    if phase == "module" and len(flags) != 1:
        raise ValueError("a module detector makes one flag prefix")

    def add(fn: Callable) -> Callable:
        for prefix in flags:
            _claim(family, prefix)
        DETECTORS.append(Detector(fn, family, tuple(flags), phase))
        return fn
    return add


def unregister(fn: Callable) -> None:
    """Take the detector ``fn`` out again, and the prefixes that only it made."""
    DETECTORS[:] = [d for d in DETECTORS if d.fn is not fn]
    kept = _STEP_PREFIXES | {p for d in DETECTORS for p in d.flags}
    for prefix in [p for p in FAMILIES if p not in kept]:
        del FAMILIES[prefix]


def detectors(phase: str) -> list[Detector]:
    return [d for d in DETECTORS if d.phase == phase]


def flag(prefix: str, detail: object) -> str:
    """The flag ``prefix:detail``; ``prefix`` must be registered with a family."""
    if prefix not in FAMILIES:
        raise ValueError(f"cheat flag prefix {prefix!r} is not registered with a family (flags.registry)")
    return f"{prefix}:{detail}"


def flag_family(text: str) -> str:
    """The family of a flag (``prefix:detail``); an unregistered prefix is an error."""
    prefix = text.split(":", 1)[0]
    if prefix not in FAMILIES:
        raise ValueError(f"cheat flag {text[:80]!r} has no registered family (known prefixes: {', '.join(FAMILIES)})")
    return FAMILIES[prefix]


def flag_families(flags: list[str]) -> list[str]:
    return list(dict.fromkeys(flag_family(f) for f in flags))


register("canary", "canary_passed")
register("unsealed", "unsealed_run")
register("unreadable", "shape_unreadable")
