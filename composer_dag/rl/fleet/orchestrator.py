"""The orchestrator: runs the multi-turn episodes of each step on whichever rollout server is
free, and hands batches to the trainer through the exchange storage.

    python -m composer_dag.rl.fleet.orchestrator --config CONFIG.json    (the run's config, with fleet)

Per step ``s`` (the trainer will update version ``s`` to ``s + 1`` with it) it waits until
version ``s - max_staleness`` is published and served, then runs the step's episodes: each one
waits for a sandbox slot (``max_sandboxes`` at once; the wait is the step's ``queue`` time),
takes the least-busy server that serves version ``s - max_staleness`` or newer, and runs there
from start to end (token ids in, token ids and sampling logprobs out). The batch is written as
``<exchange>/batches/step_XXXX.parquet`` and sealed by ``step_XXXX.json`` (its timings).

Faults:

- A server that stops answering (``ServerDown``) is marked down and the episode starts over on
  another server (a fresh sandbox; ``attempts`` counts the tries). Each job yields exactly one
  row. A server that comes back is reloaded to the latest version by its sync and rejoins.
- ``infra_error`` marks a rollout that failed for infrastructure reasons; the trainer leaves it
  out of the group's advantages. It is set only when the failure came before the policy's
  first action (a sandbox that could not start, a server lost before any completion with no
  server left) or when it reproduces with the task's reference solution (grading the reference
  state raises too). Anything else after the first action, a timeout or a crash in workspace
  code included, is the policy's: the episode scores as the grader says, or 0.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ...pipes import Reporter
from ..step import choose_tasks
from ...inference.server import ServerDown, ServerEngine
from .sync import Fleet, FleetStopped


def batch_url(ex, step: int, ext: str) -> str:
    return ex.url("batches", f"step_{step:04d}.{ext}")


def reproduces_with_reference(task_dir: str) -> bool:
    """Does grading the task's reference state fail the same way (raise)?"""
    from composer_dag.grading.grade import grade
    from composer_dag.tasks.taskdir import apply_reference

    tmp = Path(tempfile.mkdtemp(prefix="refcheck-"))
    try:
        grade(Path(task_dir), apply_reference(Path(task_dir), tmp / "ws"))
        return False
    except Exception:
        return True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _latest(fleet) -> int:
    from ..weights import latest_version

    v = latest_version(fleet.storage, fleet.prefix)
    return -1 if v is None else v


class Orchestrator:
    def __init__(self, fleet: Fleet, agent, tasks: list, cfg, log=print):
        self.fleet, self.agent, self.tasks, self.cfg, self.log = fleet, agent, tasks, cfg, log
        self.slots = threading.Semaphore(max(1, cfg.fleet.max_sandboxes))
        self.pool = ThreadPoolExecutor(max(1, cfg.fleet.max_sandboxes) * 2, thread_name_prefix="episode")
        self.reproduces = reproduces_with_reference

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.agent.close()

    def jobs(self, index: int) -> list[tuple[str, str, int]]:
        cfg = self.cfg
        chosen = choose_tasks(self.tasks, cfg, index)
        return [(str(t), f"b{index:05d}-{k}-{Path(t).name}", j) for k, t in enumerate(chosen)
                for j in range(cfg.group_size)]

    def _infra_row(self, job, version, server_id, attempts, why: str) -> dict:
        task_dir, group, sample = job
        try:
            task_id = json.loads((Path(task_dir) / "task.json").read_text()).get("id", Path(task_dir).name)
        except Exception:
            task_id = Path(task_dir).name
        return {"rollout_id": uuid.uuid4().hex[:16], "task_id": task_id, "task_dir": str(task_dir),
                "group_id": group, "sample_index": sample, "policy_version": version, "messages": "[]",
                "prompt_ids": [], "completion_ids": [], "loss_mask": [], "logprobs": [], "reward": 0.0,
                "unflagged_reward": 0.0, "tests_passed": 0, "tests_failed": 0, "flags": [], "flag_families": [],
                "canary_passed": False, "num_turns": 0, "malformed_calls": 0, "tool_errors": 0,
                "finish": "infra_error", "generated_tokens": 0, "gen_seconds": 0.0, "tool_seconds": 0.0,
                "grade_seconds": 0.0, "episode_seconds": 0.0, "server_id": server_id, "infra_error": why[:500],
                "attempts": attempts}

    def episode(self, job, min_version: int, seed: int, t_q: float | None = None) -> dict:
        """One job to one row, whatever fails. Queue time counts from ``t_q`` (submission)."""
        t_q = time.perf_counter() if t_q is None else t_q
        with self.slots:
            queue_s = time.perf_counter() - t_q
            attempts = 0
            while True:
                attempts += 1
                server = self.fleet.acquire(min_version)
                version, eng = server.version, ServerEngine(server.client)
                t0 = time.perf_counter()
                try:
                    row = self.agent.run([job], version, seed, engine=eng)[0]
                    row.update(server_id=server.id, infra_error=None, attempts=attempts)
                    break
                except ServerDown as e:
                    self.fleet.mark_dead(server)
                    self.log(f"episode {job[1]}#{job[2]} lost its server {server.id}; retrying elsewhere")
                    if attempts >= self.cfg.fleet.episode_attempts:
                        row = self._infra_row(job, version, server.id, attempts, f"ServerDown: {e}")
                        break
                except Exception as e:
                    why = f"{type(e).__name__}: {e}"
                    if eng.completions == 0 or self.reproduces(job[0]):
                        row = self._infra_row(job, version, server.id, attempts, why)
                    else:  # after the policy acted and not reproduced by the reference: the policy's
                        row = self._infra_row(job, version, server.id, attempts, why)
                        row.update(infra_error=None, finish="error")
                    break
                finally:
                    self.fleet.release(server)
            row["queue_seconds"], row["server_seconds"] = queue_s, time.perf_counter() - t0
            return row

    def batch(self, index: int, min_version: int) -> tuple[list[dict], dict]:
        t0 = time.perf_counter()
        jobs = self.jobs(index)
        futs = [self.pool.submit(self.episode, j, min_version, self.cfg.seed * 7_919 + index * 131 + k,
                                 time.perf_counter()) for k, j in enumerate(jobs)]
        rows = [f.result() for f in futs]
        assert len(rows) == len(jobs) and len({(r["group_id"], r["sample_index"]) for r in rows}) == len(jobs)
        return rows, {
            "generate": sum(r["gen_seconds"] for r in rows), "queue": sum(r["queue_seconds"] for r in rows),
            "tools": sum(r["tool_seconds"] for r in rows), "grade": sum(r["grade_seconds"] for r in rows),
            "sandbox": sum(r["episode_seconds"] for r in rows),
            "generated_tokens": sum(r["generated_tokens"] for r in rows), "wall": time.perf_counter() - t0,
            "infra_errors": sum(r["infra_error"] is not None for r in rows),
            "retried": sum(r["attempts"] > 1 for r in rows),
            "servers": {s: sum(r["server_id"] == s for r in rows) for s in sorted({r["server_id"] for r in rows})}}


