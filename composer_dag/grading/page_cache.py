"""Every run of a grading starts from the same kernel caches, whatever ran before it.

The runs of one grading follow each other on one kernel, whose caches over the image's read-only
files they all use: a file one run read stays cached and a later run can time its own read of it
(or ask ``preadv2(RWF_NOWAIT)``); a file one evicts (``posix_fadvise(DONTNEED)``, open to any
user) comes back cold; a path one looked up stays in the dentry cache. ``cold`` closes that:

* once per ``key`` (a task's environment), it runs ``calibrate`` (a run the host makes: the task's
  reference) under a fanotify watch of the file systems of ``roots``, and pins the files that run
  (this process and those under it) opened under them: their cached pages stay mapped and locked
  in this process;
* before every run it drops the machine's page, dentry and inode caches (``vm.drop_caches`` = 3).

A drop skips mapped pages, ``fadvise(DONTNEED)`` and ``madvise(PAGEOUT)`` skip pages another
process maps, and locked pages are never reclaimed: so every run finds the pinned pages cached
(what any run of the task reads: the interpreter, the runner's imports, the environment's
packages) and everything else it can read cold. What is warm is the same for every run and was
chosen before any of them, so it carries nothing from one run to the next; a run that reads other
files reads them from disk, which is the cost (``benchmarks/RESULTS.md``).

Both need root (CAP_SYS_ADMIN; CAP_IPC_LOCK to lock): where the host refuses the drop, ``cold``
says so and the caches stay shared; where it refuses the watch, nothing is pinned and every run
starts with everything cold.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import select
import stat
import struct
import threading
from typing import Callable, Iterable

DROP_CACHES = "/proc/sys/vm/drop_caches"
PAGE = os.sysconf("SC_PAGE_SIZE")
FAN_CLOEXEC, FAN_NONBLOCK, FAN_CLASS_NOTIF = 0x1, 0x2, 0x0
FAN_MARK_ADD, FAN_MARK_FILESYSTEM = 0x1, 0x100
FAN_OPEN, FAN_OPEN_EXEC, FAN_Q_OVERFLOW = 0x20, 0x1000, 0x4000
AT_FDCWD = -100
EVENT = struct.Struct("=IBBHQii")  # struct fanotify_event_metadata
PROT_READ, MAP_SHARED = 0x1, 0x1

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]

MAX_PINNED_BYTES = int(os.environ.get("COMPOSER_MAX_PINNED_BYTES", 1 << 30))
"""What this process keeps pinned at most, over all keys: past it, the least recently used keys'
files are let go (their next grading calibrates again). Locked pages cannot be reclaimed, so the
cap is what a grader with many task environments holds out of the machine's memory."""
_PINNED: dict = {}  # key -> {"maps": [(addr, length)], "files": n, "bytes": n}, oldest use first
_LOCK = threading.Lock()


def drop_caches() -> bool:
    """Drop the machine's clean page cache and its dentries and inodes (``vm.drop_caches`` = 3):
    what is not mapped becomes cold. Dirty pages stay (a run writes only its own copies). The
    first call frees what the machine gathered (a second or so); one after a run frees what that
    run loaded (milliseconds). False where the host does not allow it (``/proc/sys`` read-only)."""
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def _under(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _descends(pid: int, me: int, known: dict[int, bool]) -> bool:
    """Whether ``pid`` is ``me`` or a process under it (its sandboxes' processes are)."""
    chain, found = [], False
    while pid > 1:
        if pid in known:
            found = known[pid]
            break
        if pid == me:
            found = True
            break
        chain.append(pid)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                pid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # gone already: not counted
            break
    for c in chain:
        known[c] = found
    return found


def opened_during(calibrate: Callable[[], object], roots: Iterable[str | os.PathLike]) -> dict[str, int]:
    """The regular files under ``roots`` that this process, or a process under it (the sandbox's),
    opened while ``calibrate()`` ran (fanotify, marking the file systems that hold ``roots``; what
    other processes open meanwhile, another grading's runs among them, is left out), each with a
    descriptor of it, open (the caller's to close): a file opened through a sandbox's mount is
    named by its path there, which the host may not resolve. A root that is a mount point (an
    image the sandbox binds) counts whole. Raises OSError where fanotify is refused (no
    CAP_SYS_ADMIN)."""
    roots = [os.path.realpath(r) for r in roots if os.path.exists(r)]
    whole = {os.stat(r).st_dev for r in roots if os.path.ismount(r)}
    me, known = os.getpid(), {}
    fd = _libc.fanotify_init(FAN_CLOEXEC | FAN_CLASS_NOTIF | FAN_NONBLOCK, os.O_RDONLY | os.O_LARGEFILE | os.O_CLOEXEC)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "fanotify_init")
    seen: dict[tuple, tuple[str, int]] = {}
    stop = threading.Event()

    def keep(efd: int) -> bool:
        st = os.fstat(efd)
        k = (st.st_dev, st.st_ino)
        if k in seen or not stat.S_ISREG(st.st_mode) or st.st_nlink == 0:
            return False
        path = os.readlink(f"/proc/self/fd/{efd}")
        if st.st_dev not in whole and not _under(path, roots):
            return False
        seen[k] = (path, efd)
        return True

    def drain() -> None:
        while True:
            ready = select.select([fd], [], [], 0.02)[0]
            if not ready:
                if stop.is_set():
                    return
                continue
            try:
                buf = os.read(fd, 64 * 1024)
            except BlockingIOError:
                continue
            off = 0
            while off + EVENT.size <= len(buf):
                length, _, _, _, mask, efd, pid = EVENT.unpack_from(buf, off)
                off += max(length, EVENT.size)
                if efd < 0:
                    continue
                kept = False
                try:
                    kept = not mask & FAN_Q_OVERFLOW and _descends(pid, me, known) and keep(efd)
                except OSError:
                    pass
                finally:
                    if not kept:
                        os.close(efd)

    try:
        for path in {os.stat(r).st_dev: r for r in roots}.values():
            if _libc.fanotify_mark(fd, FAN_MARK_ADD | FAN_MARK_FILESYSTEM, FAN_OPEN | FAN_OPEN_EXEC, AT_FDCWD,
                                   os.fsencode(path)) != 0:
                raise OSError(ctypes.get_errno(), f"fanotify_mark {path}")
        reader = threading.Thread(target=drain, daemon=True, name="page-cache-watch")
        reader.start()
        try:
            calibrate()
        finally:
            stop.set()
            reader.join()
    finally:
        os.close(fd)
    return dict(seen.values())


