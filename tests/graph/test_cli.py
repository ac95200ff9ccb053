"""The command line as a user runs it: a real subprocess, JSON summary on the last line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.graph.test_graph_data import make_source

CLI = [sys.executable, "-m", "composer_dag.cli"]


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})


def last_json(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_corpus_then_dedup_local(tmp_path: Path):
    make_source(tmp_path / "src")
    corpus = last_json(run("corpus", str(tmp_path / "src"), "--out", str(tmp_path / "corpus")))
    assert corpus["files_seen"] == 7
    assert corpus["files_ingested"] == 6 and corpus["skipped"] == {"binary": 1}
    assert (tmp_path / "corpus/manifest.json").exists()
    out = last_json(run("dedup", str(tmp_path / "corpus"), "--out", str(tmp_path / "shards")))
    assert out["files_in"] == 6
    assert out["files_in"] == out["files_kept"] + sum(out["dropped"].values())
    assert out["dropped"].get("contaminated") == 1
    assert (tmp_path / "shards/manifest.json").exists()


def test_corpus_and_dedup_on_s3(tmp_path: Path, s3_bucket):
    make_source(tmp_path / "src")
    env = {
        "COMPOSER_S3_ENDPOINT_URL": s3_bucket["endpoint"],
        "AWS_ACCESS_KEY_ID": s3_bucket["options"]["key"],
        "AWS_SECRET_ACCESS_KEY": s3_bucket["options"]["secret"],
    }
    b = s3_bucket["bucket"]
    corpus = run("corpus", str(tmp_path / "src"), "--out", f"s3://{b}/corpus", env=env)
    assert last_json(corpus)["files_ingested"] == 6
    shards = run("dedup", f"s3://{b}/corpus", "--out", f"s3://{b}/shards", env=env)
    assert last_json(shards)["files_kept"] >= 1
    for proc in (corpus, shards):
        assert s3_bucket["options"]["secret"] not in proc.stdout + proc.stderr


def test_errors_are_one_line(tmp_path: Path):
    proc = run("dedup", str(tmp_path / "nothing"), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "error:" in proc.stderr
    proc = run("corpus", str(tmp_path / "does-not-exist"), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr


def test_sandbox_exec_passes_exit_code(tmp_path: Path):
    (tmp_path / "hello.txt").write_text("hi\n")
    proc = run("sandbox", "exec", str(tmp_path), "--", "sh", "-c", "cat hello.txt; exit 7")
    assert proc.returncode == 7
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "hi" and json.loads(lines[-1])["exit_code"] == 7
    # an option between the workspace and "--" is the command line's, not the command's
    proc = run("sandbox", "exec", str(tmp_path), "--timeout", "1", "--", "sleep", "20")
    assert json.loads(proc.stdout.strip().splitlines()[-1])["timed_out"] is True, proc.stdout + proc.stderr
    proc = run("sandbox", "exec", str(tmp_path), "--bogus", "--", "true")
    assert proc.returncode == 2 and "--bogus" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_env_grade_broken_and_reference(tmp_path: Path, humaneval_tasks):
    from composer_dag.tasks.taskdir import apply_reference

    out, summary = humaneval_tasks
    assert summary["tasks"] == 3
    task = sorted(out.glob("*/*/task.json"))[0].parent
    broken = last_json(run("env", "grade", str(task), str(task / "repo")))
    assert broken["reward"] == 0.0 and broken["failed"] >= 1
    ws = apply_reference(task, tmp_path / "ws")
    good = last_json(run("env", "grade", str(task), str(ws)))
    assert good["reward"] == 1.0 and good["flags"] == [] and good["passed"] >= 1


def test_env_grade_reads_an_action_log(tmp_path: Path, humaneval_tasks):
    """With ``--actions``, the flags of commands fire on a workspace graded from the command line;
    an entry that breaks the log's contract is counted, not dropped."""
    from composer_dag.tasks.taskdir import apply_reference

    out, _ = humaneval_tasks
    task = sorted(out.glob("*/*/task.json"))[0].parent
    ws = apply_reference(task, tmp_path / "ws")
    log = tmp_path / "actions.jsonl"
    log.write_text("\n".join([json.dumps({"kind": "exec", "command": "git log -p --all"}),
                              json.dumps({"kind": "read", "path": "solution.py"}),
                              json.dumps({"kind": "teleport"}), "{not json"]) + "\n")
    r = last_json(run("env", "grade", str(task), str(ws), "--actions", str(log)))
    assert any(f.startswith("git_history") for f in r["flags"]), r["flags"]
    assert r["actions"] == {"read": 2, "skipped": {"unknown kind": 1, "not JSON": 1}}, r["actions"]
    clean = last_json(run("env", "grade", str(task), str(ws)))
    assert clean["flags"] == [] and clean["reward"] == 1.0
    proc = run("env", "grade", str(task), str(ws), "--actions", str(tmp_path / "missing.jsonl"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr
