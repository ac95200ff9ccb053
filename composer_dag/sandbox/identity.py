"""Who runs in a sandbox and owns what: trees given to the sandbox user, working copies of trusted
trees (``share_tree``), and grading identities (``identity_lease``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path


def chown_tree(path: Path, uid: int = 1000, gid: int = 1000) -> None:
    """Give a host tree to the sandbox user (files the host writes later need it too)."""
    os.lchown(path, uid, gid)
    for root, dirs, files in os.walk(path):
        for n in dirs + files:
            os.lchown(os.path.join(root, n), uid, gid)


def share_tree(src: Path, dst: Path, uid: int = 1000, gid: int = 1000, skip: frozenset = frozenset()) -> None:
    """``dst`` as a working copy of the trusted tree ``src`` for a sandboxed run, at a fraction of
    a copy's cost: directories made and given to the sandbox user (``uid``); regular files this
    process owns that no one else may write (and no set-id bit) are hard links, so the sandbox
    user can replace or delete them but never write into them (nor into ``src`` through them);
    any other file is copied and given to the user; links are copied; names in ``skip`` are left
    out. Across
    filesystems every file is copied. The host must not write into ``dst``'s files in place
    (unlink, then write)."""
    src, dst = Path(src), Path(dst)
    me = os.geteuid()
    same_fs = None
    for d, dirs, files in os.walk(src):
        dirs[:] = [n for n in dirs if n not in skip]
        rel = Path(d).relative_to(src)
        t = dst / rel
        t.mkdir(exist_ok=rel != Path("."))
        os.chmod(t, os.stat(d).st_mode & 0o7777)
        os.lchown(t, uid, gid)
        if same_fs is None:
            same_fs = os.stat(d).st_dev == os.stat(t).st_dev
        for n in list(dirs) + files:
            if n in skip:
                continue
            s, f = os.path.join(d, n), t / n
            st = os.lstat(s)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(s), f)
                os.lchown(f, uid, gid)
                if n in dirs:
                    dirs.remove(n)
            elif n in files and stat.S_ISREG(st.st_mode):
                if same_fs and st.st_uid == me and not st.st_mode & (0o022 | stat.S_ISUID | stat.S_ISGID):
                    os.link(s, f)
                else:
                    shutil.copy2(s, f)
                    os.lchown(f, uid, gid)


IDENTITY_UIDS = tuple(range(1001, 1033))
"""The uids grading runs take (``identity_lease``): users after a laptop's first (1000, the
episodes'), one per live run, so that no two runs share a kernel object kept per user (the
user's keyrings, its process and inotify counts)."""


def lock_dir() -> Path:
    for d in (Path(os.environ.get("COMPOSER_IDENTITY_LOCKS", "/run/lock/cdag-identities")),
              Path(tempfile.gettempdir()) / "cdag-identities"):
        try:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            return d
        except OSError:
            continue
    raise OSError("no directory for the identity locks")


def _uid_busy(uid: int) -> bool:
    """Whether a process of ``uid`` is alive (one a lock of another mount namespace let through)."""
    want = f"Uid:\t{uid}\t"
    for e in os.scandir("/proc"):
        if e.name.isdigit():
            try:
                with open(f"/proc/{e.name}/status") as f:
                    if any(line.startswith(want) for line in f):
                        return True
            except OSError:
                continue
    return False


@contextlib.contextmanager
def identity_lease(timeout: float = 600.0):
    """A uid of ``IDENTITY_UIDS`` that no other live run on this machine holds (a lock per uid,
    across processes), drawn at random, for as long as the block lasts. What a run of that uid
    left in the user's keyrings is cleared by the grader's runner before any code runs."""
    import fcntl
    import secrets

    locks, rng, deadline = lock_dir(), secrets.SystemRandom(), time.monotonic() + timeout
    while True:
        for uid in rng.sample(IDENTITY_UIDS, len(IDENTITY_UIDS)):
            fd = os.open(locks / f"uid-{uid}", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                if _uid_busy(uid):
                    continue
                yield uid
                return
            finally:
                os.close(fd)  # releases the lock
        if time.monotonic() > deadline:
            raise TimeoutError(f"no free grading identity among {len(IDENTITY_UIDS)} in {timeout:.0f} s")
        time.sleep(0.05)
