"""Shards as outside tools read them: token shards through Megatron-Core's own
``IndexedDataset``/``IndexedDatasetBuilder``, and deduplicated Parquet shards through
pyarrow.dataset, DuckDB and Hugging Face ``datasets``."""

from __future__ import annotations

import gc
import glob
import json
import math
import os
import struct
import sys
import warnings

import numpy as np
import pytest

from composer_dag.train.data import TokenShardDataset, _unit, load_tokens, pack_documents
from composer_dag.train.megatron_shards import check_external_shards
from composer_dag.train.tokenizer import load_tokenizer, train_tokenizer

with warnings.catch_warnings():  # Megatron-Core warns that Transformer Engine/Apex are absent
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

import torch  # noqa: E402


def corpus():
    src = os.path.dirname(json.__file__)
    files = sorted(glob.glob(src + "/*.py") + glob.glob(os.path.dirname(src) + "/email/*.py"))
    docs = [(f"py:{os.path.relpath(f, os.path.dirname(src))}", open(f, encoding="utf-8").read(),
             "stdlib", "Python") for f in files]
    docs += [(f"md:{i}", f"# Note {i}\n\nSome prose about item {i}.\n" * 2, "docs", "Markdown")
             for i in range(30)]
    return docs


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = train_tokenizer([d[1] for d in corpus()], str(tmp_path_factory.mktemp("tok")),
                           vocab_size=512)
    return load_tokenizer(path)


def encode(tok, text: str) -> list[int]:
    """The tokenizer's own encoding of one document, followed by EOS."""
    return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def megatron_docs(prefix: str) -> list[list[int]]:
    """Every document of a shard, read with Megatron-Core's reader (sequences joined per doc)."""
    ds = IndexedDataset(prefix)
    bounds = ds.document_indices
    return [np.concatenate([ds[s] for s in range(a, b)]).tolist()
            for a, b in zip(bounds, bounds[1:])]


def build(prefix: str, docs: list[list[int]], dtype=np.int32) -> None:
    """Shards written with Megatron-Core's builder directly, outside the project's packer."""
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for ids in docs:
        builder.add_item(torch.tensor(ids, dtype=torch.int64))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def test_packed_shards_read_back_with_megatron(tok, tmp_path):
    docs = corpus()
    val_fraction = 0.25
    s = pack_documents(docs, tok, str(tmp_path), val_fraction=val_fraction, seed=0)
    want = {"train": [], "val": []}
    for doc_id, text, _, _ in docs:
        want["val" if _unit("split", doc_id) < val_fraction else "train"].append(encode(tok, text))
    assert want["train"] and want["val"]
    for split in ("train", "val"):
        prefix = str(tmp_path / split)
        ds = IndexedDataset(prefix)
        assert ds.index.dtype == np.uint16 and len(ds) == len(want[split]) == s[f"docs_{split}"]
        got = megatron_docs(prefix)
        assert got == want[split]  # token for token, in input order, one document each
        assert sum(map(len, got)) == s[f"tokens_{split}"]
        tokens, offsets = load_tokens(prefix)  # the project's stream over the same reader
        assert np.array_equal(tokens, np.concatenate([np.asarray(d) for d in got]))
        assert np.array_equal(np.diff(offsets), [len(d) for d in got])


def test_mixture_copies_are_separate_megatron_documents(tok, tmp_path):
    docs = corpus()
    s = pack_documents(docs, tok, str(tmp_path), val_fraction=0.0,
                       mixture={"Python": 2, "replay": 0})
    python = [encode(tok, d[1]) for d in docs if d[3] == "Python"]
    assert megatron_docs(str(tmp_path / "train")) == [d for d in python for _ in range(2)]
    assert s["docs_dropped"] == 30 and s["replay_share"] == 0.0
    assert json.load(open(tmp_path / "summary.json"))["mixture"] == {"Python": 2, "replay": 0}


def test_stream_outlives_the_reader(tok, tmp_path):
    """IndexedDataset unmaps its files when collected; the stream must keep it alive."""
    pack_documents(corpus()[:5], tok, str(tmp_path), val_fraction=0.0)
    tokens, offsets = load_tokens(str(tmp_path / "train"))
    plain = np.asarray(tokens)[10:20]
    del tokens
    gc.collect()
    assert plain.tolist() == megatron_docs(str(tmp_path / "train"))[0][10:20]
    window = TokenShardDataset(str(tmp_path / "train"), 16).tokens[:17]
    gc.collect()
    assert window.tolist() == megatron_docs(str(tmp_path / "train"))[0][:17]


