"""What an RL run did, as one dict for a report (the ``rl_run`` asset's metadata, a benchmark).

``rl_summary(result, rows, metrics)`` reads the run's ``result.json`` (in the distributed mode
its ``fleet`` block: each server's versions, reloads and deaths, and each batch's per-server
episode counts, from the orchestrator's ``orchestrator.json``), the rollout rows (``step``,
``staleness``, ``server_id``, ``infra_error``, ``attempts``; the other columns are not needed)
and the lines of ``metrics.jsonl``. Each number comes from the most direct source there is:
episode counts, retries and infra masks from the rollout rows when given, else from the
per-step metrics; published sizes from ``result["published"]`` (both modes write it).

Returned keys (absent data gives empty lists and ``None``, never an error):

- ``mode``: ``"fleet"`` or ``"one_process"``
- ``servers``: per rollout server ``{"server", "url", "alive", "deaths", "versions_served",
  "episodes", "retried", "infra_masked", "reload_s_mean", "probe_diff_max"}`` (fleet only)
- ``steps``: per trainer step ``{"step", "rollouts", "infra_masked", "retried",
  "staleness_max", "policy_versions", "servers"}``
- ``staleness_max``, ``staleness_mean`` (over rollouts), ``max_staleness`` (the bound)
- ``rollouts``, ``retried_episodes``, ``infra_masked_episodes`` (totals)
- ``published``: per version ``{"version", "kind", "bytes", "fraction"}``; ``full_bytes``
  (the size of a full checkpoint), ``delta_bytes_mean``, ``delta_share_mean``,
  ``delta_share_max`` (delta bytes over full bytes)
- ``reloads``: per version ``{"version", "reload_s": {server: s}, "rebuild_s", "lag_s_max",
  "probe_diff_max"}`` (fleet: every server's reload of that version, ``None`` where the server
  reloaded by itself, ``weight_sync: server``; lag: from the version's first sight on
  ``latest.json`` to the server's probe check passing; one process: the engine's reloads)
"""

from __future__ import annotations

import math
from collections import defaultdict


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def reward_slope(curve: list[float]) -> float:
    """The least-squares slope of a reward curve per step (0.0 for fewer than two steps): the
    trend of a run whose per-step means are noisy (16 episodes a step move by about 0.1)."""
    n = len(curve)
    if n < 2:
        return 0.0
    mid = (n - 1) / 2
    return sum((i - mid) * v for i, v in enumerate(curve)) / sum((i - mid) ** 2 for i in range(n))


def _steps(rows: list[dict], metrics: list[dict]) -> list[dict]:
    """Per step: from the rollout rows (what the trainer used), else from metrics.jsonl."""
    steps: dict[int, dict] = {}
    by_step = defaultdict(list)
    for r in rows:
        if r.get("step") is not None:
            by_step[int(r["step"])].append(r)
    for s, rs in sorted(by_step.items()):
        servers = defaultdict(int)
        for r in rs:
            if r.get("server_id"):
                servers[r["server_id"]] += 1
        steps[s] = {"step": s, "rollouts": len(rs),
                    "infra_masked": sum(r.get("infra_error") is not None for r in rs),
                    "retried": sum((r.get("attempts") or 1) > 1 for r in rs),
                    "staleness_max": max((r.get("staleness") or 0 for r in rs), default=0),
                    "policy_versions": sorted({r["policy_version"] for r in rs if r.get("policy_version") is not None}),
                    "servers": dict(sorted(servers.items()))}
    for m in metrics:  # a metrics line's "step" is the version after the update
        s = int(m["step"]) - 1
        if s in steps:
            continue
        steps[s] = {"step": s, "rollouts": None, "infra_masked": int(m.get("infra_errors") or 0),
                    "retried": int(m.get("retried") or 0), "staleness_max": m.get("staleness"),
                    "policy_versions": m.get("policy_versions") or ([m["policy_version"]] if "policy_version" in m else []),
                    "servers": dict(m.get("servers") or {})}
    return [steps[s] for s in sorted(steps)]


