"""Mid-training engine: tokenizer, token shards, base model, DeepSpeed trainer.

Plain Python (torch, transformers, tokenizers, DeepSpeed); no Dagster import, so the same code
runs inside a Pipes subprocess, under ``torchrun``/``deepspeed``, or on a cluster node.
"""
