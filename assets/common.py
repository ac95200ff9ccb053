"""Small helpers shared by the asset modules: artifact lookup, metadata formatting, provenance."""


import ast
import functools
import hashlib
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any, Callable, Mapping

import dagster as dg
import pyarrow as pa

RETRY = dg.RetryPolicy(max_retries=2, delay=2, backoff=dg.Backoff.EXPONENTIAL)
"""Retries for transient storage and network errors (a clear failure after the third try). Errors a
retry cannot fix (a missing input, a bad setting) raise ``dg.Failure(allow_retries=False)`` and fail at once."""

GPU_STAGE = {"pool": "gpu", "retry_policy": dg.RetryPolicy(max_retries=1, delay=5)}
"""What a stage run as a job on the cluster resource takes: the "gpu" pool (one such job at a time
unless the instance's pool limit says otherwise) and one retry, which resumes the job."""


def blocking_checks(asset: str, checks: Mapping[str, str]) -> list[dg.AssetCheckSpec]:
    """Blocking checks of ``asset``, by name and description."""
    return [dg.AssetCheckSpec(name, asset=asset, blocking=True, description=d) for name, d in checks.items()]


def latest_metadata(
    instance: dg.DagsterInstance, key: str | dg.AssetKey, partition: str | None = None
) -> Mapping[str, Any] | None:
    """Metadata of the newest materialization of an asset (one partition of it, if given)."""
    asset_key = dg.AssetKey.from_coercible(key)
    flt = dg.AssetRecordsFilter(asset_key=asset_key, asset_partitions=[partition] if partition else None)
    records = instance.fetch_materializations(flt, limit=1).records
    if not records:
        return None
    mat = records[0].asset_materialization
    return {k: v.value for k, v in (mat.metadata or {}).items()} if mat else None


def latest_uri(instance: dg.DagsterInstance, key: str, partition: str | None = None) -> str:
    meta = latest_metadata(instance, key, partition)
    if meta and partition and partition in (meta.get("partition_uris") or {}):
        return str(meta["partition_uris"][partition])  # one run materialized several partitions
    if not meta or "dagster/uri" not in meta:
        where = f" partition {partition!r}" if partition else ""
        raise dg.Failure(description=f"{key}{where} has no materialization yet: materialize it first", allow_retries=False)
    return str(meta["dagster/uri"])


def counts_table(counts: Mapping[str, int], key_name: str, value_name: str = "files") -> dg.MetadataValue:
    rows = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    lines = [f"| {key_name} | {value_name} |", "|---|---:|"] + [f"| {k} | {v:,} |" for k, v in rows]
    return dg.MetadataValue.md("\n".join(lines) if rows else f"_no {key_name}_")


