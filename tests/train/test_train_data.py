import glob
import json
import os

import numpy as np
import pytest

from composer_dag.train.data import TokenShardDataset, load_tokens, pack_documents
from composer_dag.train.tokenizer import load_tokenizer, train_tokenizer


def corpus():
    src = os.path.dirname(json.__file__)
    docs = [(f"py:{os.path.basename(f)}", open(f, encoding="utf-8").read(), "stdlib", "Python")
            for f in sorted(glob.glob(src + "/*.py"))]
    docs += [(f"md:{i}", f"# Title {i}\n\nSome prose about item {i}.\n" * 3, "docs", "Markdown")
             for i in range(40)]
    docs += [(f"c:{i}", f"int f{i}(void) {{ return {i}; }}\n", "misc", "C") for i in range(200)]
    return docs


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = train_tokenizer([d[1] for d in corpus()], str(tmp_path_factory.mktemp("tok")),
                           vocab_size=500)
    return load_tokenizer(path)


def test_pack_layout_and_eos_joins(tok, tmp_path):
    docs = corpus()
    s = pack_documents(docs, tok, str(tmp_path), val_fraction=0.1, seed=0)
    assert s["docs_in"] == len(docs) and s["docs_train"] + s["docs_val"] == len(docs)
    assert s["dtype"] == "uint16" and s["bytes_in"] > 0 and s["mb_per_s"] > 0
    assert s["tokens_by_language"]["Python"] > 0 and s["replay_tokens"] > 0
    assert json.load(open(tmp_path / "summary.json"))["tokens_train"] == s["tokens_train"]
    for split in ("train", "val"):
        raw = open(tmp_path / f"{split}.idx", "rb").read(18)
        assert raw[:9] == b"MMIDIDX\x00\x00" and raw[17] == 8  # Megatron header, dtype code uint16
        tokens, offsets = load_tokens(str(tmp_path / split))
        assert tokens.dtype == np.uint16 and offsets.dtype == np.int64
        assert os.path.getsize(tmp_path / f"{split}.bin") == 2 * len(tokens)
        assert offsets[0] == 0 and offsets[-1] == len(tokens) == s[f"tokens_{split}"]
        ends = offsets[1:] - 1
        assert (tokens[ends] == tok.eos_token_id).all()  # each document ends with EOS
        assert (tokens == tok.eos_token_id).sum() == len(ends)
    # the first train document decodes back to its text
    tokens, offsets = load_tokens(str(tmp_path / "train"))
    first = tok.decode(tokens[offsets[0]:offsets[1] - 1].tolist())
    assert first in {d[1] for d in docs}


def split_of(tok, docs, out, **kw):
    pack_documents(docs, tok, str(out), **kw)
    result = {}
    for split in ("train", "val"):
        tokens, offsets = load_tokens(str(out / split))
        result[split] = [tok.decode(tokens[a:b - 1].tolist()) for a, b in zip(offsets, offsets[1:])]
    return result


def test_split_is_deterministic_and_disjoint(tok, tmp_path):
    docs = corpus()
    a = split_of(tok, docs, tmp_path / "a", val_fraction=0.2, seed=0)
    b = split_of(tok, list(reversed(docs)), tmp_path / "b", val_fraction=0.2, seed=7)
    assert sorted(a["val"]) == sorted(b["val"]) and sorted(a["train"]) == sorted(b["train"])
    assert 0 < len(a["val"]) < len(docs)
    ids = {d[1]: d[0] for d in docs}
    val_ids = {ids[t] for t in a["val"]}
    assert val_ids.isdisjoint({ids[t] for t in a["train"]})


def test_mixture_keep_and_repeat(tok, tmp_path):
    docs = corpus()
    mix = {"Python": 2.0, "C": 0.25, "replay": 0.5, "*": 1.0}
    s = pack_documents(docs, tok, str(tmp_path / "m"), val_fraction=0.0, mixture=mix, seed=3)
    base = pack_documents(docs, tok, str(tmp_path / "b"), val_fraction=0.0, seed=3)
    lang = s["tokens_by_language"]
    assert lang["Python"] == 2 * base["tokens_by_language"]["Python"]
    assert 0.1 < lang["C"] / base["tokens_by_language"]["C"] < 0.45
    assert 0.2 < lang["Markdown"] / base["tokens_by_language"]["Markdown"] < 0.8
    assert s["replay_tokens"] == lang["Markdown"] and 0 < s["replay_share"] < 1
    assert s["docs_dropped"] > 0
    again = pack_documents(docs, tok, str(tmp_path / "m2"), val_fraction=0.0, mixture=mix, seed=3)
    assert again["tokens_by_language"] == lang  # deterministic
    none = pack_documents(docs, tok, str(tmp_path / "z"), val_fraction=0.0, mixture={"*": 0})
    assert none["tokens_train"] == 0 and none["docs_dropped"] == len(docs)


def test_dtype_is_megatrons_choice():
    from megatron.core.datasets.indexed_dataset import DType

    from composer_dag.train.data import token_dtype

    assert token_dtype(65499) == np.uint16 and token_dtype(65500) == np.int32
    for vocab in (500, 65499, 65500, 151_936):
        assert token_dtype(vocab) == DType.optimal_dtype(vocab)


@pytest.fixture(scope="module")
def shard(tok, tmp_path_factory):
    out = tmp_path_factory.mktemp("shard")
    pack_documents(corpus(), tok, str(out), val_fraction=0.0)
    return str(out / "train")


def test_reader_windows(shard):
    ds = TokenShardDataset(shard, seq_len=16)
    tokens, _ = load_tokens(shard)
    assert ds.num_samples == (len(tokens) - 1) // 16
    assert np.array_equal(ds[1], tokens[16:33]) and ds[1].dtype == np.int64
    assert np.array_equal(ds[ds.num_samples], ds[0])  # the next epoch starts over


def test_reader_shards_by_rank_disjointly(shard):
    world, n = 3, 60
    per_rank = [list(zip(range(n), TokenShardDataset(shard, 16, r, world, shuffle_seed=1).indices()))
                for r in range(world)]
    seen = [g for rank in per_rank for _, g in rank]
    assert sorted(seen) == list(range(n * world))  # disjoint and complete
    assert all(g % world == r for r, rank in enumerate(per_rank) for _, g in rank)
    one = TokenShardDataset(shard, 16, shuffle_seed=1)
    two = TokenShardDataset(shard, 16, 1, 2, shuffle_seed=1)
    assert np.array_equal(next(iter(two)), one[1])
    assert sorted(one.window(g) for g in range(one.num_samples)) == list(range(one.num_samples))
    assert [one.window(g) for g in range(20)] != list(range(20))  # shuffled
    assert [one.window(g) for g in range(20)] == [TokenShardDataset(shard, 16, shuffle_seed=1)
                                                  .window(g) for g in range(20)]


def test_reader_resumes_at_exact_sample(shard):
    full = TokenShardDataset(shard, 16, 1, 2, shuffle_seed=5).batches(4)
    ref = [next(full) for _ in range(6)]
    # 3 steps of 4 samples on each of 2 ranks = 24 global samples consumed
    resumed = TokenShardDataset(shard, 16, 1, 2, start_sample=24, shuffle_seed=5).batches(4)
    for want in ref[3:]:
        assert np.array_equal(next(resumed), want)
    ds = TokenShardDataset(shard, 16, epochs=1)
    assert sum(1 for _ in ds) == ds.num_samples
