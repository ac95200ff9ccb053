"""SFT trajectories: agent episodes in the harness's own format, each one known to succeed.

Three origins:

- ``reference``: built from a training task's reference solution and played through a real
  episode (the tools answer every call, the grader must pass the result): read the lines that
  change, write them, submit, each action as the harness renders it (``reference_actions``,
  ``Harness.render_action``); a task whose reference names a procedure (the learnable
  family's shell command) runs it and submits. A trajectory whose calls fail or whose grade does not pass is skipped and counted.
- ``rollout``: successful, unflagged rollouts of earlier RL runs (rejection sampling).
- ``session``: good production sessions (``production_traces``: accepted by their user,
  unflagged, tests passing where tests ran), at most ``session_share`` of the set.

Only training tasks are used, and a trajectory whose text shares an n-gram with an evaluation
task (the rule the shards are decontaminated with) is dropped and counted. Every task and every
rollout read is either written or counted under a reason.

A trajectory is a list of messages: the user's instructions, then assistant turns
(``tool_calls``) each followed by the tool's answer; the system prompt is rendered when the
trajectory is tokenized, as the agent loop renders it.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

from pydantic import Field

from composer_dag import harness as harnesses
from composer_dag.harness.base import Action
from ..runtime.config import StageConfig
from ..tasks.sources import declared

SCHEMA_FIELDS = ("trajectory_id", "task_id", "source", "origin", "split", "messages", "num_turns", "chars",
                 "harness", "harness_version")


class TrajectoryConfig(StageConfig):
    """Which trajectories the SFT set holds."""

    max_per_source: dict[str, int] = Field(
        declared("sft_demos"),
        description="reference trajectories per task source, a seeded draw; sources not named: every task; 0: "
                    "none (repo-mined: a mined task's transcript reads a module of a real package, longer than "
                    "the tiny model's sequence, so SFT's tokenization would drop it)")
    from_rollouts: bool = Field(True, description="add the successful, unflagged rollouts of the last RL run")
    max_rollouts: int = Field(200, description="rollout trajectories at most")
    session_share: float = Field(0.25, ge=0.0, le=1.0,
                                 description="production sessions' largest share of the trajectories (good sessions "
                                             "only: accepted, unflagged, tests passing where run); 0 takes none")
    val_fraction: float = Field(0.1, description="share of tasks (by a hash of the id) whose trajectories validate")
    context_lines: int = Field(3, description="lines shown around the change by the reference read")
    workers: int = Field(2, description="episodes played at once")
    harnesses: list[str] = Field([], description="external harnesses (declared names or spec files) whose reference "
                                                 "demonstrations join the set: the same tasks' reference actions "
                                                 "played through each harness itself (harness.external.demonstrate), "
                                                 "kept as the messages it sent; needs the tokenizer")
    seed: int = 0


def _split(task_id: str, fraction: float, seed: int) -> str:
    h = int(hashlib.sha256(f"{seed}:{task_id}".encode()).hexdigest()[:12], 16) / 16 ** 12
    return "val" if h < fraction else "train"


def _hunk(old_text: str, new_text: str) -> tuple[str, str, int, int] | None:
    """``(old, new, first_line, last_line)``: the smallest span of whole lines that turns
    ``old_text`` into ``new_text``, grown by context until ``old`` occurs exactly once."""
    a, b = old_text.splitlines(keepends=True), new_text.splitlines(keepends=True)
    ops = [op for op in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes() if op[0] != "equal"]
    if not ops:
        return None
    i1, i2, j1, j2 = ops[0][1], ops[-1][2], ops[0][3], ops[-1][4]
    while True:
        old = "".join(a[i1:i2])
        if old and old_text.count(old) == 1:
            return old, "".join(b[j1:j2]), i1 + 1, max(i1 + 1, i2)
        if i1 > 0:
            i1, j1 = i1 - 1, j1 - 1
        elif i2 < len(a):
            i2, j2 = i2 + 1, j2 + 1
        else:
            return None


def reference_actions(task_dir: Path, task: dict, context_lines: int = 3) -> list[Action] | None:
    """The harness-neutral actions that solve ``task`` from its reference files; None if it has none."""
    ref = task.get("reference") or {}
    files = ref.get("files") or []
    if not files:
        return None
    if ref.get("command"):  # a task whose reference is a procedure (the learnable family)
        return [Action("exec", {"command": ref["command"]}), Action("submit")]
    actions = []
    for rel in files:
        target = task_dir / "reference" / "files" / rel
        if not target.is_file():
            return None
        new_text = target.read_text()
        current = task_dir / "repo" / rel
        if ref.get("kind") == "answer":
            actions.append(Action("write", {"path": rel, "old": "", "new": new_text.strip()}))
        elif not current.is_file():
            actions.append(Action("write", {"path": rel, "old": "", "new": new_text}))
        else:
            hunk = _hunk(current.read_text(), new_text)
            if hunk is None:
                return None
            old, new, first, last = hunk
            actions.append(Action("read", {"path": rel, "start_line": max(1, first - context_lines),
                                           "end_line": last + context_lines}))
            actions.append(Action("write", {"path": rel, "old": old, "new": new}))
    return actions + [Action("submit")]


def reference_calls(task_dir: Path, task: dict, context_lines: int = 3, harness="composer") -> list[dict] | None:
    """The calls of ``harness`` that solve ``task`` from its reference files; None if it has none."""
    actions = reference_actions(task_dir, task, context_lines)
    return None if actions is None else harnesses.get(harness).render_actions(actions)


def play(task_dir: Path, calls: list[dict], harness="composer") -> tuple[list[dict] | None, str]:
    """Play ``calls`` in a real episode of the task: ``(messages, "ok")`` when every call
    succeeds and the grade passes unflagged, else ``(None, reason)``."""
    from composer_dag.harness.episode import Episode

    h = harnesses.get(harness)
    with Episode(task_dir, harness=h) as ep:
        messages = [{"role": "user", "content": ep.prompt()}]
        for c in calls:
            obs = ep.step(c)
            messages.append({"role": "assistant", "content": "", "tool_calls": [c]})
            if obs.is_error:
                return None, "reference_call_failed"
            if not obs.done:
                messages.append(h.result_message(obs.content))
        result = ep.grade()
    if result.flags:
        return None, "reference_flagged"
    if not (result.passed > 0 and result.failed == 0):
        return None, "reference_not_passing"
    return messages, "ok"


def _text(messages: list[dict]) -> str:
    text = lambda c: c if isinstance(c, str) else json.dumps(c) if c else ""
    return "\n".join(text(m.get("content")) for m in messages) + "\n" + "\n".join(
        json.dumps(c) for m in messages for c in m.get("tool_calls") or [])


def _row(task_id: str, source: str, origin: str, messages: list[dict], cfg: TrajectoryConfig,
         harness: tuple[str, str] | None = None) -> dict:
    """One trajectory row; ``harness``: the (name, version) whose messages these are (default composer's)."""
    body = json.dumps(messages, sort_keys=True)
    name, version = harness or (harnesses.get("composer").name, harnesses.get("composer").version)
    return {"trajectory_id": hashlib.sha256(f"{origin}:{task_id}:{body}".encode()).hexdigest()[:16],
            "task_id": task_id, "source": source, "origin": origin,
            "split": _split(task_id, cfg.val_fraction, cfg.seed), "messages": body,
            "num_turns": sum(m["role"] == "assistant" for m in messages), "chars": len(body),
            "harness": name, "harness_version": version}


def _draw(seed: int, task_id: str) -> str:
    return hashlib.sha256(f"{seed}:{task_id}".encode()).hexdigest()


def from_references(tasks_dir, cfg: TrajectoryConfig, log=lambda msg: None) -> tuple[list[dict], Counter, int]:
    """Reference trajectories of the tasks under ``tasks_dir``: (rows, skipped by reason, tasks read)."""
    chosen, skipped, tasks = _chosen(tasks_dir, cfg)

    def one(item):
        d, t = item
        calls = reference_calls(d, t, cfg.context_lines)
        if calls is None:
            return None, "no_usable_reference"
        try:
            return play(d, calls)
        except Exception as e:  # noqa: BLE001 - a task the host could not play is counted, not fatal
            return None, f"episode_error:{type(e).__name__}"

    t0 = time.perf_counter()
    rows = []
    with ThreadPoolExecutor(max(1, cfg.workers)) as pool:
        for (d, t), (messages, why) in zip(chosen, pool.map(one, chosen)):
            if messages is None:
                skipped[why] += 1
            else:
                rows.append(_row(t.get("id", d.name), t.get("source", "?"), "reference", messages, cfg))
    log(f"sft: {len(rows)} reference trajectories from {len(tasks)} tasks in {time.perf_counter() - t0:.1f} s "
        f"(skipped {dict(skipped)})")
    return rows, skipped, len(tasks)


def _chosen(tasks_dir, cfg: TrajectoryConfig) -> tuple[list, Counter, list]:
    """The tasks whose references are played (each source's cap drawn by seed), the skips, all tasks."""
    tasks = [(p.parent, json.loads(p.read_text())) for p in sorted(Path(tasks_dir).glob("*/task.json"))]
    skipped: Counter = Counter()
    by_source: dict[str, list] = {}
    for d, t in tasks:
        by_source.setdefault(t.get("source", "?"), []).append((d, t))
    chosen = []
    for source, items in sorted(by_source.items()):
        cap = cfg.max_per_source.get(source)
        if cap is not None and len(items) > cap:
            # the cap's tasks by a per-task draw (seed and id), so that tasks joining or leaving the
            # set do not change which of the others are kept
            keep = set(map(id, sorted(items, key=lambda x: _draw(cfg.seed, x[1]["id"]))[:cap]))
            skipped["over_source_cap"] += len(items) - cap
            items = [x for x in items if id(x) in keep]
        chosen += items
    return chosen, skipped, tasks


def from_harness(tasks_dir, cfg: TrajectoryConfig, harness: str, tokenizer, log=lambda msg: None) -> tuple[list[dict], Counter, int]:
    """Reference demonstrations of the tasks under ``tasks_dir`` played through an external
    harness: (rows, skipped by reason, tasks read). A row's ``messages`` are the harness's own
    (its system prompt, its way of giving the task and the results), ``tools`` what it declared."""
    import tempfile

    from composer_dag.harness.external import demonstrate, load_spec

    spec = load_spec(harness)
    chosen, skipped, tasks = _chosen(tasks_dir, cfg)
    work = Path(tempfile.mkdtemp(prefix="cdag-demo-"))

    def one(item):
        d, t = item
        actions = reference_actions(d, t, cfg.context_lines)
        if actions is None:
            return None, "no_usable_reference"
        try:
            conv, why, _ = demonstrate(spec, d, actions, tokenizer, work / d.name)
            return conv, why
        except Exception as e:  # noqa: BLE001 - a task the host could not play is counted, not fatal
            return None, f"episode_error:{type(e).__name__}"

    rows = []
    try:
        with ThreadPoolExecutor(max(1, cfg.workers)) as pool:
            for k, ((d, t), (conv, why)) in enumerate(zip(chosen, pool.map(one, chosen)), 1):
                if k % 10 == 0:
                    log(f"sft: {spec.name} demonstrations: {k} of {len(chosen)} tasks played ({len(rows)} kept)")
                if conv is None:
                    skipped[why] += 1
                    continue
                row = _row(t.get("id", d.name), t.get("source", "?"), "reference", conv["messages"], cfg,
                           harness=(spec.name, spec.version))
                rows.append({**row, "tools": json.dumps(conv["tools"]) if conv["tools"] else None})
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    log(f"sft: {len(rows)} {spec.name} demonstrations from {len(chosen)} tasks (skipped {dict(skipped)})")
    return rows, skipped, len(tasks)


def from_rollouts(tables: Iterable, train_tasks: dict[str, str], cfg: TrajectoryConfig) -> tuple[list[dict], Counter, int]:
    """Trajectories from rollout tables (pyarrow, the RL rollout schema): the passing, unflagged
    rollouts of training tasks, without error turns, each (task, transcript) once."""
    rows, skipped, seen, n = [], Counter(), set(), 0
    for table in tables:
        for r in table.to_pylist():
            n += 1
            msgs = [m for m in json.loads(r.get("messages") or "[]") if m.get("role") != "system"]
            if r.get("task_id") not in train_tasks:
                why = "not_a_training_task"
            elif r.get("flags"):
                why = "flagged"
            elif not ((r.get("tests_passed") or 0) > 0 and (r.get("tests_failed") or 0) == 0):
                why = "not_passing"
            elif any(m.get("truncated") or m.get("error") for m in msgs) or not msgs or msgs[0].get("role") != "user":
                why = "error_or_cut_turn"
            elif len(rows) >= cfg.max_rollouts:
                why = "over_max_rollouts"
            else:
                clean = [{k: m[k] for k in ("role", "content", "tool_calls") if k in m} for m in msgs]
                key = (r["task_id"], json.dumps(clean, sort_keys=True))
                if key in seen:
                    why = "duplicate"
                else:
                    seen.add(key)
                    named = (r["harness"], r.get("harness_version") or "") if r.get("harness") else None
                    rows.append(_row(r["task_id"], train_tasks[r["task_id"]], "rollout", clean, cfg, named))
                    continue
            skipped[why] += 1
    return rows, skipped, n


def from_sessions(sessions: Iterable[dict], others: int, cfg: TrajectoryConfig) -> tuple[list[dict], Counter, int]:
    """Trajectories from production sessions (rows of ``production_traces``): the good ones, in
    the harness's own messages, at most ``session_share`` of the whole set (``others`` is the
    count of the rest), drawn per session by the seed."""
    from ..traces.format import from_openai

    sessions = list(sessions)
    share = cfg.session_share
    cap = len(sessions) if share >= 1.0 else int(share * others / (1.0 - share)) if share > 0 else 0
    rows, skipped = [], Counter()
    for r in sorted(sessions, key=lambda x: _draw(cfg.seed, x["session_id"])):
        if not r.get("good"):
            skipped["not_good"] += 1
            continue
        msgs = [m for m in from_openai(json.loads(r["record"])["messages"]) if m.get("role") != "system"]
        if not msgs or msgs[0].get("role") != "user" or any(m.get("truncated") or m.get("error") for m in msgs):
            skipped["error_or_cut_turn"] += 1
            continue
        if len(rows) >= cap:
            skipped["over_session_share"] += 1
            continue
        clean = [{k: m[k] for k in ("role", "content", "tool_calls") if k in m} for m in msgs]
        rows.append(_row(r["session_id"], "session", "session", clean, cfg))
    return rows, skipped, len(sessions)


def session_set(sessions: list[dict], out_dir, seed: int = 0) -> dict:
    """A cycle's SFT set: every good session of ``sessions`` as a trajectory under ``out_dir``
    (nothing written when none is good); ``{in, out, skipped}``."""
    rows, skipped, n = from_sessions(sessions, 0, TrajectoryConfig(session_share=1.0, seed=seed))
    if rows:
        write_rows(rows, out_dir)
    return {"in": n, "out": len(rows), "skipped": dict(skipped), "rows": rows}


def decontaminate(rows: list[dict], eval_tasks_dir) -> tuple[list[dict], list[dict]]:
    """(clean rows, leak reports): a row sharing an n-gram with an eval task is a leak."""
    from ..evals.contamination import contamination_report

    leaks = contamination_report(((r["trajectory_id"], _text(json.loads(r["messages"]))) for r in rows), eval_tasks_dir)
    bad = {x["shard_item"] for x in leaks}
    return [r for r in rows if r["trajectory_id"] not in bad], leaks


def build(tasks_dir, out_dir, cfg: TrajectoryConfig | dict | None = None, rollout_tables: Iterable = (),
          eval_tasks_dir=None, log=lambda msg: None, sessions: Iterable[dict] = (), tokenizer=None) -> dict:
    """Write ``out_dir/trajectories.parquet`` and ``out_dir/summary.json``; return the summary
    (``{"reference": {in, out, skipped}, "rollout": {...}, "session": {...}, "contaminated",
    "by_source", ...}``). ``sessions``: rows of ``production_traces``."""
    cfg = TrajectoryConfig.load(cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ref_rows, ref_skip, ref_in = from_references(tasks_dir, cfg, log)
    if cfg.harnesses and tokenizer is None:
        raise ValueError("demonstrations through external harnesses (harnesses) need the policy's tokenizer")
    demos = {h: from_harness(tasks_dir, cfg, h, tokenizer, log) for h in cfg.harnesses}
    for h_rows, h_skip, h_in in demos.values():  # each harness reads the tasks again: its own in, out and skips
        ref_rows += h_rows
        ref_skip.update({f"harness:{k}": v for k, v in h_skip.items()})
        ref_in += h_in
    train = {t.get("id", p.parent.name): t.get("source", "?")
             for p, t in ((p, json.loads(p.read_text())) for p in Path(tasks_dir).glob("*/task.json"))}
    roll_rows, roll_skip, roll_in = from_rollouts(rollout_tables if cfg.from_rollouts else (), train, cfg)
    sess_rows, sess_skip, sess_in = from_sessions(sessions, len(ref_rows) + len(roll_rows), cfg)
    rows = ref_rows + roll_rows + sess_rows
    leaks = []
    if eval_tasks_dir is not None and rows:
        rows, leaks = decontaminate(rows, eval_tasks_dir)
    bad = {x["shard_item"] for x in leaks}
    skips = {"reference": ref_skip, "rollout": roll_skip, "session": sess_skip}
    for r in ref_rows + roll_rows + sess_rows:
        if r["trajectory_id"] in bad:
            skips[r["origin"]]["contaminated"] += 1
    if not rows:
        raise ValueError(f"no SFT trajectory could be built from {tasks_dir} "
                         f"(reference skips {dict(ref_skip)}, rollout skips {dict(roll_skip)})")
    write_rows(rows, out)
    count = lambda origin: sum(r["origin"] == origin for r in rows)
    summary = {
        "trajectories": len(rows),
        "reference": {"in": ref_in, "out": count("reference"), "skipped": dict(ref_skip)},
        "rollout": {"in": roll_in, "out": count("rollout"), "skipped": dict(roll_skip)},
        "session": {"in": sess_in, "out": count("session"), "skipped": dict(sess_skip)},
        "by_source": dict(Counter(r["source"] for r in rows)),
        "by_harness": dict(Counter(r["harness"] for r in rows)),
        "by_split": dict(Counter(r["split"] for r in rows)),
        "contamination_examples": leaks[:10],
        "config": cfg.to_dict(),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True, default=str))
    return summary


def write_rows(rows: list[dict], out_dir) -> Path:
    """``out_dir/trajectories.parquet`` with ``rows`` (the schema SFT's tokenizer reads)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(rows, schema=pa.schema([
        ("trajectory_id", pa.string()), ("task_id", pa.string()), ("source", pa.string()), ("origin", pa.string()),
        ("split", pa.string()), ("messages", pa.string()), ("num_turns", pa.int32()), ("chars", pa.int64()),
        ("harness", pa.string()), ("harness_version", pa.string()), ("tools", pa.string())]))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    pq.write_table(table, Path(out_dir) / "trajectories.parquet", compression="zstd")
    return Path(out_dir) / "trajectories.parquet"


def read_rows(path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()

