"""Evaluation engine: the pass@k estimator, the gate, the contamination guard, the HumanEval
function-completion harness, and end-to-end evaluations (a scripted engine with known
outcomes, and a tiny real checkpoint through the HF engine and the entry point)."""

import itertools
import json
import math
import re
import time
from math import comb
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from composer_dag.tasks.format import TaskLimits
from composer_dag.tasks.sources.humaneval import humaneval_task
from composer_dag.evals import (EvalConfig, GateConfig, checkpoint_digest, compare, contamination_report, decide,
                                eval_cli, evaluate, gain, pass_at_k, report_markdown, score_completions, truncate)
from composer_dag.evals.humaneval import check_completion, load_problems
from composer_dag.inference.engine import Completion, Engine, EngineStats

LIMITS = TaskLimits(max_turns=3, command_timeout=10.0, test_timeout=30.0)


# ---------------------------------------------------------------- pass@k

def test_pass_at_k_known_values():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - comb(7, 5) / comb(10, 5))
    assert pass_at_k(10, 0, 1) == 0.0 and pass_at_k(10, 0, 10) == 0.0
    assert pass_at_k(10, 8, 3) == 1.0  # n - c < k
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(1000, 1, 1) == pytest.approx(0.001)
    assert 0 < pass_at_k(2000, 3, 100) < 1  # no overflow for large n
    with pytest.raises(ValueError):
        pass_at_k(5, 2, 6)


def test_pass_at_k_brute_force():
    for n in range(1, 8):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets)), (n, c, k)


# ---------------------------------------------------------------- gate

def _summary(p1, tasks=100, flag_rate=0.0, **kw):
    return {"pass@1": p1, "num_tasks": tasks, "flag_rate": flag_rate, "checkpoint_digest": "x" * 64, **kw}


def test_gate_directions():
    base = _summary(0.50)
    bad = compare(_summary(0.30), base)  # se = sqrt(.21/100 + .25/100) ~ .068; 2 sigma ~ .136
    assert not bad["passed"] and "pass@1" in bad["reasons"][0]
    assert compare(_summary(0.42), base)["passed"]  # within noise
    assert compare(_summary(0.60), base)["passed"]  # better
    assert not compare(_summary(0.42), base, GateConfig(noise_sigmas=0.5))["passed"]  # the noise level is configurable
    flags = compare(_summary(0.55, flag_rate=0.02), base)
    assert not flags["passed"] and "cheat-flag" in flags["reasons"][0]
    assert compare(_summary(0.55, flag_rate=0.02), base, GateConfig(max_flag_rate_increase=0.05))["passed"]
    assert compare(_summary(0.55, flag_rate=0.02), base, GateConfig(max_flag_rate_increase=None))["passed"]
    assert not compare({"num_tasks": 10, "flag_rate": 0.0}, base)["passed"]  # a missing metric never passes
    # small task sets are noisier: the same drop passes on 10 tasks and fails on 1,000
    assert compare(_summary(0.40, tasks=10), _summary(0.50, tasks=10))["passed"]
    assert not compare(_summary(0.40, tasks=1000), _summary(0.50, tasks=1000))["passed"]
    # HumanEval function completion gates by the same rule, with its own count and tolerance
    he = lambda p, n: _summary(0.5, humaneval={"pass@1": p, "problems": n})
    assert compare(he(0.2, 20), he(0.3, 20))["passed"]
    res = compare(he(0.2, 400), he(0.3, 400))
    assert not res["passed"] and res["reasons"][0].startswith("HumanEval fn-completion pass@1")
    assert compare(he(0.2, 400), he(0.3, 400), GateConfig(humaneval_sigmas=None))["passed"]


