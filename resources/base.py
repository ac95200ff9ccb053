"""Resource config errors as one clear line.

Pydantic reports a bad field as a multi-line block ("1 validation error for ...", the field,
the message, a help URL). ``ClearConfigResource`` turns that into a ``ResourceConfigError``
(a ``ValueError``) whose message is one line naming the resource, each bad field and what was
expected. Values of secret-looking fields are never shown.
"""

from typing import Any

import dagster as dg
from pydantic import ValidationError

_SECRET_WORDS = ("secret", "key", "token", "password")


class ResourceConfigError(ValueError):
    """A resource was given config it cannot use; the message is one line."""


def describe(resource: str, exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ())) or "config"
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        part = f"{loc}: {msg}"
        shown = "input" in err and err.get("type") != "missing"
        if shown and not any(w in loc.lower() for w in _SECRET_WORDS) and "(got " not in msg:
            part += f" (got {repr(err['input'])[:80]})"
        parts.append(part)
    return " ".join(f"invalid {resource} config: {'; '.join(parts)}".split())


class ClearConfigResource(dg.ConfigurableResource):
    """A ``ConfigurableResource`` whose config errors are one line (``ResourceConfigError``)."""

    def __init__(self, **data: Any):
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ResourceConfigError(describe(type(self).__name__, exc)) from None