def _servers(fleet: dict, rows: list[dict]) -> list[dict]:
    """The fleet's servers as the orchestrator saw them, episodes counted from the rows."""
    servers = []
    for sid, s in sorted((fleet.get("servers") or {}).items()):
        mine = [r for r in rows if r.get("server_id") == sid]
        episodes = len(mine) if rows else sum(int((b.get("servers") or {}).get(sid, 0))
                                               for b in fleet.get("batches") or [])
        reloads = s.get("reloads") or []
        servers.append({"server": sid, "url": s.get("url"), "alive": bool(s.get("alive")),
                        "deaths": int(s.get("deaths") or 0), "versions_served": list(s.get("versions_served") or []),
                        "episodes": episodes, "retried": sum((r.get("attempts") or 1) > 1 for r in mine),
                        "infra_masked": sum(r.get("infra_error") is not None for r in mine),
                        "reload_s_mean": _mean([x.get("reload_s") for x in reloads]),
                        "probe_diff_max": max((x["probe_diff"] for x in reloads if x.get("probe_diff") is not None),
                                              default=None)})
    return servers


def _published(result: dict) -> dict:
    """The weights published: each version's kind and size, the full size and the deltas' shares."""
    pubs = [{k: p.get(k) for k in ("version", "kind", "bytes", "fraction")} for p in result.get("published") or []]
    out = {"published": pubs}
    fulls = [p["bytes"] for p in pubs if p["kind"] == "full" and p.get("bytes") is not None]
    deltas = [p for p in pubs if p["kind"] == "delta"]
    full = fulls[-1] if fulls else next((int(round(p["bytes"] / p["fraction"])) for p in deltas
                                         if p.get("bytes") and p.get("fraction")), None)
    out["full_bytes"] = full
    out["delta_bytes_mean"] = _mean([p["bytes"] for p in deltas])
    out["delta_share_mean"] = _mean([p["fraction"] for p in deltas])
    out["delta_share_max"] = max((p["fraction"] for p in deltas if p.get("fraction") is not None), default=None)
    if out["delta_share_mean"] is None and (result.get("delta_fraction") or {}).get("n"):
        out["delta_share_mean"] = result["delta_fraction"]["mean"]
        out["delta_share_max"] = result["delta_fraction"]["max"]
    return out


def _reloads(result: dict, fleet: dict, servers: list[dict]) -> list[dict]:
    """Reload time per version: each server's (fleet), or the engine's (one process)."""
    per_version: dict[int, dict] = {}
    for s in servers:
        for x in (fleet["servers"][s["server"]].get("reloads") or []):
            v = per_version.setdefault(int(x["version"]), {"version": int(x["version"]), "reload_s": {},
                                                          "rebuild_s": None, "lag_s_max": None,
                                                          "probe_diff_max": None})
            v["reload_s"][s["server"]] = x.get("reload_s")
            if x.get("lag_s") is not None:
                v["lag_s_max"] = max(v["lag_s_max"] or 0.0, x["lag_s"])
            if x.get("rebuild_s") is not None:
                v["rebuild_s"] = max(v["rebuild_s"] or 0.0, x["rebuild_s"])
            if x.get("probe_diff") is not None:
                v["probe_diff_max"] = max(v["probe_diff_max"] or 0.0, x["probe_diff"])
    for x in result.get("weight_syncs") or []:  # one process: the engine's reloads
        per_version[int(x["version"])] = {"version": int(x["version"]), "reload_s": {"engine": x.get("seconds")},
                                          "rebuild_s": None, "lag_s_max": None, "probe_diff_max": None}
    return [per_version[v] for v in sorted(per_version)]


def rl_summary(result: dict, rows: list[dict] | None = None, metrics: list[dict] | None = None) -> dict:
    rows, metrics = list(rows or []), list(metrics or [])
    fleet = result.get("fleet") or {}
    mode = "fleet" if result.get("mode") == "fleet" or fleet else "one_process"
    out: dict = {"mode": mode, "max_staleness": result.get("max_staleness")}

    out["steps"] = _steps(rows, metrics)
    stal = [r["staleness"] for r in rows if r.get("staleness") is not None]
    if stal:
        out["staleness_max"], out["staleness_mean"] = max(stal), sum(stal) / len(stal)
    else:
        st = result.get("staleness") or {}
        out["staleness_max"], out["staleness_mean"] = st.get("max"), st.get("mean")
    out["rollouts"] = len(rows) if rows else sum(x["rollouts"] or 0 for x in out["steps"])
    out["retried_episodes"] = sum(x["retried"] for x in out["steps"])
    out["infra_masked_episodes"] = sum(x["infra_masked"] for x in out["steps"])

    out["servers"] = servers = _servers(fleet, rows)
    out.update(_published(result))
    out["reloads"] = _reloads(result, fleet, servers)
    return out