def test_gate_rows_sources_and_perplexity():
    """Each task source's pass@1 gates once it has min_tasks tasks; perplexity gates as a relative
    increase over the parent and over the mid-trained checkpoint, and the verdict names the row."""
    src = lambda p, n: {"pass@1": p, "tasks": n}
    summ = lambda ppl, learn, bug, n=400: _summary(0.5, tasks=1000, perplexity={"val_ppl": ppl},
                                                   by_source={"learnable": src(learn, n), "bugfix": src(bug, 3)})
    parent = summ(600.0, 0.6, 0.5)
    # a source with fewer than min_tasks tasks is reported, not gating (bugfix: 3 tasks, 0.5 -> 0.0)
    res = compare(summ(600.0, 0.6, 0.0), parent)
    row = next(r for r in res["rows"] if r["metric"] == "pass@1 bugfix")
    assert res["passed"] and row["gating"] is False and "min_tasks" in row["note"]
    assert not compare(summ(600.0, 0.6, 0.0), parent, GateConfig(min_tasks=3, source_sigmas=0.5))["passed"]
    # a source large enough gates by the noise rule
    res = compare(summ(600.0, 0.4, 0.5), parent)
    assert not res["passed"] and res["reasons"][0].startswith("pass@1 learnable 0.4000 is below")
    # perplexity: +10 % over the parent is allowed by default, +20 % is not
    assert compare(summ(655.0, 0.6, 0.5), parent)["passed"]
    res = compare(summ(720.0, 0.6, 0.5), parent)
    assert not res["passed"] and res["reasons"] == [
        "val perplexity 720.00 exceeds the baseline's 600.00 by more than 10% (x1.2, threshold 660.00)"]
    assert compare(summ(720.0, 0.6, 0.5), parent, GateConfig(max_ppl_increase=None))["passed"]
    # a capability measured on one side only (an evaluation that left it out) is reported, not gating
    no_ppl = lambda: _summary(0.5)
    assert compare(no_ppl(), no_ppl())["passed"]
    row = next(r for r in compare(no_ppl(), parent)["rows"] if r["metric"] == "val perplexity")
    assert row["gating"] is False and row["note"] == "measured on one side only"

    # the decision: a candidate that kept the parent's perplexity but forgot against the
    # mid-trained checkpoint fails on that row, and the report names it with its threshold
    summaries = {"midtrained_checkpoint": summ(500.0, 0.0, 0.0), "sft_checkpoint": summ(90_000.0, 0.6, 0.5),
                 "rl_checkpoint": summ(91_000.0, 0.7, 0.5)}
    gate = decide(summaries, "rl_checkpoint", "sft_checkpoint", GateConfig())
    assert not gate["passed"] and gate["failed_rows"] == ["val perplexity"]
    assert gate["reasons"][0].endswith("[against midtrained_checkpoint]") and "threshold 650.00" in gate["reasons"][0]
    assert "| val perplexity | midtrained_checkpoint | 9.1e+04 | 500 | 650 | **FAIL** |" in gate["report"]
    assert decide(summaries, "rl_checkpoint", "sft_checkpoint",
                  GateConfig(max_ppl_increase_vs_midtrained=None))["passed"]


def test_gain_over_samples():
    """RL's gain over its parent on one source, against twice the standard error over samples."""
    s = lambda p, tasks, n: {"pass@1": p, "samples_per_task": n, "by_source": {"learnable": {"pass@1": p, "tasks": tasks}}}
    g = gain(s(0.80, 20, 8), s(0.60, 20, 8), "learnable")  # se = sqrt(.16/160 + .24/160) = .05
    assert g["gain"] == pytest.approx(0.2) and g["se"] == pytest.approx(0.05) and g["measurable"]
    assert not gain(s(0.75, 20, 2), s(0.60, 20, 2), "learnable")["measurable"]  # se ~.1: within the noise
    assert not gain(s(0.60, 20, 8), s(0.60, 20, 8), "learnable")["measurable"]
    assert gain(s(0.8, 20, 8), {}, "learnable")["gain"] is None


