"""File systems of the sandbox's own, so that no mount inside it names a host path.

``/proc/self/mountinfo`` shows, for every mount, the path of its tree inside the file system it
comes from: a bind of ``/root/.cache/cdag-rt/.../usr-local`` at ``/usr/local`` says so, whatever
the mount point. A laptop's mounts are file systems' roots. So the sandbox binds only trees
whose path inside their file system is ``/`` or the mount point itself:

- ``image(tree)``: a read-only ext4 image of a cached tree (``mkfs.ext4 -d``), laid out at the
  paths it is bound to, attached to a loop device and mounted once per machine under
  ``IMAGE_MOUNTS`` (every process and sandbox shares the mount and its page cache);
- ``Volume``: a sandbox's ``/home``, a sparse ext4 image of its own (about 10 ms to make), which
  holds the user's home and, where the caller makes it there, the workspace;
- ``tmpfs``: a size-capped tmpfs made on the host, with the owner and mode a laptop's
  ``/run/user/<uid>`` has.

All of it needs root, ``/dev/loop-control`` and ``mkfs.ext4`` (``available()``); without them the
sandbox binds the host's trees as before. Loop devices are attached with ``LOOP_CONFIGURE`` and
auto-clear: a volume's device goes when its last mount does.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
import threading
import time
import weakref
from pathlib import Path

IMAGE_MOUNTS = Path(os.environ.get("COMPOSER_IMAGE_MOUNTS", "/run/cdag-img"))
LOOP_CTL_GET_FREE = 0x4C82
LOOP_CONFIGURE = 0x4C0A
LO_FLAGS_READ_ONLY, LO_FLAGS_AUTOCLEAR = 1, 4
MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4
MNT_DETACH = 2

_libc = ctypes.CDLL(None, use_errno=True)
_available: bool | None = None
_images: dict[tuple, Path] = {}
_lock = threading.Lock()


def available() -> bool:
    """Whether this host lets the sandbox make file systems of its own (root, loop devices,
    ext4, ``mkfs.ext4``); ``COMPOSER_SANDBOX_VOLUMES=0`` turns them off."""
    global _available
    if os.environ.get("COMPOSER_SANDBOX_VOLUMES", "1") == "0":
        return False
    if _available is None:
        try:
            fs = Path("/proc/filesystems").read_text()
        except OSError:
            fs = ""
        _available = (os.geteuid() == 0 and os.path.exists("/dev/loop-control") and "\text4\n" in fs
                      and shutil.which("mkfs.ext4") is not None)
    return _available


def _mount(source: str, target: Path, fstype: str, flags: int, data: str = "") -> None:
    if _libc.mount(source.encode(), str(target).encode(), fstype.encode(), flags, data.encode() or None) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {fstype} {source} on {target}: {os.strerror(e)}")


def unmount(target: Path) -> None:
    """Detach the mount at ``target`` (lazily: a sandbox still holding it keeps it until it ends)."""
    if _libc.umount2(str(target).encode(), MNT_DETACH) != 0 and ctypes.get_errno() not in (errno.EINVAL, errno.ENOENT):
        e = ctypes.get_errno()
        raise OSError(e, f"umount {target}: {os.strerror(e)}")


def unmount_under(root: str) -> None:
    """Detach every mount at or under ``root`` (what a killed process left), deepest first."""
    root = os.path.realpath(root)
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return
    points = [ln.split()[4].encode().decode("unicode_escape") for ln in lines]
    for p in sorted((p for p in points if p == root or p.startswith(root + "/")), key=len, reverse=True):
        try:
            unmount(Path(p))
        except OSError:
            pass


@contextlib.contextmanager
def unmounting(root: str):
    """Detach what was mounted under ``root`` when the block ends (before the directory goes)."""
    try:
        yield
    finally:
        if available():
            unmount_under(root)


def _attach(image: Path, readonly: bool) -> tuple[int, str]:
    """A free loop device backed by ``image`` (auto-clear: it is let go when its last holder
    closes, so the caller keeps the returned descriptor open until it has mounted it)."""
    mode = os.O_RDONLY if readonly else os.O_RDWR
    ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    backing = os.open(image, mode | os.O_CLOEXEC)
    flags = LO_FLAGS_AUTOCLEAR | (LO_FLAGS_READ_ONLY if readonly else 0)
    # struct loop_config: fd, block_size, struct loop_info64 (232 bytes), __reserved[8]
    info = struct.pack("=5Q4I", 0, 0, 0, 0, 0, 0, 0, 0, flags) + bytes(64 + 64 + 32) + struct.pack("=2Q", 0, 0)
    config = struct.pack("=2I", backing, 0) + info + bytes(64)
    try:
        for _ in range(200):
            n = fcntl.ioctl(ctl, LOOP_CTL_GET_FREE)
            dev = f"/dev/loop{n}"
            try:
                fd = os.open(dev, mode | os.O_CLOEXEC)
            except FileNotFoundError:  # devtmpfs has not made the node yet
                time.sleep(0.002)
                continue
            try:
                fcntl.ioctl(fd, LOOP_CONFIGURE, config)
                return fd, dev
            except OSError as e:
                os.close(fd)
                if e.errno != errno.EBUSY:  # another process took it first
                    raise
        raise OSError(errno.EBUSY, "no free loop device")
    finally:
        os.close(backing)
        os.close(ctl)


def _mount_image(image: Path, target: Path, readonly: bool) -> None:
    fd, dev = _attach(image, readonly)
    try:
        # noinit_itable: the image is sparse, its inode tables read as zeros already; the kernel's
        # lazy init would write them all out (68 MB for a sandbox's /home) for nothing
        _mount(dev, target, "ext4", MS_RDONLY if readonly else 0, "" if readonly else "noinit_itable")
    finally:
        os.close(fd)  # mounted, the device lives as long as the mount; unmounted, it clears now


def sweep_images() -> list[str]:
    """Let go of the machine's image mounts whose image file is gone (a cache removed by hand, or
    a test's); returns their mount points."""
    gone = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return gone
    for line in lines:
        f = line.split()
        if len(f) < 10 or not f[4].startswith(f"{IMAGE_MOUNTS}/"):
            continue
        source = f[f.index("-") + 2] if "-" in f else ""
        try:
            backing = Path(f"/sys/block/{Path(source).name}/loop/backing_file").read_text().strip()
        except OSError:
            continue
        if backing.endswith("(deleted)"):
            try:
                unmount(Path(f[4]))
                gone.append(f[4])
            except OSError:
                pass
    return gone


