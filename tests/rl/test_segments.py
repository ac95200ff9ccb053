"""Rollouts recorded call by call through the gateway train as token-exact segments: one row per
segment with the episode's advantage and ratios against the recorded logprobs, the episode
counted once under the sequence mean, and an update that moves the policy the way the
advantage says."""

from __future__ import annotations

import torch


def _episode(tok, reward: float, group: str, text: str) -> dict:
    """Two segments as the gateway makes them: a prompt, a sampled turn, then a prompt that does
    not continue it (the harness dropped its history) and a second sampled turn."""
    enc = lambda s: tok(s, add_special_tokens=False).input_ids
    p1, c1 = enc("<|im_start|>user\nsay it<|im_end|>\n<|im_start|>assistant\n"), enc(text) + [tok.convert_tokens_to_ids("<|im_end|>")]
    p2, c2 = enc("<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"), enc(text)
    seg = lambda p, c: {"ids": p + c, "mask": [0] * len(p) + [1] * len(c), "logprobs": [0.0] * len(p) + [-2.0] * len(c)}
    return {"group_id": group, "reward": reward, "segments": [seg(p1, c1), seg(p2, c2)], "prompt_ids": [],
            "completion_ids": [], "loss_mask": [], "logprobs": []}


def test_segments_become_rows_that_count_their_episode_once(learnable_base):
    from composer_dag.rl import grpo
    from composer_dag.train.tokenizer import load_tokenizer

    tok = load_tokenizer(learnable_base["policy_dir"])
    ep = {**_episode(tok, 1.0, "g", " red"), "advantage": 0.5}
    rows = grpo.training_rows(ep)
    assert len(rows) == 2 and all(r["advantage"] == 0.5 and "segments" not in r for r in rows)
    for row, seg in zip(rows, ep["segments"]):
        assert row["prompt_ids"] + row["completion_ids"] == seg["ids"] and set(row["loss_mask"]) == {1}
        assert row["episode_tokens"] == sum(sum(s["mask"]) for s in ep["segments"])
    b = grpo.pack(rows, tok.pad_token_id)
    w = grpo.sequence_weights(b["loss_mask"], b["episode_tokens"])
    assert abs(w.sum().item() - 1.0) < 1e-6  # the episode is one sequence's worth, split in two rows
    one = {"group_id": "h", "reward": 0.0, "prompt_ids": [1, 2], "completion_ids": [3, 4, 5], "loss_mask": [1, 1, 0],
           "logprobs": [-1.0, -1.0, 0.0], "advantage": 1.0}
    (same,) = grpo.training_rows(one)
    b1 = grpo.pack([same], tok.pad_token_id)
    assert torch.equal(grpo.sequence_weights(b1["loss_mask"], b1["episode_tokens"]), grpo.sequence_weights(b1["loss_mask"]))


def test_a_step_on_segmented_rollouts_moves_the_policy_toward_the_rewarded_episode(learnable_base, tmp_path):
    from composer_dag.rl.grpo import pack, token_logprobs, training_rows
    from composer_dag.rl.step import advantages
    from composer_dag.rl.trainer import GRPOTrainer, TrainerConfig
    from composer_dag.train.tokenizer import load_tokenizer

    tok = load_tokenizer(learnable_base["policy_dir"])
    eps = [_episode(tok, 1.0, "g", " red"), _episode(tok, 0.0, "g", " blue")]
    for e, a in zip(eps, advantages(eps)):
        e["advantage"] = a
    trainer = GRPOTrainer(learnable_base["policy_dir"], TrainerConfig(lr=3e-3, micro_batch=1, loss_norm="sequence"),
                          batch_size=2)

    def logp(e):
        rows = training_rows(e)
        b = pack(rows, tok.pad_token_id)
        with torch.no_grad():
            lp = token_logprobs(trainer.engine, b["input_ids"], b["attention_mask"])
        return (lp * b["loss_mask"]).sum().item()

    for e in eps:  # the sampling logprobs a recording holds: the policy's own
        for sg in e["segments"]:
            with torch.no_grad():
                lp = token_logprobs(trainer.engine, torch.tensor([sg["ids"]]), torch.ones(1, len(sg["ids"]), dtype=torch.long))[0]
            sg["logprobs"] = [0.0] + [v if m else 0.0 for v, m in zip(lp.tolist(), sg["mask"][1:])]
    before = [logp(e) for e in eps]
    st = trainer.train_step(eps)  # two episodes, four rows, micro_batch 1: two rows per micro-batch
    assert st["train_tokens"] == sum(sum(s["mask"]) for e in eps for s in e["segments"]), st
    after = [logp(e) for e in eps]
    assert after[0] > before[0] and after[1] < before[1], (before, after)