def test_report_markdown():
    cand = _summary(0.45, perplexity={"val_ppl": 12.5})
    parent, promoted = _summary(0.44, perplexity={"val_ppl": 13.0}), _summary(0.70, perplexity={"val_ppl": 12.0})
    md = report_markdown([compare(cand, parent, baseline_name="parent"),
                          compare(cand, promoted, baseline_name="last promoted", ppl_tolerance=None)])
    lines = md.splitlines()
    assert lines[0].split("|")[1:-1] == [" metric ", " candidate ", " parent ", " Δ vs parent ",
                                         " last promoted ", " Δ vs last promoted "]
    row = next(l for l in lines if l.startswith("| pass@1"))
    assert "0.4500" in row and "0.4400" in row and "0.7000" in row and "✅" in row and "❌" in row
    assert any(l.startswith("| val perplexity") for l in lines)
    assert "vs **parent**: passes" in md and "vs **last promoted**: fails" in md


# ---------------------------------------------------------------- HumanEval function completion

def test_truncate_at_stop_sequences():
    assert truncate("    return 1\n\ndef other():\n    pass") == "    return 1\n"
    assert truncate("    x = 1\n# comment\n") == "    x = 1"
    assert truncate("    return 2\nprint(f(1))") == "    return 2"
    assert truncate("    return 3\n") == "    return 3\n"


def test_humaneval_harness_scores_canonical_and_wrong():
    problems = load_problems(["HumanEval/0", "HumanEval/2"])
    canon = {pid: [p["canonical_solution"]] for pid, p in problems.items()}
    res = score_completions(problems, canon, timeout=10, workers=2)
    assert res["pass@1"] == 1.0 and all(r["passed"] for r in res["rows"])
    wrong = {"HumanEval/0": ["    return False\n", problems["HumanEval/0"]["canonical_solution"]],
             "HumanEval/2": ["    return number\n"]}
    res = score_completions(problems, wrong, timeout=10, workers=2)
    assert res["per_problem"]["HumanEval/0"] == {"n": 2, "c": 1, "pass@1": 0.5}
    assert res["per_problem"]["HumanEval/2"]["c"] == 0 and res["pass@1"] == pytest.approx(0.25)
    hang = check_completion(problems["HumanEval/2"], "    while True:\n        pass\n", timeout=2)
    assert not hang["passed"] and hang["result"] == "timed out"


# ---------------------------------------------------------------- contamination guard

@pytest.fixture(scope="module")
def he_tasks(tmp_path_factory):
    out = tmp_path_factory.mktemp("he_tasks")
    for p in load_problems(["HumanEval/0", "HumanEval/2"]).values():
        humaneval_task(p, out, LIMITS)
    return out


def test_contamination_guard(he_tasks):
    import textwrap

    problem = load_problems(["HumanEval/2"])["HumanEval/2"]
    leak = ("import os\n\n\ndef helper(x):\n    return os.path.join(x, 'a')\n\n\n"
            + problem["prompt"] + problem["canonical_solution"] + "\n\nprint(helper('b'))\n")
    clean = [("stdlib/textwrap.py", open(textwrap.__file__).read()),
             ("note", "A short note about parsing floats and truncating numbers in general.")]
    assert contamination_report(iter(clean), he_tasks) == []
    found = contamination_report([*clean, ("shard-1/row-7", leak)], he_tasks)
    assert len(found) == 1
    assert found[0]["shard_item"] == "shard-1/row-7" and found[0]["task_id"] == "humaneval-002"
    assert found[0]["part"] in ("reference/truncate_number.py", "hidden_tests/test_truncate_number.py")
    # plain strings work too (named by position)
    assert contamination_report(["nothing here", leak], he_tasks)[0]["shard_item"] == 1


# ---------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def setup(tmp_path_factory, learnable_base):
    import shutil

    from composer_dag.train.data import pack_documents

    out = tmp_path_factory.mktemp("eval")
    s = learnable_base
    tasks = out / "tasks"  # two of the shared learnable tasks and one HumanEval task
    for tid in ("answer-0-000", "answer-0-001"):
        shutil.copytree(Path(s["tasks_dir"]) / tid, tasks / tid, symlinks=True)
    humaneval_task(load_problems(["HumanEval/0"])["HumanEval/0"], tasks, LIMITS)
    import colorsys, fnmatch, textwrap
    docs = [(m.__name__, open(m.__file__).read(), "stdlib", "python") for m in (colorsys, fnmatch, textwrap)]
    pack_documents(docs, s["tokenizer_dir"], str(out / "shards"), val_fraction=1.0)
    return {**s, "tasks_dir": str(tasks), "val_dir": str(out / "shards")}


