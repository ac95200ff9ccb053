import os

from composer_dag.catalog import Catalog
from resources.base import ClearConfigResource
from resources.artifacts import ArtifactStorage, composer_home


class CatalogResource(ClearConfigResource):
    """The DuckDB catalog (an embedded file by default) over the artifact storage."""

    storage: ArtifactStorage
    path: str = ""

    def resolved_path(self) -> str:
        return self.path or os.path.join(composer_home(), "catalog.duckdb")

    def get(self) -> Catalog:
        return Catalog(self.resolved_path(), self.storage.get())
