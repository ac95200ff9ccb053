"""One typed config per stage: load, validate, and say what is wrong in one line.

Every stage's settings are a ``StageConfig`` (a frozen pydantic model that refuses unknown
fields), owned by the stage's engine module. The same class serves the Dagster asset (whose run
config is generated from it in ``assets/``), the CLI and ``python -m ... --config FILE``, so a
stage has one set of names, types and defaults. Parts of a stage nest (``RLConfig.trainer``).

    cfg = MidtrainConfig.load({"model_dir": "m", "data_dir": "d", "out_dir": "o", "lr": 1e-3})
    cfg = MidtrainConfig.load("run.json", overrides={"max_steps": 50})
    cfg.replace(max_steps=10)            # a validated copy

A bad value raises ``ConfigError`` (a ``ValueError``) with one line naming every bad field.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Iterable, Mapping, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

_SECRET_WORDS = ("secret", "key", "token", "password")

C = TypeVar("C", bound="StageConfig")


class ConfigError(ValueError):
    """A config that cannot be used; the message is one line."""


def describe(name: str, exc: ValidationError) -> str:
    """A pydantic validation error as one line: ``invalid NAME config: field: why (got X); ...``.
    Values of fields whose name looks secret are never shown."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ())) or "config"
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            msg = "unknown field"
        part = f"{loc}: {msg}"
        shown = "input" in err and err.get("type") not in ("missing", "extra_forbidden")
        if shown and not any(w in loc.lower() for w in _SECRET_WORDS) and "(got " not in msg:
            part += f" (got {repr(err['input'])[:80]})"
        parts.append(part)
    return " ".join(f"invalid {name} config: {'; '.join(parts)}".split())


def set_dotted(d: dict, key: str, value: Any) -> None:
    """``d["a"]["b"] = value`` for ``key`` ``"a.b"`` (nested parts of a stage config)."""
    *path, leaf = key.split(".")
    for part in path:
        nxt = d.get(part)
        if not isinstance(nxt, dict):
            nxt = d[part] = {}
        d = nxt
    d[leaf] = value


def _merge(base: dict, over: Mapping) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def read_json(path: str) -> dict:
    """A JSON object from a file, or ``ConfigError`` in one line."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror or exc}") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, deep nesting
        raise ConfigError(f"config {path} is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must hold a JSON object, not {type(data).__name__}")
    return data


def one_of(name: str, known: Iterable[str], what: str) -> str:
    """``name`` when it is one of ``known`` (a registry's keys); else a ValueError that names what
    it is and the known names (a validator's one line)."""
    known = list(known)
    if name not in known:
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(known)}")
    return name


class StageConfig(BaseModel):
    """Base of every stage config: frozen, unknown fields refused, one-line errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    @classmethod
    def load(cls: type[C], data: "C | Mapping | str | None" = None, overrides: Mapping | None = None) -> C:
        """The config from an instance, a mapping, a JSON file path, or None (the defaults),
        with ``overrides`` (nested mappings merge) applied; ``ConfigError`` when it is bad."""
        if isinstance(data, cls) and not overrides:
            return data
        if data is None:
            raw: dict = {}
        elif isinstance(data, BaseModel):
            raw = data.model_dump()
        elif isinstance(data, str):
            raw = read_json(data)
        elif isinstance(data, Mapping):
            raw = dict(data)
        else:
            raise ConfigError(f"{cls.__name__} from {type(data).__name__}: expected a mapping or a JSON file")
        if overrides:
            raw = _merge(raw, overrides)
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise ConfigError(describe(cls.__name__, exc)) from None

    def replace(self: C, **changes: Any) -> C:
        """A validated copy with ``changes`` applied (nested mappings merge)."""
        return type(self).load(self.model_dump(), changes)

    def to_dict(self) -> dict:
        """Plain JSON-able data (tuples as lists), as ``--config`` files hold it."""
        return self.model_dump(mode="json")


def _fail(prog: str, msg: str) -> None:
    print(f"{prog}: error: {' '.join(msg.split())}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def config_from_args(cls: type[C], description: str, argv: list[str] | None = None) -> C:
    """The config of an engine entry point: ``--config FILE.json`` plus ``--set KEY=JSON``
    overrides (``KEY`` may be dotted for a nested part; a value that is not JSON is taken as a
    string). A missing or malformed file, a bad ``--set``, an unknown field or a wrong type is
    one line on stderr and exit status 2."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)  # run as ``python -m MODULE``
    p = argparse.ArgumentParser(prog=f"python -m {spec.name}" if spec else None, description=description)
    p.add_argument("--config", required=True, help="the run's config as JSON")
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="override a config field, e.g. --set max_steps=50 or --set trainer.lr=1e-5")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None,
                   help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    args = p.parse_args(argv)
    overrides: dict = {}
    for kv in args.set:
        key, sep, value = kv.partition("=")
        if not sep or not key.strip():
            _fail(p.prog, f"--set {kv!r}: expected KEY=VALUE")
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):
            parsed = value
        set_dotted(overrides, key.strip(), parsed)
    try:
        return cls.load(read_json(args.config), overrides)
    except ConfigError as exc:
        _fail(p.prog, str(exc) if str(exc).startswith(("cannot read", "config ")) else f"bad config {args.config}: {exc}")
    raise AssertionError("unreachable")
