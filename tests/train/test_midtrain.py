import glob
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from composer_dag.cluster.spec import LaunchSpec, local_command
from composer_dag.storage import Storage
from composer_dag.train.data import pack_documents
from composer_dag.train.midtrain import MidtrainConfig, ds_config, lr_factor
from composer_dag.train.model import build_base_model
from composer_dag.train.tokenizer import train_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENTRY = "composer_dag.train.midtrain"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return build_lm_inputs(tmp_path_factory.mktemp("midtrain"))


def build_lm_inputs(base):
    """A tokenizer (``tok``), packed shards (``data``) and a tiny two-layer model (``model``) of
    the stdlib's json and email packages, under ``base``."""
    src = os.path.dirname(os.__file__)
    files = sorted(glob.glob(src + "/json/*.py") + glob.glob(src + "/email/*.py"))
    docs = [(f, open(f, encoding="utf-8").read(), "stdlib", "Python") for f in files]
    tok = train_tokenizer([d[1] for d in docs], str(base / "tok"), vocab_size=512)
    pack_documents(docs, tok, str(base / "data"), val_fraction=0.15, seed=0)
    build_base_model("tiny", tok, str(base / "model"), seed=0, num_hidden_layers=2)
    return base


def write_config(base, name, **kw):
    cfg = dict(model_dir=str(base / "model"), data_dir=str(base / "data"),
               out_dir=str(base / name), seq_len=64, micro_batch=4, max_steps=20,
               warmup_steps=2, lr=3e-3, min_lr=3e-4, eval_every=10, eval_batches=2,
               save_every=5, log_every=1, seed=0)
    cfg.update(kw)
    path = base / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def env():
    return {**os.environ, "PYTHONPATH": ROOT, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def run(cmd, timeout=300):
    p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return p


def weights(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def test_config_and_schedule(tmp_path):
    cfg = MidtrainConfig(model_dir="m", data_dir="d", out_dir="o", lr=1.0, min_lr=0.1,
                         warmup_steps=10, max_steps=100)
    f = lr_factor(cfg, 100)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.55) and f(100) == pytest.approx(0.1)
    wsd = lr_factor(MidtrainConfig(model_dir="m", data_dir="d", out_dir="o", lr=1.0, min_lr=0.1, warmup_steps=10,
                                   schedule="wsd", decay_frac=0.2), 100)
    assert wsd(50) == 1.0 and wsd(79) == 1.0 and wsd(90) == pytest.approx(0.55)
    assert wsd(100) == pytest.approx(0.1)
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"model_dir": "m", "data_dir": "d", "out_dir": "o", "zero_stage": 1}))
    c = MidtrainConfig.load(str(p), {"max_tokens": 256 * 8 * 3 - 5})
    assert c.zero_stage == 1 and c.total_steps(world_size=1) == 3
    assert ds_config(c, bf16=False)["zero_optimization"]["stage"] == 1
    with pytest.raises(ValueError, match="lrr: unknown field"):
        MidtrainConfig.load({"model_dir": "m", "data_dir": "d", "out_dir": "o", "lrr": 1})


@pytest.fixture(scope="module")
def run_a(setup):
    """An uninterrupted 20-step run."""
    p = run([sys.executable, "-m", ENTRY, "--config", write_config(setup, "a")])
    return setup / "a", p


@pytest.mark.slow
def test_short_run_learns(run_a):
    out, p = run_a
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result == json.load(open(out / "result.json"))
    assert result["steps"] == 20 and result["tokens_seen"] == 20 * 4 * 64
    losses = [loss for _, loss in result["loss_curve"]]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3
    assert result["val_ppl_after"] < result["val_ppl_before"]
    assert result["tokens_per_s"] > 0 and result["params"] > 1e6
    assert "step     20/20 loss" in p.stdout
    lines = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert [x["step"] for x in lines if "loss" in x] == list(range(1, 21))
    assert [x["step"] for x in lines if "val_loss" in x] == [0, 10, 20]
    assert {"step", "loss", "lr", "tokens", "tokens_per_s"} <= set(lines[1])
    latest = json.load(open(out / "latest"))
    assert latest == {"tag": "step_0000020", "step": 20, "samples": 80}
    ckpts = sorted(os.listdir(out / "checkpoints"))
    assert [c for c in ckpts if c.startswith("step_")] == ["step_0000015", "step_0000020"]
    state = json.load(open(out / "checkpoints" / "step_0000020" / "trainer_state.json"))
    assert state["step"] == 20 and state["samples"] == 80 and "torch" in state["rng"]
    # the final export loads in transformers and generates
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(out / "hf"))
    tok = AutoTokenizer.from_pretrained(str(out / "hf"))
    ids = model.generate(**tok("import json\n", return_tensors="pt"), max_new_tokens=4,
                         do_sample=False)
    assert ids.shape[1] > 4


