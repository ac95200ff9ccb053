"""pass@k (the unbiased estimator of Chen et al. 2021) and its aggregation over tasks."""

from __future__ import annotations

import math
from collections import defaultdict


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` samples drawn without replacement from ``n``
    (``c`` of them correct) is correct: ``1 - C(n-c, k) / C(n, k)``, computed as a product
    so that large ``n`` neither overflows nor loses precision."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def stderr(p: float, n: int) -> float:
    """Standard error of a mean success rate ``p`` over ``n`` tasks (binomial)."""
    return math.sqrt(max(p * (1.0 - p), 0.0) / n) if n else 0.0


def aggregate(per_task: dict[str, dict], ks) -> dict:
    """``per_task``: task id -> {"source", "n", "c"}. Returns the mean pass@k over tasks for
    every ``k <= min(n)``, overall and by source, with the task count and pass@1's stderr."""
    def block(items: list[dict]) -> dict:
        if not items:
            return {"tasks": 0, "pass_at": {}, "pass@1": None, "pass@1_stderr": None}
        n_min = min(t["n"] for t in items)
        pa = {str(k): sum(pass_at_k(t["n"], t["c"], k) for t in items) / len(items)
              for k in sorted(set(ks)) if k <= n_min}
        p1 = pa.get("1")
        return {"tasks": len(items), "pass_at": pa, "pass@1": p1,
                "pass@1_stderr": None if p1 is None else stderr(p1, len(items))}

    by_source = defaultdict(list)
    for t in per_task.values():
        by_source[t["source"]].append(t)
    out = block(list(per_task.values()))
    out["by_source"] = {s: block(v) for s, v in sorted(by_source.items())}
    return out
