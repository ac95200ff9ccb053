"""SFT: trajectories played through real episodes, transcripts masked to the assistant's
tokens, and the mid-training trainer with ``objective: sft`` on them."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from composer_dag.harness.composer import COMPOSER
from composer_dag.tasks.sources.learnable import build_learnable_tasks
from composer_dag.sft import trajectories as traj
from composer_dag.sft.run import transcript
from composer_dag.train.data import TranscriptDataset, pack_documents
from composer_dag.train.tokenizer import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def task_mix(tmp_path_factory, humaneval_tasks, bugfix_tasks):
    """Training tasks of the three kinds in one directory: four learnable words, the session's
    HumanEval and bug-fix tasks."""
    root = tmp_path_factory.mktemp("sft-tasks")
    build_learnable_tasks(root, 4, seed=3, words=("alpha", "beta", "gamma", "delta"))
    for out, _ in (humaneval_tasks, bugfix_tasks):
        for side in ("rl_tasks", "eval_tasks"):
            for d in sorted((out / side).glob("*/task.json")):
                shutil.copytree(d.parent, root / d.parent.name)
    return root


@pytest.fixture(scope="module")
def built(task_mix, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft-built")
    summary = traj.build(task_mix, out, {"max_per_source": {}, "val_fraction": 0.3})
    return out, summary


@pytest.mark.slow
def test_every_reference_trajectory_solves_its_task(task_mix, built):
    out, s = built
    n_tasks = len(list(task_mix.glob("*/task.json")))
    assert s["reference"]["in"] == n_tasks
    assert s["reference"]["out"] + sum(s["reference"]["skipped"].values()) == n_tasks
    assert s["reference"]["out"] == n_tasks, s["reference"]["skipped"]  # every kind of reference plays through
    rows = traj.read_rows(out / "trajectories.parquet")
    assert {r["source"] for r in rows} == {"learnable", "humaneval", "stdlib-bugfix"}
    assert {(r["harness"], r["harness_version"]) for r in rows} == {("composer", COMPOSER.version)}
    for r in rows:
        msgs = json.loads(r["messages"])
        assert msgs[0]["role"] == "user" and msgs[-1]["tool_calls"][0]["name"] == "submit"
        if r["source"] == "learnable":  # the family's procedure: move the word with the shell
            assert [m["tool_calls"][0]["name"] for m in msgs if m["role"] == "assistant"] == ["run_terminal_cmd", "submit"]
        else:  # inspect, then change, then submit
            assert [m["tool_calls"][0]["name"] for m in msgs if m["role"] == "assistant"] == ["read_file", "edit_file", "submit"]
    # the played episode's real answers are in the transcript
    assert any(m["role"] == "tool" and m["content"].startswith("exit code: 0")
               for r in rows for m in json.loads(r["messages"]))
    for r in rows:  # the read_file call shows the lines the edit then changes
        msgs = json.loads(r["messages"])
        if r["source"] != "learnable":
            old = next(m["tool_calls"][0]["arguments"]["old"] for m in msgs
                       if m["role"] == "assistant" and m["tool_calls"][0]["name"] == "edit_file")
            assert old.strip().splitlines()[0].strip() in msgs[2]["content"]


def test_a_broken_reference_is_counted_not_written(task_mix, tmp_path):
    d = tmp_path / "tasks"
    shutil.copytree(next(p.parent for p in task_mix.glob("answer-*/task.json")), d / "t1")
    task = json.loads((d / "t1" / "task.json").read_text())
    task["reference"]["command"] = "echo nothing > answer.txt"
    (d / "t1" / "task.json").write_text(json.dumps(task))
    with pytest.raises(ValueError, match="reference_not_passing"):
        traj.build(d, tmp_path / "out", {})


def _rollout(task_id, passed=True, flags=(), messages=None):
    msgs = messages or [{"role": "system", "content": "sys"}, {"role": "user", "content": "do it"},
                        {"role": "assistant", "content": "", "tool_calls": [{"name": "submit", "arguments": {}}]}]
    return {"task_id": task_id, "messages": json.dumps(msgs), "tests_passed": 1 if passed else 0,
            "tests_failed": 0 if passed else 1, "flags": list(flags)}


def test_rejection_sampling_keeps_passing_unflagged_training_rollouts():
    cut = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [], "truncated": True}]
    rows = [_rollout("t1"), _rollout("t1"), _rollout("t2", passed=False), _rollout("t1", flags=["test_tamper"]),
            _rollout("eval-task"), _rollout("t2", messages=cut)]
    kept, skipped, n = traj.from_rollouts([pa.Table.from_pylist(rows)], {"t1": "learnable", "t2": "humaneval"},
                                          traj.TrajectoryConfig())
    assert n == 6 and len(kept) == 1 and len(kept) + sum(skipped.values()) == n
    assert dict(skipped) == {"duplicate": 1, "not_passing": 1, "flagged": 1, "not_a_training_task": 1,
                             "error_or_cut_turn": 1}
    assert json.loads(kept[0]["messages"])[0]["role"] == "user"  # the system prompt is rendered at tokenization


def test_trajectory_overlapping_an_eval_task_is_dropped(task_mix, tmp_path):
    ev = tmp_path / "eval"
    src = next(p.parent for p in task_mix.glob("*/task.json") if json.loads(p.read_text())["source"] != "learnable")
    shutil.copytree(src, ev / src.name)
    s = traj.build(task_mix, tmp_path / "out", {"max_per_source": {}}, eval_tasks_dir=ev)
    assert s["reference"]["skipped"].get("contaminated", 0) >= 1
    assert s["reference"]["out"] + sum(s["reference"]["skipped"].values()) == s["reference"]["in"]
    ids = {r["task_id"] for r in traj.read_rows(tmp_path / "out" / "trajectories.parquet")}
    assert json.loads((src / "task.json").read_text())["id"] not in ids


def test_transcript_supervises_the_assistant_tokens_only(built, learnable_base):
    out, _ = built
    tok = load_tokenizer(learnable_base["tokenizer_dir"])
    row = next(r for r in traj.read_rows(out / "trajectories.parquet") if r["source"] == "learnable")
    msgs = json.loads(row["messages"])
    ids, mask = transcript(msgs, tok)
    prompt = tok(COMPOSER.render_prompt(tok, msgs[0]["content"], "compact"), add_special_tokens=False).input_ids
    assert ids[:len(prompt)] == prompt and not any(mask[:len(prompt)])
    supervised = tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
    calls = [m["tool_calls"][0] for m in msgs if m["role"] == "assistant"]
    assert supervised == "".join(COMPOSER.render_call(c["name"], c["arguments"]) + "<|im_end|>" for c in calls)
    assert "exit code: 0" in tok.decode(ids, skip_special_tokens=False)  # the tool's answer, unsupervised


def test_transcript_dataset_pads_and_labels(tmp_path):
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]},
                                         {"input_ids": [9, 10], "loss_mask": [0, 1]}]), tmp_path / "train.parquet")
    ds = TranscriptDataset(str(tmp_path / "train.parquet"), seq_len=8, pad_id=0)
    x, y = next(ds.batches(2))
    assert x.tolist() == [[5, 6, 7, 8], [9, 10, 0, 0]]
    assert y.tolist() == [[-100, -100, 7, 8], [-100, 10, -100, -100]]
    resumed = TranscriptDataset(str(tmp_path / "train.parquet"), seq_len=8, pad_id=0, start_sample=1)
    assert resumed[1][0].tolist() == [9, 10] and next(iter(resumed))[0].tolist() == [9, 10]


def _code_shards(tokenizer_dir, out, max_bytes=400_000):
    """Token shards of a few standard-library modules, in the tokenizer's ids (Megatron format)."""
    import glob

    docs, total = [], 0
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py"))):
        text = open(path, encoding="utf-8").read()
        docs.append((os.path.basename(path), text, "stdlib", "Python"))
        total += len(text)
        if total > max_bytes:
            break
    pack_documents(docs, tokenizer_dir, str(out), val_fraction=0.2, seed=0)
    return out


