"""Artifact storage over fsspec: local files by default, S3 (or any fsspec URL) by config.

Contract (ARCHITECTURE.md): every artifact lives at ``<root>/<asset>/<run_id>/...``, every
directory artifact carries a ``manifest.json`` listing each file's size and sha256, and writes
are atomic: data goes to a temporary name first and is moved into place (local) or sent as a
single PUT (object stores), so a crashed step never leaves a half artifact behind.

Failures: transient S3 faults (5xx, SlowDown, dropped connections, timeouts) are retried by the
client as configured in ``S3_CLIENT_CONFIG``; what still fails is raised as one
``StorageError`` line naming the operation, the URL and what the storage said (HTTP status and
S3 error code, or the OS error such as ENOSPC / EROFS), never the credentials.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import posixpath
import uuid
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import IO, Any, Iterator

import fsspec

MANIFEST = "manifest.json"

# The one place S3 retries and timeouts are set (keys of botocore.config.Config; a
# ``config_kwargs`` entry in storage_options overrides them key by key). botocore's "standard"
# mode retries 500/502/503/504, throttling (SlowDown), connection errors and timeouts with
# jittered exponential backoff (the n-th retry waits rand() * min(2**(n-1), 20) s), at most
# ``total_max_attempts`` tries in all (a lasting fault gives up after about 7 s on average);
# 4xx answers such as 403 AccessDenied fail at once.
S3_CLIENT_CONFIG: dict[str, Any] = {
    "retries": {"mode": "standard", "total_max_attempts": 5},
    "connect_timeout": 10,  # seconds to open a connection
    "read_timeout": 60,  # seconds without a byte from the server before the try counts as failed
}
# s3fs runs its own retry loop around each botocore call; it is what retries a body cut off
# mid-download, which botocore does not see. Three rounds; s3fs repeats only SlowDown and
# connection-level failures, so a lasting 500 or 403 costs no more than botocore's attempts.
S3FS_RETRIES = 3
# Files moved or hashed at once on an object store (one request each): an artifact of many small
# files (a task set, a checkpoint with its tokenizer) is bound by round trips, not bandwidth.
# Local storage works file by file.
TRANSFER_WORKERS = 16

# OS errors that mean the storage itself refused the write, named in the error message.
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG, errno.EACCES, errno.EPERM}


class ArtifactError(RuntimeError):
    """An artifact is missing, incomplete, or does not match its manifest."""


def _sync_filesystem(path: str) -> None:
    """Flush the file system holding ``path`` to disk (Linux ``syncfs``; else ``os.sync``)."""
    import ctypes

    fd = os.open(path, os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if getattr(libc, "syncfs", None) is None or libc.syncfs(fd) != 0:
            os.sync()
    except OSError:
        os.sync()
    finally:
        os.close(fd)


class StorageError(OSError):
    """A storage operation failed for good (after the client's retries).

    The message is one line: operation, URL, and what the storage said. ``errno`` is the OS
    error number when there is one (ENOSPC, EROFS, ...); the original exception stays
    available as ``__context__``.
    """


def _remote_error_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = []
    with contextlib.suppress(ImportError):
        from botocore.exceptions import BotoCoreError, ClientError

        types += [BotoCoreError, ClientError]
    with contextlib.suppress(ImportError):
        from aiohttp import ClientError as AioClientError

        types.append(AioClientError)
    return tuple(types)


def _is_storage_failure(exc: BaseException) -> bool:
    if isinstance(exc, (ArtifactError, StorageError, FileNotFoundError)):
        return False
    if isinstance(exc, OSError):
        return True
    return isinstance(exc, _remote_error_types())


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _reason(exc: BaseException) -> tuple[str, int | None]:
    """What the storage said, in a few words, and the OS errno if there is one."""
    for e in _chain(exc):
        response = getattr(e, "response", None)
        if isinstance(response, dict) and "Error" in response:
            err, meta = response.get("Error") or {}, response.get("ResponseMetadata") or {}
            status, tries = meta.get("HTTPStatusCode"), meta.get("RetryAttempts") or 0
            where = f"HTTP {status}" if status else "no HTTP status"
            if tries:
                where += ", retried"
            return f"{err.get('Code') or type(e).__name__}: {err.get('Message') or ''} ({where})", None
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in _DISK_ERRNOS:
            return f"{e.strerror or os.strerror(e.errno)} ({errno.errorcode[e.errno]})", e.errno
    return f"{type(exc).__name__}: {exc}", getattr(exc, "errno", None)


def _strip_protocol(url: str) -> tuple[str, str]:
    if "://" in url:
        proto, rest = url.split("://", 1)
        return proto, rest
    return "file", url


def filesystem(protocol: str, storage_options: dict[str, Any] | None = None) -> "fsspec.AbstractFileSystem":
    """The fsspec filesystem for ``protocol``: the one place an S3 client is configured
    (``endpoint_url`` as a client argument, bounded retries and timeouts, fresh connections)."""
    opts = dict(storage_options or {})
    if protocol == "s3":
        endpoint = opts.pop("endpoint_url", None)
        if endpoint:
            opts["client_kwargs"] = {**opts.get("client_kwargs", {}), "endpoint_url": endpoint}
        opts["config_kwargs"] = {**S3_CLIENT_CONFIG, **opts.get("config_kwargs", {})}
        # Fresh connections per filesystem keep tests against a local server independent.
        opts.setdefault("skip_instance_cache", True)
    fs = fsspec.filesystem(protocol, **opts)
    if protocol == "s3":
        fs.retries = S3FS_RETRIES
    return fs


def storage_options_from_env(url: str = "s3://") -> dict[str, Any]:
    """S3 endpoint and keys from the environment (``COMPOSER_S3_ENDPOINT_URL`` or
    ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``); empty for a
    local ``url``."""
    if not url.startswith("s3://"):
        return {}
    opts: dict[str, Any] = {}
    endpoint = os.environ.get("COMPOSER_S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        opts["endpoint_url"] = endpoint
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        opts["key"] = os.environ["AWS_ACCESS_KEY_ID"]
    if os.environ.get("AWS_SECRET_ACCESS_KEY"):
        opts["secret"] = os.environ["AWS_SECRET_ACCESS_KEY"]
    return opts


def is_temporary(name: str) -> bool:
    """Whether a file name is an atomic write's temporary file (``.<name>.tmp-<id>``)."""
    return name.startswith(".") and ".tmp-" in name


def sweep_temporaries(directory) -> int:
    """Remove the temporary files that writes killed midway (SIGKILL, power loss) left directly
    in the local ``directory``; a finished write never leaves one. Call it only where no other
    process is writing. Returns how many were removed."""
    removed = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            if entry.is_file(follow_symlinks=False) and is_temporary(entry.name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed += 1
    return removed


def _digest(f: IO[bytes]) -> tuple[int, str]:
    """Size and sha256 of what an open file has left to read."""
    h, size = hashlib.sha256(), 0
    while chunk := f.read(1 << 20):
        h.update(chunk)
        size += len(chunk)
    return size, h.hexdigest()


def open_storage(url: str) -> "Storage":
    """A Storage rooted at ``url``, with S3 settings from the environment when it is ``s3://``."""
    return Storage(url, storage_options_from_env(url) or None)


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
        # Strings never to show in an error message.
        self._secrets = tuple(
            v
            for v in (opts.get("key"), opts.get("secret"), opts.get("token"))
            + tuple(os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"))
            if isinstance(v, str) and len(v) >= 4
        )
        with self._guard("open storage", self.root):
            self.fs: fsspec.AbstractFileSystem = filesystem(proto, opts)
            if proto == "file":
                self.fs.makedirs(rest, exist_ok=True)

    def __repr__(self) -> str:  # never show credentials
        return f"Storage(root={self.root!r})"

    # ---- errors ------------------------------------------------------------------------
    def error(self, op: str, url: str, exc: BaseException) -> StorageError:
        """A one-line StorageError for a failed operation on ``url``, credentials removed."""
        reason, num = _reason(exc)
        msg = f"{op} {url} failed: {reason}"
        for secret in self._secrets:
            msg = msg.replace(secret, "***")
        err = StorageError(" ".join(msg.split()))
        err.errno = num
        return err

    @contextlib.contextmanager
    def _guard(self, op: str, url: str) -> Iterator[None]:
        """Turn a storage failure inside the block into one StorageError line."""
        try:
            yield
        except Exception as exc:
            if not _is_storage_failure(exc):
                raise
            raise self.error(op, url, exc) from None

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
        with self._guard("check", url):
            return self.fs.exists(self._path(url))

    def find_info(self, url: str) -> dict[str, dict[str, Any]]:
        """Every file under a directory URL, recursively, with what the store says of it (``size``
        and, where it has them, ``mtime`` / ``ETag``): one listing, not a request per file."""
        try:
            with self._guard("list", url):
                found = self.fs.find(self._path(url), detail=True)
        except FileNotFoundError:
            return {}
        return {self.full_url(p): dict(v) for p, v in sorted(found.items())}

    def read_bytes(self, url: str) -> bytes:
        try:
            with self._guard("read", url):
                return self.fs.cat_file(self._path(url))
        except FileNotFoundError as exc:
            raise ArtifactError(f"missing artifact file: {url}") from exc

    def read_json(self, url: str) -> Any:
        return json.loads(self.read_bytes(url))

    def open(self, url: str, mode: str = "rb") -> IO:
        with self._guard("open", url):
            return self.fs.open(self._path(url), mode)

    def ls(self, url: str) -> list[str]:
        """URLs of the entries directly under a directory URL (sorted); [] if absent."""
        try:
            with self._guard("list", url):
                entries = self.fs.ls(self._path(url), detail=False)
        except FileNotFoundError:
            return []
        return sorted(self.full_url(e) for e in entries)

    def find(self, url: str) -> list[str]:
        """URLs of every file under a directory URL, recursively, sorted."""
        try:
            with self._guard("list", url):
                found = self.fs.find(self._path(url))
        except FileNotFoundError:
            return []
        return sorted(self.full_url(e) for e in found)

    # ---- atomic writing ----------------------------------------------------------------
    @contextlib.contextmanager
    def open_atomic(self, url: str, durable: bool = True) -> Iterator[IO[bytes]]:
        """Write a file so that readers see either nothing or the whole file.

        Local: write ``.<name>.tmp-<uuid>`` beside it, fsync (``durable``: a caller writing many
        files syncs them together instead, ``put_dir``), rename; the temporary file is
        removed on any failure. Object stores: buffer in memory and send one PUT when the
        block ends; nothing is sent if the block raises. A file already at ``url`` stays as it
        was unless the write succeeds. The storage refusing the write (disk full, read-only,
        S3 error after retries) raises StorageError.
        """
        path = self._path(url)
        parent = posixpath.dirname(path)
        if self.protocol == "file":
            with self._guard("write", url):
                os.makedirs(parent, exist_ok=True)
            tmp = posixpath.join(parent, f".{posixpath.basename(path)}.tmp-{uuid.uuid4().hex}")
            try:
                with open(tmp, "wb") as f:
                    yield f
                    f.flush()
                    if durable:
                        os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException as exc:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                if isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS:
                    raise self.error("write", url, exc) from None
                raise
        else:
            buf = io.BytesIO()
            yield buf
            with self._guard("write", url):
                self.fs.pipe_file(path, buf.getvalue())

    def write_bytes(self, url: str, data: bytes) -> None:
        with self.open_atomic(url) as f:
            f.write(data)

    def write_json(self, url: str, obj: Any) -> None:
        self.write_bytes(url, json.dumps(obj, indent=2, sort_keys=True).encode())

    def put_file(self, local_path: str, url: str, durable: bool = True) -> None:
        """Copy a local file to ``url`` atomically (``durable``: see ``open_atomic``)."""
        if self.protocol == "file":
            with open(local_path, "rb") as src, self.open_atomic(url, durable) as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        else:
            with self._guard("upload", url):
                self.fs.put_file(local_path, self._path(url))

    def _each(self, fn, items: list) -> list:
        """``[fn(x) for x in items]``, ``TRANSFER_WORKERS`` at a time on an object store. The first
        error is raised once the calls already running have ended; calls not yet started are
        dropped."""
        if self.protocol == "file" or len(items) < 2:
            return [fn(x) for x in items]
        with ThreadPoolExecutor(min(TRANSFER_WORKERS, len(items))) as pool:
            futures = [pool.submit(fn, x) for x in items]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f for f in futures if f in done and f.exception() is not None), None)
            if failed is not None:
                for f in futures:
                    f.cancel()
                raise failed.exception()
            return [f.result() for f in futures]

    def put_dir(self, local_dir: str, url: str) -> dict[str, dict[str, Any]]:
        """Upload every file under ``local_dir`` to ``url`` (same relative layout); return each
        sent file's ``{"size", "sha256"}`` by relative path, hashed here as it was read.

        A manifest already at ``url`` is removed first, so the directory reads as incomplete
        while it is rewritten. If an upload fails, the files this call sent are removed again
        (best effort) before the error is raised. Local files are synced to disk together once
        all are written (one ``syncfs``, where an fsync each was most of the time of a tree of
        many small files: a repository environment's 12,700), before any manifest seals them.
        """
        manifest = posixpath.join(url, MANIFEST)
        if self.exists(manifest):
            with self._guard("delete", manifest):
                self.fs.rm_file(self._path(manifest))
        rels = sorted(os.path.relpath(os.path.join(d, n), local_dir).replace(os.sep, "/")
                      for d, _, files in os.walk(local_dir) for n in files)
        sent: list[str] = []

        def send(rel: str) -> dict[str, Any]:
            src = os.path.join(local_dir, *rel.split("/"))
            with open(src, "rb") as f:
                size, digest = _digest(f)
            self.put_file(src, posixpath.join(url, rel), durable=False)
            sent.append(posixpath.join(url, rel))
            return {"size": size, "sha256": digest}

        try:
            out = dict(zip(rels, self._each(send, rels)))
            if self.protocol == "file" and rels:
                with self._guard("write", url):
                    _sync_filesystem(self._path(url))
            return out
        except BaseException:
            self._discard(sent, url)
            raise

    def publish_dir(self, local_dir: str, url: str, extra: dict[str, Any] | None = None) -> str:
        """Upload a finished local directory to ``url`` and seal it with a manifest; return the
        manifest's digest. The sent files are hashed here, so sealing reads back only what
        was already at ``url``."""
        return self.write_manifest(url, extra, known=self.put_dir(local_dir, url))

    def copy(self, src_url: str, dst_url: str) -> None:
        """Copy one file within this storage, atomically: streamed through a temporary name
        (local), a server-side copy (object stores: the bytes never come here)."""
        try:
            if self.protocol == "file":
                with self.open(src_url) as src, self.open_atomic(dst_url) as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
            else:
                with self._guard("copy", src_url):
                    self.fs.copy(self._path(src_url), self._path(dst_url))
        except FileNotFoundError as exc:
            raise ArtifactError(f"missing artifact file: {src_url}") from exc

    def remove(self, url: str) -> None:
        """Remove one file; a file already gone is no error."""
        with self._guard("remove", url), contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(url))

    def _discard(self, urls: list[str], under: str) -> None:
        """Best-effort removal of files written by a failed step (and, locally, of the
        directories under ``under`` that this leaves empty)."""
        for u in urls:
            with contextlib.suppress(Exception):
                self.fs.rm_file(self._path(u))
        top = self.local_path(under)
        if top is not None and os.path.isdir(top):
            for dirpath, _, _ in sorted(os.walk(top), key=lambda w: -len(w[0])):
                with contextlib.suppress(OSError):
                    os.rmdir(dirpath)

    def get_file(self, url: str, local_path: str) -> None:
        """Download one file to ``local_path``."""
        with self._guard("download", url):
            self.fs.get_file(self._path(url), local_path)

    def get_dir(self, url: str, local_dir: str) -> None:
        """Download every file under ``url`` into ``local_dir``."""
        base = self._path(url).rstrip("/")
        with self._guard("download", url):
            found = self.fs.find(base)

        def fetch(path: str) -> None:
            dst = os.path.join(local_dir, *path[len(base) + 1:].split("/"))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with self._guard("download", self.full_url(path)):
                self.fs.get_file(path, dst)

        self._each(fetch, found)

    def fetch_dir(self, url: str, local_dir: str) -> str:
        """Download a sealed artifact into ``local_dir`` and verify the copy there, every file
        against the manifest (each remote file is read once); return the manifest's digest."""
        self.get_dir(url, local_dir)
        copy = Storage(local_dir)
        copy.verify_manifest(copy.root)
        return copy.manifest_digest(copy.root)

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
        except StorageError:
            raise
        except Exception as exc:  # pyarrow raises ArrowInvalid and friends
            remote = any(isinstance(e, _remote_error_types()) for e in _chain(exc))
            if remote or isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS:
                raise self.error("read", url, exc) from None
            raise ArtifactError(f"unreadable Parquet file {url}: {exc}") from exc

    # ---- manifests ---------------------------------------------------------------------
    def _hash(self, url: str) -> tuple[int, str]:
        with self._guard("read", url), self.fs.open(self._path(url), "rb") as f:
            return _digest(f)

    def write_manifest(self, dir_url: str, extra: dict[str, Any] | None = None,
                       known: dict[str, dict[str, Any]] | None = None) -> str:
        """Hash every file under ``dir_url`` into ``manifest.json``; return its sha256 digest.
        ``known``: ``{"size", "sha256"}`` by relative path of files this process just wrote
        (``put_dir``'s answer); one whose listed size matches is not read back.

        The manifest is written last, so its presence marks a complete artifact.
        """
        base = self._path(dir_url).rstrip("/")
        with self._guard("list", dir_url):
            found = self.fs.find(base, detail=True)
        known = known or {}
        entries = []
        for path, info in sorted(found.items()):
            rel = path[len(base) + 1 :]
            if rel == MANIFEST or is_temporary(posixpath.basename(rel)):
                continue
            entries.append((rel, path, info.get("size")))

        def entry(e) -> dict[str, Any]:
            rel, path, size = e
            k = known.get(rel)
            if k is not None and size == k["size"]:
                return {"size": k["size"], "sha256": k["sha256"]}
            size, digest = self._hash(self.full_url(path))
            return {"size": size, "sha256": digest}

        manifest: dict[str, Any] = {"files": dict(zip([e[0] for e in entries], self._each(entry, entries)))}
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

    def read_verified(self, dir_url: str, rels: list[str]) -> dict[str, bytes]:
        """The files ``rels`` (paths relative to ``dir_url``) of a sealed artifact, each checked
        for size and sha256 against its manifest: reading a few files of a large artifact
        (the ``task.json`` of every task) without downloading the rest. A file the manifest
        does not list, or one that differs, raises ArtifactError."""
        files = self.read_manifest(dir_url)["files"]
        missing = [r for r in rels if r not in files]
        if missing:
            raise ArtifactError(f"{posixpath.join(dir_url, missing[0])} is not listed in the manifest")

        def read(rel: str) -> bytes:
            data, meta = self.read_bytes(posixpath.join(dir_url, rel)), files[rel]
            if len(data) != meta["size"] or hashlib.sha256(data).hexdigest() != meta["sha256"]:
                raise ArtifactError(f"{posixpath.join(dir_url, rel)} does not match its manifest (corrupt or changed)")
            return data

        return dict(zip(rels, self._each(read, list(rels))))

    def verify_manifest(self, dir_url: str) -> dict[str, Any]:
        """Check every file listed in the manifest for size and sha256; raise on mismatch."""
        manifest = self.read_manifest(dir_url)

        def check(item) -> None:
            rel, meta = item
            data_url = posixpath.join(dir_url, rel)
            try:
                size, digest = self._hash(data_url)
            except FileNotFoundError as exc:
                raise ArtifactError(f"{data_url} is listed in the manifest but missing") from exc
            if size != meta["size"] or digest != meta["sha256"]:
                raise ArtifactError(f"{data_url} does not match its manifest (corrupt or changed)")

        self._each(check, sorted(manifest["files"].items()))
        return manifest
