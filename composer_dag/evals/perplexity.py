"""Perplexity of a checkpoint on the held-out validation token shard (``val.bin``/``.idx``)."""

from __future__ import annotations

import math
import os
import time


def perplexity(checkpoint_dir: str, shard_dir: str, seq_len: int = 256, batch_size: int = 8,
               max_batches: int | None = 16, device: str | None = None, dtype: str | None = None) -> dict:
    """Mean next-token loss over the first ``max_batches * batch_size`` windows of the
    validation split (every token a target once), and ``exp`` of it."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from ..train.data import TokenShardDataset
    from ..train.model import load_base_model

    t0 = time.perf_counter()
    prefix = os.path.join(shard_dir, "val")
    ds = TokenShardDataset(prefix, seq_len)
    count = ds.num_samples if max_batches is None else min(ds.num_samples, max_batches * batch_size)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = load_base_model(checkpoint_dir, dtype).to(dev).eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(0, count, batch_size):
            x = torch.from_numpy(np.stack([ds[g] for g in range(i, min(i + batch_size, count))])).to(dev)
            logits = model(input_ids=x[:, :-1], use_cache=False).logits.float()
            total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1),
                                     reduction="sum").item()
            tokens += x[:, 1:].numel()
    del model
    loss = total / tokens
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "tokens": tokens, "windows": count,
            "seq_len": seq_len, "seconds": round(time.perf_counter() - t0, 3)}
