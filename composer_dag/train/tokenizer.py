"""Byte-level BPE tokenizer trained offline, with the special tokens of the agent harness.

The saved directory is what ``transformers.AutoTokenizer.from_pretrained`` expects
(tokenizer.json, tokenizer_config.json with a jinja ``chat_template``,
special_tokens_map.json). With a base model that ships its own tokenizer, use that instead
(``load_tokenizer(base_model_dir)``).
"""

from __future__ import annotations

import json
import os
from typing import Iterable

EOS = "<|endoftext|>"
PAD = "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
SPECIAL_TOKENS = [EOS, PAD, IM_START, IM_END, *TOOL_TOKENS]

# ChatML-style turns. A tool result is a "tool" turn whose content is wrapped in
# <tool_response>; an assistant tool call is given as message["tool_calls"] (strings, or dicts
# {"name", "arguments"} or the OpenAI {"function": {...}} form), each rendered inside
# <tool_call> ... </tool_call> as {"name": ..., "arguments": ...}, arguments given as a JSON
# string written as they are (as sampled), so a reply sent back renders as the model wrote it.
# ``tools`` (OpenAI function specs) are listed at the end of the system turn (one is opened when
# the messages have none).
CHAT_TEMPLATE = (
    "{% if tools %}{% set tool_text = '# Tools\nCall a function by writing <tool_call>{\"name\": ..., "
    "\"arguments\": {...}}</tool_call>. Functions:\n' + (tools | map('tojson') | join('\n')) %}"
    "{% if not messages or messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\n' + tool_text + '<|im_end|>\n' }}{% endif %}{% endif %}"
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['role'] == 'tool' %}{{ '<tool_response>\n' + m['content'] + '\n</tool_response>' }}"
    "{% else %}{{ m['content'] or '' }}{% endif %}"
    "{% if tools and loop.first and m['role'] == 'system' %}{{ '\n\n' + tool_text }}{% endif %}"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}"
    "{% if c is string %}{% set body = c %}{% else %}"
    "{% set fn = c['function'] if c['function'] is defined else c %}"
    "{% set args = fn['arguments'] if fn['arguments'] is defined else {} %}"
    "{% set body = '{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' + "
    "(args if args is string else (args | tojson)) + '}' %}{% endif %}"
    "{{ '\n<tool_call>\n' + body + '\n</tool_call>' }}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], out_dir: str, vocab_size: int = 8192,
                    min_frequency: int = 2) -> str:
    """Train a byte-level BPE on ``texts`` and save it to ``out_dir``; return ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=PAD, unk_token=None,
        additional_special_tokens=[IM_START, IM_END, *TOOL_TOKENS], model_max_length=1 << 20)
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    _portable_config(out_dir)
    return out_dir


def _portable_config(out_dir: str) -> None:
    """Keep the chat template and special tokens in the classic files as well, so older
    transformers, vLLM and other readers find them without the newer side files."""
    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    extra = [IM_START, IM_END, *TOOL_TOKENS]
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE,
               additional_special_tokens=extra)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    special = {"bos_token": EOS, "eos_token": EOS, "pad_token": PAD,
               "additional_special_tokens": extra}
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump(special, f, indent=2)


def load_tokenizer(path: str):
    """A fast tokenizer from a directory (a trained one or a base model's own)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok
