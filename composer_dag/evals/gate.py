"""The promotion gate: every capability the lineage measures is a row, and each row can gate
with its own tolerance (``GateConfig``).

- pass@1 over every task, each task source's pass@1 and HumanEval function-completion pass@1:
  the candidate may not fall below the baseline beyond the estimator's noise. The standard error
  of a pass@1 mean over N tasks is ``sqrt(p (1 - p) / N)``; the two are combined as
  ``sqrt(se_c**2 + se_b**2)`` and the row fails when ``p_c < p_b - sigmas * se``. A source with
  fewer than ``min_tasks`` tasks is reported and does not gate.
- validation perplexity: at most ``1 + max_ppl_increase`` times the parent's, and at most
  ``1 + max_ppl_increase_vs_midtrained`` times the mid-trained checkpoint's (what the lineage
  knew about code before it learned the harness).
- the cheat-flag rate: at most the baseline's plus ``max_flag_rate_increase``.

A tolerance set to None makes its row informational, and so does a capability that only one
side measured (HumanEval, perplexity: an evaluation may leave them out). ``gain`` measures what RL added over its
parent on one source, with the standard error over samples.
"""

from __future__ import annotations

import math
from typing import Optional

from pydantic import Field

from ..runtime.config import StageConfig
from ..tasks.sources import declared
from .metrics import stderr


class GateConfig(StageConfig):
    """The promotion gate: one tolerance per capability row (None: the row is reported, not
    gating). ``required_gain`` (default None: the noise rule alone) asks for a pass@1 gain over
    the parent on top."""

    noise_sigmas: Optional[float] = Field(2.0, description="pass@1 over every task: standard errors the candidate may "
                                                           "lose (None: reported, not gating)")
    source_sigmas: Optional[float] = Field(2.0, description="each task source's pass@1 (sources with >= min_tasks)")
    humaneval_sigmas: Optional[float] = Field(2.0, description="HumanEval function-completion pass@1")
    harness_sigmas: Optional[float] = Field(2.0, description="each harness's pass@1 (by_harness; harnesses with >= "
                                                             "min_tasks tasks gate, the others are reported)")
    min_tasks: int = Field(10, description="a task source with fewer eval tasks is reported and does not gate")
    max_ppl_increase: Optional[float] = Field(0.1, description="validation perplexity: allowed relative increase "
                                                               "over the parent")
    max_ppl_increase_vs_midtrained: Optional[float] = Field(
        0.3, description="validation perplexity: allowed relative increase over the mid-trained checkpoint")
    max_flag_rate_increase: Optional[float] = 0.0
    required_gain: Optional[float] = None
    gain_source: str = Field(next(iter(declared("gain"))), description="the task source on which RL's gain over its parent is "
                                                      "measured (samples' standard error; reported, not gating)")
    gain_sigmas: float = 2.0


