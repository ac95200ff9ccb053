"""The agent loop: many episodes in flight, one batched ``generate`` call per turn.

Each episode keeps one token stream: the rendered prompt (system + user), then for every
turn the sampled tokens (loss mask 1, with their sampling logprobs) followed by the tool
turn that answers them (mask 0). The stream is exactly what the policy saw, so the trainer
scores the same tokens. The harness (``AgentConfig.harness``, default ``composer``: calls as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks) writes the system prompt,
parses each completion into calls and renders their results; a turn without a parseable call
gets an error observation and is counted, never raised. Each rollout names its harness and
its version.

Model output and observations are untrusted: a completion longer than ``max_new_tokens`` is
cut (the assistant message is marked ``truncated``), an observation cut to the budget is
marked ``truncated`` (an error one ``error``), and control-token text inside an observation
(``<|im_end|>``, the harness's call markers, ...) is broken with a zero-width space, so that a file
cannot forge a turn or a call.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import Field

from composer_dag.tasks.taskdir import checkout_digest, workspace_digest
from composer_dag import harness as harnesses
from composer_dag.harness.base import defang
from composer_dag.harness.episode import Episode, EpisodeConfig, Observation
from .inference.engine import Completion, Engine, Sampling
from .runtime.config import StageConfig

class AgentConfig(StageConfig):
    """The agent harness: how episodes are sampled and how long they may run (RL's orchestrator
    and evaluation use the same one)."""

    max_turns: int = Field(2, description="assistant turns per episode (also capped by the task's limit)")
    max_new_tokens: int = Field(96, description="per assistant turn")
    max_context: int = Field(2048, description="prompt + every turn, per episode")
    temperature: float = 1.0
    top_p: float = 1.0
    system_style: Literal["full", "compact"] = Field("compact", description="full: the JSON tool schemas; compact: one signature per line")
    max_calls_per_turn: int = 4
    harness: str = Field("composer", description="the harness the policy acts through (composer_dag.harness.names())")
    workers: int = Field(4, description="threads for tool calls and grading")
    episode: EpisodeConfig = Field(EpisodeConfig(), description="each episode's budgets and its grading "
                                                                 "(episode.grade: reward_mode, flag_penalty)")


@dataclass
class _Run:
    task_dir: Path
    group_id: str
    sample: int
    episode: Episode
    prompt_ids: list[int]
    max_turns: int
    messages: list[dict] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: int = 0
    malformed: int = 0
    tool_errors: int = 0
    finish: str = ""
    gen_s: float = 0.0
    tool_s: float = 0.0
    grade_s: float = 0.0
    result: object = None
    t0: float = field(default_factory=time.perf_counter)

    @property
    def done(self) -> bool:
        return bool(self.finish)

    def extend(self, ids: list[int], mask: int, logprobs: list[float] | None = None) -> None:
        self.ids += ids
        self.mask += [mask] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


class GradeCache:
    """Grades kept by everything the grader reads: the task directory, the final workspace
    (``workspace_digest``) and the action log (each call with its arguments and outcome; the
    times a call and its command took are left out). Two episodes that end in the same bytes after the same calls
    get the same grade, so the first is graded and the others reuse its result: every untouched
    checkout of a task (a model that never emits a parsable call, early in training or before
    SFT), and the many identical solutions of a policy that has learned a task, which would
    otherwise each pay sandboxed test runs. A grade that raised is not kept. One instance may
    serve several loops in turn (the candidates of one evaluation job)."""

    def __init__(self):
        self._slots: dict[tuple, list] = {}  # key -> [lock, grade]
        self._lock = threading.Lock()

    @staticmethod
    def key(task_dir, workspace, log: list[dict]) -> tuple:
        actions = json.dumps([{k: v for k, v in e.items() if not k.endswith("seconds")} for e in log],
                             sort_keys=True, default=str)
        # the task's own checkout (an episode that never needed a workspace) is digested once
        tree = checkout_digest(task_dir) if Path(workspace) == Path(task_dir) / "repo" else workspace_digest(workspace)
        return str(task_dir), tree, hashlib.sha256(actions.encode()).hexdigest()

    def get(self, key: tuple, grade):
        with self._lock:
            slot = self._slots.setdefault(key, [threading.Lock(), None])
        with slot[0]:
            if slot[1] is None:
                slot[1] = grade()
            return slot[1]


class AgentLoop:
    """Runs groups of episodes against an ``Engine``; returns rollout records (dicts).
    ``grades``: a grade cache shared with other loops (default: the loop's own)."""

    def __init__(self, engine: Engine, tokenizer, config: AgentConfig = AgentConfig(),
                 episode: EpisodeConfig | None = None, grades: GradeCache | None = None):
        self.engine, self.tok, self.cfg = engine, tokenizer, config
        self.episode = config.episode if episode is None else episode
        self.harness = harnesses.get(config.harness)
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.stops = (self.im_end, tokenizer.eos_token_id)
        self.newline = self._encode("\n")
        self.control = self.harness.control(tokenizer)
        self.pool = ThreadPoolExecutor(max(1, config.workers), thread_name_prefix="agent")
        self.grades = grades if grades is not None else GradeCache()

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def _encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False).input_ids

    def _start(self, task_dir, group_id: str, sample: int) -> _Run:
        ep = Episode(task_dir, self.episode, harness=self.harness)
        user = ep.prompt()
        msgs = self.harness.prompt_messages(user, self.cfg.system_style)
        prompt = self._encode(self.harness.render_prompt(self.tok, user, self.cfg.system_style))
        return _Run(Path(task_dir), group_id, sample, ep, prompt, min(self.cfg.max_turns, ep.max_turns), msgs)

    def run(self, jobs: list[tuple[str, str, int]], version: int, seed: int = 0,
            engine: Engine | None = None) -> list[dict]:
        """``jobs``: (task_dir, group_id, sample_index). Every job becomes one rollout.
        ``engine`` replaces the loop's own for this call (a rollout server chosen per episode)."""
        engine = engine or self.engine
        runs = list(self.pool.map(lambda j: self._start(*j), jobs))
        grading = []
        active = runs
        turn = 0
        try:
            while active:
                for r in active:
                    if len(r.prompt_ids) + len(r.ids) + self.cfg.max_new_tokens > self.cfg.max_context:
                        r.finish = "max_context"
                grading += [self.pool.submit(self._grade, r) for r in active if r.done]
                active = [r for r in active if not r.done]
                if not active:
                    break
                t0 = time.perf_counter()
                outs = engine.generate(
                    [r.prompt_ids + r.ids for r in active],
                    Sampling(1, self.cfg.temperature, self.cfg.top_p, self.cfg.max_new_tokens,
                             self.stops, seed + 7919 * turn))
                dt = time.perf_counter() - t0
                for r, c in zip(active, outs):
                    r.gen_s += dt
                list(self.pool.map(self._act, active, outs))
                grading += [self.pool.submit(self._grade, r) for r in active if r.done]
                active = [r for r in active if not r.done]
                turn += 1
            for g in grading:
                g.result()
        finally:
            for r in runs:
                r.episode.close()
        return [self._record(r, version) for r in runs]

    def defang(self, text: str) -> str:
        return defang(text, self.control)

    def _act(self, r: _Run, c: Completion) -> None:
        r.turns += 1
        ids, lps = list(c.token_ids), c.logprobs
        cut = len(ids) > self.cfg.max_new_tokens  # an engine that ignored the limit
        if cut:
            ids, lps = ids[:self.cfg.max_new_tokens], (lps or [])[:self.cfg.max_new_tokens]
        r.extend(ids, 1, lps if lps is not None and len(lps) == len(ids) else None)
        text = self.tok.decode(ids, skip_special_tokens=False)
        calls, errors, prose = self.harness.parse(text)
        r.messages.append({"role": "assistant", "content": prose, "tool_calls": calls,
                           **({"truncated": True} if cut or c.finish_reason == "length" else {})})
        if ids and ids[-1] == self.tok.eos_token_id:
            r.finish = "eos"
            return
        r.extend(([] if c.finish_reason == "stop" and not cut else [self.im_end]) + self.newline, 0)
        observations: list[Observation] = [Observation(e, is_error=True) for e in errors]
        if not calls and not errors:
            observations.append(Observation(self.harness.no_call, is_error=True))
        r.malformed += len(observations)
        for call in calls[:self.cfg.max_calls_per_turn]:
            obs = r.episode.step(call)
            r.tool_s += obs.seconds
            r.tool_errors += obs.is_error
            observations.append(obs)
            if obs.done:
                break
        tool_msgs = [self.harness.result_message(self.defang(o.content)) for o in observations]
        r.messages += [{**m, **({"truncated": True} if o.truncated else {}), **({"error": True} if o.is_error else {})}
                       for m, o in zip(tool_msgs, observations)]
        if r.episode.done:
            r.finish = "submit" if any(o.kind == "submit" and not o.is_error for o in observations) else "task_turn_limit"
        elif r.turns >= r.max_turns:
            r.finish = "max_turns"
        if not r.done:
            r.extend(self._encode(self.tok.apply_chat_template(tool_msgs, tokenize=False,
                                                               add_generation_prompt=True)), 0)

    def _grade(self, r: _Run) -> None:
        t0 = time.perf_counter()
        ep = r.episode
        r.result = self.grades.get(GradeCache.key(r.task_dir, ep.final_tree, ep.log), ep.grade)
        r.grade_s = time.perf_counter() - t0

    def _record(self, r: _Run, version: int) -> dict:
        g = r.result
        return {
            "rollout_id": uuid.uuid4().hex[:16], "task_id": r.episode.task.get("id", r.task_dir.name),
            "task_dir": str(r.task_dir), "group_id": r.group_id, "sample_index": r.sample,
            "policy_version": version, "harness": self.harness.name, "harness_version": self.harness.version,
            "messages": json.dumps(r.messages),
            "prompt_ids": r.prompt_ids, "completion_ids": r.ids, "loss_mask": r.mask,
            "logprobs": r.logprobs, "reward": float(g.reward), "unflagged_reward": float(g.details.get("unflagged_reward", g.reward)),
            "tests_passed": g.passed, "tests_failed": g.failed, "flags": list(g.flags),
            "flag_families": list(getattr(g, "families", [])), "canary_passed": bool(getattr(g, "canary_passed", False)),
            "num_turns": r.turns, "malformed_calls": r.malformed, "tool_errors": r.tool_errors,
            "finish": r.finish, "generated_tokens": sum(r.mask),
            "gen_seconds": r.gen_s, "tool_seconds": r.tool_s, "grade_seconds": r.grade_s,
            "episode_seconds": time.perf_counter() - r.t0,
        }


