"""Fleet settings: what turns an RL config into the distributed mode."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from ...runtime.config import StageConfig


class FleetConfig(StageConfig):
    """Rollout servers (vLLM's OpenAI server), an orchestrator and the trainer as separate
    processes, weights through ``weights_uri``. The run's ``max_staleness`` and
    ``full_every`` apply as in one process."""

    servers: int = Field(2, description="rollout servers to start (ignored when urls are given)")
    host: str = "127.0.0.1"
    base_port: int = Field(8300, description="server i listens on base_port + i")
    urls: Optional[list[str]] = Field(None, description="servers already running (not started or stopped by the run)")
    nodes: Optional[list[str]] = Field(None, description="cluster nodes for the servers started as services: server i "
                                                         "on nodes[i mod len(nodes)] (default: the scheduler's choice)")
    weight_sync: Literal["orchestrator", "server"] = Field(
        "orchestrator", description="who rebuilds and reloads each version: the orchestrator (servers must see its "
                                    "out_dir) or a loop beside each server (python -m composer_dag.rl.fleet.serve; "
                                    "servers need only the weights storage); the orchestrator checks the probe either way")
    server_kv_cache_mb: int = 64
    server_start_timeout: float = 900.0
    probe_tolerance: float = Field(1e-3, description="max |server - reference| probe logprob after a reload")
    probe_tokens: int = Field(32, description="length of the fixed probe sequence")
    poll_seconds: float = Field(0.5, description="how often each server's sync polls latest.json")
    max_sandboxes: int = Field(4, description="episodes (sandboxes) running at once; the rest queue")
    episode_attempts: int = Field(3, description="tries of an episode whose server died")
    request_timeout: float = 120.0
    exchange_uri: Optional[str] = Field(None, description="where rollout batches go to the trainer "
                                                          "(default out_dir/exchange); s3:// works")
    start_wait: float = Field(120.0, description="longest wait, before the first batch, for every server to serve "
                                                 "its first version (so the batch spreads over the fleet); after "
                                                 "it the batch runs on the servers that do (0: no wait)")
    version_timeout: float = Field(600.0, description="longest wait for a version to be published or served")
    skip_reload: Optional[list[int]] = Field(None, description="fault injection: [server index, version] "
                                                               "that server reports without reloading (weight_sync "
                                                               "server: servers started by the run only)")
