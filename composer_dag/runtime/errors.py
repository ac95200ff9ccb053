"""Errors as one line: what a user sees when a step, a command or an entry point fails."""

from __future__ import annotations

import re


def one_line(exc: BaseException, limit: int = 500) -> str:
    """An exception as one line: its first non-empty line, or its type when it has no text."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0][:limit] if lines else type(exc).__name__


_ERROR_LINE = re.compile(  # "[rank0]: pkg.mod.SomeError: message" (torchrun prefixes rank output)
    r"^(?:\[rank\d+\]:\s*)?(?:[A-Za-z_][\w.]*\.)?([A-Za-z_]\w*(?:Error|Exception|Interrupt|Failure)): ?(.*)$")


def error_line(lines) -> str:
    """``SomeError: message`` of the last exception in ``lines`` (launcher wrappers such as
    torchrun's ChildFailedError skipped), or ''."""
    for line in reversed(list(lines)):
        m = _ERROR_LINE.match(line.strip())
        if m and m.group(1) not in ("ChildFailedError", "KeyboardInterrupt"):
            return f"{m.group(1)}: {m.group(2)}"[:300].rstrip(": ")
    return ""
