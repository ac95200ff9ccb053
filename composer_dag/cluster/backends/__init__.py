"""The backends behind one interface (``base.Backend``), by name: ``local`` (process groups on
this machine), ``slurm`` (``sbatch``, ``scontrol``, ``scancel``) and ``k8s`` (pods, Deployments and
Indexed Jobs through the ``kubernetes`` client). Importing this package registers them;
``backend_for(cluster)`` gives the one a ``ClusterConfig`` names."""

from . import k8s, local, slurm
from .base import Backend, backend_for, register_backend

__all__ = ["Backend", "backend_for", "k8s", "local", "register_backend", "slurm"]
