"""An episode's action log read from a file, for grading a workspace from outside an episode
(``composer-dag env grade --actions LOG``, an external harness's episode).

The file is a JSON array of entries or JSON lines, one entry per call, in the contract of
``grading.flags.actions``: ``kind`` (one of ``KINDS``), ``command`` for ``exec``, ``path`` for
``read``/``list``/``search``/``write``, ``outside``. An entry that breaks the contract is skipped
and counted by reason; none is dropped silently.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

# exec: run a shell command; read/list/search: look at files; write: replace text in a file (or
# create it); submit: end the episode; other: a call that performs none of these
KINDS = ("exec", "read", "list", "search", "write", "submit", "other")
_PATH_KINDS = ("read", "list", "search", "write")


def check_entry(entry) -> str | None:
    """Why ``entry`` breaks the action-log contract, or None."""
    if not isinstance(entry, dict):
        return "not an object"
    kind = entry.get("kind", "other")
    if kind not in KINDS:
        return "unknown kind"
    if kind == "exec" and not isinstance(entry.get("command"), str):
        return "exec without a command string"
    if kind in _PATH_KINDS and not isinstance(entry.get("path", "."), str):
        return "path not a string"
    if not isinstance(entry.get("outside", False), bool):
        return "outside not a boolean"
    return None


def load_action_log(path) -> tuple[list[dict], dict[str, int]]:
    """The entries of the log at ``path`` and the skipped ones counted by reason. Raises
    ``ValueError`` for a file that is neither a JSON array nor JSON lines."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    skipped: Counter = Counter()
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            raw = json.loads(stripped)
        except ValueError as e:
            raise ValueError(f"{path}: not a JSON array of action entries ({e})") from None
    else:
        raw = []
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                raw.append(json.loads(line))
            except ValueError:
                skipped["not JSON"] += 1
    entries = []
    for e in raw:
        why = check_entry(e)
        if why:
            skipped[why] += 1
        else:
            entries.append(e)
    return entries, dict(skipped)
