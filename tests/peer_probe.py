"""Run in two sandboxes (``test_grader_redteam``), at once or one after the other: each plants a
mark in every place and kernel object two runs might share, waits for the other to do the same,
then looks for the other's mark. Prints one JSON object: each channel -> whether a peer was seen.

``inotify``: open events on a file of the image both read (the interpreter's own ``textwrap.py``)
that arrive while this run has not opened it (each run opens it now and then, and drains its own
events right after): a channel between any two runs alive at once, whatever their identities,
since the file is the host's.

``page_cache``: each run reads a file of the image that nothing else reads (one of the stdlib's
``idlelib`` modules, chosen by its mark), after asking whether the other's is cached already
(``preadv2`` with ``RWF_NOWAIT`` on its first page: it fails for a page not in the page cache,
and is what a timed read finds out, without the noise): a channel between two runs one after the
other, unless the kernel's caches are dropped in between (``grade`` drops them before each run)."""

import ctypes
import hashlib
import json
import os
import random
import socket
import sys
import time

me, other = sys.argv[1], sys.argv[2]
seen = {}
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
ADD_KEY, KEYCTL = {"x86_64": (248, 250), "aarch64": (217, 219)}[os.uname().machine]


def key(desc: bytes, ring: int, add: bool) -> bool:
    if add:
        return libc.syscall(ctypes.c_long(ADD_KEY), b"user", desc, b"1", ctypes.c_long(1), ctypes.c_long(ring)) > 0
    return libc.syscall(ctypes.c_long(KEYCTL), ctypes.c_long(10), ctypes.c_long(ring), b"user", desc,
                        ctypes.c_long(0)) > 0


pool = sorted(f for f in os.listdir(os.path.join(os.path.dirname(os.__file__), "idlelib")) if f.endswith(".py"))


def pick(mark: str, peer: str) -> str:
    """The file ``mark`` reads; two marks whose hashes meet are parted (the greater takes the next
    file), the same way in both runs, so the two files always differ."""
    index = {m: int(hashlib.sha256(m.encode()).hexdigest(), 16) % len(pool) for m in (mark, peer)}
    if index[mark] == index[peer] and mark > peer:
        index[mark] = (index[mark] + 1) % len(pool)
    return os.path.join(os.path.dirname(os.__file__), "idlelib", pool[index[mark]])


def cached(path: str) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


mine, theirs = pick(me, other), pick(other, me)
seen["page_cache"] = cached(theirs)
with open(mine, "rb") as f:
    f.read()
places = ["/tmp", "/var/tmp", "/dev/shm", os.path.expanduser("~"), f"/run/user/{os.getuid()}", os.getcwd()]
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.bind(f"\0peer-probe-{me}")  # abstract: per network namespace
for ring in (-4, -5):  # the user keyring, the user-session keyring
    key(f"peer-{me}".encode(), ring, True)
for p in places:
    try:
        open(os.path.join(p, f".peer-{me}"), "w").close()
    except OSError:
        pass
IN_OPEN, IN_NONBLOCK = 0x20, 0o4000
shared = os.path.join(os.path.dirname(os.__file__), "textwrap.py")
watch = libc.inotify_init1(IN_NONBLOCK)
libc.inotify_add_watch(watch, shared.encode(), IN_OPEN)


def drain() -> int:
    n = 0
    while True:
        try:
            n += len(os.read(watch, 4096))
        except BlockingIOError:
            return n


children = [os.fork() for _ in range(3)]  # a few processes of this uid: a peer would see them
if 0 in children:
    time.sleep(3)
    os._exit(0)
foreign = 0  # open events while this run had not opened the file since its last drain
for _ in range(20):  # about 2 s: the other run plants its marks meanwhile
    time.sleep(0.05 + random.random() * 0.1)
    foreign += drain()
    open(shared, "rb").close()
    drain()
seen["keyring"] = any(key(f"peer-{other}".encode(), ring, False) for ring in (-4, -5))
probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    probe.bind(f"\0peer-probe-{other}")
    seen["abstract_socket"] = False
except OSError:
    seen["abstract_socket"] = True
seen["files"] = [p for p in places if os.path.exists(os.path.join(p, f".peer-{other}"))]
seen["processes"] = sum(1 for d in os.listdir("/proc") if d.isdigit()
                        and open(f"/proc/{d}/cmdline", "rb").read().endswith(f"peer_probe.py\0{other}\0".encode()))
seen["inotify"] = foreign > 0
seen["uid"] = os.getuid()
print(json.dumps(seen))
