"""Sessions as RL data: each becomes a rollout record the GRPO trainer takes as it takes its own.

The token stream is rebuilt exactly as the agent loop builds it: the chat template over the
session's system and user messages (generation prompt on), then per assistant turn the logged
``token_ids`` (loss mask 1, the logged sampling logprobs), the end of turn the loop adds (mask
0), and the tool answers through the chat template (mask 0). The trainer's clipped ratio
against those logprobs is the importance weight of the logged actions under the current
policy: the logprobs are the behaviour policy's.

A session is dropped and counted when it cannot be used that way:

- ``stale``: served by a version more than ``max_staleness`` promotions before the current one
  (``versions``: the registry's promoted versions, oldest first), or by one not in it;
- ``no_token_ids``: an assistant turn without its logged ids (the server returned none, or
  scrubbing changed the message), ``no_logprobs``: ids without sampling logprobs;
- ``tokenizer_mismatch``: logged with another tokenizer than the current one;
- ``no_reward``: neither a starting state to grade again nor an outcome signal.

Reward: where the session's starting state is a task of ``tasks_dir``, its tool calls are played
again in a sandboxed episode of that task and graded by the grader (``reward_kind: regraded``),
cheat flags included, as for every other episode; else the recorded outcome (``reward_kind:
outcome``): 1 for an accepted session, 0 for a rejected one. The starting state is a task when
``start.snapshot`` names it, or when ``start.repository`` and ``start.commit`` are a repository
task's (mined, imported or from history): the same repository (by name, or a URL or path ending in
it) at the commit its ``repo/`` holds, which is the tree with the task's problem in it. A
``{repository, commit}`` that is no task here is counted (``start_unmatched``) and falls back on
the outcome.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections import Counter
from pathlib import Path

from .format import from_openai
from .intake import judge


def call_segments(record: dict) -> list[dict] | str:
    """A ``composer-session/2`` session's training segments, from the ids its calls recorded (a
    call whose prompt extends the previous call's prompt and completion continues its segment;
    loss on sampled ids only), never from its messages; or the reason it has none."""
    from composer_dag.gateway.records import CallRecord, segments

    calls = [CallRecord(record["session_id"], c["index"], "chat", c["prompt_ids"], c["completion_ids"], c["logprobs"],
                        c.get("policy_version")) for c in record.get("calls") or []]
    segs = [{"ids": s.ids, "mask": s.mask, "logprobs": s.logprobs} for s in segments(calls)]
    return segs or "no_token_ids"


def token_stream(record: dict, tok) -> tuple[list[int], list[int], list[int], list[float]] | str:
    """``(prompt_ids, completion_ids, loss_mask, logprobs)`` of a ``composer-session/1`` session
    (rebuilt from its messages and logged generations), or the reason it has none."""
    msgs = record["messages"]
    first = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), None)
    if first is None:
        return "no_token_ids"
    gens = {g["message_index"]: g for g in record["generations"]}
    head = [{"role": m["role"], "content": m.get("content") or ""} for m in msgs[:first]]
    prompt = tok(tok.apply_chat_template(head, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False).input_ids
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    newline = tok("\n", add_special_tokens=False).input_ids
    ids: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    i = first
    while i < len(msgs):
        g = gens.get(i)
        if msgs[i]["role"] != "assistant" or g is None or not g["token_ids"]:
            return "no_token_ids"
        if g.get("logprobs") is None:
            return "no_logprobs"
        ids += g["token_ids"]
        mask += [1] * len(g["token_ids"])
        lps += [float(x) for x in g["logprobs"]]
        if g["token_ids"][-1] == tok.eos_token_id:
            break
        end = ([] if g["token_ids"][-1] == im_end else [im_end]) + newline
        j = i + 1
        tools = []
        while j < len(msgs) and msgs[j]["role"] == "tool":
            tools.append({"role": "tool", "content": msgs[j].get("content") or ""})
            j += 1
        ids += end
        if tools and j < len(msgs):  # the loop renders the answers only when another turn follows
            ids += tok(tok.apply_chat_template(tools, tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False).input_ids
        mask += [0] * (len(ids) - len(mask))
        lps += [0.0] * (len(ids) - len(lps))
        i = j
    return prompt, ids, mask, lps


def regrade(record: dict, task_dir: Path, harness="composer") -> tuple[float, list[str], int, int]:
    """Play the session's tool calls again in an episode of ``task_dir`` through ``harness`` (the
    one that served it) and grade it: ``(reward, flags, tests passed, tests failed)``."""
    from composer_dag import harness as harnesses
    from composer_dag.harness.episode import Episode

    served = (record.get("harness") or {}).get("name") or harness
    if served not in harnesses.names():
        return _regrade_external(record, task_dir, served)
    with Episode(task_dir, harness=harnesses.get(served)) as ep:
        for m in from_openai(record["messages"]):
            for call in m.get("tool_calls") or []:
                if ep.done:
                    break
                ep.step(call)
        g = ep.grade()
    return float(g.reward), list(g.flags), int(g.passed), int(g.failed)


def _regrade_external(record: dict, task_dir: Path, name: str) -> tuple[float, list[str], int, int]:
    """A session of an external harness played again: each call of its command tool runs in
    the episode's sandbox as the harness ran it, then the grader grades the workspace."""
    from composer_dag.harness.episode import Episode
    from composer_dag.harness.external import load_spec

    spec = load_spec(name)
    with Episode(task_dir) as ep:
        for m in from_openai(record["messages"]):
            for call in m.get("tool_calls") or []:
                args = call.get("arguments")
                if call.get("name") == spec.demo.tool and isinstance(args, dict) and isinstance(args.get(spec.demo.argument), str):
                    ep.shell(args[spec.demo.argument], tool=spec.name)
        ep.done = True
        g = ep.grade()
    return float(g.reward), list(g.flags), int(g.passed), int(g.failed)


