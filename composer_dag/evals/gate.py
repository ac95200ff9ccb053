"""The promotion gate: a candidate may not be worse than a baseline on pass@1 beyond the
noise of the estimator, nor show more cheat flags.

Noise: the standard error of a pass@1 mean over N tasks is ``sqrt(p (1 - p) / N)``; the two
are combined as ``sqrt(se_c**2 + se_b**2)`` and the candidate fails when
``p_c < p_b - noise_sigmas * se``.
"""

from __future__ import annotations

import math
from typing import Optional

from ..runtime.config import StageConfig
from .metrics import stderr


class GateConfig(StageConfig):
    """The promotion gate: the candidate may not be worse than its parent on pass@1 beyond
    ``noise_sigmas`` standard errors, nor raise its cheat-flag rate by more than
    ``max_flag_rate_increase``; ``required_gain`` (default None: the noise rule alone) asks for a
    pass@1 gain on top."""

    noise_sigmas: float = 2.0
    max_flag_rate_increase: float = 0.0
    required_gain: Optional[float] = None

# informational rows (never gating): label, summary path
INFO = (("HumanEval fn-completion pass@1", ("humaneval", "pass@1")),
        ("val perplexity", ("perplexity", "val_ppl")),
        ("tokens / solved task", ("cost", "tokens_per_solved_task")),
        ("tokens / s", ("cost", "tokens_per_s")))


def _get(summary: dict, path):
    for k in path:
        if not isinstance(summary, dict) or summary.get(k) is None:
            return None
        summary = summary[k]
    return summary


def _value(summary: dict, metric: str) -> tuple:
    """(value, task count) of a metric: a key of the summary or a dotted path into it
    (``humaneval.pass@1``, ``by_source.humaneval.pass@1``); the count is the sibling
    ``num_tasks`` / ``tasks`` / ``problems``."""
    *parent, key = metric.split(".")
    d = _get(summary, parent) if parent else summary
    if not isinstance(d, dict):
        return None, 0
    return d.get(key), d.get("num_tasks") or d.get("tasks") or d.get("problems") or 0


def _noise_check(metric: str, cand: dict, base: dict, sigmas: float) -> dict:
    (pc, nc), (pb, nb) = _value(cand, metric), _value(base, metric)
    if pc is None or pb is None:
        return {"metric": metric, "candidate": pc, "baseline": pb, "delta": None, "threshold": None,
                "ok": False, "reason": f"{metric} missing from {'candidate' if pc is None else 'baseline'}"}
    se = math.sqrt(stderr(pc, nc) ** 2 + stderr(pb, nb) ** 2)
    threshold = pb - sigmas * se
    ok = pc >= threshold - 1e-12
    return {"metric": metric, "candidate": pc, "baseline": pb, "delta": pc - pb, "threshold": threshold,
            "ok": ok, "reason": None if ok else
            f"{metric} {pc:.4f} is below the baseline's {pb:.4f} by more than {sigmas:g} sigma "
            f"(se {se:.4f}, threshold {threshold:.4f}, tasks {nc} vs {nb})"}


def compare(candidate_summary: dict, baseline_summary: dict, noise_sigmas: float = 2.0,
            max_flag_rate_increase: float = 0.0, metrics=("pass@1",),
            candidate_name: str = "candidate", baseline_name: str = "baseline") -> dict:
    """``{passed, reasons, rows, candidate, baseline}``; ``rows`` are table rows
    ``{metric, candidate, baseline, delta, threshold, ok, gating}``. ``metrics``: the
    success rates held to the noise rule (e.g. add ``"humaneval.pass@1"``)."""
    rows, reasons = [], []
    for m in metrics:
        row = _noise_check(m, candidate_summary, baseline_summary, noise_sigmas)
        rows.append({**row, "gating": True})
    fc, fb = candidate_summary.get("flag_rate"), baseline_summary.get("flag_rate")
    if fc is None or fb is None:
        rows.append({"metric": "cheat-flag rate", "candidate": fc, "baseline": fb, "delta": None, "threshold": None,
                     "ok": False, "gating": True, "reason": "flag_rate missing"})
    else:
        ok = fc <= fb + max_flag_rate_increase + 1e-12
        rows.append({"metric": "cheat-flag rate", "candidate": fc, "baseline": fb, "delta": fc - fb,
                     "threshold": fb + max_flag_rate_increase, "ok": ok, "gating": True,
                     "reason": None if ok else f"cheat-flag rate {fc:.4f} exceeds the baseline's {fb:.4f} "
                                               f"+ allowed {max_flag_rate_increase:g}"})
    for label, path in INFO:
        c, b = _get(candidate_summary, path), _get(baseline_summary, path)
        if c is not None or b is not None:
            rows.append({"metric": label, "candidate": c, "baseline": b,
                         "delta": c - b if c is not None and b is not None else None,
                         "threshold": None, "ok": None, "gating": False, "reason": None})
    reasons = [r["reason"] for r in rows if r["gating"] and not r["ok"]]
    return {"passed": not reasons, "reasons": reasons, "rows": rows,
            "candidate": candidate_name, "baseline": baseline_name,
            "candidate_digest": candidate_summary.get("checkpoint_digest"),
            "baseline_digest": baseline_summary.get("checkpoint_digest")}


