"""Runtime code every stage shares: typed configs (``config``), checkpoints and atomic files
(``checkpoint``), process-group setup (``distributed``), one-line errors (``errors``), a stage's
job on a node (``job``), and services and arrays on the cluster (``services``, ``supervise``)."""