@pytest.mark.slow
def test_resume_after_sigkill_matches_uninterrupted(setup, run_a):
    """Protection: mid-training SIGKILLed after its first checkpoints resumes from the last
    committed one (complete, by its manifest): exactly the remaining steps are trained, the step
    log runs 1..N once each, and the final weights equal an uninterrupted run's. (Killing a
    torchrun job's whole tree, and resuming it, is what the Slurm tests' external scancel, time
    limit and node-down cases do.)"""
    out_a, _ = run_a
    cfg = write_config(setup, "b")
    out_b = setup / "b"
    proc = subprocess.Popen([sys.executable, "-m", ENTRY, "--config", cfg], cwd=ROOT, env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    killed_at = None
    while time.time() < deadline and proc.poll() is None:
        try:
            killed_at = json.load(open(out_b / "latest"))["step"]
        except (OSError, ValueError):
            killed_at = None
        if killed_at is not None and killed_at >= 5:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL and 5 <= killed_at < 20
    assert not (out_b / "result.json").exists()
    tag = f"step_{killed_at:07d}"
    assert Storage(str(out_b / "checkpoints" / tag)).verify_manifest(str(out_b / "checkpoints" / tag))
    p = run([sys.executable, "-m", ENTRY, "--config", cfg])
    assert f"resumed from {tag}: step {killed_at}, sample {killed_at * 4}" in p.stderr, p.stderr[-3000:]
    result = json.load(open(out_b / "result.json"))
    assert result["steps"] == 20 and result["samples_seen"] == 80
    assert result["tokens_this_run"] == (20 - killed_at) * 4 * 64  # no completed step lost, none trained twice
    a, b = weights(out_a / "hf"), weights(out_b / "hf")
    assert a.keys() == b.keys()
    import torch

    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)
    steps = [json.loads(x)["step"] for x in open(out_b / "metrics.jsonl") if '"loss"' in x]
    assert steps == list(range(1, 21))  # no duplicated lines from the killed attempt
    assert [s for s, _ in result["loss_curve"]] == list(range(1, 21))
    final = out_b / "checkpoints" / "step_0000020"
    state = json.loads((final / "trainer_state.json").read_text())
    assert state["step"] == 20 and state["samples"] == 80
    manifest = Storage(str(final)).verify_manifest(str(final))
    exported = hashlib.sha256((out_b / "hf" / "model.safetensors").read_bytes()).hexdigest()
    assert exported == manifest["files"]["hf/model.safetensors"]["sha256"]  # the export is the final checkpoint's
    for t in os.listdir(out_b / "checkpoints"):
        if t.startswith("step_"):
            Storage(str(out_b / "checkpoints" / t)).verify_manifest(str(out_b / "checkpoints" / t))


@pytest.mark.slow
def test_torchrun_two_processes(setup):
    cfg = write_config(setup, "tr", max_steps=6, save_every=3, eval_every=3, log_every=2)
    spec = LaunchSpec(entry=ENTRY, args=["--config", cfg], nproc_per_node=2, launcher="torchrun")
    p = run(local_command(spec))
    out = setup / "tr"
    result = json.load(open(out / "result.json"))
    assert json.loads(p.stdout.strip().splitlines()[-1])["world_size"] == 2
    assert result["world_size"] == 2 and result["samples_seen"] == 6 * 4 * 2
    ck = out / "checkpoints" / "step_0000006"
    assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "zero_pp_rank_1_mp_rank_00_optim_states.pt", "trainer_state.json"} <= set(os.listdir(ck))
    assert math.isfinite(result["val_loss_after"]) and weights(out / "hf")


def test_validation_is_optional(setup, tmp_path):
    from composer_dag.train.midtrain import val_samples_per_rank

    cfg = MidtrainConfig(model_dir="m", data_dir=str(setup / "data"), out_dir="o", seq_len=64,
                         micro_batch=4, eval_batches=2)
    assert val_samples_per_rank(cfg, world=2) == 8
    cfg = cfg.replace(data_dir=str(tmp_path))  # no val.idx at all
    assert val_samples_per_rank(cfg, world=1) == 0