def test_replay_windows_ride_with_each_micro_batch_and_resume_exactly(learnable_base, tmp_path):
    """Each SFT micro-batch carries its replay windows; a run resumed at global sample k gets the
    batches, transcripts and windows, an uninterrupted run gets from k on."""
    import pyarrow.parquet as pq

    from composer_dag.sft.run import SFTConfig
    from composer_dag.train.midtrain import _train_batches

    shards = _code_shards(learnable_base["tokenizer_dir"], tmp_path / "shards", 120_000)
    rng = np.random.default_rng(0)
    rows = [{"input_ids": rng.integers(5, 50, n).tolist(), "loss_mask": [0, 1] * (n // 2)} for n in range(10, 60, 2)]
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), data / "train.parquet")
    cfg = SFTConfig(trajectories_dir="unused", model_dir="unused", out_dir=str(tmp_path), data_dir=str(data),
                    micro_batch=4, seq_len=64, pretrain_dir=str(shards), pretrain_share=0.5, pretrain_windows=3,
                    pretrain_seq_len=32)
    full = _train_batches(cfg, 0, 0, 1, 0)
    batches = [next(full) for _ in range(6)]
    assert all(len(b) == 3 and b[2].shape == (3, 33) for b in batches)
    assert len({b[2].tobytes() for b in batches}) == 6  # fresh windows in every batch
    resumed = _train_batches(cfg, 0, 0, 1, 8)  # two micro-batches (8 samples) consumed
    for want in batches[2:]:
        got = next(resumed)
        assert all(np.array_equal(g, w) for g, w in zip(got, want))
    # no share, no replay: the plain transcript batches
    assert len(next(_train_batches(cfg.replace(pretrain_share=0.0), 0, 0, 1, 0))) == 2


@pytest.mark.slow
def test_sft_job_teaches_the_call_format(learnable_base, tmp_path):
    """The SFT entry point on an untrained policy, with code windows replayed: loss down on
    held-out trajectories and on the code validation windows, and the sampled first turns parse
    as tool calls; a second run with more steps resumes."""
    words = ("red", "blue", "green", "gold", "teal", "pink", "gray", "navy", "lime", "plum", "rust", "sand")
    build_learnable_tasks(tmp_path / "tasks", len(words), seed=5, words=words, canaries=False, workers=2)
    out = tmp_path / "trajectories"
    traj.build(tmp_path / "tasks", out, {"val_fraction": 0.25})
    shards = _code_shards(learnable_base["tokenizer_dir"], tmp_path / "shards")
    cfg = {"trajectories_dir": str(out), "model_dir": learnable_base["base_dir"], "out_dir": str(tmp_path / "run"),
           "seq_len": 512, "max_steps": 30, "eval_every": 15, "save_every": 15, "log_every": 5,
           "min_lr": 2e-3,  # constant: the resumed run (60 steps) continues at the rate the first stopped at
           "format_samples": 16, "min_format_share": 0.1, "pretrain_dir": str(shards)}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    env = {**os.environ, "PYTHONPATH": ROOT, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "composer_dag.sft.run", "--config", str(tmp_path / "cfg.json")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads((tmp_path / "run" / "result.json").read_text())
    assert r["objective"] == "sft" and r["steps"] == 30
    assert r["val_loss_after"] < r["val_loss_before"]
    assert r["tokenize"]["supervised_tokens"] < r["tokenize"]["tokens"]
    assert os.path.exists(tmp_path / "run" / "hf" / "model.safetensors")
    p2 = subprocess.run([sys.executable, "-m", "composer_dag.sft.run", "--config", str(tmp_path / "cfg.json"),
                         "--set", "max_steps=60"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p2.returncode == 0, p2.stderr[-4000:]
    r2 = json.loads((tmp_path / "run" / "result.json").read_text())
    assert r2["steps"] == 60 and r2["tokens_seen"] > r["tokens_seen"]
    assert "resumed from step_0000030" in p2.stderr
    assert r2["val_loss_after"] < r["val_loss_after"]
    assert r2["format_check"]["ok"] and r2["format_check"]["parsed"] >= 2, r2["format_check"]
    assert np.isfinite(r2["val_loss_after"])
    # the replay trained on code too: every validation measured it, and it fell
    code = [e["val_code_loss"] for e in r2["evals"]]
    assert len(code) == len(r2["evals"]) == 5 and code[-1] < code[0], r2["evals"]


def test_transcript_order_is_a_seeded_permutation_bucketed_by_length(tmp_path):
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 50, 100)
    pq.write_table(pa.Table.from_pylist([{"input_ids": list(range(n)), "loss_mask": [1] * n} for n in lengths]),
                   tmp_path / "train.parquet")
    ds = TranscriptDataset(str(tmp_path / "train.parquet"), seq_len=64, pad_id=0, shuffle_seed=1)
    order = [ds.window(g) for g in range(100)]
    assert sorted(order) == list(range(100)) and order != list(range(100))
    assert all(lengths[a] <= lengths[b] for a, b in zip(order[:63], order[1:64]))  # one block, sorted
    assert [ds.window(g) for g in range(100, 200)] != order  # each epoch its own order
    resumed = TranscriptDataset(str(tmp_path / "train.parquet"), seq_len=64, pad_id=0, shuffle_seed=1, start_sample=37)
    it = iter(resumed)
    assert [len(next(it)[0]) for _ in range(10)] == [lengths[order[g]] for g in range(37, 47)]


def test_early_stop_needs_patience_validations_without_improvement():
    from composer_dag.train.midtrain import stalled

    ev = lambda *losses: [{"step": 10 * i, "val_loss": x} for i, x in enumerate(losses)]
    assert not stalled(ev(3.0, 2.0, 1.0), 1)
    assert stalled(ev(3.0, 1.0, 1.5), 1) and not stalled(ev(3.0, 1.0, 1.5), 2)
    assert stalled(ev(3.0, 1.0, 1.5, 1.2), 2) and not stalled(ev(3.0, 1.0, 1.5, 0.9), 2)
    assert not stalled(ev(3.0, 4.0), None)  # no patience: never
    assert not stalled([{"step": 0, "val_loss": None}, {"step": 10, "val_loss": None}], 1)  # no validation split


def test_transcript_loss_is_the_masked_mean_and_skips_unsupervised_logits():
    """The SFT loss computes the output layer on the supervised positions only: the same loss and
    the same gradients as the full logits with ``ignore_index``, to float precision."""
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from composer_dag.train.midtrain import lm_loss

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=4, intermediate_size=128))
    x = torch.randint(0, 512, (3, 40))
    labels = torch.where(torch.rand(3, 40) < 0.3, x, torch.full_like(x, -100))
    loss = lm_loss(model, x, labels)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits = model(input_ids=x[:, :-1], use_cache=False).logits
    full = F.cross_entropy(logits.float().reshape(-1, 512), labels[:, 1:].reshape(-1), ignore_index=-100)
    full.backward()
    assert torch.allclose(loss, full, atol=1e-6), (loss, full)
    assert all(torch.allclose(a, p.grad, atol=1e-6) for a, p in zip(grads, model.parameters()))
