"""Evaluate a checkpoint: agentic pass@k on held-out tasks through the RL harness (same
agent loop, sandbox and grader), HumanEval function completion, validation perplexity, cost.

Files written to ``out_dir``::

    results.parquet     one row per task sample (checkpoint digest, task, source, sample,
                        reward, passed, flags, tokens, seconds)
    rollouts.parquet    the full episodes (messages, token ids), the RL rollout schema
    humaneval.parquet   one row per HumanEval completion (when HumanEval runs)
    summary.json        the summary ``evaluate`` returns
    manifest.json       size and sha256 of every file above, written last: an evaluation
                        without it is unfinished

While it runs, each finished batch of tasks is kept in ``progress/<key>/batch_NNNNN.parquet``
(written atomically; ``key`` is a digest of the checkpoint, every task's files and the
settings that shape the episodes). An evaluation killed midway and started again with the same
inputs reuses those batches and samples only the rest, with the same seeds, so it ends with
the result an uninterrupted run gives; other inputs get another key and reuse nothing. The
directory is removed once the evaluation is complete.

A checkpoint directory that carries a ``manifest.json`` is verified against it before it is
read: a half-copied or damaged checkpoint is refused with ``ArtifactError``.

A sample *passes* when every hidden test ran and passed and no cheat flag was raised.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Optional

from pydantic import Field, field_validator

from ..agent import AgentConfig
from ..inference.engine import InferenceConfig
from ..runtime.config import StageConfig
from ..tasks.sources import declared
from .gate import GateConfig
from .metrics import aggregate, pass_at_k


class EvalConfig(StageConfig):
    """Evaluating checkpoints on held-out tasks, and the promotion gate between them. Agent
    episodes run through the same harness as RL (``agent``) on the same engine (``inference``).
    Defaults fit the embedded default; a real evaluation raises ``samples_per_task`` (and
    ``ks``) and drops ``max_tasks``."""

    samples_per_task: int = Field(8, ge=1, description="n: samples per task (pass@k needs k <= n); more samples "
                                                       "narrow the standard error over samples of each pass@1")
    samples_per_task_of: dict[str, int] = Field(
        {"base_model": 1, "midtrained_checkpoint": 1},
        description="samples per task for these named candidates of a multi-checkpoint evaluation (the lineage's "
                    "starting points, which the gate compares on perplexity)")
    samples_of_source: dict[str, int] = Field(
        declared("eval_samples"), description="samples per task of these task sources (at most samples_per_task), for "
                                       "sources whose gradings are slow (a repository's tasks are graded by its "
                                       "own suite); the overall pass@k then reports k up to the smallest")
    ks: list[int] = [1, 2, 8]
    task_ids: Optional[list[str]] = Field(None, description="a subset of tasks_dir (default: every task)")
    max_tasks: Optional[int] = Field(3, description="the first N tasks (by id) after task_ids, of the sources "
                                                    "not in every_task_of")
    every_task_of: list[str] = Field(list(declared("eval_every_task")),
                                     description="task sources evaluated in full, whatever max_tasks")
    batch_tasks: Optional[int] = Field(64, description="tasks per agent-loop batch (all their samples together; a "
                                                       "finished batch is what an interrupted evaluation keeps). "
                                                       "Larger batches keep the engine busier")
    humaneval_ids: Optional[list[str]] = Field(None, description="None: the HumanEval problems behind tasks_dir's humaneval tasks; []: skip")
    humaneval_samples: int = 1
    humaneval_temperature: float = Field(0.0, description="greedy")
    humaneval_max_tokens: int = 128
    humaneval_timeout: float = 10.0
    val_dir: Optional[str] = Field(None, description="token shard directory with val.bin/.idx; None: no perplexity")
    ppl_seq_len: int = 256
    ppl_batch_size: int = 8
    ppl_max_batches: Optional[int] = 16
    torch_threads: Optional[int] = None
    seed: int = 0
    harnesses: list[str] = Field([], description="external harnesses (a declared name or a spec file) also played on "
                                                 "the selected tasks through the gateway over the same engine: "
                                                 "pass@1 per harness under by_harness, which the gate compares")
    harness_candidates: list[str] = Field(["sft_checkpoint", "rl_checkpoint"],
                                          description="the candidates of a multi-checkpoint evaluation that play the "
                                                      "external harnesses (the gate's pair)")
    harness_max_tasks: Optional[int] = Field(3, description="the first N selected tasks each external harness plays")
    harness_samples: int = Field(1, ge=1, description="samples per task of each external harness")
    agent: AgentConfig = AgentConfig()
    inference: InferenceConfig = InferenceConfig()
    gate: GateConfig = GateConfig()

    @field_validator("ks")
    @classmethod
    def _ks_positive(cls, ks: list[int]) -> list[int]:
        if not ks or any(k < 1 for k in ks):
            raise ValueError("every k must be >= 1")
        return ks

    @field_validator("harnesses")
    @classmethod
    def _harnesses_declared(cls, hs: list[str]) -> list[str]:
        from ..harness import names
        from ..harness.external import load_spec

        for h in hs:
            if h not in names():
                load_spec(h)  # ValueError: neither a declared spec nor a spec file
        return hs

    @field_validator("samples_of_source")
    @classmethod
    def _samples_positive(cls, m: dict[str, int]) -> dict[str, int]:
        if any(n < 1 for n in m.values()):
            raise ValueError("samples_of_source: every source needs at least 1 sample per task")
        return m


def checkpoint_digest(checkpoint_dir) -> str:
    """sha256 of the checkpoint's ``manifest.json`` when it has one (the storage digest),
    else sha256 over every file's relative path and sha256, in path order."""
    root = Path(checkpoint_dir)
    if (root / "manifest.json").is_file():
        return hashlib.sha256((root / "manifest.json").read_bytes()).hexdigest()
    outer = hashlib.sha256()
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        rel = p.relative_to(root).as_posix()
        if any(part.startswith(".") and ".tmp" in part for part in rel.split("/")):
            continue
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        outer.update(f"{rel}\0{h.hexdigest()}\n".encode())
    return outer.hexdigest()


