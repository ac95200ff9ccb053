"""``composer-dag``: the engine from a shell, for users and for cluster payloads.

Every command prints progress on standard error and a JSON summary as the last line of
standard output. Errors are one clear line on standard error and exit status 2.

S3 outputs and sources take their endpoint and credentials from the environment
(``COMPOSER_S3_ENDPOINT_URL`` or ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable

from composer_dag.storage import ArtifactError, Storage


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def s3_options_from_env() -> dict:
    opts = {}
    endpoint = os.environ.get("COMPOSER_S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        opts["endpoint_url"] = endpoint
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        opts["key"] = os.environ["AWS_ACCESS_KEY_ID"]
    if os.environ.get("AWS_SECRET_ACCESS_KEY"):
        opts["secret"] = os.environ["AWS_SECRET_ACCESS_KEY"]
    return opts


def storage_for(url: str) -> Storage:
    return Storage(url, s3_options_from_env() if url.startswith("s3://") else None)


def cmd_corpus(args: argparse.Namespace) -> dict[str, Any]:
    from composer_dag.corpus import CorpusConfig, ingest, parse_source

    spec = parse_source(args.source, name=args.name)
    if spec.kind == "s3":
        spec.storage_options = s3_options_from_env()
    cfg = CorpusConfig(
        max_file_bytes=int(args.max_file_mb * 1_000_000),
        max_total_bytes=int(args.max_total_mb * 1_000_000) if args.max_total_mb else None,
    )
    storage = storage_for(args.out)
    return ingest(spec, storage, storage.root, cfg, progress=_progress).to_dict()


def cmd_dedup(args: argparse.Namespace) -> dict[str, Any]:
    from composer_dag.dedup import DedupConfig, dedup

    src = storage_for(args.corpus_dir)
    inputs = [u for u in src.find(src.root) if u.rsplit("/", 1)[-1].startswith("files-")]
    if not inputs:
        raise ValueError(f"{args.corpus_dir} holds no files-*.parquet: is it the output of `composer-dag corpus`?")
    if src.exists(src.url("manifest.json")):
        src.verify_manifest(src.root)
    out = storage_for(args.out)
    if out.protocol != src.protocol:
        raise ValueError("corpus and output must be on the same storage (both local or both s3://)")
    cfg = DedupConfig(num_perm=args.num_perm, threshold=args.threshold)
    return dedup(inputs, out, out.root, cfg, progress=_progress).to_dict()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="composer-dag", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("corpus", help="ingest a source (directory, git URL/path[@rev], s3://prefix, or 'python')")
    c.add_argument("source")
    c.add_argument("--out", required=True, help="output directory or s3:// URL")
    c.add_argument("--name", default=None, help="source name (default: derived from SOURCE)")
    c.add_argument("--max-file-mb", type=float, default=1.0)
    c.add_argument("--max-total-mb", type=float, default=None, help="stop ingesting after this much text")
    c.set_defaults(func=cmd_corpus)

    d = sub.add_parser("dedup", help="filter, deduplicate, decontaminate and redact a corpus")
    d.add_argument("corpus_dir", help="what `composer-dag corpus` wrote")
    d.add_argument("--out", required=True)
    d.add_argument("--num-perm", type=int, default=256)
    d.add_argument("--threshold", type=float, default=0.7)
    d.set_defaults(func=cmd_dedup)

    for register in EXTRA_COMMANDS:
        register(sub)
    return p


EXTRA_COMMANDS: list[Callable[[Any], None]] = []


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        summary = args.func(args)
    except (ValueError, ArtifactError, FileNotFoundError, PermissionError, OSError) as exc:
        print(f"composer-dag {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"composer-dag {args.command}: interrupted", file=sys.stderr)
        return 130
    code = 0
    if isinstance(summary, tuple):
        summary, code = summary
    print(json.dumps(summary, sort_keys=True, default=str))
    return code


if __name__ == "__main__":
    sys.exit(main())
