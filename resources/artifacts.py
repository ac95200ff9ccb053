
import hashlib
import os
from typing import Optional

import dagster as dg
from pydantic import PrivateAttr

from composer_dag.storage import Storage
from resources.base import ClearConfigResource


def composer_home() -> str:
    """The embedded default's working directory: ``$COMPOSER_HOME`` or ``./.composer``."""
    return os.path.abspath(os.environ.get("COMPOSER_HOME", ".composer"))


def work_dir(name: str, *inputs: str) -> str:
    """A working directory under ``$COMPOSER_HOME/work/<name>/`` keyed by the inputs: a retry or
    re-run with the same inputs and settings resumes from its last checkpoint there."""
    key = hashlib.sha256("\0".join(inputs).encode()).hexdigest()[:16]
    path = os.path.join(composer_home(), "work", name, key)
    os.makedirs(path, exist_ok=True)
    return path


class ArtifactStorage(ClearConfigResource):
    """Where artifacts live. ``root`` empty means ``$COMPOSER_HOME/artifacts`` on local disk.

    For S3 (or an S3-compatible server) set ``root: s3://bucket/prefix`` and, from the
    environment, ``endpoint_url``, ``aws_access_key_id`` and ``aws_secret_access_key``, e.g.
    ``dg.EnvVar("AWS_SECRET_ACCESS_KEY")``. Credentials are passed to s3fs only.
    """

    root: str = ""
    endpoint_url: Optional[str] = None
    aws_access_key_id: Optional[str] = None
    aws_secret_access_key: Optional[str] = None
    region_name: Optional[str] = None

    _storage: Optional[Storage] = PrivateAttr(default=None)

    def resolved_root(self) -> str:
        return self.root or os.path.join(composer_home(), "artifacts")

    def storage_options(self) -> dict:
        opts: dict = {}
        if self.endpoint_url:
            opts["endpoint_url"] = self.endpoint_url
        if self.aws_access_key_id:
            opts["key"] = self.aws_access_key_id
        if self.aws_secret_access_key:
            opts["secret"] = self.aws_secret_access_key
        if self.region_name:
            opts.setdefault("client_kwargs", {})["region_name"] = self.region_name
        return opts

    def get(self) -> Storage:
        """The storage, opened on first use. A remote root is probed once (one request), so
        bad credentials, an unknown endpoint or a missing bucket fail here with one line."""
        if self._storage is None:
            try:
                storage = Storage(self.resolved_root(), self.storage_options())
                if storage.protocol != "file":
                    storage.fs.exists(storage._path(storage.root))
            except Exception as exc:  # one clear line, credentials never included
                why = (str(exc).strip().splitlines() or [""])[0][:300]
                raise dg.Failure(
                    description=f"cannot open artifact storage at {self.resolved_root()}: {type(exc).__name__}: {why}"
                ) from None
            self._storage = storage
        return self._storage