def md_table(headers: list[str], rows: list[list[Any]], empty: str = "_none_") -> dg.MetadataValue:
    """A Markdown table (numbers right-aligned); ``None`` shows as an en dash."""
    def cell(x):
        if x is None:
            return "\u2013"
        if isinstance(x, float):
            return f"{x:.4g}"
        if isinstance(x, int) and not isinstance(x, bool):
            return f"{x:,}"
        return str(x).replace("|", "\\|")

    if not rows:
        return dg.MetadataValue.md(empty)
    num = [all(isinstance(r[i], (int, float)) and not isinstance(r[i], bool) or r[i] is None for r in rows)
           for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" if n else "---" for n in num) + "|"]
    lines += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
    return dg.MetadataValue.md("\n".join(lines))


def column_schema(schema: pa.Schema) -> dg.TableSchema:
    return dg.TableSchema(columns=[dg.TableColumn(name=f.name, type=str(f.type)) for f in schema])


def progress_logger(context: dg.OpExecutionContext | dg.AssetExecutionContext):
    return lambda msg: context.log.info(msg)


class local_copy:
    """A verified local directory for an artifact: the path itself on local storage, a
    temporary download otherwise (each file checked against the manifest once it is here).
    Use as ``with local_copy(storage, url) as path: ...``."""

    def __init__(self, storage, url: str, verify: bool = True):
        self.storage, self.url, self.verify = storage, url, verify
        self._tmp = None

    def __enter__(self) -> str:
        local = self.storage.local_path(self.url)
        if local is not None:
            if self.verify:
                self.storage.verify_manifest(self.url)
            return local
        import tempfile

        self._tmp = tempfile.TemporaryDirectory(prefix="composer-")
        if self.verify:
            self.storage.fetch_dir(self.url, self._tmp.name)
        else:
            self.storage.get_dir(self.url, self._tmp.name)
        return self._tmp.name

    def __exit__(self, *exc) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()


def run_stage(context, storage, cluster, stage: str, model, params, inputs: list[str],
              fields: Callable[[dict[str, str], str], dict], entry: str,
              outputs: dict[str, list[list[str]]], launcher: str | None = None, copy_inputs: bool = True,
              state_inputs: list[str] | None = None, state_exclude: tuple[str, ...] = (),
              given: dict[str, tuple[str, str]] | None = None):
    """Run one stage's engine entry point as a job on the cluster resource: config -> launch ->
    verified result. The job shares no disk with this process.

    ``fields`` maps the input directories and the job's working directory (paths inside the
    job's scratch, ``{scratch}/inputs/<asset key>`` and ``{scratch}``) to the engine config's path
    fields; the config is validated here (one-line failure). The job pulls each input asset's
    newest artifact and checks it against the manifest digest recorded here; its resumable state
    lives at ``<root>/work/<stage>/<key>`` (key: the inputs' digests and the settings), so a retry
    or a re-run with the same inputs resumes from the last sealed checkpoint, on any node.
    ``state_inputs`` (default: all of ``inputs``) and ``state_exclude`` (settings left out) narrow
    that key for a stage that tells its own inputs apart (evaluation keeps one result per
    candidate checkpoint and redoes only those whose digest changed). ``given`` names inputs that
    are not an asset's newest materialization: ``{name: (url, manifest digest)}`` (a cycle's
    served checkpoint, its trajectories).
    ``outputs`` maps each output asset key to the files to publish (``[dest, src]``, ``src``
    relative to the stage's ``out_dir``, see ``composer_dag.cluster.job``); each goes to
    ``<root>/<asset key>/<run id>``.
    Returns the engine config and ``{"summary": the stage's result, "outputs": {key: {url, digest}}}``."""
    from resources.dagster_config import engine_config

    from composer_dag.cluster.job import SCRATCH

    given = given or {}
    metas = {key: {"manifest_digest": given[key][1], "dagster/uri": given[key][0]} if key in given
             else latest_metadata(context.instance, key) or {} for key in inputs}
    digests = [str(metas[key].get("manifest_digest")) for key in (inputs if state_inputs is None else state_inputs)]
    settings = {k: v for k, v in params.model_dump().items() if k not in state_exclude}
    state_key = hashlib.sha256("\0".join([stage, *digests, json.dumps(settings, sort_keys=True)]).encode()).hexdigest()[:16]
    dirs = {key: f"{SCRATCH}/inputs/{key}" for key in inputs}
    cfg = engine_config(model, params, **fields(dirs, SCRATCH))
    job = {
        "stage": stage,
        "entry": entry,
        "config": cfg.to_dict(),
        "inputs": {key: {"url": given[key][0] if key in given else latest_uri(context.instance, key),
                         "digest": metas[key].get("manifest_digest")}
                   for key in inputs} if copy_inputs else {},
        "state_url": storage.url("work", stage, state_key),
        "outputs": {key: {"url": storage.url(key, context.run.run_id), "files": files} for key, files in outputs.items()},
    }
    if launcher:
        job["launcher"] = launcher
    context.log.info(f"{stage}: resumable state at {job['state_url']}")
    return cfg, cluster.run_job(context, storage, job, name=f"composer-{stage}")


def plot_md(series, xlabel: str, ylabel: str, title: str) -> dg.MetadataValue:
    """A line plot as a Markdown image (PNG inline), which the Dagster UI renders in metadata.

    ``series``: (label, xs, ys) triples; empty series are left out.
    """
    import base64
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    for label, xs, ys in series:
        if len(xs):
            ax.plot(xs, ys, label=label, marker="o" if len(xs) < 12 else None, markersize=3)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return dg.MetadataValue.md(f"![{title}](data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()})")


# ---------------------------------------------------------------- provenance

REPO_ROOT = Path(__file__).resolve().parent.parent
_LOCAL_PACKAGES = ("composer_dag", "assets", "resources")
_MODULE_NAME = re.compile(r"^(composer_dag|assets|resources)(\.[A-Za-z_]\w*)+$")


def _module_file(name: str) -> Path | None:
    base = REPO_ROOT.joinpath(*name.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


@functools.lru_cache(maxsize=None)
def _imported(path: Path) -> frozenset[str]:
    """Project modules ``path`` imports (anywhere in it, lazily too) or names as a dotted string,
    the way a stage's entry point is named for the job that runs it."""
    pkg = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if path.name == "__init__.py":
        pkg += ".__init__"
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = pkg.split(".")[:-node.level]
                base = ".".join(parent + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _MODULE_NAME.match(node.value):
            names.add(node.value)
    out = set()
    for n in names:
        if n.split(".")[0] in _LOCAL_PACKAGES:   # each enclosing package runs its __init__ too
            parts = n.split(".")
            out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return frozenset(out)


@functools.lru_cache(maxsize=None)
def code_version(module_file: str) -> str:
    """A digest of the source of ``module_file`` and of every project module it reaches through
    its imports (or runs as a job's entry point): it changes when code the asset runs changes, so
    the UI marks the asset and everything downstream of it stale."""
    seen: dict[str, Path] = {}
    todo = [Path(module_file).resolve()]
    while todo:
        path = todo.pop()
        key = str(path.relative_to(REPO_ROOT))
        if key in seen:
            continue
        seen[key] = path
        for name in _imported(path):
            found = _module_file(name)
            if found is not None and str(found.relative_to(REPO_ROOT)) not in seen:
                todo.append(found)
    h = hashlib.sha256()
    for key in sorted(seen):
        h.update(key.encode() + b"\0" + seen[key].read_bytes() + b"\0")
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def code_commit() -> str:
    """The checkout's commit, ``+dirty`` when tracked files differ from it; ``$COMPOSER_CODE_COMMIT``
    where the code is not a git checkout (an installed image); ``unknown`` otherwise."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True,
                               timeout=30, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("COMPOSER_CODE_COMMIT", "unknown")
    return commit + ("+dirty" if dirty else "")


def _seeds(config: Any, path: str = "") -> dict[str, int]:
    if isinstance(config, Mapping):
        out = {}
        for k, v in config.items():
            where = f"{path}.{k}" if path else str(k)
            if "seed" in str(k).lower() and isinstance(v, int) and not isinstance(v, bool):
                out[where] = v
            out.update(_seeds(v, where))
        return out
    return {}


def record_provenance(context: dg.AssetExecutionContext) -> dict:
    """Write on each of this step's materializations the code commit, the asset's code version,
    the digest of its run config and every seed in that config: which code and settings made it.
    Returns the same values."""
    op_config = context.op_execution_context.op_config or {}
    config = op_config if isinstance(op_config, Mapping) else {}
    meta = {
        "code_commit": code_commit(),
        "config_digest": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16],
        "seeds": dg.MetadataValue.json(_seeds(config)),
    }
    adef = context.assets_def
    for key in context.selected_asset_keys:
        version = adef.specs_by_key[key].code_version
        context.add_output_metadata({**meta, "code_version": version or ""},
                                    output_name=adef.get_output_name_for_asset_key(key))
    return meta
