"""Supervised fine-tuning between mid-training and RL: agent trajectories in the harness's own
chat and tool-call format (``trajectories``), tokenized with the loss on the assistant's tokens
and trained by the mid-training trainer with ``objective: sft`` (``run``)."""
