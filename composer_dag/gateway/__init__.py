"""The gateway: an OpenAI-compatible endpoint in front of the rollout servers that records every
call token-exact, so that any agent harness can play an episode unchanged and be trained on.

A harness keeps its own loop and calls ``/v1/chat/completions`` (or ``/v1/completions``) with a
per-episode key. The gateway renders the prompt with the checkpoint's own chat template, splicing
in the exact tokens sampled before where the harness sent its earlier turns back (``chat``),
asks a rollout server for token ids and sampling logprobs, parses tool calls out of the text,
and answers with only what was asked. Per call it records the prompt ids the server saw, the
completion ids and logprobs, the policy version, finish reason and timings (``records``), keyed by
the episode's key; the trainer builds its rows from those (``records.segments``), never by
re-tokenizing text.
"""