# Settings that change neither which episodes run nor how they are sampled and graded.
_NOT_IN_KEY = ("ks", "gate", "samples_per_task_of", "harnesses", "harness_candidates", "harness_max_tasks", "harness_samples", "torch_threads", "task_ids", "max_tasks", "every_task_of", "humaneval_ids", "humaneval_samples",
               "humaneval_temperature", "humaneval_max_tokens", "humaneval_timeout", "val_dir", "ppl_seq_len",
               "ppl_batch_size", "ppl_max_batches")


def progress_key(digest: str, tasks: list[tuple[Path, dict]], cfg: "EvalConfig") -> str:
    """What the agent episodes depend on: the checkpoint digest, the id and files of every
    selected task in order, and every setting except those in ``_NOT_IN_KEY``."""
    h = hashlib.sha256(digest.encode())
    for d, t in tasks:
        h.update(f"\0{t.get('id', d.name)}\0{checkpoint_digest(d)}".encode())
    settings = {k: v for k, v in cfg.to_dict().items() if k not in _NOT_IN_KEY}
    settings["agent"] = {k: v for k, v in settings["agent"].items() if k != "workers"}
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return h.hexdigest()[:24]


def select_tasks(tasks_dir, cfg: EvalConfig) -> list[tuple[Path, dict]]:
    """(task dir, task.json) of the tasks to evaluate, sorted by id."""
    tasks = sorted(((p.parent, json.loads(p.read_text())) for p in Path(tasks_dir).glob("*/task.json")),
                   key=lambda t: t[1].get("id", t[0].name))
    if cfg.task_ids is not None:
        want = set(cfg.task_ids)
        tasks = [t for t in tasks if t[1].get("id", t[0].name) in want]
        missing = want - {t[1].get("id", t[0].name) for t in tasks}
        if missing:
            raise FileNotFoundError(f"tasks not found under {tasks_dir}: {sorted(missing)[:5]}")
    if cfg.max_tasks is not None:
        full = set(cfg.every_task_of)
        capped = [t for t in tasks if t[1].get("source") not in full][:cfg.max_tasks]
        keep = {id(t) for t in capped}
        tasks = [t for t in tasks if t[1].get("source") in full or id(t) in keep]
    if not tasks:
        raise FileNotFoundError(f"no task directories (*/task.json) to evaluate under {tasks_dir}")
    return tasks


