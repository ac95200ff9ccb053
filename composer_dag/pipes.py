"""Report progress and results from an engine entry point, through Dagster Pipes when present.

When the process was launched by Dagster Pipes (``DAGSTER_PIPES_CONTEXT`` is set and the
``dagster_pipes`` package imports), rank 0 opens the Pipes session and forwards logs, asset
materializations and custom messages. Otherwise log lines go to stderr and ``result`` prints
the final JSON summary as the last line of stdout. Ranks other than 0 stay silent.
This is the only engine module that may import ``dagster_pipes`` (never ``dagster``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import types
import typing
from typing import Any, Callable


class Reporter:
    def __init__(self, rank: int | None = None):
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.pipes = None

    def __enter__(self) -> "Reporter":
        if self.rank == 0 and os.environ.get("DAGSTER_PIPES_CONTEXT"):
            try:
                from dagster_pipes import open_dagster_pipes
            except ImportError:
                pass
            else:
                self.pipes = open_dagster_pipes()
        return self

    def __exit__(self, *exc) -> None:
        if self.pipes is not None:
            self.pipes.__exit__(*exc)
            self.pipes = None

    def log(self, msg: str) -> None:
        if self.rank != 0:
            return
        if self.pipes is not None:
            self.pipes.log.info(msg)
        else:
            print(msg, file=sys.stderr, flush=True)

    def progress(self, msg: str) -> None:
        """A progress line: the Dagster log under Pipes, else stdout."""
        if self.rank != 0:
            return
        if self.pipes is not None:
            self.pipes.log.info(msg)
        else:
            print(msg, flush=True)

    def report_asset_materialization(self, metadata: dict[str, Any],
                                     asset_key: str | None = None) -> None:
        if self.rank == 0 and self.pipes is not None:
            self.pipes.report_asset_materialization(metadata=metadata, asset_key=asset_key)

    def report_custom_message(self, payload: Any) -> None:
        if self.rank == 0 and self.pipes is not None:
            self.pipes.report_custom_message(payload)

    def result(self, summary: dict[str, Any]) -> None:
        """The final summary: a Pipes custom message (the launching asset turns it into its
        materialization), else the last line of stdout."""
        if self.rank != 0:
            return
        if self.pipes is None:
            print(json.dumps(summary, default=str), flush=True)
        else:
            self.pipes.report_custom_message(summary)


def _type_ok(value: Any, hint: Any) -> bool:
    """Whether ``value`` (from JSON) fits the annotation ``hint``; unknown annotations pass."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin in (tuple, list):
        elem = args[0] if args and (origin is list or args[-1] is Ellipsis) else Any
        return isinstance(value, (tuple, list)) and all(_type_ok(v, elem) for v in value)
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    return True


def check_types(cfg: Any) -> None:
    """Raise ``ValueError`` (one line) for the first field of dataclass ``cfg`` whose value
    does not fit its annotation, e.g. ``max_steps="ten"``."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            check_types(value)
        elif f.name in hints and not _type_ok(value, hints[f.name]):
            want = getattr(hints[f.name], "__name__", None) or str(hints[f.name])
            raise ValueError(f"{f.name} must be {want}, not {type(value).__name__} {value!r:.80}")


def _fail(prog: str, msg: str) -> None:
    print(f"{prog}: error: {' '.join(msg.split())}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def config_from_args(description: str, argv: list[str] | None = None,
                     parse: Callable[[dict], Any] | None = None) -> Any:
    """The config of an engine entry point: ``--config FILE.json`` plus ``--set KEY=JSON``
    overrides (a value that is not JSON is taken as a string).

    With ``parse`` (e.g. ``SomeConfig.from_dict``) the result is ``parse(config)`` with every
    dataclass in it type-checked (``check_types``). A missing or malformed file, a bad
    ``--set``, an unknown field or a wrong type is one line on stderr and exit status 2."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)  # run as ``python -m MODULE``
    p = argparse.ArgumentParser(prog=f"python -m {spec.name}" if spec else None, description=description)
    p.add_argument("--config", required=True, help="the run's config as JSON")
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="override a config field, e.g. --set max_steps=50")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None,
                   help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    args = p.parse_args(argv)
    try:
        with open(args.config) as f:
            config = json.load(f)
    except OSError as exc:
        _fail(p.prog, f"cannot read config {args.config}: {exc.strerror or exc}")
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, deep nesting
        _fail(p.prog, f"config {args.config} is not valid JSON: {str(exc)[:200]}")
    if not isinstance(config, dict):
        _fail(p.prog, f"config {args.config} must hold a JSON object, not {type(config).__name__}")
    for kv in args.set:
        key, sep, value = kv.partition("=")
        if not sep or not key.strip():
            _fail(p.prog, f"--set {kv!r}: expected KEY=VALUE")
        try:
            config[key.strip()] = json.loads(value)
        except (ValueError, RecursionError):
            config[key.strip()] = value
    if parse is None:
        return config
    try:
        out = parse(config)
        for part in out if isinstance(out, tuple) else (out,):
            if dataclasses.is_dataclass(part) and not isinstance(part, type):
                check_types(part)
    except (ValueError, TypeError, KeyError) as exc:
        _fail(p.prog, f"bad config {args.config}: {exc}")
    return out


def serve(work: Callable[["Reporter"], dict]) -> dict:
    """Run an entry point's work under a Reporter, report its summary, and leave the process
    group (when torch.distributed was used) cleanly."""
    with Reporter() as rep:
        result = work(rep)
        rep.result(result)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return result