def test_check_external_shards(tok, tmp_path):
    docs = [encode(tok, d[1]) for d in corpus()[:12]]
    build(str(tmp_path / "good"), docs)
    s = check_external_shards(str(tmp_path / "good"), tok)
    assert s["documents"] == 12 and s["tokens"] == sum(map(len, docs)) and s["dtype"] == "int32"
    assert s["max_token_id"] == max(max(d) for d in docs) < len(tok) and s["eos_ok"] is True
    pack_documents(corpus(), tok, str(tmp_path / "packed"), val_fraction=0.0)
    assert check_external_shards(str(tmp_path / "packed" / "train"), tok)["dtype"] == "uint16"

    def refused(prefix, *words):
        with pytest.raises(ValueError) as e:
            check_external_shards(str(tmp_path / prefix), tok)
        msg = str(e.value)
        assert "\n" not in msg and all(w in msg for w in words), msg

    build(str(tmp_path / "over"), docs[:3] + [docs[3][:5] + [len(tok)] + docs[3][5:]])
    refused("over", f"token id {len(tok)}", "document 3", f"vocabulary of {len(tok)}")
    build(str(tmp_path / "noeos"), docs[:4] + [docs[4][:-1]])
    refused("noeos", "1 of 5 documents do not end with EOS", "document 4")
    build(str(tmp_path / "empty_doc"), docs[:2] + [[]])
    refused("empty_doc", "document 2 is empty")
    # the index format this project wrote before (magic CDTOKIDX), and plain junk
    (tmp_path / "old.bin").write_bytes(np.asarray(docs[0], dtype=np.uint16).tobytes())
    (tmp_path / "old.idx").write_bytes(struct.pack("<8sIIQ", b"CDTOKIDX", 1, 2, 1)
                                       + np.asarray([0, len(docs[0])], dtype=np.int64).tobytes())
    refused("old", "old.idx: not a Megatron index", "CDTOKIDX")
    (tmp_path / "short.bin").write_bytes(b"")
    (tmp_path / "short.idx").write_bytes(b"MMIDIDX\x00\x00" + b"\x01\x00")
    refused("short", "short.idx: unreadable Megatron index", "header cut")
    good_idx = (tmp_path / "good.idx").read_bytes()
    (tmp_path / "cutidx.bin").write_bytes((tmp_path / "good.bin").read_bytes())
    (tmp_path / "cutidx.idx").write_bytes(good_idx[:-20])
    refused("cutidx", "cutidx.idx: unreadable Megatron index", "12 sequences and 13 document")
    build(str(tmp_path / "cut"), docs[:3])
    with open(tmp_path / "cut.bin", "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / "cut.bin") - 8)
    refused("cut", "cut.bin", "bytes, the index describes")
    build(str(tmp_path / "floats"), docs[:2], dtype=np.float32)
    refused("floats", "float32, not an integer dtype")
    refused("missing", "missing.idx: no such file")


@pytest.mark.slow
def test_midtrain_on_megatron_built_shards(tok, tmp_path):
    """A few steps of the mid-training entry point on shards written by Megatron-Core's own
    builder (int32 tokens), not by the project's packer."""
    from composer_dag.train.model import build_base_model
    from tests.train.test_midtrain import ENTRY, run, write_config

    docs = corpus()
    data = tmp_path / "data"
    data.mkdir()
    build(str(data / "train"), [encode(tok, d[1]) for d in docs[4:]])
    build(str(data / "val"), [encode(tok, d[1]) for d in docs[:4]])
    for split in ("train", "val"):
        assert check_external_shards(str(data / split), tok)["dtype"] == "int32"
    build_base_model("tiny", tok, str(tmp_path / "model"), seed=0, num_hidden_layers=2)
    cfg = write_config(tmp_path, "run", max_steps=3, warmup_steps=1, eval_every=3, save_every=3,
                       log_every=1)
    p = run([sys.executable, "-m", ENTRY, "--config", cfg])
    result = json.load(open(tmp_path / "run" / "result.json"))
    assert json.loads(p.stdout.strip().splitlines()[-1]) == result
    assert result["steps"] == 3 and result["tokens_seen"] == 3 * 4 * 64
    assert all(math.isfinite(loss) for _, loss in result["loss_curve"])
    assert math.isfinite(result["val_loss_after"])


def test_dedup_parquet_loads_in_pyarrow_duckdb_and_datasets(tmp_path):
    import duckdb
    import pyarrow.dataset as pads
    import pyarrow.parquet as pq

    from composer_dag.dedup import DedupConfig, dedup
    from composer_dag.storage import Storage
    from tests.data.test_dedup import _code, _row, _write

    storage = Storage(str(tmp_path / "store"))
    rows = [_row(f"r{i}", f"pkg/m{i}.py", _code(i)) for i in range(40)]
    rows.append(_row("copy", "pkg/copy.py", _code(7)))  # an exact duplicate of r7: one goes
    res = dedup([_write(storage, rows)], storage, storage.url("out"), DedupConfig())
    paths = [storage.local_path(u) for u in res.shard_urls]
    assert paths and all(p and p.endswith(".parquet") for p in paths)
    ref = pq.read_table(paths[0]).to_pydict()
    for p in paths[1:]:
        for k, v in pq.read_table(p).to_pydict().items():
            ref[k] += v
    ids = sorted(ref["id"])
    assert len(ids) == res.files_kept == 40 and len({"r7", "copy"} & set(ids)) == 1

    table = pads.dataset(paths, format="parquet").to_table(columns=["id", "content"])
    assert sorted(table.column("id").to_pylist()) == ids
    assert dict(zip(table.column("id").to_pylist(), table.column("content").to_pylist())) == \
        dict(zip(ref["id"], ref["content"]))

    files = ", ".join(f"'{p}'" for p in paths)
    query = f"select count(*), sum(size_bytes) from read_parquet([{files}])"
    [(n, total)] = duckdb.sql(query).fetchall()
    assert n == 40 and total == sum(ref["size_bytes"])
    got = duckdb.sql(f"select id from read_parquet([{files}]) order by id").fetchall()
    assert [r[0] for r in got] == ids

    datasets = pytest.importorskip("datasets")
    hf = datasets.load_dataset("parquet", data_files=paths, split="train",
                               cache_dir=str(tmp_path / "hf_cache"))
    assert hf.num_rows == 40 and sorted(hf["id"]) == ids
    assert dict(zip(hf["id"], hf["content"])) == dict(zip(ref["id"], ref["content"]))


def test_token_shards_from_elsewhere_on_s3(tok, tmp_path, s3_bucket):
    """The token_shards stage's ``external_prefix``: shards built by Megatron-Core's builder
    outside the project, put on the S3 server, taken as the train and val splits after the
    check against the tokenizer; a shard over the vocabulary is refused in one line."""
    from composer_dag.storage import Storage
    from composer_dag.train.data import TokenShardConfig, import_external_shards

    texts = [d[1] for d in corpus()[:40]]
    docs = [encode(tok, t) for t in texts]
    build(str(tmp_path / "ext_train"), docs[:30])
    build(str(tmp_path / "ext_val"), docs[30:])
    st = Storage(f"s3://{s3_bucket['bucket']}/shards", s3_bucket["options"])
    for name in ("ext_train", "ext_val"):
        for ext in (".bin", ".idx"):
            st.put_file(str(tmp_path / (name + ext)), st.url(name + ext))
    cfg = TokenShardConfig(external_prefix=st.url("ext_train"), external_val_prefix=st.url("ext_val"))
    summary = import_external_shards(cfg, tok, str(tmp_path / "out"))
    assert (summary["docs_train"], summary["docs_val"]) == (30, 10)
    assert summary["tokens_train"] == sum(map(len, docs[:30]))
    assert megatron_docs(str(tmp_path / "out" / "train")) == docs[:30]
    assert TokenShardDataset(str(tmp_path / "out" / "val"), 16).num_samples > 0

    build(str(tmp_path / "bad"), [docs[0][:-1] + [len(tok) + 7, tok.eos_token_id]])
    with pytest.raises(ValueError, match="outside the vocabulary") as err:
        import_external_shards(TokenShardConfig(external_prefix=str(tmp_path / "bad")), tok, str(tmp_path / "o2"))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="no such file"):
        import_external_shards(TokenShardConfig(external_prefix=st.url("missing")), tok, str(tmp_path / "o3"))
