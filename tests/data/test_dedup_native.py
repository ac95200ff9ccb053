"""The compiled kernels of the per-file pass (composer_dag/dedup/kernels.py) give exactly what the
plain Python/numpy code gives: every verdict, exact hash, signature, contamination hit and
redaction on real and edge-case files, and the golden digests when the pipeline uses them."""

from __future__ import annotations

import os
import random
import sysconfig
from types import SimpleNamespace

import numpy as np
import pytest
import rensa

from composer_dag.dedup import DedupConfig, humaneval_texts
from composer_dag.dedup.decontam import default_index
from composer_dag.dedup.features import analyse_batch
from composer_dag.dedup.secrets import NEEDLES, ON_LOWER, SECRET_PATTERNS
from tests import dedup_golden
from tests.data.test_dedup import HARMLESS, SECRETS

from composer_dag.dedup import kernels  # noqa: E402


def test_compiled_kernels_are_available():
    """numba is a declared dependency: the compiled pass is what runs at corpus scale."""
    assert kernels.AVAILABLE

WORD = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_"


def _edge_cases() -> list[bytes | None]:
    rnd = random.Random(7)
    tokens = b" ".join(bytes(rnd.choice(WORD) for _ in range(n)) for n in list(range(1, 70)) * 3 + [100, 257, 1000])
    secrets = "".join(SECRETS.values()) + "".join(HARMLESS)
    mixed_case = 'DB_PASSWORD = "hunter2"\nConfig = {"Api_Key": "k-123"}\nAWS_Secret_Access_Key = ' \
                 '"wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"\nmail: a.b@c-d.example.org\n'
    he = humaneval_texts()[3][1]
    return [
        None, b"", b"x", b"\n\n\n", b"  \t\n", b"a b c d", tokens, tokens + b"end",
        b"line one  \r\nline two\t\r\n\r\nthree\rfour \x0b\x0c\nfive\x1c \n  \n\n",
        b"\n\n  lead\n" + b"x = 1   \n" * 50 + b"\t\n \n",
        ("caf\u00e9 na\u00efve \u4e2d\u6587 " * 40).encode(),
        b"blob = '" + b"QUJD" * 40 + b"'\n" + b"y = 'A" + b"b" * 62 + b"'\n" + b"code line here\n" * 5,
        b"z = 1\n" + b"q" * 1500 + b"\n",
        b"table = [" + b"0x1f, 2.5, " * 400 + b"]\n",
        secrets.encode(), mixed_case.encode(), (secrets.upper() + secrets.lower()).encode(),
        he.encode(), ("# header\n" + he).encode(),
        b"@decorator\ndef f(x):\n    return x@y  # matmul, user@host, a@b.io\n",
    ]


def _stdlib_files(limit: int) -> list[bytes]:
    root = sysconfig.get_paths()["stdlib"]
    out, total = [], 0
    for dirpath, dirnames, files in os.walk(root):
        dirnames.sort()
        for name in sorted(files):
            if name.endswith(".py") and total < limit:
                with open(os.path.join(dirpath, name), "rb") as f:
                    out.append(f.read())
                total += len(out[-1])
    return out


@pytest.fixture(scope="module")
def cfg():
    return SimpleNamespace(**DedupConfig().model_dump())


def test_token_hash_is_rensas():
    rnd = random.Random(0)
    tokens = [bytes(rnd.choice(WORD) for _ in range(n)) for n in list(range(1, 90)) * 5 + [500, 4096]]
    buf = np.frombuffer(b" ".join(tokens), np.uint8)
    flat, offsets = kernels.token_hashes(buf, np.array([0], np.int64), np.array([len(buf)], np.int64))
    assert offsets.tolist() == [0, len(tokens)]
    assert flat.tolist() == rensa.RMinHash.hash_token_sets([tokens])[0]


def test_compiled_and_plain_per_file_pass_agree(cfg):
    docs = _edge_cases() + _stdlib_files(3_000_000)
    paths = [f"f{k}.py" for k in range(len(docs))]
    contam = default_index(extra=[("he", humaneval_texts()[3][1])]).hashes
    for batch in (slice(0, 30), slice(30, None)):
        plain = analyse_batch(docs[batch], paths[batch], cfg, contam, native=False)
        native = analyse_batch(docs[batch], paths[batch], cfg, contam, native=True)
        for key in ("verdicts", "live", "exact", "hits", "redacted"):
            assert native[key] == plain[key], key
        assert np.array_equal(native["sig"], plain["sig"]) and np.array_equal(native["has_shingles"], plain["has_shingles"])
    # the edge cases do exercise the paths compared above
    edge = analyse_batch(docs[:30], paths[:30], cfg, contam, native=True)
    assert edge["hits"] and edge["redacted"] and any(v for v in edge["verdicts"])


def test_every_secret_match_holds_one_of_its_literals():
    """``NEEDLES`` are what lets the compiled pass skip patterns: each match must contain one."""
    texts = [s.encode() for s in SECRETS.values()] + [_edge_cases()[15], _edge_cases()[16]]
    seen = set()
    for kind, patterns in SECRET_PATTERNS.items():
        for i, pat in enumerate(patterns):
            for text in texts:
                text = text.lower() if kind in ON_LOWER else text
                for m in pat.finditer(text):
                    seen.add((kind, i))
                    assert any(lit in m.group(0) for lit in NEEDLES[kind][i]), (kind, m.group(0))
    assert {kind for kind, _ in seen} == set(SECRET_PATTERNS)


@pytest.mark.parametrize("name", ["default"])
def test_golden_digests_with_compiled_kernels(tmp_path, name):
    from tests.data.test_dedup_golden import EXPECTED

    rows, extra = dedup_golden.corpus()
    if dedup_golden.input_digest(rows, extra) != EXPECTED["input"]:
        pytest.skip("this Python's stdlib gives another golden input")
    config = DedupConfig(**dedup_golden.CONFIGS[name], native_min_bytes=0)
    got = dedup_golden.run(str(tmp_path), rows, extra, config)
    assert got == EXPECTED[name]