def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) >= 10 else f"{v:.4f}"
    return str(v)


def report_markdown(comparisons: list[dict]) -> str:
    """One table for a candidate against several baselines (e.g. its parent and the last
    promoted checkpoint): a value and delta column per baseline, then the verdicts."""
    if not comparisons:
        return "_no comparison_\n"
    metrics = list(dict.fromkeys(r["metric"] for c in comparisons for r in c["rows"]))
    head = ["metric", comparisons[0]["candidate"]]
    for c in comparisons:
        head += [c["baseline"], f"Δ vs {c['baseline']}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in metrics:
        cand = next((r["candidate"] for c in comparisons for r in c["rows"] if r["metric"] == m), None)
        cells = [m + (" (gate)" if any(r["gating"] for c in comparisons for r in c["rows"] if r["metric"] == m) else ""),
                 _fmt(cand)]
        for c in comparisons:
            r = next((r for r in c["rows"] if r["metric"] == m), None)
            if r is None:
                cells += ["–", "–"]
                continue
            mark = "" if r["ok"] is None else " ✅" if r["ok"] else " ❌"
            cells += [_fmt(r["baseline"]), (("+" if (r["delta"] or 0) > 0 else "") + _fmt(r["delta"])) + mark]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for c in comparisons:
        verdict = "passes" if c["passed"] else "fails"
        lines.append(f"- vs **{c['baseline']}**: {verdict}" + "".join(f"\n  - {r}" for r in c["reasons"]))
    return "\n".join(lines) + "\n"


def decide(summaries: dict[str, dict], candidate: str, parent: str, cfg: GateConfig,
           others: dict[str, dict] | None = None) -> dict:
    """The gate's verdict for ``candidate`` against ``parent`` (both keys of ``summaries``),
    with comparisons against every other summary (``summaries`` and ``others``, e.g. the last
    promoted model) for the report. ``{passed, reasons, gain, comparisons, report}``."""
    kw = {"noise_sigmas": cfg.noise_sigmas, "max_flag_rate_increase": cfg.max_flag_rate_increase}
    cand = summaries[candidate]
    baselines = [(parent + " (parent)", summaries[parent])]
    baselines += [(k, s) for k, s in summaries.items() if k not in (candidate, parent)]
    baselines += list((others or {}).items())
    comparisons = [compare(cand, s, **kw, candidate_name=candidate, baseline_name=name) for name, s in baselines]
    gain = (cand.get("pass@1") or 0.0) - (summaries[parent].get("pass@1") or 0.0)
    reasons = list(comparisons[0]["reasons"])
    if cfg.required_gain is not None and gain < cfg.required_gain:
        reasons.append(f"pass@1 gain {gain:+.4f} below the required {cfg.required_gain:+.4f}")
    passed = not reasons
    report = ("# Evaluation report\n\n" + report_markdown(comparisons) + "\n## Gate\n\n"
              + ("passed" if passed else "failed: " + "; ".join(reasons)) + "\n")
    return {"passed": passed, "reasons": reasons, "gain": gain, "comparisons": comparisons, "report": report}
