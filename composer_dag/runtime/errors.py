"""Errors as one line: what a user sees when a step, a command or an entry point fails."""

from __future__ import annotations


def one_line(exc: BaseException, limit: int = 500) -> str:
    """An exception as one line: its first non-empty line, or its type when it has no text."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0][:limit] if lines else type(exc).__name__
