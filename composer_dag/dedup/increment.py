"""Incremental runs of a stage that must always hold every kept file: which sources a new run
deduplicates, and the earlier output's shards carried into the new one.

An incremental ``dedup`` (``pipeline.py``) writes only the new kept files and leaves an index of
every file kept so far (the earlier index's files and its own) in its work directory. A stage
output that downstream reads whole (the tokenizer, the token shards) must still hold them all,
so an increment is:

1. ``plan_increment``: the earlier output may be built on only if it was made in incremental
   mode, with the same settings (all but those in ``RUN_SETTINGS``, which change how a run goes,
   not what it keeps) and the same decontamination set, from sources that are all still
   ingested with the same content (their corpus manifests' digests), and its index is there.
   Then the new run deduplicates only the sources that are new since; otherwise (or when a
   source changed or disappeared) it is a full rebuild, and ``why`` says why.
2. ``carry_shards``: the earlier output's ``shard-*`` files copied into the new output (through
   the storage: a server-side copy on S3) as ``shard-cNNNNN.parquet``, before ``dedup`` writes
   its own ``shard-NNNNN.parquet`` and the manifest that covers both.
3. ``check_carried``: each carried copy, as the new manifest records it, is the file the earlier
   manifest recorded (size and SHA-256).

In incremental mode a file already kept always wins over a new one; a full rebuild keeps the
longest copy (the keep rule), so the two differ exactly where a new source holds a longer copy
of an already-kept file.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from dataclasses import dataclass, field
from typing import Mapping

from ..storage import ArtifactError, Storage
from .pipeline import DedupConfig, work_url
from .shards import open_parquet

RUN_SETTINGS = ("workers", "parallel_min_input_bytes", "batch_bytes", "native_min_bytes", "task_bytes",
                "memory_bytes", "shard_bytes", "incremental")
"""Settings that change how a run goes (speed, memory, shard sizes), not which files it keeps."""


@dataclass
class Increment:
    """What a run in incremental mode does: ``mode`` is ``full`` (every source, no ``previous``),
    ``increment`` (``new_sources`` deduplicated against ``previous``) or ``unchanged`` (nothing
    new: ``previous`` is still the whole answer); ``why`` says why, in one line."""

    mode: str
    why: str
    previous: str | None = None
    new_sources: list[str] = field(default_factory=list)


def plan_increment(storage: Storage, cfg: DedupConfig, sources: Mapping[str, str], contamination: str,
                   previous: Mapping | None) -> Increment:
    """How to bring the output up to date with ``sources`` (name -> corpus manifest digest).

    ``previous`` describes the latest output: ``{"url", "config", "sources": {name: digest},
    "contamination": digest}`` (None when there is none); ``contamination`` is the digest of this
    run's decontamination set."""
    if not cfg.incremental:
        return Increment("full", "incremental mode is off")
    if not previous or not previous.get("url"):
        return Increment("full", "no earlier output to build on")
    made = dict(previous.get("config") or {})
    if not made.get("incremental"):
        return Increment("full", "the latest output was not made in incremental mode")
    try:
        before = DedupConfig.load(made)
    except Exception:  # settings this version no longer reads
        return Increment("full", "the latest output's settings no longer load")
    diff = [k for k in DedupConfig.model_fields if k not in RUN_SETTINGS and getattr(before, k) != getattr(cfg, k)]
    if diff:
        return Increment("full", f"settings changed since the latest output: {', '.join(diff)}")
    if previous.get("contamination") != contamination:
        return Increment("full", "the decontamination set changed since the latest output")
    used = dict(previous.get("sources") or {})
    if not used:
        return Increment("full", "the latest output does not record its sources")
    gone = sorted(s for s in used if s not in sources)
    if gone:
        return Increment("full", f"source(s) {', '.join(gone)} no longer in the corpus")
    changed = sorted(s for s, d in used.items() if sources[s] != d)
    if changed:
        return Increment("full", f"source(s) {', '.join(changed)} re-ingested with other content")
    url = str(previous["url"])
    if not storage.exists(posixpath.join(work_url(url), "index.json")):
        return Increment("full", f"the latest output {url} has no index of kept files")
    if not storage.exists(posixpath.join(url, "manifest.json")):
        return Increment("full", f"the latest output {url} is incomplete (no manifest)")
    new = sorted(s for s in sources if s not in used)
    if not new:
        return Increment("unchanged", "no new source since the latest output", url)
    return Increment("increment", f"{len(new)} new source(s) deduplicated against {url}", url, new)


@dataclass
class Carried:
    """Shards copied from an earlier output: their new URLs, their files (recounted from the
    Parquet footers) and the earlier manifest's record of each (name -> size and sha256)."""

    urls: list[str]
    files: int
    expected: dict[str, dict]


