"""GRPO pieces as plain functions: group-relative advantages, batch packing, token logprobs
and the policy losses (``LOSSES``: the clipped token-level surrogate, REINFORCE), each with an
optional KL term to a reference policy."""

from __future__ import annotations

from collections import defaultdict

import torch


def group_advantages(rewards: list[float], group_ids: list[str], normalize_std: bool = True,
                     eps: float = 1e-6, include: list[bool] | None = None) -> list[float]:
    """reward - mean of its group, divided by the group's std unless ``normalize_std`` is off.
    ``include[i]`` False (an infrastructure failure) leaves rollout i out of its group's
    statistics and gives it advantage 0."""
    include = include if include is not None else [True] * len(rewards)
    groups = defaultdict(list)
    for r, g, ok in zip(rewards, group_ids, include):
        if ok:
            groups[g].append(r)
    stats = {}
    for g, rs in groups.items():
        t = torch.tensor(rs, dtype=torch.float64)
        stats[g] = (t.mean().item(), t.std(unbiased=False).item())
    return [(r - stats[g][0]) / ((stats[g][1] + eps) if normalize_std else 1.0) if ok else 0.0
            for r, g, ok in zip(rewards, group_ids, include)]


def informative(rewards: list[float], group_ids: list[str], include: list[bool] | None = None) -> list[bool]:
    """Whether rollout i's group (over the included rollouts) has rewards that differ: a group
    whose samples all earned the same reward has advantage 0 everywhere and teaches nothing (DAPO's
    dynamic-sampling filter). An excluded rollout is never informative."""
    include = include if include is not None else [True] * len(rewards)
    seen = defaultdict(set)
    for r, g, ok in zip(rewards, group_ids, include):
        if ok:
            seen[g].add(float(r))
    return [ok and len(seen[g]) > 1 for g, ok in zip(group_ids, include)]


def training_rows(rollout: dict) -> list[dict]:
    """The sequences a rollout trains on: itself, or, for a rollout recorded call by call through
    the gateway (``segments``: each ``{"ids", "mask", "logprobs"}``, token-exact), one row per
    segment, each with the episode's advantage and ratios against that segment's recorded
    logprobs. Every row carries ``episode_tokens`` (the episode's sampled tokens over all its
    segments), so that under the sequence mean an episode counts once however it was cut."""
    segs = rollout.get("segments")
    if not segs:
        return [{**rollout, "episode_tokens": sum(rollout.get("loss_mask") or [])}]
    total = sum(sum(s["mask"]) for s in segs)
    rows = []
    for s in segs:
        first = next((i for i, m in enumerate(s["mask"]) if m), len(s["mask"]))
        rows.append({**{k: v for k, v in rollout.items() if k != "segments"}, "prompt_ids": list(s["ids"][:first]),
                     "completion_ids": list(s["ids"][first:]), "loss_mask": list(s["mask"][first:]),
                     "logprobs": list(s["logprobs"][first:]), "episode_tokens": total})
    return rows