_RESIDENT = bytes(range(256)).translate(bytes(i & 1 for i in range(256)))  # mincore's bit 0, per byte
_MERGE_GAP = 16 << 20


def _extents(fd: int, size: int) -> list[tuple[int, int]]:
    """The page-aligned ranges of ``fd`` that hold data (holes of a sparse file left out; gaps under
    16 MB bridged, so that a file is a few mappings): a persona's root image is 256 GB to 2 TB
    with some 10 MB written. The whole file where the file system cannot say."""
    out: list[list[int]] = []
    off = 0
    try:
        while off < size:
            try:
                start = os.lseek(fd, off, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:  # nothing but a hole to the end
                    break
                raise
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            start -= start % PAGE
            if out and start - out[-1][1] <= _MERGE_GAP:
                out[-1][1] = end
            else:
                out.append([start, end])
            off = end
    except OSError:
        return [(0, size)]
    return [(a, b) for a, b in out]


def _pin_file(path: str | int) -> tuple[list[tuple[int, int]], int] | None:
    """Map the data of ``path`` (or of the open descriptor ``path``, closed here) and lock its pages
    that are cached now: (the mappings, as (address, length), and the bytes held)."""
    try:
        fd = path if isinstance(path, int) else os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    maps, held = [], 0
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
            return None
        for start, end in _extents(fd, st.st_size):
            addr = _libc.mmap(None, end - start, PROT_READ, MAP_SHARED, fd, start)
            if addr in (None, ctypes.c_void_p(-1).value):
                continue
            vec = (ctypes.c_ubyte * ((end - start + PAGE - 1) // PAGE))()
            _libc.mincore(addr, end - start, vec)
            runs = [(m.start(), m.end()) for m in re.finditer(rb"\x01+", bytes(vec).translate(_RESIDENT))]
            if not runs:  # nothing of it cached: nothing to keep
                _libc.munmap(addr, end - start)
                continue
            for i, j in runs:
                # mlock faults the range in and keeps it; where refused, the mapping alone keeps it
                # from a drop and from another process's fadvise or madvise
                if _libc.mlock(addr + i * PAGE, (j - i) * PAGE) != 0:
                    for k in range(i, j):  # touch them: mapped, as the mapping's own pages
                        ctypes.c_char.from_address(addr + k * PAGE).value
                held += (j - i) * PAGE
            maps.append((addr, end - start))
    finally:
        os.close(fd)
    return maps, held


def pin(key, files: Iterable[str | int]) -> dict:
    """Pin the cached pages of ``files`` (paths, or open descriptors, which are closed) for as long
    as this process runs (or ``release(key)``)."""
    maps, held, n = [], 0, 0
    for p in sorted(set(files), key=str):
        got = _pin_file(p)
        if got is not None:
            maps += got[0]
            held += got[1]
            n += 1
    _PINNED[key] = {"maps": maps, "files": n, "bytes": held}
    return _PINNED[key]


def release(key) -> None:
    for addr, length in (_PINNED.pop(key, None) or {}).get("maps", []):
        _libc.munmap(addr, length)


def cold(key, roots: Iterable[str | os.PathLike], calibrate: Callable[[], object]) -> dict:
    """Before a run: the first time for ``key``, pin what ``calibrate`` opens under ``roots``;
    then drop the machine's caches. Returns {"dropped": bool, "pinned_files": n, "pinned_bytes": n}."""
    with _LOCK:
        if key not in _PINNED:
            try:
                files = list(opened_during(calibrate, roots).values())
            except OSError:  # no fanotify here: nothing pinned, every run starts all cold
                files = []
            pin(key, files)
        else:
            _PINNED[key] = _PINNED.pop(key)  # the most recently used last
        # let go of the least recently used keys past the cap (never the one in use): which files
        # stay cached then changes between two runs, but by the host's choice, not a run's
        while len(_PINNED) > 1 and sum(v["bytes"] for v in _PINNED.values()) > MAX_PINNED_BYTES:
            release(next(iter(_PINNED)))
        state = _PINNED[key]
    return {"dropped": drop_caches(), "pinned_files": state["files"], "pinned_bytes": state["bytes"]}