# informational rows (never gating): label, summary path
INFO = (("tokens / solved task", ("cost", "tokens_per_solved_task")),
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


def _row(metric, cand, base, threshold, ok, gating, reason=None) -> dict:
    delta = cand - base if cand is not None and base is not None else None
    return {"metric": metric, "candidate": cand, "baseline": base, "delta": delta, "threshold": threshold,
            "ok": ok, "gating": gating, "reason": None if ok or not gating else reason}


def _unmeasured(label: str, cand, base) -> dict:
    """A capability one side did not measure (an evaluation run without it): reported, not gating."""
    row = _row(label, cand, base, None, None, False)
    row["note"] = "measured on one side only"
    return row


def _noise_row(label: str, path: str, cand: dict, base: dict, sigmas: Optional[float], baseline: str,
               required: bool = True) -> dict:
    (pc, nc), (pb, nb) = _value(cand, path), _value(base, path)
    if (pc is None or pb is None) and not required:
        return _unmeasured(label, pc, pb)
    if pc is None or pb is None:
        return _row(label, pc, pb, None, False if sigmas is not None else None, sigmas is not None,
                    f"{label} missing from {'candidate' if pc is None else baseline}")
    if sigmas is None:
        return _row(label, pc, pb, None, None, False)
    se = math.sqrt(stderr(pc, nc) ** 2 + stderr(pb, nb) ** 2)
    threshold = pb - sigmas * se
    ok = pc >= threshold - 1e-12
    return _row(label, pc, pb, threshold, ok, True,
                f"{label} {pc:.4f} is below the {baseline}'s {pb:.4f} by more than {sigmas:g} sigma "
                f"(se {se:.4f}, threshold {threshold:.4f}, tasks {nc} vs {nb})")


def _ppl_row(label: str, cand: dict, base: dict, tolerance: Optional[float], baseline: str) -> dict:
    pc, pb = _get(cand, ("perplexity", "val_ppl")), _get(base, ("perplexity", "val_ppl"))
    if pc is None or pb is None:  # an evaluation without validation shards
        return _unmeasured(label, pc, pb)
    if tolerance is None:
        return _row(label, pc, pb, None, None, False)
    threshold = pb * (1 + tolerance)
    ok = pc <= threshold * (1 + 1e-12)
    return _row(label, pc, pb, threshold, ok, True,
                f"{label} {pc:,.2f} exceeds the {baseline}'s {pb:,.2f} by more than {tolerance:.0%} "
                f"(x{pc / pb:.3g}, threshold {threshold:,.2f})")


def _harness_rows(cand: dict, base: dict, gate: GateConfig, baseline: str) -> list[dict]:
    """One row per harness that played the tasks besides the evaluation's own (its pass@1 is
    the overall row), gating as a task source does."""
    own = {cand.get("harness"), base.get("harness")}
    rows = []
    for h in sorted((set(cand.get("by_harness") or {}) | set(base.get("by_harness") or {})) - own):
        n = min(_value(s, f"by_harness.{h}.pass@1")[1] for s in (cand, base))
        sigmas = gate.harness_sigmas if n >= gate.min_tasks else None
        row = _noise_row(f"pass@1 harness {h}", f"by_harness.{h}.pass@1", cand, base, sigmas, baseline, required=False)
        if n < gate.min_tasks and row.get("note") is None:
            row["note"] = f"{n} tasks < min_tasks {gate.min_tasks}: not gating"
        rows.append(row)
    return rows


def compare(candidate_summary: dict, baseline_summary: dict, gate: GateConfig | None = None,
            candidate_name: str = "candidate", baseline_name: str = "baseline",
            ppl_tolerance: Optional[float] | str = "parent") -> dict:
    """``{passed, reasons, rows, candidate, baseline}``; ``rows`` are table rows
    ``{metric, candidate, baseline, delta, threshold, ok, gating, reason}``, one per capability,
    each gating with its tolerance in ``gate``. ``ppl_tolerance``: the allowed relative
    perplexity increase against this baseline (default ``gate.max_ppl_increase``)."""
    gate = gate or GateConfig()
    cand, base = candidate_summary, baseline_summary
    tol = gate.max_ppl_increase if ppl_tolerance == "parent" else ppl_tolerance
    rows = [_noise_row("pass@1", "pass@1", cand, base, gate.noise_sigmas, baseline_name)]
    sources = sorted(set(cand.get("by_source") or {}) | set(base.get("by_source") or {}))
    for src in sources:
        n = min(_value(s, f"by_source.{src}.pass@1")[1] for s in (cand, base))
        sigmas = gate.source_sigmas if n >= gate.min_tasks else None
        row = _noise_row(f"pass@1 {src}", f"by_source.{src}.pass@1", cand, base, sigmas, baseline_name)
        if n < gate.min_tasks:
            row["note"] = f"{n} tasks < min_tasks {gate.min_tasks}: not gating"
        rows.append(row)
    rows += _harness_rows(cand, base, gate, baseline_name)
    if _get(cand, ("humaneval", "pass@1")) is not None or _get(base, ("humaneval", "pass@1")) is not None:
        rows.append(_noise_row("HumanEval fn-completion pass@1", "humaneval.pass@1", cand, base,
                               gate.humaneval_sigmas, baseline_name, required=False))
    rows.append(_ppl_row("val perplexity", cand, base, tol, baseline_name))
    fc, fb = cand.get("flag_rate"), base.get("flag_rate")
    allowed = gate.max_flag_rate_increase
    if fc is None or fb is None:
        rows.append(_row("cheat-flag rate", fc, fb, None, False, allowed is not None, "flag_rate missing"))
    elif allowed is None:
        rows.append(_row("cheat-flag rate", fc, fb, None, None, False))
    else:
        rows.append(_row("cheat-flag rate", fc, fb, fb + allowed, fc <= fb + allowed + 1e-12, True,
                         f"cheat-flag rate {fc:.4f} exceeds the {baseline_name}'s {fb:.4f} + allowed {allowed:g}"))
    for label, path in INFO:
        c, b = _get(cand, path), _get(base, path)
        if c is not None or b is not None:
            rows.append(_row(label, c, b, None, None, False))
    reasons = [r["reason"] for r in rows if r["gating"] and not r["ok"]]
    return {"passed": not reasons, "reasons": reasons, "rows": rows,
            "candidate": candidate_name, "baseline": baseline_name,
            "candidate_digest": cand.get("checkpoint_digest"), "baseline_digest": base.get("checkpoint_digest")}


def gain(candidate_summary: dict, baseline_summary: dict, source: str | None = None, sigmas: float = 2.0) -> dict:
    """What the candidate adds over the baseline in pass@1 (on one task source, or overall), with
    the combined standard error over samples, ``sqrt(p1 (1 - p1) / n1 + p2 (1 - p2) / n2)``;
    ``measurable`` when the gain is at least ``sigmas`` of it."""
    path = f"by_source.{source}.pass@1" if source else "pass@1"

    def samples(s: dict) -> int:
        return _value(s, path)[1] * int(s.get("samples_per_task") or 1)

    (pc, _), (pb, _) = _value(candidate_summary, path), _value(baseline_summary, path)
    nc, nb = samples(candidate_summary), samples(baseline_summary)
    if pc is None or pb is None or not nc or not nb:
        return {"source": source, "gain": None, "se": None, "sigmas": sigmas, "measurable": False,
                "samples": [nc, nb]}
    se = math.sqrt(pc * (1 - pc) / nc + pb * (1 - pb) / nb)
    return {"source": source, "candidate": pc, "baseline": pb, "gain": pc - pb, "se": se, "sigmas": sigmas,
            "measurable": pc - pb >= sigmas * se and pc > pb, "samples": [nc, nb]}


def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) >= 10 else f"{v:.4f}"
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


