"""Repository environments at scale: ten real packages (none used by the tests) bootstrapped and
mined through the map, their soundness, time per bootstrap and per task, the wheel store's and
the layers' hit rates (a second pass over the same store), then the map's fixed cost per
repository over many small generated repositories. Prints markdown sections.

    .venv/bin/python benchmarks/bench_repo_envs.py --out /tmp/bench-repos [--small 100] [--workers 2]
        [--packages NAME==VERSION,...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from composer_dag.grading.grade import check_task
from composer_dag.repos.bootstrap import bootstrap
from composer_dag.repos.config import BootstrapConfig
from composer_dag.tasks.sources.repo_map import map_repos
from composer_dag.storage import open_storage

PACKAGES = (("more-itertools", "10.5.0"), ("toolz", "1.0.0"), ("boltons", "24.1.0"), ("six", "1.16.0"),
            ("idna", "3.10"), ("tabulate", "0.9.0"), ("iso8601", "2.1.0"), ("humanize", "4.11.0"),
            ("pathspec", "0.12.1"), ("jmespath", "1.0.1"))


def small_repo(root: Path, i: int) -> Path:
    """A small pure-Python project with its own tests (distinct code per ``i``)."""
    (root / f"lib{i}").mkdir(parents=True)
    (root / f"lib{i}" / "__init__.py").write_text(
        f"def scale(x):\n    return x * {i + 2}\n\n\ndef clamp(x, lo=0, hi={i + 10}):\n"
        "    if x < lo:\n        return lo\n    if x > hi:\n        return hi\n    return x\n")
    (root / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n\n'
        f'[project]\nname = "lib{i}"\nversion = "1.0"\nlicense = {{text = "MIT"}}\n\n[tool.setuptools]\n'
        f'packages = ["lib{i}"]\n')
    (root / "tests").mkdir()
    (root / "tests" / "test_lib.py").write_text(
        f"from lib{i} import clamp, scale\n\n\ndef test_scale():\n    assert scale(3) == {3 * (i + 2)}\n\n\n"
        f"def test_clamp():\n    assert clamp(-1) == 0 and clamp({i + 50}) == {i + 10} and clamp(5) == 5\n")
    return root


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", type=int, default=100)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--mine", type=int, default=3)
    ap.add_argument("--packages", default=None, help="NAME==VERSION,... instead of the ten (PACKAGES)")
    args = ap.parse_args()
    packages = [tuple(x.split("==", 1)) for x in args.packages.split(",")] if args.packages else PACKAGES
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    storage = open_storage(str(out / "storage"))
    cfg = BootstrapConfig(store=str(out / "store"))
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"## Repository environments ({when}, {platform.node()}, {args.workers} workers)\n")

    sources = [f"pypi:{n}=={v}" for n, v in packages]
    t0 = time.monotonic()
    first = map_repos(sources, str(out / "storage" / "pass1"), storage, cfg, mine_max=args.mine, workers=args.workers,
                      progress=print)
    wall1 = time.monotonic() - t0
    rows, sound_total, task_secs = [], 0, []
    for r in first["results"]:
        sound = 0
        for k, tid in enumerate(r.get("tasks") or []):
            d = out / "check" / tid
            storage.get_dir(str(out / "storage" / "pass1" / "tasks" / str(r["index"]) / tid), str(d))
            sound += bool(check_task(d)["ok"])
        sound_total += sound
        b = r.get("bootstrap") or {}
        per_task = (r["mine_seconds"] / len(r["tasks"])) if r.get("tasks") else None
        if per_task:
            task_secs.append(per_task)
        rows.append(f"| {r['source'][5:]} | {'yes' if b.get('ok') else 'no: ' + str(r.get('reason'))} | "
                    f"{b.get('tests_passing', '')} / {b.get('tests_total', '')} | {b.get('licence') or ''} | "
                    f"{r.get('bootstrap_seconds')} | {len(r.get('tasks') or [])} | {sound} | "
                    f"{'' if per_task is None else f'{per_task:.1f}'} | {(r.get('mine') or {}).get('rejected', '')} |")
    print(f"`map_repos` over {len(sources)} packages, mining up to {args.mine} tasks each: wall {wall1:.1f} s, "
          f"{first['ok']} ok, failures by reason {first['failed_by_reason']}\n")
    print("| package | bootstraps | tests kept / total | licence | bootstrap s | tasks | sound | s per task | rejected |")
    print("|---|---|---:|---|---:|---:|---:|---:|---|")
    print("\n".join(rows))
    print(f"\n{sum(r['ok'] for r in first['results'])} of {len(sources)} bootstrap and mine; {sound_total} sound tasks; "
          f"median s per task {statistics.median(task_secs) if task_secs else 0:.1f}\n")
    for r in first["results"]:
        if not r["ok"]:
            print(f"- {r['source']}: {r.get('reason')}: {(r.get('error') or '')[:300]}")

    t0 = time.monotonic()
    second = map_repos(sources, str(out / "storage" / "pass2"), storage, cfg, mine_max=0, workers=args.workers)
    wall2 = time.monotonic() - t0
    hits = {"wheel": [0, 0], "layer": [0, 0]}
    for name in ("pass1", "pass2"):
        for r in (first if name == "pass1" else second)["results"]:
            env = out / "storage" / name / "envs" / str(r["index"]) / "env.json"
            if env.exists():
                st = json.loads(env.read_text())["store"]
                hits["wheel"][name == "pass2"] += st["wheel_hit"]
                hits["layer"][name == "pass2"] += st["layer_hit"]
    n_ok = [first["ok"], second["ok"]]
    print(f"\nHit rates (first pass on an empty store, second pass over the same store; wall {wall1:.1f} s "
          f"with mining, {wall2:.1f} s without):\n")
    print("| store | first pass | second pass |\n|---|---:|---:|")
    for k in ("wheel", "layer"):
        print(f"| {k} | {hits[k][0]} / {n_ok[0]} | {hits[k][1]} / {n_ok[1]} |")

    if args.small:
        with tempfile.TemporaryDirectory() as tmp:
            srcs = [str(small_repo(Path(tmp) / f"r{i}", i)) for i in range(args.small)]
            srcs[7] = str(Path(tmp) / "does-not-exist")  # one failing repository among them
            t0 = time.monotonic()
            m = map_repos(srcs, str(out / "storage" / "small"), storage, cfg, mine_max=0, workers=args.workers)
            wall = time.monotonic() - t0
            boot = [r["bootstrap_seconds"] for r in m["results"] if r.get("bootstrap_seconds") and r["ok"]]
            t0 = time.monotonic()
            direct = [bootstrap(srcs[i], Path(tmp) / f"direct{i}", cfg)["seconds"] for i in range(10)]
            direct_wall = time.monotonic() - t0
        per = wall * args.workers / len(srcs)
        print(f"\nThe map over {len(srcs)} small generated repositories (one of them missing): wall {wall:.1f} s, "
              f"{m['ok']} ok, failures {m['failed_by_reason']}; per repository {per:.2f} worker-seconds, of which "
              f"bootstrap itself {statistics.mean(boot):.2f} s (median {statistics.median(boot):.2f}); "
              f"the map's fixed cost {per - statistics.mean(boot):.2f} s per repository. Ten bootstraps called "
              f"directly, one at a time: {direct_wall / 10:.2f} s each (median {statistics.median(direct):.2f} s).")


if __name__ == "__main__":
    main()