class _Scripted(Engine):
    """Agent prompts: sample j of each task answers correctly (j = 0), wrongly (j = 1), or
    correctly with a planted conftest.py (j = 2). Raw prompts (HumanEval): the canonical
    solution of HumanEval/0."""

    def __init__(self, tok):
        self.tok, self.stats = tok, EngineStats()

    def _text(self, i, prompt):
        from composer_dag.harness.composer import COMPOSER

        tool_call_text = COMPOSER.render_call

        m = re.search(r"Write the word (\w+)", prompt)
        if "<|im_start|>" not in prompt:
            return load_problems(["HumanEval/0"])["HumanEval/0"]["canonical_solution"] + "<|endoftext|>"
        calls = []
        if m:
            calls.append(tool_call_text("edit_file", {"path": "answer.txt", "old": "",
                                                      "new": "nope" if i % 3 == 1 else m.group(1)}))
            if i % 3 == 2:
                calls.append(tool_call_text("edit_file", {"path": "conftest.py", "old": "", "new": "X = 1\n"}))
        return "".join(calls) + tool_call_text("submit", {}) + "<|im_end|>"

    def generate(self, prompts, params):
        t0 = time.perf_counter()
        outs = []
        for i, p in enumerate(prompts):
            text = self._text(i, self.tok.decode(p))
            ids = self.tok(text, add_special_tokens=False).input_ids
            outs += [Completion(list(p), ids, [0.0] * len(ids), text, "stop")] * params.n
        return self._account(outs, t0)


def test_evaluate_scripted_known_outcomes(setup, tmp_path, monkeypatch):
    import composer_dag.inference as inference
    from composer_dag.train.tokenizer import load_tokenizer

    tok = load_tokenizer(setup["base_dir"])
    monkeypatch.setattr(inference, "engine_from_config", lambda cfg, model_dir, **kw: _Scripted(tok))
    cfg = dict(samples_per_task=3, ks=(1, 2, 3, 5), batch_tasks=2, max_tasks=None, inference={"engine": "hf"},
               agent={"max_turns": 2, "max_new_tokens": 256, "max_context": 4096, "system_style": "compact", "workers": 2})
    s = evaluate(setup["base_dir"], setup["tasks_dir"], tmp_path / "base", EvalConfig.load(cfg))
    assert s["num_tasks"] == 3 and s["num_samples"] == 9
    p2 = 1 - comb(2, 2) / comb(3, 2)
    assert s["pass@1"] == pytest.approx(2 / 9) and s["pass_at"]["2"] == pytest.approx(2 * p2 / 3)
    assert s["pass_at"]["3"] == pytest.approx(2 / 3) and "5" not in s["pass_at"]  # k > n is left out
    assert s["pass@1_stderr"] == pytest.approx(math.sqrt(2 / 9 * 7 / 9 / 3))
    assert s["by_source"]["learnable"]["pass@1"] == pytest.approx(1 / 3)
    assert s["by_source"]["humaneval"]["pass@1"] == 0.0 and s["by_source"]["humaneval"]["flag_rate"] == 0.0
    assert s["flag_rate"] == pytest.approx(2 / 9) and s["flags_by_kind"] == {"conftest": 2}
    assert s["humaneval"]["pass@1"] == 1.0 and s["humaneval"]["solved"] == ["HumanEval/0"]
    cost = s["cost"]
    assert cost["tokens_per_solved_task"] == pytest.approx(cost["generated_tokens"] / 2)
    assert cost["tokens_per_task"] == pytest.approx(cost["generated_tokens"] / 3) and cost["tokens_per_s"] > 0
    rows = pq.read_table(tmp_path / "base" / "results.parquet").to_pylist()
    by = {(r["task_id"], r["sample_index"]): r for r in rows}
    for tid in ("answer-0-000", "answer-0-001"):
        assert [by[(tid, j)]["passed"] for j in range(3)] == [True, False, False]
        assert by[(tid, 0)]["reward"] == 1.0 and by[(tid, 2)]["flags"] == ["conftest:conftest.py"]
        assert by[(tid, 2)]["unflagged_reward"] == 1.0 and by[(tid, 2)]["reward"] == 0.0
    assert {r["checkpoint_digest"] for r in rows} == {s["checkpoint_digest"]}
    assert json.loads((tmp_path / "base" / "summary.json").read_text())["pass@1"] == s["pass@1"]
    assert pq.read_table(tmp_path / "base" / "humaneval.parquet").num_rows == 1
    assert pq.read_table(tmp_path / "base" / "rollouts.parquet").num_rows == 9
    # the CLI function, gated against the first run: the same policy passes its own gate
    again = eval_cli(setup["base_dir"], setup["tasks_dir"], out_dir=str(tmp_path / "again"),
                     baseline=str(tmp_path / "base" / "summary.json"), config={**cfg, "humaneval_ids": []})
    assert again["gate"]["passed"] and again["humaneval"] is None and "| pass@1 (gate)" in again["gate"]["markdown"]


