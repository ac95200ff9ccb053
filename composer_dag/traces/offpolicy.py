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

Reward: where the session carries its starting state as a task of ``tasks_dir``
(``start.snapshot``), its tool calls are played again in a sandboxed episode of that task and
graded by the grader (``reward_kind: regraded``), cheat flags included, as for every other
episode; else the recorded outcome (``reward_kind: outcome``): 1 for an accepted session, 0 for
a rejected one.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from .format import from_openai
from .intake import judge


def token_stream(record: dict, tok) -> tuple[list[int], list[int], list[int], list[float]] | str:
    """``(prompt_ids, completion_ids, loss_mask, logprobs)`` of a session, or the reason it has none."""
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


def regrade(record: dict, task_dir: Path) -> tuple[float, list[str], int, int]:
    """Play the session's tool calls again in an episode of ``task_dir`` and grade it:
    ``(reward, flags, tests passed, tests failed)``."""
    from ..envs.tools import Episode

    with Episode(task_dir) as ep:
        for m in from_openai(record["messages"]):
            for call in m.get("tool_calls") or []:
                if ep.done:
                    break
                ep.step(call)
        g = ep.grade()
    return float(g.reward), list(g.flags), int(g.passed), int(g.failed)


def session_rollouts(sessions: list[dict], tok, *, current_version: str, versions: list[str], max_staleness: int,
                     tokenizer_digest: str | None = None, tasks_dir=None) -> tuple[list[dict], dict]:
    """Rollout records (``composer_dag.agent``'s fields the trainer reads, plus ``session_id``,
    ``reward_kind``, ``staleness``, ``flags``) from ``sessions`` (rows of ``production_traces``),
    and ``{in, out, dropped: {reason: n}, by_reward_kind}``."""
    order = {v: k for k, v in enumerate(versions)}
    now = order.get(current_version, len(versions) - 1)
    tasks = {p.parent.name: p.parent for p in Path(tasks_dir).glob("*/task.json")} if tasks_dir else {}
    out, dropped = [], Counter()
    for row in sessions:
        rec = json.loads(row["record"]) if "record" in row else row
        served = order.get(rec["model"]["version"])
        if served is None or now - served > max_staleness:
            dropped["stale"] += 1
            continue
        if tokenizer_digest is not None and rec["tokenizer_digest"] != tokenizer_digest:
            dropped["tokenizer_mismatch"] += 1
            continue
        stream = token_stream(rec, tok)
        if isinstance(stream, str):
            dropped[stream] += 1
            continue
        snapshot = (rec.get("start") or {}).get("snapshot")
        passed = failed = 0
        if snapshot in tasks:
            reward, flags, passed, failed = regrade(rec, tasks[snapshot])
            kind = "regraded"
        else:
            reward = {"accepted": 1.0, "rejected": 0.0}.get(judge(rec)[0])  # intake's reading of the outcome
            if reward is None:
                dropped["no_reward"] += 1
                continue
            flags, kind = [], "outcome"
        prompt, ids, mask, lps = stream
        out.append({"session_id": rec["session_id"], "task_id": snapshot or rec["session_id"],
                    "group_id": f"session:{snapshot or rec['session_id']}", "prompt_ids": prompt,
                    "completion_ids": ids, "loss_mask": mask, "logprobs": lps, "reward": reward,
                    "reward_kind": kind, "flags": flags, "tests_passed": passed, "tests_failed": failed,
                    "staleness": now - served, "policy_version": served})
    return out, {"in": len(sessions), "out": len(out), "dropped": dict(dropped),
                 "by_reward_kind": dict(Counter(r["reward_kind"] for r in out))}
