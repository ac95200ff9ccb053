"""Artifact storage over fsspec: local files by default, S3 (or any fsspec URL) by config.

Contract (ARCHITECTURE.md): every artifact lives at ``<root>/<asset>/<run_id>/...``, every
directory artifact carries a ``manifest.json`` listing each file's size and sha256, and writes
are atomic: data goes to a temporary name first and is moved into place (local) or sent as a
single PUT (object stores), so a crashed step never leaves a half artifact behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import posixpath
import uuid
from dataclasses import dataclass
from typing import IO, Any, Iterator

import fsspec

MANIFEST = "manifest.json"


class ArtifactError(RuntimeError):
    """An artifact is missing, incomplete, or does not match its manifest."""


def _strip_protocol(url: str) -> tuple[str, str]:
    if "://" in url:
        proto, rest = url.split("://", 1)
        return proto, rest
    return "file", url


@dataclass
class Storage:
    """A storage root plus the fsspec filesystem that reaches it.

    ``root`` is a URL such as ``file:///abs/path/.composer`` or ``s3://bucket/prefix``; a bare
    path is taken as a local directory. ``storage_options`` go to fsspec (for S3:
    ``key``, ``secret``, ``endpoint_url``, ...). They are never logged or returned.
    """

    root: str
    storage_options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        proto, rest = _strip_protocol(self.root)
        if proto == "file":
            rest = os.path.abspath(os.path.expanduser(rest))
            self.root = "file://" + rest
        else:
            self.root = f"{proto}://{rest.rstrip('/')}"
        self.protocol = proto
        opts = dict(self.storage_options or {})
        if proto == "s3":
            endpoint = opts.pop("endpoint_url", None)
            if endpoint:
                opts.setdefault("client_kwargs", {})["endpoint_url"] = endpoint
            # Fresh connections per Storage keep tests against a local server independent.
            opts.setdefault("skip_instance_cache", True)
        self.fs: fsspec.AbstractFileSystem = fsspec.filesystem(proto, **opts)
        if proto == "file":
            self.fs.makedirs(rest, exist_ok=True)

    def __repr__(self) -> str:  # never show credentials
        return f"Storage(root={self.root!r})"

    # ---- paths -------------------------------------------------------------------------
    def url(self, *parts: str) -> str:
        """A URL under the root, parts joined with '/'."""
        clean = [p.strip("/") for p in parts if p]
        return posixpath.join(self.root, *clean) if clean else self.root

    def artifact_dir(self, asset: str, run_id: str) -> str:
        return self.url(asset, run_id)

    def _path(self, url: str) -> str:
        """The filesystem-internal path of a URL (what fsspec calls with the protocol off)."""
        proto, rest = _strip_protocol(url)
        if proto != self.protocol:
            raise ValueError(f"{url!r} is not on this storage ({self.protocol}://)")
        return rest

    def full_url(self, path: str) -> str:
        """Inverse of _path: the URL of a filesystem-internal path."""
        if "://" in path:
            return path
        if self.protocol == "file":
            return "file://" + path
        return f"{self.protocol}://{path}"

    def local_path(self, url: str) -> str | None:
        """The OS path for a local URL, None for remote storage."""
        return self._path(url) if self.protocol == "file" else None

    # ---- reading -----------------------------------------------------------------------
    def exists(self, url: str) -> bool:
        return self.fs.exists(self._path(url))

    def read_bytes(self, url: str) -> bytes:
        try:
            return self.fs.cat_file(self._path(url))
        except FileNotFoundError as exc:
            raise ArtifactError(f"missing artifact file: {url}") from exc

    def read_json(self, url: str) -> Any:
        return json.loads(self.read_bytes(url))

    def open(self, url: str, mode: str = "rb") -> IO:
        return self.fs.open(self._path(url), mode)

    def ls(self, url: str) -> list[str]:
        """URLs of the entries directly under a directory URL (sorted); [] if absent."""
        try:
            entries = self.fs.ls(self._path(url), detail=False)
        except FileNotFoundError:
            return []
        return sorted(self.full_url(e) for e in entries)

    def find(self, url: str) -> list[str]:
        """URLs of every file under a directory URL, recursively, sorted."""
        try:
            found = self.fs.find(self._path(url))
        except FileNotFoundError:
            return []
        return sorted(self.full_url(e) for e in found)

    # ---- atomic writing ----------------------------------------------------------------
    @contextlib.contextmanager
    def open_atomic(self, url: str) -> Iterator[IO[bytes]]:
        """Write a file so that readers see either nothing or the whole file.

        Local: write ``.<name>.tmp-<uuid>`` beside it, fsync, rename. Object stores: buffer in
        memory and send one PUT when the block ends; nothing is sent if the block raises.
        """
        path = self._path(url)
        parent = posixpath.dirname(path)
        if self.protocol == "file":
            os.makedirs(parent, exist_ok=True)
            tmp = posixpath.join(parent, f".{posixpath.basename(path)}.tmp-{uuid.uuid4().hex}")
            try:
                with open(tmp, "wb") as f:
                    yield f
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
        else:
            buf = io.BytesIO()
            yield buf
            self.fs.pipe_file(path, buf.getvalue())

    def write_bytes(self, url: str, data: bytes) -> None:
        with self.open_atomic(url) as f:
            f.write(data)

    def write_json(self, url: str, obj: Any) -> None:
        self.write_bytes(url, json.dumps(obj, indent=2, sort_keys=True).encode())

    def put_file(self, local_path: str, url: str) -> None:
        """Copy a local file to ``url`` atomically."""
        if self.protocol == "file":
            with open(local_path, "rb") as src, self.open_atomic(url) as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        else:
            self.fs.put_file(local_path, self._path(url))

    def put_dir(self, local_dir: str, url: str) -> None:
        """Upload every file under ``local_dir`` to ``url`` (same relative layout)."""
        for dirpath, _, files in os.walk(local_dir):
            for name in sorted(files):
                src = os.path.join(dirpath, name)
                rel = os.path.relpath(src, local_dir).replace(os.sep, "/")
                self.put_file(src, posixpath.join(url, rel))

    def get_dir(self, url: str, local_dir: str) -> None:
        """Download every file under ``url`` into ``local_dir``."""
        base = self._path(url).rstrip("/")
        for path in self.fs.find(base):
            rel = path[len(base) + 1 :]
            dst = os.path.join(local_dir, *rel.split("/"))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            self.fs.get_file(path, dst)

    def write_parquet(self, table, url: str, **kwargs: Any) -> None:
        """Write a pyarrow Table as Parquet (zstd by default), atomically."""
        import pyarrow.parquet as pq

        kwargs.setdefault("compression", "zstd")
        with self.open_atomic(url) as f:
            pq.write_table(table, f, **kwargs)

    def read_parquet(self, url: str, columns: list[str] | None = None):
        import pyarrow.parquet as pq

        try:
            with self.open(url) as f:
                return pq.read_table(f, columns=columns)
        except FileNotFoundError as exc:
            raise ArtifactError(f"missing Parquet file: {url}") from exc
        except Exception as exc:  # pyarrow raises ArrowInvalid and friends
            raise ArtifactError(f"unreadable Parquet file {url}: {exc}") from exc

    # ---- manifests ---------------------------------------------------------------------
    def write_manifest(self, dir_url: str, extra: dict[str, Any] | None = None) -> str:
        """Hash every file under ``dir_url`` into ``manifest.json``; return its sha256 digest.

        The manifest is written last, so its presence marks a complete artifact.
        """
        files = {}
        base = self._path(dir_url).rstrip("/")
        for path in sorted(self.fs.find(base)):
            rel = path[len(base) + 1 :]
            name = posixpath.basename(rel)
            if rel == MANIFEST or name.startswith(".") and ".tmp-" in name:
                continue
            h = hashlib.sha256()
            size = 0
            with self.fs.open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
                    size += len(chunk)
            files[rel] = {"size": size, "sha256": h.hexdigest()}
        manifest = {"files": files}
        if extra:
            manifest["meta"] = extra
        data = json.dumps(manifest, indent=2, sort_keys=True).encode()
        self.write_bytes(posixpath.join(dir_url, MANIFEST), data)
        return hashlib.sha256(data).hexdigest()

    def read_manifest(self, dir_url: str) -> dict[str, Any]:
        url = posixpath.join(dir_url, MANIFEST)
        if not self.exists(url):
            raise ArtifactError(f"{dir_url} has no {MANIFEST}: the artifact is incomplete")
        return self.read_json(url)

    def manifest_digest(self, dir_url: str) -> str:
        return hashlib.sha256(self.read_bytes(posixpath.join(dir_url, MANIFEST))).hexdigest()

    def verify_manifest(self, dir_url: str) -> dict[str, Any]:
        """Check every file listed in the manifest for size and sha256; raise on mismatch."""
        manifest = self.read_manifest(dir_url)
        for rel, meta in manifest["files"].items():
            data_url = posixpath.join(dir_url, rel)
            h = hashlib.sha256()
            size = 0
            try:
                with self.open(data_url) as f:
                    while chunk := f.read(1 << 20):
                        h.update(chunk)
                        size += len(chunk)
            except FileNotFoundError as exc:
                raise ArtifactError(f"{data_url} is listed in the manifest but missing") from exc
            if size != meta["size"] or h.hexdigest() != meta["sha256"]:
                raise ArtifactError(f"{data_url} does not match its manifest (corrupt or changed)")
        return manifest
