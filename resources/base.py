"""Resource config errors as one clear line.

Pydantic reports a bad field as a multi-line block ("1 validation error for ...", the field,
the message, a help URL). ``ClearConfigResource`` turns that into a ``ResourceConfigError``
(a ``ValueError``) whose message is one line naming the resource, each bad field and what was
expected. Values of secret-looking fields are never shown.
"""

from typing import Any, ClassVar, Optional

import dagster as dg
from pydantic import ValidationError

from composer_dag.runtime.config import ConfigError, StageConfig, describe


class ResourceConfigError(ConfigError):
    """A resource was given config it cannot use; the message is one line."""


class ClearConfigResource(dg.ConfigurableResource):
    """A ``ConfigurableResource`` whose config errors are one line (``ResourceConfigError``).

    A resource generated from an engine stage config (``resources.dagster_config``) names it in
    ``_engine_model``; its values are then validated by the engine's rules too, at construction."""

    _engine_model: ClassVar[Optional[type[StageConfig]]] = None

    def __init__(self, **data: Any):
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ResourceConfigError(describe(type(self).__name__, exc)) from None
        if self._engine_model is not None:
            self.engine_config()

    def engine_config(self) -> Any:
        """The engine's config with this resource's values (``ResourceConfigError`` if bad)."""
        fields = {k: v for k, v in self.__dict__.items() if k in self._engine_model.model_fields}
        try:
            return self._engine_model.load(fields)
        except ConfigError as exc:
            raise ResourceConfigError(str(exc).replace(self._engine_model.__name__, type(self).__name__, 1)) from None
