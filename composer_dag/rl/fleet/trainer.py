"""The trainer role of the distributed mode: takes the orchestrator's batches from the exchange
storage, updates the policy with GRPO, publishes every version to ``weights_uri``.

    python -m composer_dag.rl.fleet.trainer --config CONFIG.json    (the run's config, with fleet)

Version 0 (the starting policy, in the published dtype) is published first, so the servers run
exactly the published weights from the start. Then for each step ``s``: wait for the sealed
batch ``s``, run the step both modes run (``rl.step``: advantages without the rollouts marked
``infra_error``, the rollouts under ``out_dir/rollouts``, one update), checkpoint, publish
version ``s + 1`` (full every ``full_every``, else a delta). Writes ``metrics.jsonl`` and
``result.json`` like the one-process run; a restarted trainer resumes from its last sealed
checkpoint while the servers keep serving the last published version.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ...pipes import Reporter
from ..step import append_metrics, finish, read_metrics, stats, step_record, summary, train_step
from .orchestrator import batch_url


def _logged_steps(path: Path) -> set[int]:
    try:
        return {json.loads(x)["step"] for x in open(path) if x.strip()}
    except OSError:
        return set()


def _with_publication(rec: dict, pub: dict, step_s: float | None = None) -> dict:
    """The step's record with its publication (``publish`` metadata or the version's manifest: a
    manifest carries no ``seconds``)."""
    return {**rec, "publish_s": pub.get("seconds"), "publish_kind": pub["kind"],
            "publish_fraction": pub.get("fraction", pub["bytes"] / pub["full_bytes"]), "step_s": step_s}


def _wait_for_batch(ex, step: int, timeout: float) -> float:
    """Wait for the orchestrator's sealed batch ``step``; the seconds waited."""
    t0, deadline = time.perf_counter(), time.monotonic() + timeout
    while not ex.exists(batch_url(ex, step, "json")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no batch for step {step} after {timeout:.0f} s")
        time.sleep(0.2)
    return time.perf_counter() - t0


def _resume(cfg, trainer, out: Path, wstore, wprefix: str, publisher, rep: Reporter) -> tuple[str | None, list]:
    """Resume from the last sealed checkpoint; publish the trainer's version unless it is out
    already (version 0 at the start, or a kill between checkpoint and publish); restore the step's
    metrics line from the checkpoint when the kill came before it was written."""
    from ...runtime.checkpoint import resume_checkpoint, trim_metrics
    from ..weights import latest_version, version_manifest

    metrics_path, ckpt_root = out / "metrics.jsonl", str(out / "checkpoints")
    resumed, saved = resume_checkpoint(str(out), ckpt_root, rep.log), {}
    if resumed:
        saved = trainer.load_checkpoint(ckpt_root, resumed)
        trim_metrics(str(metrics_path), trainer.version)
        rep.log(f"trainer resumed from {resumed} at version {trainer.version}")
    pubs = []
    latest = latest_version(wstore, wprefix)
    if not resumed or latest is None or latest < trainer.version:
        pubs.append(publisher.publish(trainer.version, trainer.state_dict()))
    if saved.get("metrics") and trainer.version not in _logged_steps(metrics_path):
        pub = pubs[-1] if pubs else version_manifest(wstore, wprefix, trainer.version)
        append_metrics(metrics_path, _with_publication(saved["metrics"], pub))
        rep.log(f"metrics of step {trainer.version} restored from checkpoint {resumed}")
    return resumed, pubs


def run(cfg, rep: Reporter | None = None) -> dict:
    import torch

    from ...runtime.checkpoint import write_json_atomic
    from ...storage import Storage, open_storage
    from ..trainer import GRPOTrainer
    from ..weights import WeightPublisher

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
    metrics_path = out / "metrics.jsonl"
    trainer = GRPOTrainer(cfg.policy_dir, cfg.trainer, batch_size=cfg.tasks_per_step * cfg.group_size,
                          temperature=cfg.orchestrator.temperature, seed=cfg.seed)
    publisher = WeightPublisher(wstore, wprefix, cfg.full_every, cfg.publish_dtype)
    resumed, pubs = _resume(cfg, trainer, out, wstore, wprefix, publisher, rep)
    tag = resumed
    while trainer.version < cfg.steps:
        step, t_step = trainer.version, time.perf_counter()
        wait_s = _wait_for_batch(ex, step, cfg.fleet.version_timeout)
        secs = ex.read_json(batch_url(ex, step, "json"))
        rs = ex.read_parquet(batch_url(ex, step, "parquet")).to_pylist()
        for r in rs:
            r["staleness"] = step - r["policy_version"]
        if max(r["staleness"] for r in rs) > cfg.max_staleness:
            raise RuntimeError(f"batch {step} holds rollouts of versions {secs['policy_versions']}, beyond "
                               f"max_staleness {cfg.max_staleness}")
        ts, used = train_step(trainer, store, rs, step, cfg.trainer.normalize_std, cfg.trainer.uniform_groups)
        version = trainer.version
        rec = step_record(
            version, used, ts, batch=step, policy_versions=secs["policy_versions"],
            staleness=max(r["staleness"] for r in rs), infra_errors=len(rs) - len(used), retried=secs["retried"],
            servers=secs["servers"], generated_tokens=secs["generated_tokens"], generate_s=secs["generate"],
            queue_s=secs["queue"], tools_s=secs["tools"], grade_s=secs["grade"], sandbox_s=secs["sandbox"],
            rollout_wall_s=secs["wall"], wait_s=wait_s)
        # checkpoint first, then publish: a version number is never published twice with
        # different weights (a trainer killed in between publishes it when it resumes). The
        # step's record goes into the checkpoint too, so a kill before its metrics line is
        # written loses nothing.
        if version % cfg.save_every == 0 or version == cfg.steps:
            tag = trainer.commit_checkpoint(str(out), cfg.policy_dir, {"metrics": rec}, cfg.keep_checkpoints)
        pub = publisher.publish(version, trainer.state_dict())
        pubs.append(pub)
        rec = _with_publication(rec, pub, step_s=time.perf_counter() - t_step)
        append_metrics(metrics_path, rec)
        rep.progress(f"step {version}/{cfg.steps} reward {rec['reward_mean']:.3f} infra {rec['infra_errors']} "
                     f"servers {rec['servers']} staleness {rec['staleness']} publish {pub['kind']} "
                     f"{pub['fraction']:.3f}")
    hist = read_metrics(metrics_path)
    result = {
        "mode": "fleet", "steps": trainer.version, "resumed_from": resumed,
        **summary(hist, ("generate_s", "queue_s", "tools_s", "grade_s", "sandbox_s", "rollout_wall_s", "wait_s",
                         "train_s", "publish_s", "step_s")),
        "infra_errors": [h["infra_errors"] for h in hist], "retried": [h["retried"] for h in hist],
        "max_staleness": cfg.max_staleness,
        "published": [{k2: p[k2] for k2 in ("version", "kind", "bytes", "fraction", "seconds")} for p in pubs],
        "delta_fraction": stats([p["fraction"] for p in pubs if p["kind"] == "delta"]),
        **finish(trainer, out, cfg.policy_dir, wstore, wprefix, cfg.publish_dtype),
        "checkpoint": tag, "config": cfg.to_dict(),
    }
    write_json_atomic(str(out / "result.json"), result)
    return result


def main(argv=None) -> dict:
    from .sync import role_main

    return role_main("the RL trainer (fleet mode)", run, argv)


if __name__ == "__main__":
    main()