def _repo_name(s: str) -> str:
    """A repository's name as written in a session or a task: the last part of a URL or path,
    without ``.git``, normalised as distribution names are."""
    tail = re.split(r"[/:\\]", str(s).rstrip("/"))[-1]
    return re.sub(r"[-_.]+", "-", re.sub(r"\.git$", "", tail)).lower()


def starting_tasks(tasks_dir) -> tuple[dict[str, Path], dict[tuple[str, str], Path]]:
    """The tasks of ``tasks_dir`` a session can start from: by name, and by (repository, commit of
    its ``repo/``) for repository tasks."""
    by_name, by_commit = {}, {}
    for f in sorted(Path(tasks_dir).glob("*/task.json")) if tasks_dir else []:
        d = f.parent
        by_name[d.name] = d
        try:
            task = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        repo = (task.get("origin") or {}).get("repository")
        if task.get("framework") != "pytest" or not repo or not (d / "repo" / ".git").exists():
            continue
        head = subprocess.run(["git", "-c", "safe.directory=*", "rev-parse", "HEAD"], cwd=d / "repo",
                              capture_output=True, text=True)
        if head.returncode == 0:
            by_commit[(_repo_name(repo), head.stdout.strip())] = d
    return by_name, by_commit


def start_task(start: dict | None, by_name: dict, by_commit: dict) -> Path | None:
    """The task a session's ``start`` names, if it is here (a commit may be abbreviated, 7 or more
    hex digits, when only one task's commit begins with it)."""
    start = start or {}
    if start.get("snapshot") in by_name:
        return by_name[start["snapshot"]]
    repo, commit = start.get("repository"), str(start.get("commit") or "").lower()
    if not repo or not re.fullmatch(r"[0-9a-f]{7,64}", commit):
        return None
    name = _repo_name(repo)
    hits = [d for (r, c), d in by_commit.items() if r == name and c.startswith(commit)]
    return hits[0] if len(hits) == 1 else None


def session_rollouts(sessions: list[dict], tok, *, current_version: str, versions: list[str], max_staleness: int,
                     tokenizer_digest: str | None = None, tasks_dir=None) -> tuple[list[dict], dict]:
    """Rollout records (``composer_dag.agent``'s fields the trainer reads, plus ``session_id``,
    ``reward_kind``, ``staleness``, ``flags``) from ``sessions`` (rows of ``production_traces``),
    and ``{in, out, dropped: {reason: n}, by_reward_kind, start_unmatched}``."""
    order = {v: k for k, v in enumerate(versions)}
    now = order.get(current_version, len(versions) - 1)
    by_name, by_commit = starting_tasks(tasks_dir)
    out, dropped, unmatched = [], Counter(), 0
    for row in sessions:
        rec = json.loads(row["record"]) if "record" in row else row
        served = order.get(rec["model"]["version"])
        if served is None or now - served > max_staleness:
            dropped["stale"] += 1
            continue
        if tokenizer_digest is not None and rec["tokenizer_digest"] != tokenizer_digest:
            dropped["tokenizer_mismatch"] += 1
            continue
        stream = call_segments(rec) if rec.get("format") == "composer-session/2" else token_stream(rec, tok)
        if isinstance(stream, str):
            dropped[stream] += 1
            continue
        task = start_task(rec.get("start"), by_name, by_commit)
        unmatched += task is None and bool(rec.get("start"))
        snapshot = task.name if task is not None else None
        passed = failed = 0
        if task is not None:
            reward, flags, passed, failed = regrade(rec, task)
            kind = "regraded"
        else:
            reward = {"accepted": 1.0, "rejected": 0.0}.get(judge(rec)[0])  # intake's reading of the outcome
            if reward is None:
                dropped["no_reward"] += 1
                continue
            flags, kind = [], "outcome"
        prompt, ids, mask, lps = stream if isinstance(stream, tuple) else ([], [], [], [])
        out.append({"session_id": rec["session_id"], "task_id": snapshot or rec["session_id"],
                    "group_id": f"session:{snapshot or rec['session_id']}", "prompt_ids": prompt,
                    "completion_ids": ids, "loss_mask": mask, "logprobs": lps,
                    **({"segments": stream} if isinstance(stream, list) else {}), "reward": reward,
                    "reward_kind": kind, "flags": flags, "tests_passed": passed, "tests_failed": failed,
                    "staleness": now - served, "policy_version": served})
    return out, {"in": len(sessions), "out": len(out), "dropped": dict(dropped),
                 "by_reward_kind": dict(Counter(r["reward_kind"] for r in out)), "start_unmatched": unmatched}
