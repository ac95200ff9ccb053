"""Dedup output on a fixed stdlib corpus must not change: digests recorded on the engine as it was
when they were taken (see ``tests/dedup_golden.py`` for the input and what is digested).

A change that alters output on purpose updates ``EXPECTED`` from
``.venv/bin/python -m tests.dedup_golden`` and says why in its commit message.
"""

from __future__ import annotations

import pytest

from composer_dag.dedup import DedupConfig
from tests import dedup_golden

# What both runs must give alike: the kept, clustered and dropped rows and every count.
SAME = {
    "clusters_rows": "c20f2107fd476742305c0e7980e9b6c95aeb97db9fc4dd6f121d02266c10ccf2",
    "counts": {
        "bytes_in": 2660815,
        "bytes_kept": 2272840,
        "clusters": 12,
        "dropped": {
            "contaminated": 2,
            "exact_duplicate": 3,
            "filter:data_file": 1,
            "filter:longest_line": 1,
            "filter:minified": 1,
            "invalid_row": 1,
            "near_duplicate": 15
        },
        "files_in": 214,
        "files_kept": 190,
        "lsh": {
            "candidate_pairs": 28,
            "contamination_ngrams": 17652,
            "lsh_bands": 25,
            "lsh_rows": 10,
            "verified_pairs": 20
        },
        "redactions": {
            "aws_access_key": 1,
            "aws_secret_key": 1,
            "email": 48,
            "github_token": 1,
            "password": 1
        }
    },
    "dropped_rows": "df8e0c5309c7e2afd2468bad9365020541003724544383ae76db58b166a4e453",
    "kept_rows": "d82dedc62d6a8a9e6b7c2bfff577b8dcb6a5318b1f834757e801a7ea1e1de929"
}
# What differs with the run's shard size and worker count: shard layout and progress lines.
EXPECTED = {
    "files": 214,
    "input": "9dedc3755191ff9ce09340891fa1988ffd332c19203eaad93a8579ef605f53a3",
    "default": {**SAME, **{
        "files": [
            "clusters.parquet",
            "dropped.parquet",
            "shard-00000.parquet"
        ],
        "manifest_files": [
            "clusters.parquet",
            "dropped.parquet",
            "shard-00000.parquet"
        ],
        "progress": "4d080f5989443b800d1d1cbf130575327cd26a9d59ef4e767d0a694884ab6709",
        "shard_rows": [
            "d82dedc62d6a8a9e6b7c2bfff577b8dcb6a5318b1f834757e801a7ea1e1de929"
        ],
        "shard_schema": "389325d8b6befd3d74a5005919111ddd0e0fbe6bd96a18d8529790d057daf27b"
    }},
    "parallel": {**SAME, **{
        "files": [
            "clusters.parquet",
            "dropped.parquet",
            "shard-00000.parquet",
            "shard-00001.parquet",
            "shard-00002.parquet",
            "shard-00003.parquet"
        ],
        "manifest_files": [
            "clusters.parquet",
            "dropped.parquet",
            "shard-00000.parquet",
            "shard-00001.parquet",
            "shard-00002.parquet",
            "shard-00003.parquet"
        ],
        "progress": "6cc8c81e92f348a23a7b117b4504a63ac0535f199eff16d942be82157ff89b9e",
        "shard_rows": [
            "f6a67871f43f9dee54acd334d2ddecb919dcd8f3f274bc3194db33bfd829c9e2",
            "5411a8804186797531c106a8f8f8ca4786d7020b07ec70d790467add32834091",
            "6f9fcf3b09e36489d9d69d8860b77fd026bf20f23a1d63633be91def46b35dcd",
            "ffbb1730173d634a1c3eb67c7d1a210802d9865f8e171b82b62367f9f0ca6ed5"
        ],
        "shard_schema": "b763f9bc0085d55dfbb80dd1161c53527dada384e519d9ba075a034eaed85f9d"
    }},
}


@pytest.fixture(scope="module")
def corpus():
    rows, extra = dedup_golden.corpus()
    digest = dedup_golden.input_digest(rows, extra)
    if digest != EXPECTED["input"]:
        pytest.skip(f"this Python's stdlib gives another golden input ({len(rows)} files, digest {digest[:12]}); "
                    "the digests were recorded on CPython 3.11.7")
    return rows, extra


@pytest.mark.parametrize("name", sorted(dedup_golden.CONFIGS))
def test_dedup_output_matches_recorded_digests(tmp_path, corpus, name):
    rows, extra = corpus
    assert len(rows) == EXPECTED["files"]
    got = dedup_golden.run(str(tmp_path), rows, extra, DedupConfig(**dedup_golden.CONFIGS[name]))
    want = EXPECTED[name]
    assert got["counts"] == want["counts"]
    assert got == want
