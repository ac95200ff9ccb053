"""Dagster resources: where data lives and where work runs, hidden behind small interfaces.

- ``ArtifactStorage``: an fsspec root (local ``.composer/artifacts`` by default, ``s3://`` by
  config, credentials from ``dg.EnvVar`` and never shown).
- ``CatalogResource``: the DuckDB catalog, reading Parquet through the storage's filesystem.
- ``SourceRegistry``: the declared corpus sources (``sources.yaml``) and a watched S3 prefix.
"""

from resources.duckdb_catalog import CatalogResource
from resources.source_registry import SourceRegistry
from resources.artifacts import ArtifactStorage, composer_home, work_dir

__all__ = ["ArtifactStorage", "CatalogResource", "SourceRegistry", "composer_home", "work_dir"]