def _write_parquet(rows: list[dict], path: Path, schema=None) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(rows, schema=schema)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp, compression="zstd")
    os.replace(tmp, path)
    return str(path)


def _results_schema():
    import pyarrow as pa

    return pa.schema([
        ("checkpoint_digest", pa.string()), ("task_id", pa.string()), ("source", pa.string()),
        ("sample_index", pa.int32()), ("reward", pa.float64()), ("unflagged_reward", pa.float64()),
        ("passed", pa.bool_()), ("flags", pa.list_(pa.string())), ("tests_passed", pa.int32()),
        ("tests_failed", pa.int32()), ("num_turns", pa.int32()), ("finish", pa.string()),
        ("prompt_tokens", pa.int32()), ("generated_tokens", pa.int32()), ("seconds", pa.float64()),
        ("gen_seconds", pa.float64()), ("tool_seconds", pa.float64()), ("grade_seconds", pa.float64()),
    ])


def sample_passed(rollout: dict) -> bool:
    return rollout["tests_passed"] > 0 and rollout["tests_failed"] == 0 and not rollout["flags"]


def _load_batch(path: Path, jobs: list[tuple[str, str, int]], log) -> list[dict] | None:
    """The rollouts a finished batch left in ``path``, or None (absent, unreadable, or not the
    episodes ``jobs`` asks for: the batch is then sampled again)."""
    if not path.exists():
        return None
    from ..storage import ArtifactError, Storage

    try:
        rows = Storage(str(path.parent)).read_parquet(str(path)).to_pylist()
    except ArtifactError as exc:
        log(f"eval: {exc}: the batch is sampled again")
        return None
    if [(r["task_id"], r["sample_index"]) for r in rows] != [(tid, j) for _, tid, j in jobs]:
        log(f"eval: {path} holds other episodes than its batch: the batch is sampled again")
        return None
    return rows


