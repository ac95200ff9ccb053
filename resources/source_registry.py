"""The declared corpus sources, one ``code_corpus`` partition each, and the declared
repositories, one ``repo_environments`` partition each.

The list is ``sources.yaml`` (or ``$COMPOSER_SOURCES``), read by the engine's
``composer_dag.corpus.sources.load_sources`` (the CLI reads the same file), plus, optionally,
a watched S3 prefix: every top-level prefix under it is a source named ``s3-<prefix>``. The
new-source sensor turns each new name into a partition and a run.
"""

import re
from typing import Optional

from composer_dag.corpus import CorpusConfig, SourceSpec
from composer_dag.corpus.sources import SourceEntry, load_sources, sources_file
from composer_dag.tasks.format import RepoSpec, load_repositories
from composer_dag.storage import Storage
from resources.artifacts import ArtifactStorage
from resources.base import ClearConfigResource


class SourceError(ValueError):
    pass


class SourceRegistry(ClearConfigResource):
    """Where the list of sources comes from (``sources_file``, default ``$COMPOSER_SOURCES`` or
    ``sources.yaml``) and an optional watched S3 prefix."""

    storage: ArtifactStorage
    sources_file: str = ""
    watch_s3_prefix: Optional[str] = None

    def resolved_file(self) -> str:
        return sources_file(self.sources_file or None)

    def _watched(self) -> list[SourceEntry]:
        if not self.watch_s3_prefix:
            return []
        fs = Storage(self.watch_s3_prefix, self.storage.storage_options()).fs
        base = self.watch_s3_prefix.removeprefix("s3://").rstrip("/")
        try:
            entries = fs.ls(base, detail=True, refresh=True)
        except FileNotFoundError:
            return []
        out = []
        for e in sorted(entries, key=lambda e: e["name"]):
            if e.get("type") == "directory":
                leaf = e["name"].rstrip("/").rsplit("/", 1)[-1]
                name = "s3-" + re.sub(r"[^A-Za-z0-9_.-]", "-", leaf)
                out.append(SourceEntry(name=name, kind="s3", uri=f"s3://{e['name'].rstrip('/')}/"))
        return out

    def entries(self) -> list[SourceEntry]:
        try:
            declared = load_sources(self.resolved_file())
        except ValueError as exc:
            raise SourceError(str(exc)) from None
        return declared + self._watched()

    def names(self) -> list[str]:
        return [e.name for e in self.entries()]

    def resolve(self, name: str) -> tuple[SourceSpec, CorpusConfig]:
        for e in self.entries():
            if e.name == name:
                return e.spec(dict(self.storage.storage_options())), e.corpus_config()
        raise SourceError(f"no source named {name!r} in {self.resolved_file()} or the watched S3 prefix")

    def repositories(self) -> list[RepoSpec]:
        """The repositories made into environments (the file's ``environments`` and its sources
        with ``environments: true``)."""
        try:
            return load_repositories(self.resolved_file())
        except ValueError as exc:
            raise SourceError(str(exc)) from None

    def repository(self, name: str) -> RepoSpec:
        for r in self.repositories():
            if r.name == name:
                return r
        raise SourceError(f"no repository named {name!r} among the environments of {self.resolved_file()}")