def test_evaluate_tiny_checkpoint_hf_entry_point(setup, tmp_path, capsys):
    import torch

    from composer_dag.evals.run import main

    cfg = {"checkpoint_dir": setup["base_dir"], "tasks_dir": setup["tasks_dir"], "out_dir": str(tmp_path / "out"),
           "samples_per_task": 2, "samples_of_source": {"humaneval": 1}, "ks": [1, 2], "humaneval_max_tokens": 16,
           "max_tasks": None, "val_dir": setup["val_dir"], "ppl_seq_len": 64, "ppl_max_batches": 2, "torch_threads": 1,
           "agent": {"max_turns": 1, "max_new_tokens": 8, "max_context": 1024, "system_style": "compact", "workers": 2},
           "inference": {"engine": "hf"}}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    threads = torch.get_num_threads()
    try:
        s = main(["--config", str(tmp_path / "c.json")])
    finally:
        torch.set_num_threads(threads)
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["checkpoint_digest"] == s["checkpoint_digest"] == checkpoint_digest(setup["base_dir"])
    t = pq.read_table(tmp_path / "out" / "results.parquet")
    assert t.num_rows == 5 and {"checkpoint_digest", "task_id", "source", "sample_index", "reward", "passed",
                                "flags", "generated_tokens", "seconds"} <= set(t.column_names)
    rows = t.to_pylist()
    # two samples of each learnable task, one of the HumanEval task (samples_of_source)
    assert sorted((r["task_id"], r["sample_index"]) for r in rows) == sorted(
        [(tid, j) for tid in ("answer-0-000", "answer-0-001") for j in range(2)] + [("humaneval-000", 0)])
    assert {r["source"] for r in rows} == {"learnable", "humaneval"}
    assert all(0 < r["generated_tokens"] <= 8 for r in rows)
    assert set(s["pass_at"]) == {"1"} and 0.0 <= s["pass@1"] <= 1.0  # k up to the fewest samples of a task
    assert set(s["by_source"]["learnable"]["pass_at"]) == {"1", "2"} and s["samples_of_source"] == {"humaneval": 1}
    assert set(s["by_source"]) == {"humaneval", "learnable"}
    assert s["humaneval"]["problems"] == 1 and s["humaneval"]["pass@1"] in (0.0, 1.0)
    ppl = s["perplexity"]
    assert ppl["tokens"] == 2 * 8 * 64 and 1.0 < ppl["val_ppl"] < 1e5 and math.isfinite(ppl["val_loss"])
    assert s["cost"]["wall_seconds"] > 0 and s["cost"]["generated_tokens"] == sum(r["generated_tokens"] for r in rows)
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["files"].keys() >= {
        "results.parquet", "rollouts.parquet", "humaneval.parquet", "summary.json"}