def _run_agent(engine, tok, tasks, cfg: EvalConfig, log, progress_dir: Path | None = None,
               grades=None) -> tuple[list[dict], int]:
    """Rollouts of every sample of every task, and how many batches came from ``progress_dir``
    (batches finished by an earlier, interrupted run with the same inputs). ``grades``: an
    ``agent.GradeCache`` shared across the candidates of one job."""
    from ..agent import agent_loop, rollouts_to_table
    from ..storage import Storage

    agent = agent_loop(engine, tok, cfg.agent, grades=grades)
    size = cfg.batch_tasks or len(tasks)
    store = Storage(str(progress_dir)) if progress_dir is not None else None
    rollouts, reused = [], 0
    try:
        for b in range(0, len(tasks), size):
            chunk = tasks[b:b + size]
            jobs = [(str(d), t.get("id", d.name), j) for d, t in chunk
                    for j in range(min(cfg.samples_per_task, cfg.samples_of_source.get(t.get("source"), cfg.samples_per_task)))]
            path = progress_dir / f"batch_{b // size:05d}.parquet" if progress_dir is not None else None
            done = _load_batch(path, jobs, log) if path is not None else None
            if done is None:
                done = agent.run(jobs, version=0, seed=cfg.seed + 1_000_003 * (b // size))
                if store is not None:
                    store.write_parquet(rollouts_to_table(done), store.url(path.name))
                how = "sampled"
            else:
                reused, how = reused + 1, "reused from an interrupted run"
            rollouts += done
            log(f"eval: {min(b + size, len(tasks))}/{len(tasks)} tasks ({how}), "
                f"{sum(map(sample_passed, rollouts))}/{len(rollouts)} samples passed")
    finally:
        agent.close()
    return rollouts, reused


def _run_harness(engine, tok, tasks, cfg: EvalConfig, harness: str, log, progress_dir: Path) -> list[dict]:
    """The rollouts of one external harness: the first ``harness_max_tasks`` tasks,
    ``harness_samples`` samples each, through a gateway over ``engine`` (resumable as the main
    run is, in a progress directory of its own)."""
    from ..harness.external import load_spec

    if harness == cfg.agent.harness:
        return []
    spec = load_spec(harness)
    if not spec.installed():
        log(f"eval: harness {spec.name} {spec.version} is not installed (make harnesses): skipped")
        return []
    chosen = tasks[:cfg.harness_max_tasks] if cfg.harness_max_tasks else tasks
    own = cfg.replace(samples_per_task=cfg.harness_samples, samples_of_source={}, agent={"harness": harness})
    log(f"eval: harness {harness}: {len(chosen)} tasks x {cfg.harness_samples} samples")
    tag = hashlib.sha256(f"{harness}\0{cfg.harness_samples}\0{len(chosen)}".encode()).hexdigest()[:12]
    rollouts, _ = _run_agent(engine, tok, chosen, own, log, progress_dir / f"harness-{tag}")
    return rollouts


def _harness_block(rollouts: list[dict], digest: str, source: dict, ks) -> tuple[dict, list[dict]]:
    """pass@1 of one external harness (infrastructure failures left out and counted), its end
    reasons and mean prompt-extension rate; and its result rows."""
    kept = [r for r in rollouts if not r.get("infra_error")]
    rows, per_task, agg = _score(kept, digest, source, ks) if kept else ([], {}, {"pass@1": None, "pass@1_stderr": None})
    rates = [r["extension_rate"] for r in rollouts if r.get("extension_rate") is not None]
    block = {"tasks": len(per_task), "samples": len(rows), "pass@1": agg["pass@1"], "pass@1_stderr": agg["pass@1_stderr"],
             "infra_failures": len(rollouts) - len(kept),
             "end_reasons": dict(Counter(r.get("end_reason") or r.get("finish") for r in rollouts)),
             "extension_rate": sum(rates) / len(rates) if rates else None,
             "harness_version": next((r.get("harness_version") for r in rollouts), None)}
    return block, rows


def _humaneval(engine, tok, he_ids: list, cfg: EvalConfig, log) -> tuple[dict, dict]:
    """HumanEval function completion on the running engine: the scored samples (with their
    seconds) and the generated token counts per problem."""
    from . import humaneval as he

    t1 = time.perf_counter()
    problems = he.load_problems(he_ids)
    texts, he_tokens = he.generate_completions(
        engine, tok, problems, cfg.humaneval_samples, cfg.humaneval_temperature,
        max_tokens=cfg.humaneval_max_tokens, seed=cfg.seed)
    he_res = he.score_completions(problems, texts, cfg.humaneval_timeout, cfg.agent.workers)
    he_res["seconds"] = round(time.perf_counter() - t1, 3)
    log(f"eval: HumanEval function completion pass@1 {he_res['pass@1']:.4f} on {len(problems)} problems")
    return he_res, he_tokens


def _score(rollouts: list[dict], digest: str, source: dict, ks) -> tuple[list[dict], dict, dict]:
    """One results row per episode, per-task counts with pass@1, and the aggregate (pass@k, by
    source with each source's flag rate)."""
    rows = [{"checkpoint_digest": digest, "task_id": r["task_id"], "source": source.get(r["task_id"], "unknown"),
             "sample_index": r["sample_index"], "reward": r["reward"], "unflagged_reward": r["unflagged_reward"],
             "passed": sample_passed(r), "flags": r["flags"], "tests_passed": r["tests_passed"],
             "tests_failed": r["tests_failed"], "num_turns": r["num_turns"], "finish": r["finish"],
             "prompt_tokens": len(r["prompt_ids"]), "generated_tokens": r["generated_tokens"],
             "seconds": r["episode_seconds"], "gen_seconds": r.get("gen_seconds"), "tool_seconds": r.get("tool_seconds"),
             "grade_seconds": r.get("grade_seconds")} for r in rollouts]
    per_task: dict[str, dict] = {}
    for r in rows:
        t = per_task.setdefault(r["task_id"], {"source": r["source"], "n": 0, "c": 0, "flagged": 0})
        t["n"] += 1
        t["c"] += r["passed"]
        t["flagged"] += bool(r["flags"])
    for t in per_task.values():
        t["pass@1"] = pass_at_k(t["n"], t["c"], 1)
    agg = aggregate(per_task, ks)
    for src, block in agg["by_source"].items():
        src_rows = [r for r in rows if r["source"] == src]
        block["flag_rate"] = sum(bool(r["flags"]) for r in src_rows) / len(src_rows)
    return rows, per_task, agg


def _write_tables(out: Path, rows: list[dict], rollouts: list[dict], digest: str, he_res, he_tokens,
                  humaneval_samples: int) -> tuple[dict, dict | None]:
    """results.parquet, rollouts.parquet and (when HumanEval ran) humaneval.parquet; their paths,
    and the HumanEval summary."""
    from ..agent import rollouts_to_table

    files = {"results": _write_parquet(rows, out / "results.parquet", _results_schema()),
             "rollouts": _write_parquet(rollouts_to_table(rollouts), out / "rollouts.parquet")}
    he_summary = None
    if he_res is not None:
        he_rows = [{"checkpoint_digest": digest, **r,
                    "generated_tokens": he_tokens[r["problem_id"]][r["sample_index"]]} for r in he_res["rows"]]
        files["humaneval"] = _write_parquet(he_rows, out / "humaneval.parquet")
        he_summary = {"problems": he_res["problems"], "samples_per_problem": humaneval_samples,
                      "pass@1": he_res["pass@1"], "solved": sorted(p for p, v in he_res["per_problem"].items() if v["c"]),
                      "seconds": he_res["seconds"]}
    return files, he_summary


def _seal(out: Path, summary: dict) -> dict:
    """summary.json written atomically, the resumable progress removed (every batch is in
    results.parquet now), then the manifest that makes ``out`` a finished evaluation."""
    from ..storage import Storage

    summary["files"]["summary"] = str(out / "summary.json")
    tmp = out / ".summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2, default=str))
    os.replace(tmp, out / "summary.json")
    shutil.rmtree(out / "progress", ignore_errors=True)
    store = Storage(str(out))
    summary["manifest_digest"] = store.write_manifest(store.root)
    return summary


def _open(out: Path, checkpoint_dir: str) -> str:
    """Make ``out`` and unmark it as finished (whatever it held is no longer a finished evaluation
    until the new manifest); verify the checkpoint's manifest where it has one (never read a
    half-copied checkpoint); return the checkpoint's digest."""
    from ..storage import Storage

    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)
    if (Path(checkpoint_dir) / "manifest.json").is_file():
        ckpt_store = Storage(checkpoint_dir)
        ckpt_store.verify_manifest(ckpt_store.root)
    return checkpoint_digest(checkpoint_dir)


def _fit_context(cfg: EvalConfig, checkpoint_dir: str, log) -> EvalConfig:
    """``cfg`` with its inference settings and the agent's context fitted to the checkpoint (its
    positions bound the context)."""
    from ..inference import fit_to_model

    inference = fit_to_model(cfg.inference, checkpoint_dir, log)
    if cfg.agent.max_context > inference.max_model_len or inference != cfg.inference:
        cfg = cfg.replace(inference=inference.to_dict(),
                          agent={"max_context": min(cfg.agent.max_context, inference.max_model_len)})
    return cfg


def _perplexity(cfg: EvalConfig, checkpoint_dir: str, log) -> dict | None:
    """The checkpoint's perplexity on ``cfg.val_dir`` (None without one)."""
    if not cfg.val_dir:
        return None
    from .perplexity import perplexity

    ppl = perplexity(checkpoint_dir, cfg.val_dir, cfg.ppl_seq_len, cfg.ppl_batch_size, cfg.ppl_max_batches)
    log(f"eval: val loss {ppl['val_loss']:.4f}, perplexity {ppl['val_ppl']:.2f}")
    return ppl


def _token_cost(rows: list[dict], num_tasks: int, solved: int) -> dict:
    """The tokens generated in all, per sample, per task (all its samples) and per solved task."""
    total = sum(r["generated_tokens"] for r in rows)
    return {"generated_tokens": total, "tokens_per_sample": total / len(rows), "tokens_per_task": total / num_tasks,
            "tokens_per_solved_task": total / solved if solved else None}


def _by_harness(cfg: EvalConfig, agg: dict, tasks: int, samples: int, external: dict, digest: str, source: dict,
                out: Path, files: dict, log) -> dict:
    """pass@1 per harness: the evaluation's own (its overall figures) and each external one's,
    whose rows go to ``harness_results.parquet``."""
    by_harness = {cfg.agent.harness: {"tasks": tasks, "samples": samples,
                                      "pass@1": agg["pass@1"], "pass@1_stderr": agg["pass@1_stderr"]}}
    h_rows = []
    for h, h_rollouts in ((h, r) for h, r in external.items() if h != cfg.agent.harness):
        block, hr = _harness_block(h_rollouts, digest, source, cfg.ks)
        h = next((r["harness"] for r in h_rollouts if r.get("harness")), Path(h).stem)  # its name, not a path
        by_harness[h] = block if h_rollouts else {**block, "skipped": "not installed (make harnesses)"}
        if not h_rollouts:
            continue
        h_rows += [{**r, "harness": h} for r in hr]
        log(f"eval: harness {h}: pass@1 {block['pass@1']:.4f} on {block['tasks']} tasks, "
            f"{block['infra_failures']} infrastructure failures, extension rate {block['extension_rate']}")
    if h_rows:
        files["harness_results"] = _write_parquet(h_rows, out / "harness_results.parquet")
    return by_harness


def evaluate(checkpoint_dir, tasks_dir, out_dir, config: EvalConfig | dict | None = None, rep=None,
             engine=None, grades=None) -> dict:
    """Evaluate the Hugging Face checkpoint at ``checkpoint_dir`` on the tasks under
    ``tasks_dir``; write the files listed in the module docstring to ``out_dir`` and return
    the summary. ``rep``: a ``pipes.Reporter`` (or anything with ``log``) for progress.
    ``engine``: a running engine of the same architecture to load the checkpoint's weights
    into (see ``evaluate_many``); it stays open. Without it, one is started and closed.
    ``grades``: the grades kept from earlier candidates (``agent.GradeCache``)."""
    import torch

    from ..inference import engine_from_config
    from ..train.tokenizer import load_tokenizer
    from . import humaneval as he

    cfg = EvalConfig.load(config)
    log = rep.log if rep is not None else (lambda msg: None)
    t_start = time.perf_counter()
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    out, checkpoint_dir = Path(out_dir), str(checkpoint_dir)
    digest = _open(out, checkpoint_dir)
    tasks = select_tasks(tasks_dir, cfg)
    source = {t.get("id", d.name): t.get("source", "unknown") for d, t in tasks}
    he_ids = he.held_out_ids(tasks_dir) if cfg.humaneval_ids is None else list(cfg.humaneval_ids)
    log(f"eval: checkpoint {digest[:12]}, {len(tasks)} tasks x {cfg.samples_per_task} samples, "
        f"{len(he_ids)} HumanEval problems, perplexity {'on' if cfg.val_dir else 'off'}")

    ppl = _perplexity(cfg, checkpoint_dir, log)  # before the engine takes its memory

    cfg = _fit_context(cfg, checkpoint_dir, log)
    key = progress_key(digest, tasks, cfg)
    progress_dir = out / "progress" / key
    if progress_dir.is_dir():
        log(f"eval: resuming from {progress_dir}")
    own_engine = engine is None
    if own_engine:
        engine = engine_from_config(cfg.inference, checkpoint_dir, seed=cfg.seed)
    else:
        log(f"eval: weights of {checkpoint_dir} loaded into the running engine in {engine.load_weights(checkpoint_dir):.2f} s")
    gen_tokens0, gen_seconds0 = engine.stats.generated_tokens, engine.stats.seconds
    he_res, he_tokens = None, {}
    try:
        tok = load_tokenizer(checkpoint_dir)
        t0 = time.perf_counter()
        rollouts, reused = _run_agent(engine, tok, tasks, cfg, log, progress_dir, grades)
        agent_wall = time.perf_counter() - t0
        gen_tokens, gen_seconds = engine.stats.generated_tokens - gen_tokens0, engine.stats.seconds - gen_seconds0
        if he_ids:
            he_res, he_tokens = _humaneval(engine, tok, he_ids, cfg, log)
        external = {h: _run_harness(engine, tok, tasks, cfg, h, log, progress_dir) for h in cfg.harnesses}
    finally:
        if own_engine:
            engine.close()

    rows, per_task, agg = _score(rollouts, digest, source, cfg.ks)
    flagged = sum(bool(r["flags"]) for r in rows)
    solved = sum(r["passed"] for r in rows)

    files, he_summary = _write_tables(out, rows, rollouts, digest, he_res, he_tokens, cfg.humaneval_samples)
    by_harness = _by_harness(cfg, agg, len(per_task), len(rows), external, digest, source, out, files, log)
    summary = {
        "checkpoint": checkpoint_dir, "checkpoint_digest": digest, "tasks_dir": str(tasks_dir),
        "num_tasks": len(per_task), "samples_per_task": cfg.samples_per_task, "samples_of_source": cfg.samples_of_source,
        "num_samples": len(rows),
        "resumed_batches": reused,
        "pass@1": agg["pass@1"], "pass@1_stderr": agg["pass@1_stderr"], "pass_at": agg["pass_at"],
        "by_source": agg["by_source"], "solved_samples": solved, "harness": cfg.agent.harness, "by_harness": by_harness,
        "mean_reward": sum(r["reward"] for r in rows) / len(rows),
        "flag_rate": flagged / len(rows), "flagged_samples": flagged,
        "flags_by_kind": dict(Counter(f.split(":", 1)[0] for r in rows for f in r["flags"]).most_common()),
        "humaneval": he_summary, "perplexity": ppl,
        "cost": {
            **_token_cost(rows, len(per_task), solved), "tokens_per_s": gen_tokens / gen_seconds if gen_seconds else None,
            "generation_seconds": round(gen_seconds, 3), "agent_seconds": round(agent_wall, 3),
            "wall_seconds": round(time.perf_counter() - t_start, 3),
        },
        "per_task": {k: {kk: v[kk] for kk in ("source", "n", "c", "pass@1", "flagged")} for k, v in per_task.items()},
        "config": cfg.to_dict(), "files": files,
    }
    return _seal(out, summary)


def _same_architecture(a: str, b: str) -> bool:
    """Whether checkpoint ``b`` loads into an engine built for ``a``: the same model config
    (dtype aside) and the same tokenizer."""
    def sig(d: str):
        cfg = json.loads((Path(d) / "config.json").read_text())
        cfg = {k: v for k, v in cfg.items() if k not in ("dtype", "torch_dtype", "transformers_version", "_name_or_path")}
        tok = Path(d) / "tokenizer.json"
        return cfg, hashlib.sha256(tok.read_bytes()).hexdigest() if tok.exists() else None

    return sig(a) == sig(b)


def _mark_done(out_dir: Path, summaries: dict[str, dict]) -> None:
    tmp = out_dir / ".latest.tmp"
    tmp.write_text(json.dumps({k: v.get("checkpoint_digest") for k, v in summaries.items()}, indent=1))
    os.replace(tmp, out_dir / "latest")


def evaluate_many(checkpoints: dict[str, str], tasks_dir, out_dir, config: EvalConfig | dict | None = None,
                  rep=None) -> dict[str, dict]:
    """``evaluate`` each named checkpoint into ``out_dir/<name>``, sharing one engine: a
    checkpoint of the same architecture as the engine's model is loaded into it in place (a
    second vLLM start costs about a minute of CPU here; a weight reload a fraction of a second).
    A checkpoint whose ``summary.json`` and manifest are already there for the same checkpoint
    digest (a retried job, or a later run whose other candidates changed: the job's state is
    keyed by the tasks and settings, not by the checkpoints) is not evaluated again; one whose
    digest changed is. After each checkpoint, ``out_dir/latest`` lists the finished ones (name:
    digest), which marks the directory as a state a job resumes from."""
    from ..agent import GradeCache
    from ..inference import engine_from_config, fit_to_model
    from ..storage import ArtifactError, Storage

    cfg = EvalConfig.load(config)
    log = rep.log if rep is not None else (lambda msg: None)
    summaries, engine, engine_dir = {}, None, None
    grades = GradeCache()  # the same final workspace after the same calls grades the same for every candidate
    try:
        for name, ckpt in checkpoints.items():
            out = Path(out_dir) / name
            if (out / "summary.json").exists() and (out / "manifest.json").exists():
                try:
                    done = Storage(str(out))
                    done.verify_manifest(done.root)
                    prior = json.loads((out / "summary.json").read_text())
                    if prior.get("checkpoint_digest") == checkpoint_digest(ckpt):
                        prior["manifest_digest"] = done.manifest_digest(done.root)
                        summaries[name] = prior
                        # batches a state copy may have brought back are not part of the result
                        shutil.rmtree(out / "progress", ignore_errors=True)
                        log(f"eval: {name} was evaluated already (checkpoint {prior['checkpoint_digest'][:12]})")
                        _mark_done(Path(out_dir), summaries)
                        continue
                    log(f"eval: {name} changed since its last evaluation: evaluating it again")
                except (ArtifactError, OSError, ValueError):
                    pass
            if engine is not None and not _same_architecture(engine_dir, ckpt):
                engine.close()
                engine = None
            if engine is None:
                inference = fit_to_model(cfg.inference, ckpt, log)
                engine, engine_dir = engine_from_config(inference, ckpt, seed=cfg.seed), ckpt
            log(f"eval: {name}")
            own = cfg.replace(samples_per_task=cfg.samples_per_task_of.get(name, cfg.samples_per_task),
                              harnesses=cfg.harnesses if name in cfg.harness_candidates else [])
            summaries[name] = evaluate(ckpt, tasks_dir, out, own, rep, engine=engine, grades=grades)
            _mark_done(Path(out_dir), summaries)
    finally:
        if engine is not None:
            engine.close()
    return summaries


def summary_record(checkpoint: str, summary: dict) -> dict:
    """One row of the catalog's ``eval_summaries`` table for a checkpoint's summary."""
    def num(x) -> float:
        return float(x) if isinstance(x, (int, float)) else float("nan")

    return {"checkpoint": checkpoint, "checkpoint_digest": str(summary.get("checkpoint_digest")),
            "pass_at_1": num(summary.get("pass@1")), "flag_rate": num(summary.get("flag_rate")),
            "humaneval_pass_at_1": num((summary.get("humaneval") or {}).get("pass@1")),
            "val_ppl": num((summary.get("perplexity") or {}).get("val_ppl")),
            **{f"pass_at_1_{src}": num(block.get("pass@1")) for src, block in sorted((summary.get("by_source") or {}).items())},
            "tasks_by_source": json.dumps({src: block.get("num_tasks") or block.get("tasks")
                                           for src, block in sorted((summary.get("by_source") or {}).items())})}


def eval_cli(checkpoint, tasks_dir, out_dir: str | None = None, baseline: str | None = None,
             config: EvalConfig | dict | None = None) -> dict:
    """``evaluate`` for the command line: ``out_dir`` (default ``./eval-<digest12>``) and
    ``baseline`` (a summary.json to gate against with ``config.gate``)."""
    from .gate import compare, report_markdown

    cfg = EvalConfig.load(config)
    out_dir = out_dir or f"eval-{checkpoint_digest(checkpoint)[:12]}"
    summary = evaluate(checkpoint, tasks_dir, out_dir, cfg)
    if baseline:
        base = json.loads(Path(baseline).read_text())
        cmp = compare(summary, base, cfg.gate, baseline_name=str(baseline))
        summary["gate"] = {"passed": cmp["passed"], "reasons": cmp["reasons"], "markdown": report_markdown([cmp])}
    return summary
