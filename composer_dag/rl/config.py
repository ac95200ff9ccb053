"""The RL stage's one typed config, and the settings of its learnable environment.

Its own module, so that the fleet's processes (rl/fleet/) read it without importing the run
that drives them."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from ..agent import AgentConfig
from ..inference.engine import InferenceConfig
from ..runtime.config import StageConfig
from ..tasks.sources import declared
from .fleet.config import FleetConfig
from .trainer import TrainerConfig


class RLConfig(StageConfig):
    """One RL run: the orchestrator drives agent episodes on the inference engine, the trainer
    updates the policy with GRPO, new weights go back to the engine and to ``weights_uri``.
    Defaults fit the embedded default (a tiny model on CPU, a short run)."""

    policy_dir: str                 # Hugging Face checkpoint (+ tokenizer) to start from
    tasks_dir: str                  # a directory of task directories (each with task.json)
    out_dir: str
    environment: Literal["tasks", "learnable"] = Field("tasks", description="learnable: see LEARNABLE_RUN")
    task_sources: Optional[list[str]] = Field(
        list(declared("rl")), description="train on tasks of these sources only (None: every task); the "
                                                 "default fits the tiny CPU model, which solves no HumanEval or bug-fix "
                                                 "task yet, with the tasks mined from repositories in the mix")
    source_weights: Optional[dict[str, float]] = Field(
        None, description="each step's tasks drawn source by source with these weights (None: uniformly over tasks)")
    steps: int = Field(16, description="policy updates (GRPO steps) in the run")
    tasks_per_step: int = 4
    group_size: int = Field(8, description="samples per task (a GRPO group), whose rewards set each other's "
                                           "advantages")
    max_staleness: int = Field(1, description="versions a batch may lag the trainer")
    async_generation: bool = Field(True, description="generate the next batch while training on this one")
    queue_size: Optional[int] = Field(None, description="batches generated ahead (default: max(1, max_staleness))")
    full_every: int = Field(5, description="published weights: a full checkpoint every N versions")
    weights_uri: Optional[str] = Field(None, description="where to publish (default out_dir/weights); s3:// works")
    publish_dtype: Optional[Literal["bfloat16", "float16", "float32"]] = Field(
        "bfloat16", description="the dtype the weights are published in (what the inference fleet runs); "
                                "None: as trained")
    save_every: int = Field(1, description="checkpoint every N updates (and at the end)")
    keep_checkpoints: int = 2
    torch_threads: Optional[int] = None
    seed: int = 0
    max_flag_rate: float = Field(0.5, description="the cheat-flag rate the rl_rollouts check allows")
    trainer: TrainerConfig = Field(
        TrainerConfig(lr=3e-4, kl_coef=0.1, warmup_steps=3, loss_norm="sequence", negative_weight=0.1,
                      uniform_groups=False),
        description="the default run's trainer: a KL term to the starting (SFT) policy, the learning rate warmed "
                    "up over 3 updates, each rollout weighed once whatever its length, failures pushed down at a "
                    "tenth of the weight, groups whose samples all earned one reward left out of the update")
    orchestrator: AgentConfig = AgentConfig()
    inference: InferenceConfig = InferenceConfig()
    fleet: Optional[FleetConfig] = Field(None, description="distributed mode: rollout servers, orchestrator and "
                                                           "trainer as separate processes (rl/fleet/)")

    @model_validator(mode="after")
    def _fleet_checkpoints_every_version(self) -> "RLConfig":
        # A fleet trainer resumed from a checkpoint older than the newest published version would
        # publish version numbers again with other weights, under servers already serving them.
        if self.fleet is not None and self.save_every != 1:
            raise ValueError(f"save_every {self.save_every}: the distributed mode (fleet) checkpoints every "
                             "version before publishing it, so save_every must be 1")
        return self


LEARNABLE_RUN = {"steps": 10, "tasks_per_step": 4, "group_size": 8, "async_generation": False, "torch_threads": 1,
                 "trainer": {"lr": 1e-3, "micro_batch": 16, "kl_coef": 0.1, "warmup_steps": 0},
                 "orchestrator": {"max_turns": 2, "max_new_tokens": 40, "max_context": 512, "system_style": "compact",
                                  "workers": 2},
                 "inference": {"engine": "hf"}}
"""``environment: learnable``: the small task family a tiny model learns on CPU within minutes
(tests/rl/test_rl_learn.py), with a freshly built policy warmed up on the tool-call syntax; these
settings replace the run's. The KL term to the warmed-up policy keeps this learning rate from
collapsing the policy: without it, some runs drift into repeating one token, every episode fails,
and with no group-relative signal left nothing brings them back (benchmarks/RESULTS.md, "The
learnable family's collapse"). Four tasks a step, not two: on two, 5 of 20 seeded runs still
collapsed, on four none did and every one rose (benchmarks/RESULTS.md, "test_reward_rises across
seeds")."""
