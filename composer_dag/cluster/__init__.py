"""Where jobs and services run: one module per backend behind one interface.

``spec`` (what a job or service is), ``backends`` (``local``, ``slurm``, ``k8s`` behind the
``Backend`` interface, by name: ``backend_for(cluster)``), ``services`` (the API: ``start_service``,
``run_array``, ``ServiceGroup``), ``stage`` (a stage's job: its spec, what its backend launches,
run and verified) and ``job`` (what every stage job runs where the GPUs are). Importing the
package registers the backends, so that ``ClusterConfig`` knows their names."""

from . import backends  # noqa: F401  (registers local, slurm and k8s)
