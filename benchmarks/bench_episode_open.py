"""What an episode with no valid tool call costs the agent loop (a small model's usual episode:
its calls malformed, or none): open the episode, its prompt, the grade cache's key, the grade,
close; as ``AgentLoop`` does it, on a repository task (networkx, mined as ``sources.yaml``
declares it) and on a HumanEval task. Rounds alternate between this checkout and ``--old`` (a
copy of the repository at an older commit, ``git archive OLD composer_dag | tar -x -C DIR``),
each in a process of its own; prints a markdown table of seconds per episode.

    .venv/bin/python benchmarks/bench_episode_open.py [--old DIR] [--rounds 3] [--episodes 20] [--tasks DIR]

``--tasks``: a directory with the mined tasks (``tasks/<id>/`` as ``repo_environment`` writes
them); without it networkx is bootstrapped and mined once first (about a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def worker(tasks: list[str], episodes: int) -> None:
    from composer_dag.agent import GradeCache
    from composer_dag.harness.episode import Episode

    out = {}
    for t in map(Path, tasks):
        Episode(t).close()  # the runtime and bytecode caches warm, as in a running loop
        t0 = time.monotonic()
        for _ in range(episodes):
            ep = Episode(t)
            ep.prompt()
            tree = getattr(ep, "final_tree", None) or ep.workspace
            GradeCache.key(t, tree, ep.log)
            ep.grade()
            ep.close()
        out[t.name] = round((time.monotonic() - t0) / episodes, 4)
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--episodes", type=int, default=20)
    ap.add_argument("--tasks", default=None, help="a repository environment's output (tasks/<id>/)")
    ap.add_argument("--worker", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        return worker(args.worker, args.episodes)
    with tempfile.TemporaryDirectory(prefix="bench-episode-") as tmp:
        from composer_dag.tasks.format import NETWORKX, task_dirs
        from composer_dag.tasks.sources.build import build_tasks, repo_environment

        env_out = Path(args.tasks) if args.tasks else Path(tmp) / "env"
        if not args.tasks:
            repo_environment(NETWORKX, env_out, seed=0, workers=2)
        mined = sorted(d for d in (env_out / "tasks").iterdir() if (d / "task.json").is_file())[0]
        build_tasks(Path(tmp) / "he", {"humaneval_limit": 2, "bugfix_count": 0, "learnable_count": 0})
        he = next(d for side in ("rl_tasks", "eval_tasks") for d in task_dirs(Path(tmp) / "he", side))
        sides = [("new", HERE)] + ([("old", Path(args.old).resolve())] if args.old else [])
        print(f"| round | code | {mined.name} s/episode | {he.name} s/episode |")
        print("|---:|---|---:|---:|")
        for r in range(args.rounds):
            for name, root in (sides if r % 2 == 0 else sides[::-1]):
                env = {**os.environ, "PYTHONPATH": str(root)}
                p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--episodes", str(args.episodes),
                                    "--worker", str(mined), str(he)], env=env, cwd=root, capture_output=True, text=True)
                if p.returncode != 0:
                    print(f"| {r + 1} | {name} | failed: {p.stderr.strip().splitlines()[-1:]} | |")
                    continue
                x = json.loads(p.stdout.strip().splitlines()[-1])
                print(f"| {r + 1} | {name} | {x[mined.name]} | {x[he.name]} |", flush=True)


if __name__ == "__main__":
    main()
