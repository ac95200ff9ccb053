"""The sandbox: isolation only. A ``Sandbox`` runs a workspace's commands under bubblewrap (no
network, a read-only system, private /tmp and /run, rlimits, a disk cap, a wall clock), and
shows whatever machine its caller hands in as data (a ``Dressing``: ``laptop.desktop`` builds a
developer's laptop). ``bwrap`` makes the command line from the mount plan and holds the
sandbox's lifetime; ``session`` the control socket and the output pump; ``limits`` the rlimits
and the disk watches; ``cgroups`` pids, freezer and the machine lock; ``identity`` grading
identities and shared trees; ``hygiene`` sweeps of what dead processes left; ``volumes`` and
``netns`` file systems and the network namespace.
"""

from composer_dag.sandbox.bwrap import Bind, Sandbox, home_volume, sandbox_exec, scratch, volume_workspace
from composer_dag.sandbox.cgroups import exclusive_runs
from composer_dag.sandbox.dressing import Dressing
from composer_dag.sandbox.hygiene import STALE_TEMP_S, sweep_stale_temporaries
from composer_dag.sandbox.identity import IDENTITY_UIDS, chown_tree, identity_lease, share_tree
from composer_dag.sandbox.limits import Limits, entry_disk_bytes
from composer_dag.sandbox.session import ExecResult

__all__ = ["Bind", "Dressing", "ExecResult", "IDENTITY_UIDS", "Limits", "STALE_TEMP_S", "Sandbox", "chown_tree",
           "entry_disk_bytes", "exclusive_runs", "home_volume", "identity_lease", "sandbox_exec", "scratch",
           "share_tree", "sweep_stale_temporaries", "volume_workspace"]
