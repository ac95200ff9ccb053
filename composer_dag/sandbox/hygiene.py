"""Sweeps of what killed processes left: sandboxes', episodes' and gradings' temporary
directories and the mounts in them, and the images no one uses.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time

from composer_dag.sandbox import volumes


STALE_TEMP_S = 86400.0
"""A ``cdag-*`` temporary directory no write has touched for this long was left by a process
that was killed (SIGKILL, the OOM killer) before it could remove it: an episode lasts minutes."""
_TEMP_NAME = re.compile(r"cdag-[a-z]+-[a-z0-9_]{8}")  # tempfile.mkdtemp's names for the prefixes here
_swept: set[str] = set()


def sweep_stale_temporaries(root: str | None = None, max_age: float = STALE_TEMP_S, force: bool = False) -> list[str]:
    """Remove the temporary directories of sandboxes, episodes and gradings (``cdag-h-*``,
    ``cdag-w-*``, ``cdag-g-*``, ...) under ``root`` (the temporary directory) untouched for
    ``max_age`` seconds; once per process and root unless ``force``. Returns the names removed."""
    root = root or tempfile.gettempdir()
    if root in _swept and not force:
        return []
    _swept.add(root)
    gone, now = [], time.time()
    if volumes.available():
        gone += volumes.sweep_images()
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    for e in entries:
        try:
            if _TEMP_NAME.fullmatch(e.name) and e.is_dir(follow_symlinks=False) and \
                    now - e.stat(follow_symlinks=False).st_mtime > max_age:
                if volumes.available():  # a killed sandbox's /home and /run/user
                    volumes.unmount_under(e.path)
                shutil.rmtree(e.path, ignore_errors=True)
                gone.append(e.name)
        except OSError:
            continue
    return gone
