"""The task sources, one module each (``tasks.registry``): importing this package registers them
all, in the order they are built."""

from composer_dag.tasks.registry import SOURCES
from composer_dag.tasks.sources import humaneval, stdlib_bugfix, learnable, repo_mined, swebench  # noqa: F401, I001


def declared(field: str) -> dict:
    """Every registered source's value of the ``TaskSource`` field ``field``, by name, in
    registration order; sources that leave it unset (None or False) are not named. The configs
    that name sources take their defaults from it: ``list(declared("rl"))``."""
    return {s.name: v for s in SOURCES.values() if (v := getattr(s, field)) is not None and v is not False}
