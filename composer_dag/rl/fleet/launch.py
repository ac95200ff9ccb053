"""The distributed mode on one machine: rollout servers, the trainer and the orchestrator as
separate processes (each in its own process group), weights through ``weights_uri``.

``python -m composer_dag.rl.run --config C`` takes this path when C has ``fleet`` settings.
Servers listed in ``fleet.urls`` are used as they are; otherwise ``fleet.servers`` vLLM servers
are started here (server i on ``base_port + i``, its worker bound to core ``i mod cores``) and
stopped at the end; with ``fleet.weight_sync: server`` each one runs under
``composer_dag.rl.fleet.serve``, which keeps it on the published weights by itself. The run fails with the failing role's one-line reason (a probe mismatch, a
server fleet that is gone, a missing batch) and stops the other role.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ...pipes import Reporter
from ...inference.server import ServerProcess, server_command


def _last_line(path: Path) -> str:
    try:
        lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


class _NewSteps:
    """The trainer's ``metrics.jsonl`` lines written since the run started, as they complete."""

    def __init__(self, path: Path):
        self.path = path
        self.pos = path.stat().st_size if path.exists() else 0

    def poll(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self.pos += end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out


def step_line(rec: dict, steps: int) -> str:
    """One progress line per trained step of the distributed run."""
    servers = " ".join(f"{k}:{v}" for k, v in sorted((rec.get("servers") or {}).items()))
    return (f"step {rec['step']:>4}/{steps} reward {rec.get('reward_mean', 0.0):.3f} "
            f"loss {rec.get('loss') or 0.0:+.4f} staleness {rec.get('staleness')} episodes by server {servers or '-'} "
            f"infra-masked {rec.get('infra_errors', 0)} retried {rec.get('retried', 0)} "
            f"took {rec.get('step_s') or 0.0:.1f} s")


def weights_url(cfg) -> str:
    """The URL the trainer publishes under (``weights_uri``, else ``out_dir/weights``)."""
    from ...storage import Storage

    return cfg.weights_uri or Storage(str(cfg.out_dir)).url("weights")


def follow_settings(cfg, index: int) -> dict | None:
    """``ServerProcess``'s ``follow`` for server ``index`` (``weight_sync: server``), else None."""
    fc = cfg.fleet
    if fc.weight_sync != "server":
        return None
    skip = fc.skip_reload[1] if fc.skip_reload and fc.skip_reload[0] == index else None
    return {"weights_uri": weights_url(cfg), "poll_seconds": fc.poll_seconds, "skip_reload": skip,
            "work_dir": str(Path(cfg.out_dir) / f"server_{index}_weights")}


def server_services(fleet, model_url: str, weights_uri: str, max_model_len: int = 1024, seed: int = 0) -> list[dict]:
    """The rollout servers of ``fleet`` (``FleetConfig``) as long-running services for a cluster
    backend (``composer_dag.cluster.services``, ``ClusterResource.services``): each one vLLM's
    server under ``composer_dag.rl.fleet.serve``, which takes the model from ``model_url`` (a
    storage URL or a path on its node) and follows the versions published at ``weights_uri``, so
    it needs no disk shared with the orchestrator. ``{host}``/``{port}`` are the backend's."""
    out = []
    for i in range(fleet.servers):
        skip = fleet.skip_reload[1] if fleet.skip_reload and fleet.skip_reload[0] == i else None
        argv = server_command(model_url, "{port}", "{host}", follow={"weights_uri": weights_uri, "skip_reload": skip,
                                                                    "poll_seconds": fleet.poll_seconds},
                              max_model_len=max_model_len, kv_cache_mb=fleet.server_kv_cache_mb, seed=seed)
        out.append({"name": f"rollout-{i}", "argv": argv, "health_url": "http://{host}:{port}/health",
                    "start_timeout_s": fleet.server_start_timeout,
                    "node": fleet.nodes[i % len(fleet.nodes)] if fleet.nodes else None})
    return out


def run_distributed(cfg, rep: Reporter | None = None) -> dict:
    from ...inference.engine import fit_to_model
    from ...runtime.checkpoint import write_json_atomic

    rep = rep or Reporter()
    fc = cfg.fleet
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    servers: list[ServerProcess] = []
    t0 = time.perf_counter()
    try:
        urls = fc.urls
        if not urls:
            max_len = fit_to_model(cfg.inference, cfg.policy_dir).max_model_len
            servers = [ServerProcess(cfg.policy_dir, fc.base_port + i, fc.host, str(out / f"server_{i}.log"),
                                     cpu=i % (os.cpu_count() or 1), follow=follow_settings(cfg, i),
                                     kv_cache_mb=fc.server_kv_cache_mb, max_model_len=max_len,
                                     seed=cfg.seed).start() for i in range(fc.servers)]
            for s in servers:
                s.wait_ready(fc.server_start_timeout)
            urls = [s.url for s in servers]
            rep.log(f"fleet: {len(urls)} rollout servers up in {time.perf_counter() - t0:.0f} s")
        run_cfg = cfg.replace(fleet={"urls": urls})
        path = out / "fleet_config.json"
        path.write_text(json.dumps(run_cfg.to_dict()))
        progress = _NewSteps(out / "metrics.jsonl")

        def relay() -> None:
            for rec in progress.poll():
                rep.progress(step_line(rec, cfg.steps))

        procs = {}
        for role in ("trainer", "orchestrator"):
            with open(out / f"{role}.out", "wb") as so, open(out / f"{role}.err", "wb") as se:
                procs[role] = subprocess.Popen([sys.executable, "-m", f"composer_dag.rl.fleet.{role}", "--config",
                                                str(path)], stdout=so, stderr=se, stdin=subprocess.DEVNULL,
                                               start_new_session=True)
        failed = None
        try:
            while any(p.poll() is None for p in procs.values()):
                for role, p in procs.items():
                    if p.poll() not in (None, 0):
                        failed = role
                        break
                if failed:
                    break
                relay()
                time.sleep(0.5)
            relay()
            failed = failed or next((r for r, p in procs.items() if p.returncode), None)
        finally:
            for p in procs.values():
                _stop(p)
        if failed:
            raise SystemExit(f"fleet run failed in the {failed}: {_last_line(out / f'{failed}.err')}")
        result = json.loads((out / "result.json").read_text())
        ex_dir = fc.exchange_uri or str(out / "exchange")
        from ...storage import open_storage

        ex = open_storage(ex_dir)
        orch = ex.read_json(ex.url("orchestrator.json"))
        result.update(fleet={"servers": orch["servers"], "batches": orch["batches"],
                             "wall_s": time.perf_counter() - t0})
        write_json_atomic(str(out / "result.json"), result)
        return result
    finally:
        for s in servers:
            s.stop()
