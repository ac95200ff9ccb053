"""Contamination guard: does any eval task's text or solution appear in the training shards?

Each task contributes one item to a ``dedup.ContaminationIndex`` (word n-grams, the same
hashing and rules as the corpus decontamination step): its instructions, hidden tests and
reference solution. A shard text is contaminated when it shares an n-gram with an item;
the report names the task, the part of the task that leaked, and the n-gram.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import numpy as np

from ..dedup.decontam import ContaminationIndex
from ..dedup.text import ngram_hashes


def task_parts(task_dir) -> dict[str, str]:
    """``{part: text}``: ``instructions``, ``hidden_tests/<path>``, ``reference/<path>``."""
    d = Path(task_dir)
    task = json.loads((d / "task.json").read_text())
    parts = {"instructions": task.get("instructions", "")}
    # a repository task's own tests are its FAIL_TO_PASS files (the rest of its tree is the public
    # repository's suite, as ``task_format.task_texts`` has it for the decontamination set)
    own = {f for t in (task.get("tests") or {}).get("FAIL_TO_PASS", []) for f in [t.split("::", 1)[0]]} \
        if task.get("framework") == "pytest" else None
    for base in ("hidden_tests", "reference/files"):
        for p in sorted((d / base).rglob("*")) if (d / base).is_dir() else []:
            if base == "hidden_tests" and own is not None and p.relative_to(d / base).as_posix() not in own:
                continue
            if p.is_file():
                try:
                    parts[f"{base.split('/')[0]}/{p.relative_to(d / base).as_posix()}"] = p.read_text()
                except UnicodeDecodeError:
                    continue
    return parts


def task_index(tasks_dir, n: int = 10, min_word_tokens: int = 6,
               max_items: int = 3) -> tuple[ContaminationIndex, dict[str, dict[str, str]]]:
    """The index over every task under ``tasks_dir`` and each task's parts."""
    parts = {}
    for tj in sorted(Path(tasks_dir).glob("*/task.json")):
        parts[json.loads(tj.read_text()).get("id", tj.parent.name)] = task_parts(tj.parent)
    items = [(tid, "\n".join(p.values())) for tid, p in parts.items()]
    return ContaminationIndex(items, n=n, min_word_tokens=min_word_tokens, max_items=max_items), parts


def contamination_report(shard_texts_iter: Iterable, tasks_dir, n: int = 10, min_word_tokens: int = 6,
                         max_items: int = 3) -> list[dict]:
    """One row per contaminated shard text: ``{shard_item, task_id, part, ngram}``; [] if clean.

    ``shard_texts_iter`` yields texts or ``(name, text)`` pairs (e.g. shard row id and content).
    """
    index, parts = task_index(tasks_dir, n, min_word_tokens, max_items)
    found = []
    for k, item in enumerate(shard_texts_iter):
        name, text = item if isinstance(item, tuple) else (k, item)
        hit = index.first_match(text or "")
        if hit is None:
            continue
        task_id, ngram = hit
        gram = ngram_hashes(ngram, n)
        part = next((p for p, t in parts.get(task_id, {}).items() if np.isin(gram, ngram_hashes(t, n)).any()), "?")
        found.append({"shard_item": name, "task_id": task_id, "part": part, "ngram": ngram})
    return found
