"""composer-dag engine: plain Python (no Dagster import) so the same code runs in a Pipes payload."""

__version__ = "0.1.0"
