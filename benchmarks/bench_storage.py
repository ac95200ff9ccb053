"""Publishing and fetching an artifact of many small files on S3 (moto's server over HTTP).

The artifact is shaped like a task set: ``--tasks`` directories of ``--files`` small files.
Two ways, alternating, each timed per round:

- ``serial``: the baseline, what the storage layer did before. Files uploaded one by one, the
  manifest written by reading every file back, the artifact verified where it lies, then
  downloaded one by one.
- ``parallel``: ``Storage.publish_dir`` (``TRANSFER_WORKERS`` requests at once; the manifest
  from the hashes taken while uploading) and a download of ``TRANSFER_WORKERS`` files at once,
  verified on the local copy.

    .venv/bin/python benchmarks/bench_storage.py --tasks 100 --files 6 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from composer_dag import storage as storage_mod  # noqa: E402
from composer_dag.storage import Storage  # noqa: E402


def start_moto(port: int) -> subprocess.Popen:
    exe = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1)
            return proc
        except Exception:
            if time.monotonic() > deadline:
                proc.kill()
                raise SystemExit("moto_server did not start")
            time.sleep(0.2)


def serial(st: Storage, src: str, url: str, dest: str) -> None:
    workers = storage_mod.TRANSFER_WORKERS
    storage_mod.TRANSFER_WORKERS = 1
    try:
        st.put_dir(src, url)
        st.write_manifest(url)
        st.verify_manifest(url)
        st.get_dir(url, dest)
    finally:
        storage_mod.TRANSFER_WORKERS = workers


def parallel(st: Storage, src: str, url: str, dest: str) -> None:
    st.publish_dir(src, url)
    st.get_dir(url, dest)
    copy = Storage(dest)
    copy.verify_manifest(copy.root)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=100)
    ap.add_argument("--files", type=int, default=6, help="files per task directory")
    ap.add_argument("--bytes", type=int, default=2000, help="bytes per file")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--port", type=int, default=5123)
    args = ap.parse_args()

    import boto3

    proc = start_moto(args.port)
    endpoint = f"http://127.0.0.1:{args.port}"
    try:
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="k", aws_secret_access_key="s",
                     region_name="us-east-1").create_bucket(Bucket="bench")
        st = Storage("s3://bench/root", {"endpoint_url": endpoint, "key": "k", "secret": "s"})
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "src")
            for t in range(args.tasks):
                for f in range(args.files):
                    p = os.path.join(src, f"task-{t:04d}", f"file-{f}.txt")
                    os.makedirs(os.path.dirname(p), exist_ok=True)
                    with open(p, "wb") as fh:
                        fh.write(os.urandom(args.bytes))
            n = args.tasks * args.files
            times: dict[str, list[float]] = {"serial": [], "parallel": []}
            for r in range(args.rounds):
                for name, fn in (("serial", serial), ("parallel", parallel)):
                    dest = os.path.join(tmp, f"{name}-{r}")
                    t0 = time.perf_counter()
                    fn(st, src, st.url(name, str(r)), dest)
                    times[name].append(time.perf_counter() - t0)
                    print(f"round {r} {name:>8}: {times[name][-1]:6.2f} s for {n} files")
            s, p = statistics.median(times["serial"]), statistics.median(times["parallel"])
            print(f"median: serial {s:.2f} s, parallel {p:.2f} s, {s / p:.2f}x "
                  f"({n} files of {args.bytes} bytes, {storage_mod.TRANSFER_WORKERS} workers)")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


if __name__ == "__main__":
    main()