def unmount_image(path: Path) -> None:
    """Let go of the machine's mount of the image file ``path`` (its tree is being removed)."""
    try:
        key, target = _image_target(path)
    except OSError:
        return
    _images.pop(key, None)
    if os.path.ismount(target):
        unmount(target)


def mount_file(path: Path, target: Path) -> None:
    """The image file ``path`` mounted read-only at ``target`` on a loop device of its own (for
    one sandbox: ``unmount`` lets both go)."""
    _mount_image(path, target, readonly=True)


def mkfs(image: Path, size: int, tree: Path | None = None, inodes: int | None = None, extra=()) -> None:
    """An ext4 file system of ``size`` bytes (sparse) in ``image``, holding ``tree`` if given."""
    with open(image, "wb") as f:
        f.truncate(size)
    # a laptop's block and inode sizes, whatever the size (mke2fs would pick 1 KiB blocks and
    # 128-byte inodes for a small one, which ``ls -la /`` and ``stat`` show); no journal: these
    # file systems die with their sandbox or are read-only, and a journal's kernel thread and
    # /proc/fs/jbd2 entry would be one more trace (a third less time to make and let go of)
    cmd = ["mkfs.ext4", "-q", "-F", "-b", "4096", "-I", "256", "-O", "^has_journal",
           "-E", "nodiscard,lazy_itable_init=1"]
    cmd += list(extra)
    if inodes:
        cmd += ["-N", str(inodes)]
    if tree is not None:
        cmd += ["-d", str(tree)]
    r = subprocess.run(cmd + [str(image)], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"mkfs.ext4 failed for {image}: {r.stderr.strip()[-500:]}")


