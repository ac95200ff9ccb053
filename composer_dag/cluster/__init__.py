"""Where jobs and services run: one module per backend behind one interface.

``spec`` (what a job or service is), ``local``, ``slurm`` and ``k8s`` (the backends),
``services`` (the dispatcher: ``runner``, ``start_service``, ``run_array``, ``ServiceGroup``),
``stage`` (a stage's job: its command, sbatch script or pod, submitted and waited on) and ``job``
(what every stage job runs where the GPUs are)."""