def _shard_names(manifest: dict) -> list[str]:
    return sorted(n for n in manifest["files"] if "/" not in n and n.startswith("shard-") and n.endswith(".parquet"))


def carry_shards(storage: Storage, previous: str, out_url: str) -> Carried:
    """Copy every ``shard-*.parquet`` the earlier output's manifest lists into ``out_url`` as
    ``shard-c00000.parquet``, ... (those it carried itself first, so the oldest files come first)."""
    manifest = storage.read_manifest(previous)
    names = sorted(_shard_names(manifest), key=lambda n: (not n.startswith("shard-c"), n))
    urls, expected, files = [], {}, 0
    for k, name in enumerate(names):
        dst = posixpath.join(out_url.rstrip("/"), f"shard-c{k:05d}.parquet")
        storage.copy(posixpath.join(previous, name), dst)
        files += open_parquet(storage, dst).metadata.num_rows
        urls.append(dst)
        expected[posixpath.basename(dst)] = manifest["files"][name]
    return Carried(urls, files, expected)


def check_carried(storage: Storage, carried: Carried, out_url: str) -> None:
    """Raise ``ArtifactError`` unless the new output's manifest records each carried shard as
    the earlier manifest did (same size and SHA-256)."""
    files = storage.read_manifest(out_url)["files"]
    bad = [n for n, want in carried.expected.items()
           if (files.get(n) or {}).get("sha256") != want["sha256"] or files[n].get("size") != want["size"]]
    if bad:
        raise ArtifactError(f"carried shard(s) {', '.join(bad)} in {out_url} differ from the earlier output's")


def contamination_digest(contamination: list[tuple[str, str]] | None) -> str:
    """A digest of the extra decontamination texts (HumanEval itself is a setting)."""
    return hashlib.sha256(json.dumps([list(p) for p in contamination or []]).encode()).hexdigest()


class CarryMismatch(ArtifactError):
    """The earlier output's shards do not hold the files its materialization reports kept."""


@dataclass
class Refresh:
    """What ``refresh`` did: its plan, the sources it deduplicated, the files and bytes carried
    from the earlier output, every shard of the new output, and the new run's result (None when
    the plan is ``unchanged``: the earlier output is still the whole answer)."""

    plan: Increment
    sources: list[str]
    result: object = None
    files_carried: int = 0
    bytes_carried: int = 0
    shard_urls: list[str] = field(default_factory=list)


def refresh(storage: Storage, cfg: DedupConfig, inputs: Mapping[str, list[str]], digests: Mapping[str, str],
            out_url: str, contamination: list[tuple[str, str]] | None, previous: Mapping | None,
            log=lambda msg: None, progress=None, run_tasks=None) -> Refresh:
    """Bring the deduplicated output up to date with the ingested sources (``inputs``: name ->
    Parquet URLs, ``digests``: name -> corpus manifest digest): a full run, or in incremental mode
    the plan (``plan_increment``, against ``previous``: the latest output's ``{"url", "config",
    "sources", "contamination", "files_kept", "bytes_kept"}``), the earlier shards carried and
    checked, and only the new sources deduplicated. A failed run leaves no carried shard behind."""
    import contextlib

    from .pipeline import dedup

    plan = Increment("full", "incremental mode is off")
    if cfg.incremental:
        plan = plan_increment(storage, cfg, digests, contamination_digest(contamination), previous or None)
        log(f"incremental mode: {plan.mode} ({plan.why})")
        if plan.mode == "unchanged":
            return Refresh(plan, [])
    sources = plan.new_sources if plan.mode == "increment" else list(inputs)
    urls = [u for name in sources for u in inputs[name]]
    log(f"deduplicating {len(urls)} Parquet files from sources {sources}")
    carried = None
    if plan.mode == "increment":
        carried = carry_shards(storage, plan.previous, out_url)
        if carried.files != int((previous or {}).get("files_kept", -1)):
            raise CarryMismatch(f"the shards of {plan.previous} hold {carried.files} files, its materialization "
                                f"reports {(previous or {}).get('files_kept')} kept")
        log(f"carried {len(carried.urls)} shard(s), {carried.files} kept files, from {plan.previous}")
    try:
        result = dedup(urls, storage, out_url, cfg, contamination=contamination, progress=progress,
                       run_tasks=run_tasks, previous=plan.previous if carried else None)
        if carried:
            check_carried(storage, carried, out_url)
    except BaseException:
        for url in carried.urls if carried else []:  # no half output left behind
            with contextlib.suppress(OSError):
                storage.fs.rm_file(storage._path(url))
        raise
    return Refresh(plan, sources, result, carried.files if carried else 0,
                   int((previous or {}).get("bytes_kept", 0)) if carried else 0,
                   (carried.urls if carried else []) + result.shard_urls)