class ExternalLoop:
    """Episodes played by an external harness (``AgentConfig.harness`` names a declared spec or a
    spec file): each job is one ``harness.external.run_episode`` through a gateway, several at
    once (``workers``); each becomes one rollout with the gateway's token-exact segments. The
    same ``run`` as ``AgentLoop``: on the loop's engine, or on the ``engine`` a call gives (the
    rollout fleet's server for that episode: its key is bound to it at the gateway). A server
    lost mid-episode raises ``ServerDown`` after the episode, so the fleet plays it again elsewhere."""

    def __init__(self, engine: Engine, tokenizer, config: AgentConfig = AgentConfig(),
                 episode: EpisodeConfig | None = None, grades=None):
        from composer_dag.gateway.core import Gateway
        from composer_dag.gateway.server import GatewayServer
        from composer_dag.gateway.upstream import Bound
        from composer_dag.harness.external import load_spec

        self.cfg, self.engine = config, engine
        self.episode = config.episode if episode is None else episode
        self.spec = load_spec(config.harness)
        self.upstream = Bound()
        self.gateway = Gateway(self.upstream, tokenizer, "policy", max_model_len=config.max_context,
                               default_max_tokens=config.max_new_tokens)
        self.server = GatewayServer(self.gateway).start()
        self.work = Path(tempfile.mkdtemp(prefix="cdag-ext-"))

    def close(self) -> None:
        self.server.stop()
        shutil.rmtree(self.work, ignore_errors=True)

    def run(self, jobs: list[tuple[str, str, int]], version: int, seed: int = 0,
            engine: Engine | None = None) -> list[dict]:
        from composer_dag.harness.external import rollout_record, run_episode
        from composer_dag.inference.server import ServerDown

        own = engine is None
        engine = self.engine if own else engine

        def one(job):
            task_dir, group, sample = job
            out = self.work / f"{group}-{sample}-{uuid.uuid4().hex[:6]}"
            key = self.gateway.issue(f"{group}#{sample}", self.spec.run.max_calls)
            self.upstream.bind(key, engine, str(version), "in-process" if own else "fleet", exclusive=own)
            try:
                s = run_episode(self.spec, task_dir, self.server, "policy", out, self.episode, key=key)
            finally:
                self.upstream.unbind(key)
                self.gateway.forget(key)
            if s["end_reason"] == "upstream_down" and not own:
                raise ServerDown(f"the episode's server stopped answering ({s['calls']} calls)")
            return rollout_record(s, task_dir, group, sample, version)

        with ThreadPoolExecutor(max(1, self.cfg.workers), thread_name_prefix="external") as pool:
            return list(pool.map(one, jobs))


