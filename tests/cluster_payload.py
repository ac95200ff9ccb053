"""A tiny distributed payload for the cluster-resource tests: every rank records its pid,
joins the process group, and rank 0 reports the world size through Pipes.
With ``--sleep S`` every rank then sleeps (to be cancelled); with ``--ignore-term`` the ranks
ignore SIGTERM, as a worker stuck in native code does."""

import argparse
import os
import signal
import time

import torch.distributed as dist

from composer_dag.pipes import Reporter


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pid-dir", required=True)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--ignore-term", action="store_true")
    p.add_argument("--fail", default="", help="raise ValueError(FAIL) once the group is up")
    args = p.parse_args()
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(args.pid_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    with Reporter() as rep:
        rep.log(f"rank {rank} of {world} up")
        if args.fail:
            raise ValueError(args.fail)
        if args.sleep:
            time.sleep(args.sleep)
        dist.barrier()
        rep.result({"world_size": world, "rank": rank})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
