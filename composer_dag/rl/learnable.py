"""The learnable task family (``envs.tasks_learnable``) set up for a small RL run: a tokenizer,
a freshly built policy and a warm-up on the tool-call syntax.

Each task asks the agent to put one word, named in the instructions, into ``answer.txt`` at
the project root. The hidden test checks the file's content; grading is the ordinary grader
(hidden tests in a sandbox, cheat flags). A random policy almost never gets there; a policy
that only knows the tool-call syntax gets it by chance (about ``1 / (2 * len(words))``
under ``format_warmup_texts``); learning to write the file and to copy the word from the
instructions is what RL has to find.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from composer_dag import harness as harnesses
from composer_dag.harness.base import Action
from composer_dag.tasks.sources.learnable import ANSWER_FILE, build_learnable_tasks

WORDS = ("red", "green", "blue", "gold")


def format_warmup_texts(tokenizer, task_dirs, n: int, seed: int = 0, words=WORDS,
                        system_style: str = "compact", harness="composer") -> list[tuple[str, list[tuple[str, int]]]]:
    """(prompt, segments) transcripts that teach the harness's call syntax only.

    Turn 1 is one of: a write creating ``answer.txt`` with a word drawn uniformly from
    ``words`` (independent of the instructions; half of the time), a listing of the project,
    or a submit, each as the harness renders that action; unless it submitted, the real tool
    output follows and turn 2 submits. The right answer is never shown more often than chance.
    ``segments`` are (text, supervised) pieces after the prompt, tokenized piece by piece as the
    agent loop does.
    """
    from composer_dag.harness.episode import Episode

    h = harnesses.get(harness)
    rng = random.Random(seed)
    prompts, outputs = [], {}
    for d in task_dirs:
        with Episode(d, harness=h) as ep:
            prompts.append(h.render_prompt(tokenizer, ep.prompt(), system_style))
    listing, first = Action("list", {"path": "."}), Action("write", {"path": ANSWER_FILE, "old": "", "new": words[0]})
    with Episode(task_dirs[0], harness=h) as ep:  # what the tools really answer
        for a in (listing, first):
            outputs[a.kind] = [ep.step(c).content for c in h.render_action(a)][-1]
    end = "<|im_end|>"
    turn = lambda action: h.render_turn("", h.render_action(action)) + end
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.5:
            action = Action("write", {"path": ANSWER_FILE, "old": "", "new": rng.choice(words)})
        elif r < 0.75:
            action = listing
        else:
            action = Action("submit")
        segs = [(turn(action), 1)]
        if action.kind != "submit":
            tool = tokenizer.apply_chat_template([h.result_message(outputs[action.kind])], tokenize=False,
                                                 add_generation_prompt=True)
            segs += [("\n", 0), (tool, 0), (turn(Action("submit")), 1)]
        out.append((rng.choice(prompts), segs))
    return out


def format_warmup(policy_dir: str, out_dir: str, task_dirs, steps: int = 60, batch: int = 16,
                  lr: float = 2e-3, seed: int = 0, system_style: str = "compact", words=WORDS) -> dict:
    """A short supervised warm-up on ``format_warmup_texts`` (loss on the completion only);
    saves the result as a Hugging Face directory at ``out_dir``."""
    import time

    import torch

    from ..train.model import load_base_model, save_hf_dir, supervised_loss
    from ..train.tokenizer import load_tokenizer

    torch.manual_seed(seed)
    tok = load_tokenizer(policy_dir)
    model = load_base_model(policy_dir, "float32")
    model.train()
    pairs = format_warmup_texts(tok, task_dirs, steps * batch, seed, words, system_style)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    t0, losses = time.perf_counter(), []
    for s in range(steps):
        chunk = pairs[s * batch:(s + 1) * batch]
        enc = lambda text: tok(text, add_special_tokens=False).input_ids
        seqs = [(enc(p), [(t, m) for text, m in segs for t in enc(text)]) for p, segs in chunk]
        width = max(len(p) + len(c) for p, c in seqs)
        x = torch.full((len(seqs), width), tok.pad_token_id)
        y = torch.full((len(seqs), width), -100)
        att = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, (p, c) in enumerate(seqs):
            x[i, :len(p) + len(c)] = torch.tensor(p + [t for t, _ in c])
            att[i, :len(p) + len(c)] = 1
            y[i, len(p):len(p) + len(c)] = torch.tensor([t if m else -100 for t, m in c])
        loss = supervised_loss(model, x, y)  # right padding: no later token changes an earlier one
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    save_hf_dir(model, out_dir, tokenizer_dir=policy_dir)
    return {"path": out_dir, "steps": steps, "loss_first": losses[0], "loss_last": losses[-1],
            "seconds": round(time.perf_counter() - t0, 2)}



# a narrower, shallower variant of the "tiny" config: fast enough to warm up and train with
# RL in a couple of minutes on two CPU cores
TEST_MODEL = dict(hidden_size=128, num_hidden_layers=2, intermediate_size=352, max_position_embeddings=1024)


def make_learnable_setup(out_dir, n_tasks: int = 8, seed: int = 0, words=WORDS, warmup_steps: int = 100,
                         warmup_lr: float = 3e-3, model_config: str = "tiny", model_overrides=None,
                         vocab_size: int = 1024) -> dict:
    """Tasks, a byte-level BPE trained on code (the stdlib ``json`` package) plus agent
    transcripts, a freshly built Llama, and its format warm-up. Returns the paths."""
    import glob
    import os

    from ..train.model import build_base_model
    from ..train.tokenizer import train_tokenizer

    out = Path(out_dir)
    tasks = build_learnable_tasks(out / "tasks", n_tasks, seed, words, request_file=False)
    src = os.path.dirname(json.__file__)
    texts = [open(f, encoding="utf-8").read() for f in sorted(glob.glob(src + "/*.py"))]

    class _Plain:  # renders transcripts before a tokenizer exists
        @staticmethod
        def apply_chat_template(msgs, tokenize=False, add_generation_prompt=False):
            s = "".join(f"<|im_start|>{m['role']}\n" + (f"<tool_response>\n{m['content']}\n</tool_response>"
                        if m["role"] == "tool" else m["content"]) + "<|im_end|>\n" for m in msgs)
            return s + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    texts += [p + "".join(t for t, _ in segs) for p, segs in format_warmup_texts(_Plain, tasks, 200, seed, words)]
    tok_dir = train_tokenizer(texts, str(out / "tokenizer"), vocab_size=vocab_size)
    base = str(out / "base")
    build_base_model(model_config, tok_dir, base, seed=seed,
                     **(TEST_MODEL if model_overrides is None else model_overrides))
    if not warmup_steps:
        return {"tasks_dir": str(out / "tasks"), "tokenizer_dir": tok_dir, "base_dir": base,
                "policy_dir": base, "warmup": None}
    warm = format_warmup(base, str(out / "policy"), tasks, steps=warmup_steps, lr=warmup_lr, seed=seed,
                         words=words)
    return {"tasks_dir": str(out / "tasks"), "tokenizer_dir": tok_dir, "base_dir": base,
            "policy_dir": str(out / "policy"), "warmup": warm}