def tree_image(tree: Path, image: Path, size: int | None = None) -> None:
    """``image``: a read-only ext4 file system holding ``tree`` (owners, modes, times, links),
    with room to spare, of ``size`` bytes if given (sparse: what ``df`` reports)."""
    used, count = 0, 0
    for root, dirs, files in os.walk(tree):
        for n in dirs + files:
            st = os.lstat(os.path.join(root, n))
            used += (st.st_size + 4095) // 4096 * 4096
            count += 1
    need = int(used * 1.25) + (64 << 20)
    # read-only: inodes for the tree and some, two superblock backups, no room to grow: a 2 TB
    # image then writes 11 MB (32 MB with mke2fs's defaults), most of it the block groups' bitmaps
    mkfs(image, max(need, size or 0), tree, inodes=int(count * 1.25) + 8192, extra=("-O", "^resize_inode,sparse_super2"))


def _image_target(path: Path) -> tuple[tuple, Path]:
    st = path.stat()
    key = (str(path), st.st_ino, st.st_mtime_ns)
    return key, IMAGE_MOUNTS / hashlib.sha256(repr(key).encode()).hexdigest()[:16]


def image(path: Path) -> Path:
    """Where the image file ``path`` is mounted (read-only, once per machine: mounted now if no
    process has yet, or if it was let go since)."""
    key, target = _image_target(path)
    known = _images.get(key)
    if known is not None and os.path.ismount(known):
        return known
    with _lock:
        IMAGE_MOUNTS.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(IMAGE_MOUNTS / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            target.mkdir(exist_ok=True)
            if not os.path.ismount(target):
                _mount_image(path, target, readonly=True)
    _images[key] = target
    return target


_templates: dict[tuple[int, int], Path] = {}


def _template(size: int, inodes: int) -> Path:
    """An empty file system of ``size`` bytes and ``inodes`` entries, made once per process:
    a volume starts as a copy of it (its 2 MB of metadata: about 1 ms, against 10 ms for
    ``mkfs.ext4``)."""
    with _lock:
        path = _templates.get((size, inodes))
        if path is None or not path.exists():
            path = Path(tempfile.mkdtemp(prefix="cdag-vt-")) / "empty.ext4"
            mkfs(path, size, inodes=inodes)
            _templates[(size, inodes)] = path
        return path


def _sparse_copy(src: Path, dst: Path) -> None:
    """``dst``: a copy of ``src`` that writes only its data, leaving its holes holes."""
    with open(src, "rb") as f, open(dst, "wb") as g:
        size = os.fstat(f.fileno()).st_size
        g.truncate(size)
        off = 0
        while off < size:
            try:
                start = os.lseek(f.fileno(), off, os.SEEK_DATA)
            except OSError:  # ENXIO: nothing but a hole to the end
                break
            end = os.lseek(f.fileno(), start, os.SEEK_HOLE)
            while start < end:
                start += os.copy_file_range(f.fileno(), g.fileno(), end - start, start, start)
            off = end


class Volume:
    """A sandbox's own ext4 file system (sparse: ``size`` bytes at most, ``inodes`` entries),
    mounted read-write on the host at ``path`` until ``close()``."""

    def __init__(self, size: int, inodes: int, parent: str | None = None):
        if parent is not None:
            os.makedirs(parent, exist_ok=True)
        self._dir = Path(tempfile.mkdtemp(prefix="cdag-v-", dir=parent))
        self.path = self._dir / "fs"
        self.path.mkdir()
        try:
            _sparse_copy(_template(size, inodes), self._dir / "image")
            _mount_image(self._dir / "image", self.path, readonly=False)
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        os.chmod(self.path, 0o755)
        self._closer = weakref.finalize(self, _drop, self._dir)

    def close(self) -> None:
        self._closer()


def _drop(d: Path) -> None:
    if d.exists():
        unmount_under(str(d))
        shutil.rmtree(d, ignore_errors=True)


def tmpfs(target: Path, size: int, mode: int, uid: int, gid: int) -> None:
    """A tmpfs at ``target`` on the host: ``size`` bytes at most, its root ``mode`` and owner."""
    _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode={mode:o},uid={uid},gid={gid}")
