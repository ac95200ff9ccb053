import glob
import json
import os

import pytest

from composer_dag.train.tokenizer import EOS, PAD, SPECIAL_TOKENS, load_tokenizer, train_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    src = os.path.dirname(json.__file__)
    texts = [open(f, encoding="utf-8").read() for f in sorted(glob.glob(src + "/*.py"))]
    texts.append("# Notes\n\nSome *markdown* text about `json`.\n")
    return train_tokenizer(texts, str(tmp_path_factory.mktemp("tok")), vocab_size=600)


def test_files_and_config(tok_dir):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert os.path.exists(os.path.join(tok_dir, name))
    cfg = json.load(open(os.path.join(tok_dir, "tokenizer_config.json")))
    assert "<|im_start|>" in cfg["chat_template"]
    smap = json.load(open(os.path.join(tok_dir, "special_tokens_map.json")))
    assert smap["eos_token"] == EOS and smap["pad_token"] == PAD


def test_round_trip_and_special_tokens(tok_dir):
    from transformers import PreTrainedTokenizerFast

    tok = load_tokenizer(tok_dir)
    assert len(tok) == 600
    assert tok.eos_token == EOS and tok.pad_token == PAD and tok.eos_token_id != tok.pad_token_id
    for text in ["def f(x):\n    return {'a': x}  # ünïcode ✓\n", "\t\r\n  \x00 tabs", ""]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    ids = [tok.encode(s, add_special_tokens=False) for s in SPECIAL_TOKENS]
    assert all(len(i) == 1 for i in ids) and len({i[0] for i in ids}) == len(SPECIAL_TOKENS)
    wrapped = tok.encode("<tool_call>{}</tool_call>", add_special_tokens=False)
    assert wrapped[0] == tok.convert_tokens_to_ids("<tool_call>")
    assert wrapped[-1] == tok.convert_tokens_to_ids("</tool_call>")
    # the plain fast class loads it too
    assert PreTrainedTokenizerFast.from_pretrained(tok_dir).encode(EOS) == [tok.eos_token_id]


def test_chat_template(tok_dir):
    tok = load_tokenizer(tok_dir)
    msgs = [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "List files."},
            {"role": "assistant", "content": "",
             "tool_calls": [{"name": "bash", "arguments": {"cmd": "ls"}}]},
            {"role": "tool", "content": "a.py"},
            {"role": "assistant", "content": "There is a.py."}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a coding agent.<|im_end|>\n")
    assert '<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>tool\n<tool_response>\na.py\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 6
    assert tok.decode(ids) == text