def _secs(v) -> str:
    """A step-time cell; blank where the time was not recorded (a step's record restored from
    its checkpoint after the trainer was killed has no publish or step time)."""
    return "" if v is None else f"{v:.2f}"


def step_time_table(metrics: list[dict], fleet: bool) -> str:
    """A markdown table of each step's seconds by phase (the distributed mode's phases, or the
    one process's), with the step's wall time."""
    phases = (("generate_s", "queue_s", "tools_s", "grade_s", "wait_s", "train_s", "publish_s") if fleet else
              ("generate_s", "grade_s", "train_s", "sync_s"))
    head = "| step | " + " | ".join(p[:-2] for p in phases) + " | wall |\n|---|" + "---:|" * (len(phases) + 1) + "\n"
    return head + "\n".join(f"| {h['step']} | " + " | ".join(_secs(h.get(p, 0.0)) for p in phases)
                            + f" | {_secs(h.get('step_s', 0.0))} |" for h in metrics)


# what the RL asset's summaries and checks read of each rollout
ROW_COLUMNS = ("reward", "flags", "flag_families", "staleness", "step", "policy_version", "server_id", "infra_error",
               "attempts")


def read_rollout_rows(storage, urls: list[str], columns: tuple[str, ...] = ROW_COLUMNS) -> list[dict]:
    """``columns`` of every rollout in the Parquet files at ``urls``. A column a file lacks
    (rollouts written before it existed) is None in that file's rows, never an error."""
    import pyarrow.parquet as pq

    rows: list[dict] = []
    for url in urls:
        with storage.open(url) as f:
            pf = pq.ParquetFile(f)
            table = pf.read(columns=[c for c in columns if c in pf.schema_arrow.names])
        rows += [{c: r.get(c) for c in columns} for r in table.to_pylist()]
    return rows


def flag_family_shares(rows: list[dict]) -> list[tuple[str, list[int], list[float]]]:
    """Per cheat-flag family: the steps, and the share of each step's rollouts flagged with it
    (rows with ``step`` and ``flag_families``)."""
    steps = sorted({r["step"] for r in rows if r["step"] is not None})
    per_step = {s: [r for r in rows if r["step"] == s] for s in steps}
    families = sorted({f for r in rows for f in (r["flag_families"] or [])})
    return [(f, steps, [sum(f in (r["flag_families"] or []) for r in per_step[s]) / len(per_step[s]) for s in steps])
            for f in families]


def rl_checks(result: dict, rows: list[dict], metrics: list[dict], max_flag_rate: float,
              max_staleness: int) -> dict[str, tuple[bool, dict]]:
    """The RL run's checks, name -> (passed, metadata): every rollout has a finite reward, the
    flagged share is within ``max_flag_rate``, no rollout is staler than ``max_staleness``, no
    loss is NaN (none skipped either), and the published weights were verified."""
    n = len(rows)
    flag_rate = sum(bool(r["flags"]) for r in rows) / n if n else 0.0
    worst = max((r["staleness"] or 0 for r in rows), default=0)
    losses = [h.get("loss") for h in metrics]
    skipped = int(result.get("nan_loss_skipped") or 0)
    return {
        "every_rollout_has_reward": (n > 0 and all(r["reward"] is not None and math.isfinite(r["reward"]) for r in rows),
                                     {"rollouts": n}),
        "cheat_flag_rate_below_threshold": (flag_rate <= max_flag_rate,
                                            {"flag_rate": flag_rate, "threshold": max_flag_rate}),
        "staleness_within_bound": (worst <= max_staleness, {"max_staleness_seen": worst, "bound": max_staleness}),
        "loss_has_no_nan": (bool(losses) and all(x is not None and math.isfinite(x) for x in losses) and skipped == 0,
                            {"steps": len(losses), "nan_skipped": skipped}),
        "published_weights_verified": (bool(result.get("weights_verified")), {}),
    }
