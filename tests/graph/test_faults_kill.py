"""Faults: the RL run and an evaluation SIGKILLed (the whole process tree) at a seeded random
point, then started again. The next run resumes from the last completed step and loses none, and
a half-written checkpoint or a half-copied artifact is never read. (Mid-training killed and
resumed to the same weights as an uninterrupted run: tests/train/test_midtrain.py.)"""

import contextlib
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from composer_dag.cluster.spec import LaunchSpec, local_command
from composer_dag.storage import ArtifactError, Storage

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SEED = int(os.environ.get("COMPOSER_FAULT_SEED", "20260"))  # change it to try other kill points


def _env(**extra):
    return {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **extra}


def _start(cmd, log: Path, **env) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, cwd=ROOT, env=_env(**env), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _procs() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) of every process, from /proc."""
    out = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(stat).read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        out[int(stat.split("/")[2])] = (int(fields[1]), fields[0])
    return out


def _tree(root: int) -> list[int]:
    """``root`` and every live descendant (by parent links: torchrun starts its workers in a
    session of their own, so a process group is not the whole tree)."""
    procs, found, todo = _procs(), [], [root]
    while todo:
        pid = todo.pop()
        if pid in procs and procs[pid][1] != "Z":
            found.append(pid)
        todo += [c for c, (ppid, _) in procs.items() if ppid == pid]
    return found


def _kill_tree(proc: subprocess.Popen) -> None:
    """Freeze the whole process tree (SIGSTOP, so nothing new is spawned), SIGKILL all of it,
    and wait until none of it is left."""
    pids = _tree(proc.pid)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    pids = sorted(set(pids) | set(_tree(proc.pid)))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=60)
    deadline = time.monotonic() + 30
    alive = pids
    while alive and time.monotonic() < deadline:
        procs = _procs()
        alive = [p for p in pids if p in procs and procs[p][1] != "Z"]
        time.sleep(0.05)
    assert proc.returncode == -signal.SIGKILL and not alive, alive


def _wait(pred, proc: subprocess.Popen, log: Path, timeout: float = 300) -> float:
    """Poll ``pred`` every 20 ms while ``proc`` runs; the time it first held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return time.monotonic()
        if proc.poll() is not None:
            pytest.fail(f"the process ended (rc {proc.returncode}) before the fault:\n{log.read_text()[-3000:]}")
        time.sleep(0.02)
    _kill_tree(proc)
    pytest.fail(f"timed out waiting:\n{log.read_text()[-3000:]}")


def _kill_at_random_point(proc, log, first_mark, second_mark, rng: random.Random) -> float:
    """Wait for two progress marks (e.g. the first two checkpoints), then SIGKILL the tree after
    a random delay of 0 to 2 times the interval between them; returns the delay."""
    t1 = _wait(first_mark, proc, log)
    t2 = _wait(second_mark, proc, log)
    delay = rng.uniform(0, 2 * (t2 - t1))
    time.sleep(delay)
    assert proc.poll() is None, f"the run ended within the kill window ({delay:.2f}s): nothing was interrupted"
    _kill_tree(proc)
    return delay


def _run(cmd, timeout=600, **env) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=ROOT, env=_env(**env), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return p


def _latest(out: Path) -> dict | None:
    try:
        return json.loads((out / "latest").read_text())
    except (OSError, ValueError):
        return None


def _verify(path) -> dict:
    store = Storage(str(path))
    return store.verify_manifest(store.root)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, learnable_base):
    """Learnable tasks, a tiny policy and its tokenizer (shared), and token shards for mid-training."""
    from composer_dag.train.data import pack_documents

    out = tmp_path_factory.mktemp("faults")
    s = learnable_base
    src = os.path.dirname(json.__file__)
    docs = [(f, open(f, encoding="utf-8").read(), "stdlib", "Python") for f in sorted(glob.glob(src + "/*.py"))]
    pack_documents(docs, s["tokenizer_dir"], str(out / "shards"), val_fraction=0.15, seed=0)
    return {**s, "root": out, "shards": str(out / "shards")}


