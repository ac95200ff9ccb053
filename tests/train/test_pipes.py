import json
import subprocess
import sys

from dagster_pipes import encode_env_var

CHILD = """
from composer_dag.pipes import Reporter
with Reporter() as rep:
    rep.log("hello")
    rep.progress("step 1")
    rep.report_custom_message({"k": 1})
    rep.result({"tokens": 5, "curve": [[1, 2.0]]})
"""


def run_child(env):
    import os

    full = {k: v for k, v in os.environ.items() if not k.startswith("DAGSTER_PIPES")}
    full.update(PYTHONPATH=os.getcwd(), **env)
    return subprocess.run([sys.executable, "-c", CHILD], env=full, capture_output=True,
                          text=True, timeout=120, check=True)


def test_plain_mode_prints_summary_last():
    p = run_child({"RANK": "0"})
    assert p.stdout.splitlines() == ["step 1", json.dumps({"tokens": 5, "curve": [[1, 2.0]]})]
    assert "hello" in p.stderr


def test_a_cluster_job_reads_the_summary_from_its_file_not_the_terminal(tmp_path):
    """Under a job (``$COMPOSER_RESULT_PATH`` set) the summary goes to the file only: the job reads it
    there, and the terminal of `make run` gets progress lines, not tens of KB of JSON."""
    path = tmp_path / "result.json"
    p = run_child({"RANK": "0", "COMPOSER_RESULT_PATH": str(path)})
    assert p.stdout.splitlines() == ["step 1"]
    assert json.loads(path.read_text()) == {"tokens": 5, "curve": [[1, 2.0]]}


def test_other_ranks_are_silent():
    p = run_child({"RANK": "1"})
    assert p.stdout == "" and "hello" not in p.stderr


def test_pipes_mode_forwards_messages(tmp_path):
    ctx = {"asset_keys": ["midtrained_checkpoint"], "code_version_by_asset_key": None,
           "provenance_by_asset_key": None, "partition_key": None, "partition_key_range": None,
           "partition_time_window": None, "run_id": "r1", "job_name": "j", "retry_number": 0,
           "extras": {}}
    (tmp_path / "ctx.json").write_text(json.dumps(ctx))
    msgs = tmp_path / "messages.jsonl"
    p = run_child({"RANK": "0",
                   "DAGSTER_PIPES_CONTEXT": encode_env_var({"path": str(tmp_path / "ctx.json")}),
                   "DAGSTER_PIPES_MESSAGES": encode_env_var({"path": str(msgs)})})
    assert p.stdout.strip() == ""  # progress and the summary went through Pipes
    sent = [json.loads(line) for line in msgs.read_text().splitlines()]
    methods = [m["method"] for m in sent]
    assert methods[0] == "opened" and methods[-1] == "closed"
    assert "log" in methods
    custom = [m["params"]["payload"] for m in sent if m["method"] == "report_custom_message"]
    assert custom == [{"k": 1}, {"tokens": 5, "curve": [[1, 2.0]]}]
    # the launching asset builds the materialization from the summary; the payload reports none
    assert "report_asset_materialization" not in methods
