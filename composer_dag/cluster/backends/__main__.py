"""What a node runs of a backend's own helpers:

    python -m composer_dag.cluster.backends ship-log PATTERN LOG_URI   # slurm: a task's log to LOG_URI
"""

import sys

from .slurm import ship_log


def main(argv: list[str]) -> None:
    if len(argv) != 3 or argv[0] != "ship-log":
        sys.exit("usage: python -m composer_dag.cluster.backends ship-log PATTERN LOG_URI")
    try:
        ship_log(argv[1], argv[2])
    except Exception as exc:  # one line in the log it could not copy; the job's own status stands
        sys.exit(f"could not copy the log to {argv[2]}: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main(sys.argv[1:])