# ---------------------------------------------------------------- mid-training

def _midtrain_cmd(setup, name, launcher="torchrun", **kw) -> tuple[list[str], Path]:
    out = setup["root"] / name
    cfg = dict(model_dir=setup["base_dir"], data_dir=setup["shards"], out_dir=str(out), seq_len=64, micro_batch=4,
               max_steps=16, warmup_steps=2, lr=3e-3, min_lr=3e-4, eval_every=8, eval_batches=1, save_every=2,
               keep_checkpoints=2, log_every=1, seed=0)
    cfg.update(kw)
    path = setup["root"] / f"{name}.json"
    path.write_text(json.dumps(cfg))
    spec = LaunchSpec(entry="composer_dag.train.midtrain", args=["--config", str(path)], nproc_per_node=1,
                      launcher=launcher)
    return local_command(spec), out


def test_half_written_checkpoint_is_never_read(setup, tmp_path):
    """Protection: a checkpoint whose save was cut short (killed after DeepSpeed wrote its
    state, before the export, trainer state and manifest) is never resumed from. ``latest``
    still names the previous checkpoint, ``verify_manifest`` refuses the partial one, and even
    with ``latest`` pointing at it (a pointer that got ahead of its data) the resume logic
    refuses it and falls back to the previous complete checkpoint, then re-trains exactly the
    lost steps."""
    cmd, out = _midtrain_cmd(setup, "mt_partial", launcher="python", max_steps=8, save_every=4, eval_every=0)
    log = tmp_path / "killed.log"
    proc = _start(cmd, log, COMPOSER_SAVE_PAUSE_S="2")
    partial = out / "checkpoints" / "step_0000008"
    _wait(lambda: (_latest(out) or {}).get("step") == 4, proc, log)
    _wait(lambda: partial.is_dir() and any(partial.glob("*optim_states.pt")), proc, log)
    _kill_tree(proc)  # inside the save: DeepSpeed state written, nothing else yet
    assert _latest(out)["tag"] == "step_0000004"
    assert not (partial / "manifest.json").exists() and not (partial / "trainer_state.json").exists()
    with pytest.raises(ArtifactError, match="no manifest.json: the artifact is incomplete"):
        _verify(partial)

    (out / "latest").write_text(json.dumps({"tag": "step_0000008", "step": 8, "samples": 32}))
    p = _run(cmd)
    assert "checkpoint step_0000008 is not usable, skipped" in p.stderr, p.stderr[-3000:]
    assert "falling back from step_0000008 to step_0000004" in p.stderr
    assert "resumed from step_0000004: step 4, sample 16" in p.stderr
    result = json.loads((out / "result.json").read_text())
    assert result["steps"] == 8 and result["tokens_this_run"] == 4 * 4 * 64
    assert _latest(out)["tag"] == "step_0000008" and _verify(partial)
    assert json.loads((partial / "trainer_state.json").read_text())["step"] == 8


def _fake_checkpoint(root: Path, step: int, seal: bool = True) -> Path:
    """A checkpoint directory with real files (a weights blob and a trainer state)."""
    from composer_dag.runtime.checkpoint import seal_checkpoint

    d = root / "checkpoints" / f"step_{step:07d}"
    (d / "hf").mkdir(parents=True)
    (d / "hf" / "model.safetensors").write_bytes(os.urandom(4096))
    (d / "trainer_state.json").write_text(json.dumps({"step": step}))
    if seal:
        seal_checkpoint(str(d))
    return d