def agent_loop(engine: Engine, tokenizer, config: AgentConfig = AgentConfig(), **kw):
    """The loop for ``config.harness``: the built-in harnesses' ``AgentLoop``, an external one's
    ``ExternalLoop``."""
    if config.harness in harnesses.names():
        return AgentLoop(engine, tokenizer, config, **kw)
    return ExternalLoop(engine, tokenizer, config, **kw)


_SCHEMA = None


def rollout_schema():
    import pyarrow as pa

    global _SCHEMA
    if _SCHEMA is None:
        ints, floats = pa.list_(pa.int32()), pa.list_(pa.float32())
        _SCHEMA = pa.schema([
            ("rollout_id", pa.string()), ("task_id", pa.string()), ("task_dir", pa.string()),
            ("group_id", pa.string()), ("sample_index", pa.int32()), ("policy_version", pa.int64()),
            ("messages", pa.string()), ("prompt_ids", ints), ("completion_ids", ints), ("loss_mask", pa.list_(pa.int8())),
            ("logprobs", floats), ("reward", pa.float64()), ("unflagged_reward", pa.float64()),
            ("tests_passed", pa.int32()), ("tests_failed", pa.int32()), ("flags", pa.list_(pa.string())),
            ("flag_families", pa.list_(pa.string())), ("canary_passed", pa.bool_()),
            ("num_turns", pa.int32()), ("malformed_calls", pa.int32()), ("tool_errors", pa.int32()),
            ("finish", pa.string()), ("generated_tokens", pa.int32()), ("gen_seconds", pa.float64()),
            ("tool_seconds", pa.float64()), ("grade_seconds", pa.float64()), ("episode_seconds", pa.float64()),
            ("step", pa.int64()), ("advantage", pa.float64()), ("staleness", pa.int64()),
            ("server_id", pa.string()), ("infra_error", pa.string()), ("attempts", pa.int32()),
            ("harness", pa.string()), ("harness_version", pa.string()),
            # a rollout recorded call by call through the gateway: its token-exact sequences
            ("segments", pa.list_(pa.struct([("ids", ints), ("mask", pa.list_(pa.int8())), ("logprobs", floats)]))),
            ("extension_rate", pa.float64()), ("end_reason", pa.string()),
        ])
    return _SCHEMA


def rollouts_to_table(rollouts: list[dict]):
    """A pyarrow Table (one row per rollout); fields a record lacks are null."""
    import pyarrow as pa

    schema = rollout_schema()
    return pa.Table.from_pylist([{k: r.get(k) for k in schema.names} for r in rollouts], schema=schema)