def _gate_table(rows: list[tuple[str, dict]]) -> str:
    lines = ["| row | against | candidate | baseline | threshold | verdict |", "|---|---|---:|---:|---:|---|"]
    for against, r in rows:
        verdict = ("pass" if r["ok"] else "**FAIL**") if r["gating"] else "not gating" + (
            f" ({r['note']})" if r.get("note") else "")
        lines.append(f"| {r['metric']} | {against} | {_fmt(r['candidate'])} | {_fmt(r['baseline'])} | "
                     f"{_fmt(r['threshold'])} | {verdict} |")
    return "\n".join(lines) + "\n"


def decide(summaries: dict[str, dict], candidate: str, parent: str, cfg: GateConfig,
           others: dict[str, dict] | None = None, midtrained: str | None = "midtrained_checkpoint") -> dict:
    """The gate's verdict for ``candidate`` against ``parent`` (both keys of ``summaries``): every
    row against the parent, plus the perplexity against ``midtrained`` when it is there; with
    comparisons against every other summary (``summaries`` and ``others``, e.g. the last
    promoted model) for the report. ``{passed, reasons, failed_rows, gain, measured_gain,
    comparisons, report}``."""
    cand = summaries[candidate]
    baselines = [(parent + " (parent)", summaries[parent], "parent")]
    baselines += [(k, s, cfg.max_ppl_increase_vs_midtrained if k == midtrained else None)
                  for k, s in summaries.items() if k not in (candidate, parent)]
    baselines += [(k, s, None) for k, s in (others or {}).items()]
    comparisons = [compare(cand, s, cfg, candidate_name=candidate, baseline_name=name, ppl_tolerance=tol)
                   for name, s, tol in baselines]
    gating = [(comparisons[0]["baseline"], r) for r in comparisons[0]["rows"]]
    if midtrained in summaries and midtrained not in (candidate, parent):
        mid = next(c for c in comparisons if c["baseline"] == midtrained)
        gating += [(midtrained, r) for r in mid["rows"] if r["metric"] == "val perplexity"]
    failed = [(against, r) for against, r in gating if r["gating"] and not r["ok"]]
    reasons = [f"{r['reason']} [against {against}]" for against, r in failed]
    p_gain = (cand.get("pass@1") or 0.0) - (summaries[parent].get("pass@1") or 0.0)
    if cfg.required_gain is not None and p_gain < cfg.required_gain:
        reasons.append(f"pass@1 gain {p_gain:+.4f} below the required {cfg.required_gain:+.4f}")
    passed = not reasons
    measured = gain(cand, summaries[parent], cfg.gain_source, cfg.gain_sigmas)
    report = ("# Evaluation report\n\n" + report_markdown(comparisons) + "\n## Gate\n\n"
              + _gate_table([(a, r) for a, r in gating if r["gating"] or r.get("note")]) + "\n"
              + ("passed" if passed else "failed:\n" + "".join(f"\n- {r}" for r in reasons)) + "\n")
    if measured["gain"] is not None:
        report += (f"\n{candidate} against {parent} on `{cfg.gain_source}`: {measured['candidate']:.4f} vs "
                   f"{measured['baseline']:.4f}, gain {measured['gain']:+.4f}, {cfg.gain_sigmas:g} x se over samples "
                   f"{cfg.gain_sigmas * measured['se']:.4f} ({'measurable' if measured['measurable'] else 'within the noise'})\n")
    return {"passed": passed, "reasons": reasons, "failed_rows": [r["metric"] for _, r in failed],
            "gain": p_gain, "measured_gain": measured, "comparisons": comparisons, "report": report}