def test_resume_picks_newest_checkpoint_matching_its_manifest(tmp_path):
    """Protection: the resume logic reads only a checkpoint that matches its manifest. A
    damaged file in the one ``latest`` names makes it fall back to the newest older sealed
    one; an unsealed one (save cut short) is skipped; one newer than ``latest`` was never
    committed and is ignored; an unreadable ``latest`` still finds the newest sealed one."""
    from composer_dag.runtime.checkpoint import resume_checkpoint

    ckpts = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        _fake_checkpoint(tmp_path, step)
    _fake_checkpoint(tmp_path, 8, seal=False)
    lines = []
    (tmp_path / "latest").write_text(json.dumps({"tag": "step_0000004", "step": 4}))
    assert resume_checkpoint(str(tmp_path), str(ckpts), lines.append) == "step_0000004" and not lines

    weights = ckpts / "step_0000004" / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")  # one byte changed on disk
    assert resume_checkpoint(str(tmp_path), str(ckpts), lines.append) == "step_0000002"
    assert "step_0000004 is not usable" in lines[0] and "does not match its manifest" in lines[0]
    assert lines[1] == "falling back from step_0000004 to step_0000002, the newest complete checkpoint"

    (tmp_path / "latest").write_text(json.dumps({"tag": "step_0000008", "step": 8}))
    lines.clear()
    assert resume_checkpoint(str(tmp_path), str(ckpts), lines.append) == "step_0000006"
    assert "step_0000008 is not usable, skipped" in lines[0] and "incomplete" in lines[0]

    (tmp_path / "latest").write_text('{"tag": "step_00')  # torn
    lines.clear()
    assert resume_checkpoint(str(tmp_path), str(ckpts), lines.append) == "step_0000006"
    assert lines[0].startswith(f"unreadable {tmp_path / 'latest'}")

    for d in ckpts.iterdir():
        (d / "manifest.json").unlink(missing_ok=True)
    (tmp_path / "latest").write_text(json.dumps({"tag": "step_0000006", "step": 6}))
    assert resume_checkpoint(str(tmp_path), str(ckpts), lines.append) is None
    assert lines[-1] == "no complete checkpoint at or before step_0000006: starting from the beginning"


def test_torn_metrics_line_is_dropped_and_counted(tmp_path):
    """Protection: a metrics line cut short by a crash (no newline, not JSON) is dropped and
    counted when a run resumes, instead of making the resume fail; lines past the resumed step
    go too."""
    from composer_dag.runtime.checkpoint import trim_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": i, "loss": 1.0}) + "\n" for i in (1, 2, 3)) + '{"step": 4, "lo')
    assert trim_metrics(str(path), 2) == 1
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]


# ---------------------------------------------------------------- RL

