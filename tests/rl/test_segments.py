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
