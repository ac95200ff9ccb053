"""The declared corpus sources, one ``code_corpus`` partition each.

Sources come from a YAML file (``sources.yaml`` at the project root by default, or
``$COMPOSER_SOURCES``)::

    sources:
      - name: python          # the running Python's stdlib, its tests and site-packages
        kind: python
        max_total_mb: 40      # remove for the whole tree
        languages: [python]   # optional allow-list; others are counted as language_excluded
      - name: myrepo
        kind: git
        uri: https://example.com/org/repo.git
        rev: v1.2.0
      - name: docs
        kind: local
        uri: /data/code

and, optionally, from a watched S3 prefix: every top-level prefix under it is a source named
``s3-<prefix>``. The new-source sensor turns each new name into a partition and a run.
"""


import os
import re
from typing import Optional

import yaml

from composer_dag.corpus import CorpusConfig, SourceSpec
from resources.config import ClearConfigResource
from resources.storage import ArtifactStorage

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


class SourceError(ValueError):
    pass


class SourceRegistry(ClearConfigResource):
    """Where the list of sources comes from, and the per-source ingestion limits."""

    storage: ArtifactStorage
    sources_file: str = ""
    watch_s3_prefix: Optional[str] = None
    max_file_mb: float = 1.0

    def resolved_file(self) -> str:
        return self.sources_file or os.environ.get("COMPOSER_SOURCES", "sources.yaml")

    def _declared(self) -> list[dict]:
        path = self.resolved_file()
        if not os.path.exists(path):
            return [{"name": "python", "kind": "python", "max_total_mb": 40}]
        try:
            with open(path) as f:
                doc = yaml.safe_load(f) or {}
        except yaml.YAMLError as exc:
            raise SourceError(f"{path} is not valid YAML: {exc}") from None
        entries = doc.get("sources") if isinstance(doc, dict) else None
        if not isinstance(entries, list):
            raise SourceError(f"{path} must hold a mapping with a 'sources' list")
        seen = set()
        for i, e in enumerate(entries):
            if not isinstance(e, dict) or "name" not in e or "kind" not in e:
                raise SourceError(f"{path}: source #{i + 1} needs at least 'name' and 'kind'")
            if not _NAME_RE.match(str(e["name"])):
                raise SourceError(f"{path}: source name {e['name']!r} must match {_NAME_RE.pattern}")
            if e["kind"] not in ("python", "local", "git", "s3"):
                raise SourceError(
                    f"{path}: source {e['name']!r} has unknown kind {e['kind']!r} (python, local, git, s3)"
                )
            if e["kind"] != "python" and not e.get("uri"):
                raise SourceError(f"{path}: source {e['name']!r} of kind {e['kind']} needs a 'uri'")
            if e["name"] in seen:
                raise SourceError(f"{path}: source name {e['name']!r} is declared twice")
            seen.add(e["name"])
        return entries

    def _watched(self) -> list[dict]:
        if not self.watch_s3_prefix:
            return []
        storage = self.storage.get()
        import fsspec

        fs = storage.fs if storage.protocol == "s3" else fsspec.filesystem("s3", **storage.storage_options)
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
                out.append({"name": name, "kind": "s3", "uri": f"s3://{e['name'].rstrip('/')}/"})
        return out

    def entries(self) -> list[dict]:
        return self._declared() + self._watched()

    def names(self) -> list[str]:
        return [e["name"] for e in self.entries()]

    def resolve(self, name: str) -> tuple[SourceSpec, CorpusConfig]:
        for e in self.entries():
            if e["name"] == name:
                opts = None
                if e["kind"] == "s3":
                    opts = dict(self.storage.storage_options())
                spec = SourceSpec(name=e["name"], kind=e["kind"], uri=e.get("uri", ""), rev=e.get("rev"), storage_options=opts)
                cfg = CorpusConfig(
                    max_file_bytes=int(float(e.get("max_file_mb", self.max_file_mb)) * 1_000_000),
                    max_total_bytes=int(float(e["max_total_mb"]) * 1_000_000) if e.get("max_total_mb") else None,
                    max_files=int(e["max_files"]) if e.get("max_files") else None,
                    languages=tuple(e["languages"]) if e.get("languages") else None,
                )
                return spec, cfg
        raise SourceError(f"no source named {name!r} in {self.resolved_file()} or the watched S3 prefix")