def test_rl_killed_at_random_point_loses_no_step(setup, tmp_path):
    """Protection: the RL run (async generation, weights published as full + deltas) killed at
    a seeded random point after its first checkpoints resumes at the last committed policy
    version: every update 1..N is logged once, every batch's rollouts are kept, the final
    trainer state is version N, and the published weights of version N rebuild, digest
    checked, to exactly the final policy."""
    import torch
    from safetensors.torch import load_file

    from composer_dag.rl.weights import reconstruct

    out = setup["root"] / "rl_random"
    cfg = {"policy_dir": setup["policy_dir"], "tasks_dir": setup["tasks_dir"], "out_dir": str(out),
           "steps": 6, "tasks_per_step": 1, "group_size": 2, "torch_threads": 1, "full_every": 3,
           "async_generation": True, "max_staleness": 1,
           "trainer": {"lr": 1e-3, "weight_decay": 0.1, "micro_batch": 2},
           "orchestrator": {"max_turns": 1, "max_new_tokens": 8, "max_context": 512, "system_style": "compact",
                            "workers": 2},
           "inference": {"engine": "hf"}}
    path = setup["root"] / "rl_random.json"
    path.write_text(json.dumps(cfg))
    cmd = [sys.executable, "-m", "composer_dag.rl.run", "--config", str(path)]
    log = tmp_path / "killed.log"
    proc = _start(cmd, log)
    step_at = lambda n: lambda: (_latest(out) or {}).get("step", 0) >= n
    delay = _kill_at_random_point(proc, log, step_at(1), step_at(2), random.Random(SEED + 1))
    committed = _latest(out)
    k = committed["step"]
    assert 2 <= k < 6 and not (out / "result.json").exists(), (delay, committed)
    assert _verify(out / "checkpoints" / committed["tag"])

    p = _run(cmd)
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res == json.loads((out / "result.json").read_text())
    assert res["resumed_from"] == k and res["steps"] == 6 and res["weights_verified"], p.stderr[-3000:]
    assert f"resumed from step_{k:07d} at policy version {k}" in p.stderr
    assert [json.loads(x)["step"] for x in open(out / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert sorted(os.listdir(out / "rollouts")) == [f"step_{i:04d}.parquet" for i in range(6)]
    for i in range(6):
        t = pq.read_table(out / "rollouts" / f"step_{i:04d}.parquet")
        assert t.num_rows == 2 and set(t.column("step").to_pylist()) == {i}
        assert all(i - 1 <= v <= i for v in t.column("policy_version").to_pylist())  # within max_staleness
    final = out / "checkpoints" / "step_0000006"
    assert json.loads((final / "trainer_state.json").read_text())["version"] == 6 and _verify(final)
    wstore = Storage(str(out))
    latest = wstore.read_json(wstore.url("weights", "latest.json"))
    assert latest["version"] == 6 and latest["digest"], latest
    published = reconstruct(wstore, wstore.url("weights"), 6)
    policy = load_file(str(out / "hf" / "model.safetensors"))
    assert published.keys() == policy.keys()
    for name in policy:
        # the fleet runs bf16: the published version is the policy rounded to bf16, bit for bit
        assert torch.equal(published[name], policy[name].to(published[name].dtype)), name
    # The untrained policy never solves a task, so every advantage is 0 and only AdamW's
    # decoupled weight decay moves the weights: by (1 - lr * wd) per update. The final policy is
    # the start decayed exactly 6 times: no update was lost to the kill, none applied twice.
    assert {r for _, r in res["reward_curve"]} == {0.0}
    start = load_file(os.path.join(setup["policy_dir"], "model.safetensors"))
    for name in policy:
        torch.testing.assert_close(policy[name], start[name] * (1 - 1e-3 * 0.1) ** 6, rtol=2e-6, atol=1e-9,
                                   msg=name)
        assert not torch.allclose(policy[name], start[name] * (1 - 1e-3 * 0.1) ** 5, rtol=2e-6, atol=1e-9)


# ---------------------------------------------------------------- evaluation

def _eval_config(setup, checkpoint, out) -> dict:
    return {"checkpoint_dir": str(checkpoint), "tasks_dir": setup["tasks_dir"], "out_dir": str(out),
            "samples_per_task": 2, "ks": [1, 2], "batch_tasks": 1, "humaneval_ids": [], "torch_threads": 1,
            "max_tasks": None,
            "agent": {"max_turns": 2, "max_new_tokens": 16, "max_context": 1024, "system_style": "compact", "workers": 2},
            "inference": {"engine": "hf"}}


class _Log:
    def __init__(self):
        self.lines = []

    def log(self, msg):
        self.lines.append(msg)


def _evaluate_here(cfg: dict, log: _Log | None = None) -> dict:
    """An evaluation run in this process (the same ``evaluate`` the entry point calls)."""
    import torch

    from composer_dag.evals import EvalConfig, evaluate

    cfg = dict(cfg)
    paths = [cfg.pop(k) for k in ("checkpoint_dir", "tasks_dir", "out_dir")]
    threads = torch.get_num_threads()
    try:
        return evaluate(*paths, EvalConfig.load(cfg), log)
    finally:
        torch.set_num_threads(threads)


_TIMING = ("seconds", "gen_seconds", "tool_seconds", "grade_seconds", "episode_seconds", "rollout_id")


def _rows(path) -> dict:
    """Rows of a results/rollouts Parquet by (task, sample), timings left out."""
    return {(r["task_id"], r["sample_index"]): {k: v for k, v in r.items() if k not in _TIMING}
            for r in pq.read_table(path).to_pylist()}


def test_eval_killed_at_random_point_resumes_with_same_result(setup, tmp_path):
    """Protection: an evaluation SIGKILLed at a seeded random point after some batches
    finished, run again with the same inputs, reuses exactly the batches that were persisted
    (atomically, as it went) and ends with the same per-sample results, episodes and pass@k as
    an uninterrupted run. The persisted batches are keyed by the inputs: a different
    checkpoint evaluated into the same directory reuses none of them."""
    ref = _evaluate_here(_eval_config(setup, setup["base_dir"], tmp_path / "ref"))
    assert ref["resumed_batches"] == 0 and not (tmp_path / "ref" / "progress").exists()

    out = tmp_path / "out"
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(_eval_config(setup, setup["base_dir"], out)))
    cmd = [sys.executable, "-m", "composer_dag.evals.run", "--config", str(path)]
    log = tmp_path / "killed.log"
    proc = _start(cmd, log)
    batch = lambda n: lambda: len(glob.glob(str(out / "progress" / "*" / "batch_*.parquet"))) >= n
    delay = _kill_at_random_point(proc, log, batch(1), batch(2), random.Random(SEED + 2))
    done = sorted(glob.glob(str(out / "progress" / "*" / "batch_*.parquet")))
    assert 2 <= len(done) < 6 and not (out / "manifest.json").exists(), (delay, done)
    kept = tmp_path / "progress-at-kill"
    shutil.copytree(out / "progress", kept)

    log = _Log()
    s = _evaluate_here(_eval_config(setup, setup["base_dir"], out), log)
    assert s["resumed_batches"] == len(done), log.lines
    assert sum("(reused from an interrupted run)" in x for x in log.lines) == len(done)
    assert sum("(sampled)" in x for x in log.lines) == 6 - len(done)
    for key in ("num_samples", "pass@1", "pass_at", "per_task", "by_source", "mean_reward", "flag_rate",
                "checkpoint_digest"):
        assert s[key] == ref[key], key
    assert s["cost"]["generated_tokens"] == ref["cost"]["generated_tokens"]
    assert _rows(out / "results.parquet") == _rows(tmp_path / "ref" / "results.parquet")
    assert _rows(out / "rollouts.parquet") == _rows(tmp_path / "ref" / "rollouts.parquet")
    assert not (out / "progress").exists() and "summary.json" in _verify(out)["files"]

    # another checkpoint into the same directory, with the killed run's batches put back
    other = tmp_path / "other_ckpt"
    shutil.copytree(setup["base_dir"], other)
    cfg_file = other / "generation_config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "top_k": 50}))
    shutil.copytree(kept, out / "progress")
    s2 = _evaluate_here(_eval_config(setup, other, out))
    assert s2["resumed_batches"] == 0 and s2["checkpoint_digest"] != ref["checkpoint_digest"]
    assert {r["checkpoint_digest"] for r in _rows(out / "results.parquet").values()} == {s2["checkpoint_digest"]}


def test_eval_refuses_half_copied_checkpoint(setup, tmp_path):
    """Protection: an evaluation never reads a checkpoint directory whose files do not match
    its manifest (a copy cut short after ``manifest.json`` landed): the entry point exits with
    one clear line, no traceback, and writes no results."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(setup["base_dir"], ckpt)
    Storage(str(ckpt)).write_manifest(Storage(str(ckpt)).root)
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # the copy stopped midway
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(_eval_config(setup, ckpt, tmp_path / "out")))
    p = subprocess.run([sys.executable, "-m", "composer_dag.evals.run", "--config", str(path)], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("evaluation refused: ") and "model.safetensors does not match its manifest" in last
    assert not (tmp_path / "out" / "results.parquet").exists()