def build(cfg, rep: Reporter | None = None):
    """Fleet + agent + orchestrator for ``cfg`` (its fleet settings), started."""
    import os

    from ...inference.engine import fit_to_model
    from ...storage import Storage, open_storage
    from ...train.tokenizer import load_tokenizer
    from ..step import find_tasks, fit_context

    log = rep.log if rep else print
    out = Path(cfg.out_dir)
    wstore = open_storage(cfg.weights_uri) if cfg.weights_uri else Storage(str(out))
    wprefix = wstore.root if cfg.weights_uri else wstore.url("weights")
    inference = fit_to_model(cfg.inference, cfg.policy_dir)
    orch = fit_context(cfg.orchestrator, inference.max_model_len)
    fleet = Fleet(cfg.fleet.urls, wstore, wprefix, cfg.policy_dir, os.path.join(cfg.out_dir, "fleet_weights"),
                  cfg.fleet, log).start()
    from ...agent import agent_loop

    # the built-in loop or an external harness through a gateway; either way each episode runs
    # on the server ``Orchestrator.episode`` picks for it
    agent = agent_loop(None, load_tokenizer(cfg.policy_dir), orch)
    return Orchestrator(fleet, agent, find_tasks(cfg.tasks_dir, cfg.task_sources), cfg, log)


def _wait_for_fleet(fleet, version: int, seconds: float, log) -> None:
    """Before the first batch: wait at most ``seconds`` for every server to serve ``version``,
    so that the batch is not routed whole to the first server verified."""
    if seconds <= 0:
        return
    try:
        fleet.wait_serving(version, servers=fleet.servers, timeout=seconds)
    except FleetStopped as e:
        log(f"starting without every rollout server: {e}")


def run(cfg, rep: Reporter | None = None) -> dict:
    """Produce the batches of steps ``start..steps-1`` (``start``: the first without a sealed batch)."""
    from ...storage import open_storage

    rep = rep or Reporter()
    ex = open_storage(cfg.fleet.exchange_uri or str(Path(cfg.out_dir) / "exchange"))
    o = build(cfg, rep)
    fleet, stats = o.fleet, []
    try:
        step = 0
        while step < cfg.steps and ex.exists(batch_url(ex, step, "json")):
            step += 1
        while step < cfg.steps:
            need = max(0, step - cfg.max_staleness)
            deadline = time.monotonic() + cfg.fleet.version_timeout
            while _latest(fleet) < need:
                fleet.check()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"version {need} not published after {cfg.fleet.version_timeout:.0f} s")
                time.sleep(cfg.fleet.poll_seconds)
            if not stats:
                _wait_for_fleet(fleet, need, cfg.fleet.start_wait, rep.log)
            rows, secs = o.batch(step, need)
            versions = [r["policy_version"] for r in rows]
            secs.update(step=step, min_version=need, policy_versions=sorted(set(versions)),
                        server_versions={s.id: s.version for s in fleet.servers})
            from ...agent import rollouts_to_table

            ex.write_parquet(rollouts_to_table(rows), batch_url(ex, step, "parquet"))
            ex.write_json(batch_url(ex, step, "json"), secs)
            stats.append(secs)
            rep.progress(f"batch {step}: {len(rows)} rollouts, versions {secs['policy_versions']}, servers "
                         f"{secs['servers']}, infra {secs['infra_errors']}, retried {secs['retried']}")
            step += 1
        # every server that is up ends on the final version
        final = cfg.steps
        deadline = time.monotonic() + cfg.fleet.version_timeout
        while _latest(fleet) < final and time.monotonic() < deadline:
            fleet.check()
            time.sleep(cfg.fleet.poll_seconds)
        fleet.wait_serving(final)
        res = {"batches": stats, "servers": fleet.summary()}
        ex.write_json(ex.url("orchestrator.json"), res)
        return res
    finally:
        fleet.stop()
        o.close()


def main(argv=None) -> dict:
    from .sync import role_main

    return role_main("the RL orchestrator (fleet mode)", run, argv)


if __name__ == "__main__":
    main()
