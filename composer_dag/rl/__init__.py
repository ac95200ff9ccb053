"""RL on agent episodes: the agent loop (orchestrator side), GRPO trainer, asynchronous
rollout source with a staleness bound, and weight publication (full + deltas).

Entry point: ``python -m composer_dag.rl.run --config CONFIG.json``.
"""
