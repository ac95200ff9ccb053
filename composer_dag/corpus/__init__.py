"""Corpus ingestion: turn a source (local directory, git repository, S3 prefix, or the running
Python's own source tree) into Parquet tables of code files, counting everything it skips."""

from composer_dag.corpus.ingest import (
    FILES_SCHEMA, SKIPPED_SCHEMA, CorpusConfig, CorpusResult, file_id, ingest,
)
from composer_dag.corpus.languages import LANGUAGES, detect_language
from composer_dag.corpus.sources import SourceSpec, default_sources, parse_source

__all__ = [
    "FILES_SCHEMA", "LANGUAGES", "SKIPPED_SCHEMA", "CorpusConfig", "CorpusResult", "SourceSpec",
    "default_sources", "detect_language", "file_id", "ingest", "parse_source",
]
