"""The default run's mined source, step by step: networkx bootstrapped and mined as
``sources.yaml`` declares it (``task_format.NETWORKX``: four test modules, 20 tasks, 2 workers),
then the environment with its tasks published to a fresh local storage, as ``repo_environments``
does. Rounds alternate between this checkout and ``--old`` (a copy of the repository at an older
commit, e.g. ``git archive OLD | tar -x -C /tmp/old``), each in a process of its own; prints a
markdown table and whether both made the same tasks (the digest of every ``task.json``).

    .venv/bin/python benchmarks/bench_mining.py [--old /tmp/old] [--rounds 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def worker() -> None:
    from composer_dag.tasks.format import NETWORKX
    from composer_dag.tasks.sources.build import repo_environment
    from composer_dag.storage import Storage

    with tempfile.TemporaryDirectory(prefix="bench-mining-") as tmp:
        out = Path(tmp) / "env"
        t = time.monotonic()
        row = repo_environment(NETWORKX, out, seed=0, workers=2)
        wall = time.monotonic() - t
        digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(out.glob("tasks/*/task.json")))).hexdigest()
        st = Storage(str(Path(tmp) / "storage"))
        t = time.monotonic()
        st.publish_dir(str(out), st.url("repo_environments", "networkx", "run"))
        publish = time.monotonic() - t
        files = sum(len(f) for _, _, f in os.walk(out))
    print(json.dumps({"bootstrap": row.get("seconds"), "mine": row.get("mine_seconds"), "wall": round(wall, 2),
                      "publish": round(publish, 2), "tasks": row["tasks"], "files": files, "digest": digest[:12]}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", default=None, help="a copy of the repository at the older commit (omit: this one only)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker()
    sides = [("new", HERE)] + ([("old", Path(args.old).resolve())] if args.old else [])
    print("| round | code | bootstrap s | mine s | bootstrap + mine s | publish s | tasks | files | task.json digest |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---|")
    for r in range(args.rounds):
        for name, root in (sides if r % 2 == 0 else sides[::-1]):
            env = {**os.environ, "PYTHONPATH": str(root)}
            p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker"], env=env, cwd=root,
                               capture_output=True, text=True)
            if p.returncode != 0:
                print(f"| {r + 1} | {name} | failed: {p.stderr.strip().splitlines()[-1:]} |||||||")
                continue
            x = json.loads(p.stdout.strip().splitlines()[-1])
            print(f"| {r + 1} | {name} | {x['bootstrap']} | {x['mine']} | {x['wall']} | {x['publish']} | {x['tasks']} | "
                  f"{x['files']} | {x['digest']} |", flush=True)


if __name__ == "__main__":
    main()