def pack(rollouts: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors for a micro-batch (of ``training_rows``). Target-aligned (length T-1)
    fields: ``loss_mask`` (1 on sampled tokens only), ``old_logprobs``; plus ``advantages`` [B]
    and ``episode_tokens`` [B] (each row's episode's sampled tokens)."""
    seqs = [list(r["prompt_ids"]) + list(r["completion_ids"]) for r in rollouts]
    width = max(map(len, seqs))
    B = len(seqs)
    ids = torch.full((B, width), pad_id, dtype=torch.long)
    att = torch.zeros((B, width), dtype=torch.long)
    mask = torch.zeros((B, width - 1))
    old = torch.zeros((B, width - 1))
    for i, (r, s) in enumerate(zip(rollouts, seqs)):
        ids[i, :len(s)] = torch.tensor(s)
        att[i, :len(s)] = 1
        p, n = len(r["prompt_ids"]), len(r["completion_ids"])
        if n:
            mask[i, p - 1:p - 1 + n] = torch.tensor(list(r["loss_mask"]), dtype=torch.float32)
            old[i, p - 1:p - 1 + n] = torch.tensor(list(r["logprobs"]), dtype=torch.float32)
    adv = torch.tensor([float(r["advantage"]) for r in rollouts])
    ep = torch.tensor([float(r.get("episode_tokens") or sum(r["loss_mask"])) for r in rollouts])
    return {"input_ids": ids, "attention_mask": att, "loss_mask": mask, "old_logprobs": old,
            "advantages": adv, "episode_tokens": ep}


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0, positions: torch.Tensor | None = None) -> torch.Tensor:
    """log p(x_t | x_<t) of every next token, under logits / temperature: [B, T-1]. With
    ``positions`` ([B, T-1], the loss mask), only those tokens get the output layer and a
    log-softmax over the vocabulary (the prompt's do not: most of an agent turn's sequence); the
    others are 0."""
    scale = temperature if temperature > 0 else 1.0
    targets = input_ids[:, 1:]
    if positions is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
        return (logits.float() / scale).log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    module = getattr(model, "module", model)  # a DeepSpeed engine's model
    hidden = module.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                  use_cache=False).last_hidden_state[:, :-1]
    keep = positions > 0
    logits = module.get_output_embeddings()(hidden[keep]).float() / scale
    picked = logits.log_softmax(-1).gather(-1, targets[keep].unsqueeze(-1)).squeeze(-1)
    return torch.zeros(keep.shape, dtype=picked.dtype, device=picked.device).masked_scatter(keep, picked)


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_eps: float = 0.2, clip_eps_high: float | None = None, ref_logp: torch.Tensor | None = None,
              kl_coef: float = 0.0, denom: float | None = None, weight: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, dict]:
    """Token-level clipped surrogate (PPO-style) against the sampling logprobs, summed over
    masked tokens (each times ``weight``, default the mask: see ``sequence_weights``) and divided
    by ``denom`` (default: the weights' sum), plus ``kl_coef`` times the k3 estimate of
    KL(policy || reference) on the same tokens, weighted alike."""
    w = mask if weight is None else weight
    denom = float(denom if denom is not None else w.sum().clamp(min=1).item())
    ratio = torch.exp((logp - old_logp).clamp(-20, 20))
    adv = advantages.unsqueeze(-1)
    hi = clip_eps if clip_eps_high is None else clip_eps_high
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + hi) * adv)
    loss = -(surr * w).sum() / denom
    stats = {"clip_frac": ((((ratio < 1 - clip_eps) & (adv < 0)) | ((ratio > 1 + hi) & (adv > 0))).float()
                           * mask).sum().item(),
             "ratio_sum": (ratio.detach() * mask).sum().item(), "tokens": mask.sum().item(), "kl_sum": 0.0}
    return _with_kl(loss, stats, logp, ref_logp, kl_coef, w, denom)


def reinforce_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                   clip_eps: float = 0.2, clip_eps_high: float | None = None, ref_logp: torch.Tensor | None = None,
                   kl_coef: float = 0.0, denom: float | None = None, weight: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, dict]:
    """REINFORCE with the group baseline: minus the advantage times the token's log-probability,
    over masked tokens (times ``weight``), divided by ``denom``: no ratio and no clipping (the clip
    settings are not used), so it assumes on-policy rollouts (staleness 0); plus the same KL term."""
    w = mask if weight is None else weight
    denom = float(denom if denom is not None else w.sum().clamp(min=1).item())
    loss = -(logp * advantages.unsqueeze(-1) * w).sum() / denom
    ratio = torch.exp((logp.detach() - old_logp).clamp(-20, 20))
    stats = {"clip_frac": 0.0, "ratio_sum": (ratio * mask).sum().item(), "tokens": mask.sum().item(), "kl_sum": 0.0}
    return _with_kl(loss, stats, logp, ref_logp, kl_coef, w, denom)


def weigh_negatives(advantages: torch.Tensor, weight: float) -> torch.Tensor:
    """Negative advantages times ``weight`` (W-REINFORCE's lambda), positive ones as they are. Below
    1 a failure is pushed down less than a success is pushed up: where failures are mangled calls
    that ramble on, most of their tokens are noise, and pushing them down spreads probability over
    other noise rather than onto the call that worked."""
    return advantages if weight == 1.0 else torch.where(advantages < 0, advantages * weight, advantages)


def sequence_weights(mask: torch.Tensor, episode_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token weights that make each rollout count once, whatever its length: the mask divided by
    the rollout's own token count (GRPO's per-sequence mean), or by its episode's
    (``episode_tokens`` [B]) where an episode is several rows. Under the token mean a failed
    episode that rambled to the turn budget outweighs a short correct one many times over."""
    denom = mask.sum(-1, keepdim=True) if episode_tokens is None else episode_tokens.unsqueeze(-1).to(mask.dtype)
    return mask / denom.clamp(min=1)


def _with_kl(loss, stats: dict, logp, ref_logp, kl_coef: float, weight, denom: float):
    """``loss`` plus ``kl_coef`` times the k3 estimate of KL(policy || reference) on the masked tokens,
    each times ``weight`` (the mask, or ``sequence_weights``)."""
    if ref_logp is not None and kl_coef:
        d = (ref_logp - logp).clamp(-20, 20)
        kl = torch.exp(d) - d - 1
        loss = loss + kl_coef * (kl * weight).sum() / denom
        stats["kl_sum"] = (kl.detach() * (weight > 0)).sum().item()
    return loss, stats


LOSSES = {"grpo": grpo_loss, "reinforce": reinforce_loss}
"""The policy losses ``TrainerConfig.loss`` selects from, all with ``grpo_loss``'s signature: a new
loss is one function registered here."""
