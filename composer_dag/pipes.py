"""Report progress and results from an engine entry point, through Dagster Pipes when present.

When the process was launched by Dagster Pipes (``DAGSTER_PIPES_CONTEXT`` is set and the
``dagster_pipes`` package imports), rank 0 opens the Pipes session and forwards logs, asset
materializations and custom messages. Otherwise log lines go to stderr and ``result`` prints
the final JSON summary as the last line of stdout, or writes it to ``$COMPOSER_RESULT_PATH``
when that is set (a cluster job reads it there). Ranks other than 0 stay silent.

Pipes context and messages travel through files (the local backend) or through artifact
storage (a cluster job that shares no disk with Dagster): when the context parameters hold a
``url``, the context is read from that storage URL and messages are written there as numbered
chunks (``<url>/<n>.json``), the layout of Dagster's blob-store readers.
This is the only engine module that may import ``dagster_pipes`` (never ``dagster``).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable

RESULT_PATH_ENV = "COMPOSER_RESULT_PATH"


def _storage_pipes(interval: float = 1.0):
    """A context loader and message writer over artifact storage (any fsspec URL)."""
    import contextlib
    import posixpath

    from dagster_pipes import (PipesBlobStoreMessageWriter, PipesBlobStoreMessageWriterChannel,
                               PipesContextLoader)

    from .storage import open_storage

    class Loader(PipesContextLoader):
        @contextlib.contextmanager
        def load_context(self, params):
            url = params["url"]
            yield open_storage(posixpath.dirname(url)).read_json(url)

    class Channel(PipesBlobStoreMessageWriterChannel):
        def __init__(self, url: str):
            super().__init__(interval=interval)
            self.url, self.storage = url, open_storage(url)

        def upload_messages_chunk(self, payload, index: int) -> None:
            self.storage.write_bytes(f"{self.url}/{index}.json", payload.read().encode())

    class Writer(PipesBlobStoreMessageWriter):
        def make_channel(self, params):
            return Channel(params["url"])

    return Loader(), Writer(interval=interval)


def _open_pipes():
    from dagster_pipes import PipesEnvVarParamsLoader, open_dagster_pipes

    params = PipesEnvVarParamsLoader()
    if "url" in params.load_context_params():
        loader, writer = _storage_pipes()
        return open_dagster_pipes(context_loader=loader, message_writer=writer, params_loader=params)
    return open_dagster_pipes(params_loader=params)


class Reporter:
    def __init__(self, rank: int | None = None):
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.pipes = None

    def __enter__(self) -> "Reporter":
        if self.rank == 0 and os.environ.get("DAGSTER_PIPES_CONTEXT"):
            import importlib.util

            if importlib.util.find_spec("dagster_pipes") is not None:
                self.pipes = _open_pipes()
        return self

    def __exit__(self, *exc) -> None:
        if self.pipes is not None:
            self.pipes.__exit__(*exc)
            self.pipes = None

    def log(self, msg: str) -> None:
        """A log line: the Dagster log under Pipes, else stderr."""
        self._say(msg, sys.stderr)

    def progress(self, msg: str) -> None:
        """A progress line: the Dagster log under Pipes, else stdout."""
        self._say(msg, sys.stdout)

    def _say(self, msg: str, stream) -> None:
        if self.rank != 0:
            return
        if self.pipes is not None:
            self.pipes.log.info(msg)
        else:
            print(msg, file=stream, flush=True)

    def report_asset_materialization(self, metadata: dict[str, Any],
                                     asset_key: str | None = None) -> None:
        if self.rank == 0 and self.pipes is not None:
            self.pipes.report_asset_materialization(metadata=metadata, asset_key=asset_key)

    def report_custom_message(self, payload: Any) -> None:
        if self.rank == 0 and self.pipes is not None:
            self.pipes.report_custom_message(payload)

    def result(self, summary: dict[str, Any]) -> None:
        """The final summary: a Pipes custom message (the launching asset turns it into its
        materialization), else the file ``$COMPOSER_RESULT_PATH`` names (a cluster job reads it),
        else the last line of stdout."""
        if self.rank != 0:
            return
        if self.pipes is None:
            text = json.dumps(summary, default=str)
            if os.environ.get(RESULT_PATH_ENV):
                # a cluster job reads the file: the summary (up to tens of KB) stays off the
                # terminal, in the artifacts and the Dagster event log
                tmp = os.environ[RESULT_PATH_ENV] + ".tmp"
                with open(tmp, "w") as f:
                    f.write(text)
                os.replace(tmp, os.environ[RESULT_PATH_ENV])
            else:
                print(text, flush=True)
        else:
            self.pipes.report_custom_message(summary)


def serve(work: Callable[["Reporter"], dict]) -> dict:
    """Run an entry point's work under a Reporter, report its summary, and leave the process
    group (when torch.distributed was used) cleanly."""
    with Reporter() as rep:
        result = work(rep)
        rep.result(result)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return result


def entry_point(cls, description: str, work: Callable[[Any, "Reporter"], dict], argv: list[str] | None = None) -> dict:
    """An engine entry point's ``main``: its config from ``--config``/``--set`` (one line and exit
    status 2 when bad), then ``work(config, reporter)`` under ``serve``."""
    from .runtime.config import config_from_args

    cfg = config_from_args(cls, description, argv)
    return serve(lambda rep: work(cfg, rep))