@pytest.mark.slow
def test_eval_command_line(setup, tmp_path):
    """`composer-dag eval CHECKPOINT --tasks DIR`: a real subprocess, JSON summary on the last line,
    then the same against that summary as the baseline (the gate passes against itself)."""
    import subprocess
    import sys

    base = [sys.executable, "-m", "composer_dag.cli", "eval", setup["base_dir"], "--tasks", setup["tasks_dir"],
            "--engine", "hf", "--samples", "2", "--max-turns", "1", "--system-style", "compact"]
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.run([*base, "--out", str(tmp_path / "a")], capture_output=True, text=True, timeout=600, env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    s = json.loads(first.stdout.strip().splitlines()[-1])
    assert s["checkpoint_digest"] == checkpoint_digest(setup["base_dir"]) and "pass@1" in s
    again = subprocess.run([*base, "--out", str(tmp_path / "b"), "--baseline", str(tmp_path / "a" / "summary.json")],
                           capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout.strip().splitlines()[-1])["gate"]["passed"] is True


def test_evaluate_many_shares_one_engine_and_matches_separate_runs(setup, tmp_path):
    """Several checkpoints of one architecture on one engine (weights loaded in place) give the
    same results as a fresh engine each; a finished checkpoint is not evaluated again."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    import composer_dag.inference as inference
    from composer_dag.evals.evaluate import evaluate_many

    other = tmp_path / "other"
    shutil.copytree(setup["base_dir"], other)
    sd = load_file(str(other / "model.safetensors"))
    save_file({k: v * 1.5 if v.ndim == 2 else v for k, v in sd.items()}, str(other / "model.safetensors"))
    ckpts = {"a": setup["base_dir"], "b": str(other)}
    cfg = {"samples_per_task": 2, "ks": [1, 2], "humaneval_ids": [], "torch_threads": 1, "max_tasks": None,
           "agent": {"max_turns": 1, "max_new_tokens": 8, "max_context": 1024, "system_style": "compact", "workers": 2},
           "inference": {"engine": "hf"}}
    starts = []
    real = inference.engine_from_config

    def counting(*a, **kw):
        starts.append(a[1])
        return real(*a, **kw)

    threads = torch.get_num_threads()
    try:
        inference.engine_from_config = counting
        shared = evaluate_many(ckpts, setup["tasks_dir"], tmp_path / "shared", cfg)
        assert starts == [setup["base_dir"]]  # one engine for both
        again = evaluate_many(ckpts, setup["tasks_dir"], tmp_path / "shared", cfg)
        assert len(starts) == 1 and again == shared  # both were finished: nothing sampled again
        assert json.loads((tmp_path / "shared" / "latest").read_text()) == {k: shared[k]["checkpoint_digest"] for k in ckpts}
        # a candidate that changed (a new RL checkpoint) is evaluated again; the other is kept
        changed = tmp_path / "changed"
        shutil.copytree(other, changed)
        save_file({k: v * 0.5 if v.ndim == 2 else v for k, v in sd.items()}, str(changed / "model.safetensors"))
        shutil.copytree(tmp_path / "shared", tmp_path / "third")
        n = len(starts)
        third = evaluate_many({"a": setup["base_dir"], "b": str(changed)}, setup["tasks_dir"], tmp_path / "third", cfg)
        assert starts[n:] == [str(changed)]  # one engine, for the changed candidate only
        assert third["a"] == shared["a"] and third["b"]["checkpoint_digest"] != shared["b"]["checkpoint_digest"]
        assert not (tmp_path / "third" / "b" / "progress").exists()
        alone = {k: evaluate(d, setup["tasks_dir"], tmp_path / "alone" / k, cfg) for k, d in ckpts.items()}
    finally:
        inference.engine_from_config = real
        torch.set_num_threads(threads)

    def rows(path):  # every sampled token of every episode
        return [(r["task_id"], r["sample_index"], r["completion_ids"])
                for r in pq.read_table(path / "rollouts.parquet", columns=["task_id", "sample_index", "completion_ids"]).to_pylist()]

    for k in ckpts:
        assert rows(tmp_path / "shared" / k) == rows(tmp_path / "alone" / k)
        assert shared[k]["checkpoint_digest"] == alone[k]["checkpoint_digest"]
    assert rows(tmp_path / "shared" / "a") != rows(tmp_path / "shared" / "b")  # the weights really changed
