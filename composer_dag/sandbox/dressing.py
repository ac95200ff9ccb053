"""What makes a sandbox look like a machine, handed in by its caller as data (``Dressing``).

The sandbox itself is isolation only: namespaces, a read-only system, private /tmp and /run,
rlimits, the disk cap, the control socket. Everything a reader inside should take for an
ordinary machine (whose it is, its root file system and /usr/local, its init and process
tree, its home, its environment, its desktop's mount points) comes in one ``Dressing``,
built by whoever knows that machine (``laptop.desktop.dressing`` for a developer's laptop).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

INIT_DIR = "/usr/lib/systemd"  # where the init is bound (it must exist on the host); PATH when process 1 starts
ROOT = "@root@"
"""Stand-in in ``Dressing.system`` for the sandbox's own mount of ``Dressing.root_image``."""


@dataclass(frozen=True, eq=False)
class Dressing:
    """A machine for the sandbox to show: data and a few functions of the caller's.

    ``system``: bwrap arguments for the read-only system (the root, /usr, /usr/local, the init's
    directory bound at ``INIT_DIR``), with ``ROOT`` where ``root_image`` is to be mounted;
    ``overlays``: host files bound read-only over it (host path, inside); ``mounts``: bwrap
    arguments laid after the private /tmp (a desktop's socket directories, its other mount
    points); ``env``: the commands' environment; ``init(first_pid, ctl_fd)``: process 1's
    environment (it serves the control socket and runs each command's shell at about
    ``first_pid``); ``command_pids(project)``: the pid each start's first command gets;
    ``skel`` and ``history(project, files)``: the user's home; ``preload``: a library bubblewrap
    runs with; ``immutable`` and ``image_at(tree, inside)``: trees bound from an image of them
    laid out at ``inside``; ``network``: what the network namespace's addresses are drawn from.
    ``persona``: the caller's own record of whose machine this is (``Sandbox.persona``).
    """

    user: str
    uid: int
    gid: int
    home: str
    hostname: str
    system: tuple[str, ...]
    init: Callable[[int, int], dict]
    disk_usage: Path  # the disk cap's walk (``disk_usage.c``, built)
    root_image: Path | None = None
    overlays: tuple[tuple[Path, str], ...] = ()
    mounts: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    command_pids: Callable[[str], Iterator[int]] | None = None
    skel: Path | None = None
    history: Callable[[str, list[str]], str] | None = None
    preload: str | None = None
    immutable: tuple[Path, ...] = ()
    image_at: Callable[[Path, str], Path] | None = None
    network: object = None
    persona: object = None
