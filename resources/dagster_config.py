"""Dagster config (run config of assets, config of resources) generated from the engine's
stage configs, so each setting has one name, one type and one default.

Dagster takes only ``dg.Config`` (or ``ConfigurableResource``) classes as config, and its
config system knows no tuples, literals or arbitrary models. ``dagster_config`` builds that
class from an engine ``StageConfig``: every field that has a default, tuples as lists, literals
as their base type (the engine validates the values), nested stage configs as nested
``dg.Config`` classes. Fields without a default (paths a run is given) are left to the asset.
``engine_config`` turns the run config back into the engine's config, validated, with those
fields filled in; a bad value fails the step at once with one line.
"""

from __future__ import annotations

import sys
import typing
from typing import Any, Literal, Optional, Union

import dagster as dg
import pydantic
from pydantic import BaseModel

from composer_dag.runtime.config import ConfigError, StageConfig


def _dagster_type(hint: Any) -> Any:
    """The annotation Dagster's config system accepts for an engine field's annotation."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(hint, type) and issubclass(hint, StageConfig):
        return dagster_config(hint)
    if origin is Literal:
        return type(args[0])
    if origin is tuple or origin is list:
        return list[_dagster_type(args[0])] if args else list
    if origin is dict:
        return dict[args[0], _dagster_type(args[1])] if args else dict
    if origin in (Union, getattr(__import__("types"), "UnionType", Union)):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2:
            return Optional[_dagster_type(rest[0])]
    return hint


_CACHE: dict[tuple[type, type], type] = {}


def dagster_config(model: type[StageConfig], base: type[BaseModel] = dg.Config,
                   name: str | None = None, module: str | None = None) -> type:
    """A ``base`` subclass (``dg.Config`` by default) with every defaulted field of ``model``."""
    key = (model, base)
    if key in _CACHE and name is None:
        return _CACHE[key]
    fields: dict[str, Any] = {}
    for fname, info in model.model_fields.items():
        if info.is_required():
            continue
        hint = _dagster_type(info.annotation)
        default = info.get_default(call_default_factory=True)
        if isinstance(default, StageConfig):
            default = hint(**_plain(default.model_dump()))
        elif isinstance(default, list) and default and all(isinstance(d, StageConfig) for d in default):
            default = [_plain(d.model_dump()) for d in default]  # Dagster's config takes plain values
        elif isinstance(default, tuple):
            default = list(default)
        fields[fname] = (hint, pydantic.Field(default=default, description=info.description))
    cls = pydantic.create_model(
        name or (model.__name__.removesuffix("Config") + ("Settings" if base is not dg.Config else "Params")),
        __base__=base, __module__=module or __name__, __doc__=model.__doc__, **fields)
    if "_engine_model" in getattr(cls, "__private_attributes__", {}) or hasattr(cls, "_engine_model"):
        cls._engine_model = model  # a resource validates its values by the engine's rules
    if name is None:
        _CACHE[key] = cls
    return cls


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def engine_config(model: type[StageConfig], params: BaseModel | dict | None = None, **given: Any) -> StageConfig:
    """The engine's config from the run config ``params`` plus the fields the asset fills in;
    a bad value is a ``dg.Failure`` of one line that no retry repeats."""
    data = params.model_dump(warnings=False) if isinstance(params, BaseModel) else dict(params or {})
    try:
        return model.load({**data, **given})
    except ConfigError as exc:
        raise dg.Failure(description=str(exc), allow_retries=False) from None


def register(module_name: str, *classes: type) -> None:
    """Bind generated classes to a module's namespace (Dagster's UI and pickling look them up
    by module and name)."""
    mod = sys.modules[module_name]
    for cls in classes:
        cls.__module__ = module_name
        setattr(mod, cls.__name__, cls)
