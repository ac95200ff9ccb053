"""Runtime code every stage shares: typed configs (``config``), checkpoints and atomic files
(``checkpoint``), process-group setup (``distributed``) and one-line errors (``errors``)."""
