"""Harnesses by name: the built-in ``composer``, and any other a module registers."""

from __future__ import annotations

from composer_dag.harness.base import Harness
from composer_dag.harness.composer import COMPOSER

_HARNESSES: dict[str, Harness] = {}


def register(harness: Harness) -> Harness:
    """Make ``harness`` known under its name (a second one of the same name replaces the first)."""
    if not harness.name or not harness.version:
        raise ValueError("a harness needs a name and a version")
    _HARNESSES[harness.name] = harness
    return harness


def get(name: str | Harness) -> Harness:
    """The harness called ``name`` (a harness given is returned as it is)."""
    if isinstance(name, Harness):
        return name
    try:
        return _HARNESSES[name]
    except KeyError:
        raise KeyError(f"unknown harness {name!r}; known: {', '.join(names())}") from None


def names() -> list[str]:
    return sorted(_HARNESSES)


register(COMPOSER)
