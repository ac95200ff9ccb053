"""The trainer role of the distributed mode: takes the orchestrator's batches from the exchange
storage, updates the policy with GRPO, publishes every version to ``weights_uri``.

    python -m composer_dag.rl.fleet.trainer --config CONFIG.json    (the run's config, with fleet)

Version 0 (the starting policy, in the published dtype) is published first, so the servers run
exactly the published weights from the start. Then for each step ``s``: wait for the sealed
batch ``s``, compute the group advantages without the rollouts marked ``infra_error``, write the
rollouts under ``out_dir/rollouts`` as the one-process run does, train, checkpoint, publish
version ``s + 1`` (full every ``full_every``, else a delta). Writes ``metrics.jsonl`` and
``result.json`` like the one-process run; a restarted trainer resumes from its last sealed
checkpoint while the servers keep serving the last published version.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ...pipes import Reporter
from .orchestrator import batch_url


def _stats(xs):
    xs = [x for x in xs if x is not None]  # (a record restored from a checkpoint has no step and publish times)
    return {"mean": sum(xs) / len(xs), "max": max(xs), "min": min(xs), "n": len(xs)} if xs else {"n": 0}


def _logged_steps(path: Path) -> set[int]:
    try:
        return {json.loads(x)["step"] for x in open(path) if x.strip()}
    except OSError:
        return set()


def _append_metrics(path: Path, rec: dict, pub: dict, step_s: float | None = None) -> dict:
    """Append the step's record with its publication (``publish`` metadata or the version's
    manifest: a manifest carries no ``seconds``)."""
    rec = {**rec, "publish_s": pub.get("seconds"), "publish_kind": pub["kind"],
           "publish_fraction": pub.get("fraction", pub["bytes"] / pub["full_bytes"]), "step_s": step_s}
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


def advantages(rows: list[dict], normalize_std: bool = True) -> list[float]:
    """Group advantages over the rollouts without ``infra_error``; those get 0 (and are not trained on)."""
    from ..grpo import group_advantages

    return group_advantages([r["reward"] for r in rows], [r["group_id"] for r in rows], normalize_std,
                            include=[r.get("infra_error") is None for r in rows])


def run(cfg, rep: Reporter | None = None) -> dict:
    import torch

    from ...agent import rollouts_to_table
    from ...runtime.checkpoint import resume_checkpoint, trim_metrics, write_json_atomic
    from ...storage import Storage, open_storage
    from ..trainer import GRPOTrainer
    from ..weights import WeightPublisher, cast_state, latest_version, reconstruct, state_digest, version_manifest

    rep = rep or Reporter()
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    out = Path(cfg.out_dir)
    for d in ("rollouts", "checkpoints"):
        (out / d).mkdir(parents=True, exist_ok=True)
    store = Storage(str(out))
    wstore = open_storage(cfg.weights_uri) if cfg.weights_uri else store
    wprefix = wstore.root if cfg.weights_uri else store.url("weights")
    ex = open_storage(cfg.fleet.exchange_uri or str(out / "exchange"))
    metrics_path, ckpt_root = out / "metrics.jsonl", str(out / "checkpoints")
    trainer = GRPOTrainer(cfg.policy_dir, cfg.trainer, batch_size=cfg.tasks_per_step * cfg.group_size,
                          temperature=cfg.orchestrator.temperature, seed=cfg.seed)
    resumed, saved = resume_checkpoint(str(out), ckpt_root, rep.log), {}
    if resumed:
        saved = trainer.load_checkpoint(ckpt_root, resumed)
        trim_metrics(str(metrics_path), trainer.version)
        rep.log(f"trainer resumed from {resumed} at version {trainer.version}")
    publisher = WeightPublisher(wstore, wprefix, cfg.full_every, cfg.publish_dtype)
    pubs = []
    latest = latest_version(wstore, wprefix)
    if not resumed or latest is None or latest < trainer.version:  # (a kill between checkpoint and publish)
        pubs.append(publisher.publish(trainer.version, trainer.state_dict()))
    if saved.get("metrics") and trainer.version not in _logged_steps(metrics_path):
        # killed after the checkpoint, before the step's metrics line: the record saved with the
        # checkpoint, with its publication (made just now, or read from the version's manifest)
        pub = pubs[-1] if pubs else version_manifest(wstore, wprefix, trainer.version)
        _append_metrics(metrics_path, saved["metrics"], pub)
        rep.log(f"metrics of step {trainer.version} restored from checkpoint {resumed}")
    tag = resumed
    while trainer.version < cfg.steps:
        step, t_step = trainer.version, time.perf_counter()
        deadline = time.monotonic() + cfg.fleet.version_timeout
        while not ex.exists(batch_url(ex, step, "json")):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no batch for step {step} after {cfg.fleet.version_timeout:.0f} s")
            time.sleep(0.2)
        wait_s = time.perf_counter() - t_step
        secs = ex.read_json(batch_url(ex, step, "json"))
        rs = ex.read_parquet(batch_url(ex, step, "parquet")).to_pylist()
        ok = [r["infra_error"] is None for r in rs]
        for r, a in zip(rs, advantages(rs, cfg.trainer.normalize_std)):
            r["advantage"], r["step"], r["staleness"] = a, step, step - r["policy_version"]
        if max(r["staleness"] for r in rs) > cfg.max_staleness:
            raise RuntimeError(f"batch {step} holds rollouts of versions {secs['policy_versions']}, beyond "
                               f"max_staleness {cfg.max_staleness}")
        store.write_parquet(rollouts_to_table(rs), store.url("rollouts", f"step_{step:04d}.parquet"))
        ts = trainer.train_step([r for r, k in zip(rs, ok) if k])
        version = trainer.version
        used = [r for r, k in zip(rs, ok) if k]
        n = max(1, len(used))
        rec = {"step": version, "batch": step, "policy_versions": secs["policy_versions"],
               "staleness": max(r["staleness"] for r in rs), "reward_mean": sum(r["reward"] for r in used) / n,
               "pass_rate": sum(r["tests_failed"] == 0 and r["tests_passed"] > 0 for r in used) / n,
               "flag_rate": sum(bool(r["flags"]) for r in used) / n,
               "infra_errors": len(rs) - len(used), "retried": secs["retried"], "servers": secs["servers"],
               "generated_tokens": secs["generated_tokens"], "generate_s": secs["generate"], "queue_s": secs["queue"],
               "tools_s": secs["tools"], "grade_s": secs["grade"], "sandbox_s": secs["sandbox"], "rollout_wall_s": secs["wall"],
               "wait_s": wait_s, "train_s": ts["train_seconds"],
               **{k: ts[k] for k in ("loss", "lr", "clip_frac", "kl", "grad_norm", "nan_skipped", "train_tokens")}}
        # checkpoint first, then publish: a version number is never published twice with
        # different weights (a trainer killed in between publishes it when it resumes). The
        # step's record goes into the checkpoint too, so a kill before its metrics line is
        # written loses nothing.
        if version % cfg.save_every == 0 or version == cfg.steps:
            tag = trainer.commit_checkpoint(str(out), cfg.policy_dir, {"metrics": rec}, cfg.keep_checkpoints)
        pub = publisher.publish(version, trainer.state_dict())
        pubs.append(pub)
        rec = _append_metrics(metrics_path, rec, pub, step_s=time.perf_counter() - t_step)
        rep.progress(f"step {version}/{cfg.steps} reward {rec['reward_mean']:.3f} infra {rec['infra_errors']} "
                     f"servers {rec['servers']} staleness {rec['staleness']} publish {pub['kind']} "
                     f"{pub['fraction']:.3f}")
    verified = (state_digest(reconstruct(wstore, wprefix, trainer.version))
                == state_digest(cast_state(trainer.state_dict(), cfg.publish_dtype)))
    hf_dir = trainer.export_hf(str(out / "hf"), cfg.policy_dir)
    hist = [json.loads(x) for x in open(metrics_path)] if metrics_path.exists() else []
    k = max(1, len(hist) // 4)
    result = {
        "mode": "fleet", "steps": trainer.version, "resumed_from": resumed,
        "reward_curve": [[h["step"], h["reward_mean"]] for h in hist],
        "reward_first": sum(h["reward_mean"] for h in hist[:k]) / k if hist else None,
        "reward_last": sum(h["reward_mean"] for h in hist[-k:]) / k if hist else None,
        "cheat_flag_rate": sum(h["flag_rate"] for h in hist) / len(hist) if hist else None,
        "infra_errors": [h["infra_errors"] for h in hist], "retried": [h["retried"] for h in hist],
        "staleness": {**_stats([h["staleness"] for h in hist])}, "max_staleness": cfg.max_staleness,
        "step_seconds": {k2: _stats([h[k2] for h in hist]) for k2 in
                         ("generate_s", "queue_s", "tools_s", "grade_s", "sandbox_s", "rollout_wall_s", "wait_s", "train_s",
                          "publish_s", "step_s")},
        "published": [{k2: p[k2] for k2 in ("version", "kind", "bytes", "fraction", "seconds")} for p in pubs],
        "delta_fraction": _stats([p["fraction"] for p in pubs if p["kind"] == "delta"]),
        "weights_verified": verified, "weights_uri": wprefix, "nan_loss_skipped": trainer.nan_skipped,
        "hf_dir": hf_dir, "checkpoint": tag, "config": cfg.to_dict(),
    }
    write_json_atomic(str(out / "result.json"), result)
    return result


def main(argv=None) -> dict:
    from .sync import role_main

    return role_main("the RL trainer (fleet mode)", run, argv)


if __name__ == "__main__":
    main()
