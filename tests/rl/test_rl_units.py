"""RL engine pieces without a model: tool-call parsing and malformed-call observations in the
agent loop, GRPO advantages and loss, the staleness bound, weight deltas and digests."""

import json
import threading
from pathlib import Path
import time

import pytest
import torch

from composer_dag.tasks.format import TaskLimits
from composer_dag.inference.engine import Completion, Engine, EngineStats
from composer_dag.agent import AgentConfig, AgentLoop, GradeCache, rollouts_to_table, workspace_digest
from composer_dag.harness.composer import COMPOSER
from composer_dag.rl.grpo import group_advantages, grpo_loss, pack
from composer_dag.rl.learnable import build_learnable_tasks
from composer_dag.rl.loop import Batch, RolloutSource
from composer_dag.rl.weights import DigestMismatch, WeightPublisher, publish, reconstruct, state_digest
from composer_dag.storage import Storage


# ---------------------------------------------------------------- agent loop with a scripted engine

class _Tok:
    """Character-level stand-in for the tokenizer: specials are single ids."""
    SPECIAL = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
               "<tool_response>", "</tool_response>"]
    eos_token_id, pad_token_id = 0, 1

    def convert_tokens_to_ids(self, t):
        return self.SPECIAL.index(t)

    def __call__(self, text, add_special_tokens=False):
        ids, i = [], 0
        while i < len(text):
            for k, s in enumerate(self.SPECIAL):
                if text.startswith(s, i):
                    ids.append(k)
                    i += len(s)
                    break
            else:
                ids.append(100 + ord(text[i]))
                i += 1
        return type("E", (), {"input_ids": ids})()

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.SPECIAL[t] if t < 100 else chr(t - 100) for t in ids)

    def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=False):
        s = "".join(f"<|im_start|>{m['role']}\n" + (f"<tool_response>\n{m['content']}\n</tool_response>"
                    if m["role"] == "tool" else (m["content"] or "")) + "<|im_end|>\n" for m in msgs)
        return s + ("<|im_start|>assistant\n" if add_generation_prompt else "")


class _Scripted(Engine):
    def __init__(self, tok, turns):
        self.tok, self.turns, self.calls = tok, turns, 0
        self.stats = EngineStats()

    def generate(self, prompts, params):
        text = self.turns[min(self.calls, len(self.turns) - 1)]
        self.calls += 1
        outs = []
        for p in prompts:
            ids = self.tok(text).input_ids
            outs.append(Completion(p, ids, [-0.5] * len(ids), text, "stop" if ids[-1] == 3 else "length"))
        return self._account(outs, time.perf_counter())


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    return build_learnable_tasks(tmp_path_factory.mktemp("tasks"), 2, seed=0, words=("red", "blue"),
                                 limits=TaskLimits(max_turns=10, command_timeout=10, test_timeout=30))


def test_parse_tool_calls():
    calls, errors, prose = COMPOSER.parse('hi <tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call>'
                                          '<tool_call>{oops}</tool_call><tool_call>[1]</tool_call>'
                                          '<tool_call>{"name": {"x": 1}}</tool_call><|im_end|>')
    assert calls == [{"name": "submit", "arguments": {}}] and len(errors) == 3 and prose == "hi"


def test_malformed_calls_get_error_observations_and_are_counted(tasks):
    tok = _Tok()
    word = json.loads((tasks[0] / "task.json").read_text())["reference"]["word"]
    script = ["no call here<|im_end|>",
              '<tool_call>{"name": "edit_file", "arguments": {"path": 3}</tool_call><|im_end|>',   # bad JSON
              '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call><|im_end|>',             # unknown tool
              '<tool_call>{"name": "edit_file", "arguments": {"path": "answer.txt", "old": "", "new": "'
              + word + '"}}</tool_call><|im_end|>',
              '<tool_call>{"name": "submit", "arguments": {}}</tool_call><|im_end|>']
    loop = AgentLoop(_Scripted(tok, script), tok, AgentConfig(max_turns=8, max_new_tokens=200, max_context=50_000, workers=1))
    (r,) = loop.run([(str(tasks[0]), "g", 0)], version=3)
    loop.close()
    assert r["finish"] == "submit" and r["num_turns"] == 5 and r["reward"] == 1.0
    assert r["malformed_calls"] == 2 and r["tool_errors"] == 1 and r["policy_version"] == 3
    tool_turns = [m["content"] for m in json.loads(r["messages"]) if m["role"] == "tool"]
    assert tool_turns[0].startswith("Error: no tool call") and "not valid JSON" in tool_turns[1]
    assert tool_turns[2].startswith("Error: unknown tool")
    # the stream: sampled tokens masked in with their logprobs, everything else masked out
    ids, mask, lps = r["completion_ids"], r["loss_mask"], r["logprobs"]
    assert len(ids) == len(mask) == len(lps)
    sampled = [t for t, m in zip(ids, mask) if m]
    assert tok.decode(sampled) == "".join(script)
    assert all(lp == -0.5 for lp, m in zip(lps, mask) if m) and all(lp == 0 for lp, m in zip(lps, mask) if not m)
    assert "Error: no tool call" in tok.decode([t for t, m in zip(ids, mask) if not m])
    t = rollouts_to_table([r])
    assert t.num_rows == 1 and t.column("reward")[0].as_py() == 1.0
    assert (t.column("harness")[0].as_py(), t.column("harness_version")[0].as_py()) == ("composer", COMPOSER.version)


def test_the_grading_settings_come_from_the_agent_config(tasks):
    """AgentConfig.episode.grade (orchestrator.episode.grade in an RL run config, agent.episode.grade
    in an evaluation's) decides the reward: a solved episode that also planted a conftest.py is
    flagged and gets flag_penalty (0 by default, -1 here); with flag_penalty None the flag is only
    recorded and the reward is the tests'."""
    tok = _Tok()
    word = json.loads((tasks[0] / "task.json").read_text())["reference"]["word"]
    call = '<tool_call>{{"name": "edit_file", "arguments": {{"path": "{}", "old": "", "new": "{}"}}}}</tool_call><|im_end|>'
    script = [call.format("answer.txt", word), call.format("conftest.py", "x = 1"),
              '<tool_call>{"name": "submit", "arguments": {}}</tool_call><|im_end|>']
    rewards = {}
    for penalty in (-1.0, None):
        cfg = AgentConfig.load({"max_turns": 8, "max_new_tokens": 200, "max_context": 50_000, "workers": 1,
                                "episode": {"grade": {"flag_penalty": penalty}}})
        loop = AgentLoop(_Scripted(tok, script), tok, cfg)
        (r,) = loop.run([(str(tasks[0]), "g", 0)], version=0)
        loop.close()
        assert r["flags"] == ["conftest:conftest.py"] and r["finish"] == "submit", r["flags"]
        rewards[penalty] = r["reward"]
    assert rewards == {-1.0: -1.0, None: 1.0}


def test_turn_budget_ends_episode(tasks):
    tok = _Tok()
    loop = AgentLoop(_Scripted(tok, ["thinking"]), tok, AgentConfig(max_turns=2, max_new_tokens=50, max_context=50_000, workers=1))
    rs = loop.run([(str(tasks[1]), "g", 0), (str(tasks[1]), "g", 1)], version=0)
    loop.close()
    assert [r["finish"] for r in rs] == ["max_turns"] * 2 and all(r["reward"] == 0 for r in rs)
    assert rs[0]["malformed_calls"] == 2


def test_the_same_workspace_after_the_same_calls_is_graded_once(tasks, monkeypatch):
    """Episodes in which no tool ran share their task's one grade, also across loops that share
    the cache (the candidates of one evaluation job); episodes that made the same calls and left
    the same bytes share one grade too, and any other call or byte is graded on its own; a grade
    that raised is not kept."""
    import composer_dag.harness.episode as tools

    real, graded, failed = tools.grade, [], []

    def counting(task_dir, workspace, log, config):
        graded.append((Path(task_dir).name, len(log)))
        if not failed:
            failed.append(1)
            raise OSError("the sandbox did not start")  # the first attempt fails: nothing is kept
        return real(task_dir, workspace, log, config)

    monkeypatch.setattr(tools, "grade", counting)
    tok = _Tok()
    shared = GradeCache()
    quiet_cfg = AgentConfig(max_turns=1, max_new_tokens=50, max_context=50_000, workers=2)
    quiet = AgentLoop(_Scripted(tok, ["no call<|im_end|>"]), tok, quiet_cfg, grades=shared)
    jobs = [(str(t), t.name, j) for t in tasks for j in range(3)]
    with pytest.raises(OSError):
        quiet.run(jobs[:1], version=0)
    rs = quiet.run(jobs, version=0)
    quiet.close()
    assert sorted(graded) == sorted([(tasks[0].name, 0)] * 2 + [(tasks[1].name, 0)])  # the failed one, then one per task
    assert [(r["reward"], r["tests_passed"], r["tests_failed"]) for r in rs] == [(0.0, 0, 1)] * 6
    graded.clear()
    again = AgentLoop(_Scripted(tok, ["still no call<|im_end|>"]), tok, quiet_cfg, grades=shared)
    rs = again.run(jobs, version=0)
    again.close()
    assert graded == [] and [r["reward"] for r in rs] == [0.0] * 6  # the next candidate reuses the grades
    reader = AgentLoop(_Scripted(tok, ['<tool_call>{"name": "read_file", "arguments": {"path": "answer.txt"}}'
                                       '</tool_call><|im_end|>']), tok,
                       AgentConfig(max_turns=1, max_new_tokens=200, max_context=50_000, workers=2), grades=shared)
    reader.run(jobs[:3], version=0)
    reader.close()
    assert graded == [(tasks[0].name, 1)]  # three identical reads: one grade
    graded.clear()
    writers = [AgentLoop(_Scripted(tok, ['<tool_call>{"name": "run_terminal_cmd", "arguments": {"command": '
                                         f'"echo {word} > answer.txt"}}}}</tool_call><|im_end|>']), tok,
                         AgentConfig(max_turns=1, max_new_tokens=200, max_context=50_000, workers=2), grades=shared)
               for word in ("one", "one", "two")]
    for w in writers:
        w.run(jobs[:1], version=0)
        w.close()
    assert graded == [(tasks[0].name, 1)] * 2  # "two" is another call and other bytes: graded again


def test_workspace_digest_sees_bytes_modes_and_links(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f.py").write_text("x = 1\n")
    first = workspace_digest(tmp_path)
    assert workspace_digest(tmp_path) == first
    changes = [lambda: (tmp_path / "a" / "f.py").write_text("x = 2\n"),
               lambda: (tmp_path / "a" / "f.py").chmod(0o755),
               lambda: (tmp_path / "a" / "g").symlink_to("f.py"),
               lambda: (tmp_path / "b").mkdir()]
    seen = {first}
    for change in changes:
        change()
        seen.add(workspace_digest(tmp_path))
    assert len(seen) == len(changes) + 1


def test_a_checkouts_digest_follows_git_rewriting_its_index(tmp_path):
    """The digest of a task's checkout is kept per process, keyed by the times of the checkout and
    its git directory: a ``git status`` that refreshes ``.git/index`` (here: a file's time moved,
    its bytes the same) is seen, where the checkout's own time alone missed it."""
    import os
    import subprocess

    from composer_dag.tasks.taskdir import checkout_digest

    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "m.py").write_text("x = 1\n")
    git = lambda *a: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *a], cwd=repo,
                                    check=True, capture_output=True)
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "base")
    before = checkout_digest(tmp_path)
    index = (repo / ".git" / "index").read_bytes()
    os.utime(repo / "pkg" / "m.py", (1_000_000_000, 1_000_000_000))
    git("status", "--porcelain")
    assert (repo / ".git" / "index").read_bytes() != index  # git refreshed the entry's stat data
    assert checkout_digest(tmp_path) == workspace_digest(repo, skip=(".venv",)) != before


# ---------------------------------------------------------------- GRPO

def test_group_advantages():
    adv = group_advantages([1, 0, 0, 0, 1, 1], ["a", "a", "b", "b", "c", "c"])
    assert adv[0] > 0 > adv[1] and adv[2] == adv[3] == 0 and adv[4] == adv[5] == 0
    raw = group_advantages([1, 0, 0, 0], ["a", "a", "a", "a"], normalize_std=False)
    assert raw == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_a_step_trains_only_on_groups_whose_rewards_differ(tmp_path):
    """A group whose samples all earned the same reward has advantage 0: the step leaves it out of
    the update (it would dilute the token mean), still writes it with the batch's rollouts and counts
    it (``uniform_groups`` off); an infrastructure failure is left out of its group; by default it
    trains on them all."""
    import pyarrow.parquet as pq

    from composer_dag.rl.grpo import informative
    from composer_dag.rl.step import train_step
    from composer_dag.storage import Storage

    assert informative([1, 0, 0, 0, 1, 1], ["a", "a", "b", "b", "c", "c"]) == [True, True, False, False, False, False]
    assert informative([1, 0, 0.5], ["a", "a", "b"], include=[True, False, True]) == [False, False, False]

    class Recorder:  # the trainer's interface: one update on the rollouts it is given
        def __init__(self):
            self.seen = []

        def train_step(self, rollouts):
            self.seen.append([r["rollout_id"] for r in rollouts])
            return {"loss": 0.0, "train_seconds": 0.0}

    rows = [{"rollout_id": f"{g}{i}", "group_id": g, "reward": r, "completion_ids": [1], "loss_mask": [1],
             "logprobs": [0.0], "prompt_ids": [1]}
            for g, rs in {"mixed": [1.0, 0.0, 0.0], "failed": [0.0, 0.0, 0.0], "solved": [1.0, 1.0, 1.0],
                          "broken": [1.0, 0.0, 0.0]}.items() for i, r in enumerate(rs)]
    rows[-2]["infra_error"] = "server_lost"  # broken: 1.0 and one 0.0 left
    rec = Recorder()
    ts, used = train_step(rec, Storage(str(tmp_path)), rows, 0, True, uniform_groups=False)
    assert rec.seen[-1] == ["mixed0", "mixed1", "mixed2", "broken0", "broken2"]
    assert (ts["groups_trained"], ts["groups_uniform"]) == (2, 2) and len(used) == 11
    assert pq.read_table(tmp_path / "rollouts" / "step_0000.parquet").num_rows == 12
    ts, _ = train_step(rec, Storage(str(tmp_path)), rows, 1, True)
    assert len(rec.seen[-1]) == 11 and ts["groups_trained"] == 4


def test_grpo_loss_clips_and_masks():
    logp = torch.log(torch.tensor([[0.5, 0.9, 0.1]]))
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, st = grpo_loss(logp, old, torch.tensor([1.0]), mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(-(1.0 + 1.2) / 2) and st["clip_frac"] == 1
    x = logp.clone().requires_grad_()
    grpo_loss(x, old, torch.tensor([1.0]), mask, 0.2)[0].backward()
    assert x.grad[0, 1] == 0 and x.grad[0, 2] == 0 and x.grad[0, 0] < 0  # clipped and masked: no gradient
    _, st = grpo_loss(logp, old, torch.tensor([1.0]), mask, 0.2, ref_logp=old, kl_coef=0.1)
    assert st["kl_sum"] > 0


def test_sequence_weights_and_weighed_negatives():
    """Per sequence, each rollout's tokens weigh 1 in all, whatever its length, so a long failure no
    longer outweighs a short success; negative advantages scale by the weight, positive ones not."""
    from composer_dag.rl.grpo import sequence_weights, weigh_negatives

    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    w = sequence_weights(mask)
    assert w.sum(-1).tolist() == [1.0, 1.0] and w[1, 0].item() == 0.25 and w[0, 2].item() == 0
    logp = torch.zeros(2, 4, requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    loss, st = grpo_loss(logp, torch.zeros(2, 4), adv, mask, 0.2, denom=2.0, weight=w)
    assert loss.item() == pytest.approx(0.0) and st["tokens"] == 6  # one success, one failure: even
    loss, _ = grpo_loss(logp, torch.zeros(2, 4), adv, mask, 0.2)  # the token mean: the failure's 4 tokens win
    assert loss.item() == pytest.approx(2 / 6)
    assert weigh_negatives(torch.tensor([0.5, -1.0, 0.0]), 0.1).tolist() == pytest.approx([0.5, -0.1, 0.0])
    assert weigh_negatives(adv, 1.0) is adv


def test_rl_loss_is_selected_by_name_and_reinforce_matches_the_surrogate_on_policy():
    """TrainerConfig.loss picks from rl.grpo.LOSSES; on-policy (old = current logprobs) the
    REINFORCE loss has the clipped surrogate's gradient, off-policy it does not clip; an unknown
    name is refused in one line."""
    from composer_dag.rl.grpo import LOSSES
    from composer_dag.rl.trainer import TrainerConfig
    from composer_dag.runtime.config import ConfigError

    assert TrainerConfig().loss == "grpo" and TrainerConfig.load({"loss": "reinforce"}).loss == "reinforce"
    with pytest.raises((ConfigError, ValueError), match="unknown RL loss 'ppo2'"):
        TrainerConfig.load({"loss": "ppo2"})
    mask, adv = torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([0.7])
    grads = {}
    for name in ("grpo", "reinforce"):
        x = torch.log(torch.tensor([[0.5, 0.9, 0.1]])).requires_grad_()
        LOSSES[name](x, x.detach(), adv, mask, 0.2)[0].backward()
        grads[name] = x.grad
    assert torch.allclose(grads["grpo"], grads["reinforce"]) and grads["grpo"][0, 0] < 0
    x = torch.log(torch.tensor([[0.5, 0.9, 0.1]])).requires_grad_()
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    _, st = LOSSES["reinforce"](x, old, torch.tensor([1.0]), mask, 0.2)
    assert st["clip_frac"] == 0.0 and st["tokens"] == 2


def test_pack_aligns_targets():
    r = {"prompt_ids": [5, 6], "completion_ids": [7, 8, 9], "loss_mask": [1, 0, 1], "logprobs": [-1, 0, -2],
         "advantage": 0.5}
    b = pack([r, {**r, "prompt_ids": [5]}], pad_id=1)
    assert b["input_ids"][0].tolist() == [5, 6, 7, 8, 9] and b["input_ids"][1].tolist() == [5, 7, 8, 9, 1]
    assert b["loss_mask"][0].tolist() == [0, 1, 0, 1] and b["old_logprobs"][0].tolist() == [0, -1, 0, -2]
    assert b["loss_mask"][1].tolist() == [1, 0, 1, 0]


# ---------------------------------------------------------------- staleness bound

def test_async_source_drops_stale_batches():
    trainer = {"version": 0}
    made = []

    def produce(index, version):
        time.sleep(0.05)
        made.append(version)
        return Batch(index, version, [{"policy_version": version} for _ in range(4)])

    src = RolloutSource(produce, lambda: trainer["version"], max_staleness=0, queue_size=3).start()
    used = []
    for _ in range(4):
        b = src.get(trainer["version"])
        used.append(trainer["version"] - b.version)
        time.sleep(0.3)  # a slow update: the generator runs ahead with the old weights
        trainer["version"] += 1
    src.stop()
    assert used == [0, 0, 0, 0] and src.dropped_batches > 0 and src.dropped_rollouts == 4 * src.dropped_batches
    assert all(s <= 0 for s in src.staleness)


def test_async_source_waits_for_the_trainer_instead_of_running_ahead():
    # One batch ahead at most: each batch samples the weights of the update before the one that
    # takes it, so nothing is dropped at max_staleness 1, and no batch is made past the limit.
    trainer = {"version": 0}
    made = []

    def produce(index, version):
        time.sleep(0.02)
        made.append(index)
        return Batch(index, version, [{} for _ in range(4)])

    src = RolloutSource(produce, lambda: trainer["version"], max_staleness=1, limit=5).start()
    lags = []
    for _ in range(5):
        b = src.get(trainer["version"])
        lags.append(trainer["version"] - b.version)
        time.sleep(0.15)  # a slow update: the generator waits instead of sampling old weights
        trainer["version"] += 1
    time.sleep(0.2)
    src.stop()
    assert src.dropped_batches == 0 and lags == [0, 1, 1, 1, 1]
    assert made == [0, 1, 2, 3, 4]


def test_sync_source_is_never_stale():
    src = RolloutSource(lambda i, v: Batch(i, v, []), lambda: 7, max_staleness=0, async_generation=False)
    assert src.get(7).version == 7 and src.dropped_batches == 0


def test_generation_errors_surface():
    def boom(i, v):
        raise OSError("engine died")

    src = RolloutSource(boom, lambda: 0).start()
    with pytest.raises(RuntimeError, match="rollout generation failed"):
        src.get(0)
    src.stop()


# ---------------------------------------------------------------- weight deltas

def _states(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    sd = {"w": torch.randn(300, 40, generator=g), "b": torch.randn(40, generator=g).to(torch.bfloat16),
          "i": torch.arange(10)}
    out = []
    for _ in range(n):
        out.append({k: v.clone() for k, v in sd.items()})
        sd["w"] = sd["w"] - 1e-3 * torch.randn(300, 40, generator=g)
        sd["b"] = (sd["b"].float() + 1e-2 * torch.randn(40, generator=g)).to(torch.bfloat16)
        sd["w"][0, 0] = float("nan") if len(out) == 3 else sd["w"][0, 0]
    return out


def test_delta_round_trip_is_bit_exact(tmp_path):
    st = Storage(str(tmp_path))
    prefix = st.url("weights")
    states = _states()
    pub = WeightPublisher(st, prefix, full_every=4)
    infos = [pub.publish(v, sd) for v, sd in enumerate(states)]
    assert [i["kind"] for i in infos] == ["full", "delta", "delta", "delta", "full", "delta"]
    assert all(i["fraction"] < 0.9 for i in infos if i["kind"] == "delta")
    for v, sd in enumerate(states):
        got = reconstruct(st, prefix, v)
        assert state_digest(got) == state_digest(sd)
        for k in sd:  # bit for bit, NaN payloads included
            assert got[k].dtype == sd[k].dtype and torch.equal(got[k].view(torch.uint8) if got[k].dtype != torch.int64
                                                               else got[k], sd[k].view(torch.uint8)
                                                               if sd[k].dtype != torch.int64 else sd[k])
    # without the in-memory previous version, publish reads it back from storage
    info = publish(st, prefix, 6, states[5], full_every=4)
    assert info["kind"] == "delta" and state_digest(reconstruct(st, prefix, 6)) == state_digest(states[5])


def test_digest_mismatch_is_detected(tmp_path):
    st = Storage(str(tmp_path))
    prefix = st.url("w")
    pub = WeightPublisher(st, prefix, full_every=10)
    for v, sd in enumerate(_states(3)):
        pub.publish(v, sd)
    meta = st.read_json(prefix + "/v00000002.json")
    meta["digest"] = "0" * 64
    st.write_json(prefix + "/v00000002.json", meta)
    reconstruct(st, prefix, 1)
    with pytest.raises(DigestMismatch):
        reconstruct(st, prefix, 2)
    blob = bytearray(st.read_bytes(prefix + "/v00000000.full.safetensors"))
    blob[-1] ^= 1  # corrupt a weight byte of the full checkpoint
    st.write_bytes(prefix + "/v00000000.full.safetensors", bytes(blob))
    with pytest.raises(DigestMismatch):
        reconstruct(st, prefix, 1)


def test_bf16_publication_and_weight_cache(tmp_path):
    from composer_dag.rl.weights import WeightCache, cast_state, latest_version

    st = Storage(str(tmp_path))
    prefix = st.url("w")
    states = [{k: v for k, v in sd.items() if k != "i"} for sd in _states(5)]
    pub = WeightPublisher(st, prefix, full_every=3, dtype="bfloat16")
    infos = [pub.publish(v, sd) for v, sd in enumerate(states)]
    assert [i["kind"] for i in infos] == ["full", "delta", "delta", "full", "delta"]
    assert infos[0]["full_bytes"] == sum(v.numel() * 2 for v in states[0].values())  # bf16 on storage
    assert latest_version(st, prefix) == 4 and st.read_json(prefix + "/latest.json")["digest"] == infos[4]["digest"]
    cache = WeightCache(st, prefix)
    for v in (0, 2, 1, 4):  # forward steps apply only the new deltas; going back rebuilds from a full
        got = cache.get(v)
        assert all(t.dtype == torch.bfloat16 for t in got.values())
        assert state_digest(got) == state_digest(cast_state(states[v], "bfloat16"))
    assert states[0]["w"].dtype == torch.float32  # the caller's tensors are left as they were
    blob = bytearray(st.read_bytes(prefix + "/v00000004.delta.zst"))
    blob[-1] ^= 1  # a corrupt delta blob fails its manifest's sha256
    st.write_bytes(prefix + "/v00000004.delta.zst", bytes(blob))
    with pytest.raises(DigestMismatch, match="sha256"):
        WeightCache(st, prefix).get(4)


def test_group_advantages_leave_out_infrastructure_failures():
    adv = group_advantages([1.0, 0.0, 0.0, 5.0], ["g", "g", "g", "h"], normalize_std=False,
                           include=[True, True, False, False])
    assert adv == [0.5, -0.5, 0.0, 0.0]  # the failed one is neither a zero reward nor trained on


def test_fleet_mode_refuses_sparse_checkpoints():
    """A fleet trainer checkpoints every version before publishing it: with ``save_every`` > 1 a
    trainer resumed from an older checkpoint would publish version numbers again."""
    from composer_dag.rl.run import RLConfig
    from composer_dag.runtime.config import ConfigError

    base = {"policy_dir": "p", "tasks_dir": "t", "out_dir": "o", "save_every": 2}
    assert RLConfig.load(base).save_every == 2  # one process: its engine is in the trainer's process
    with pytest.raises(ConfigError, match="save_every 2: the distributed mode .* save_every must be 1"):
        RLConfig.load({**base, "fleet": {"servers": 2}})


def test_reward_slope_is_the_least_squares_fit():
    import numpy as np

    from composer_dag.rl.report import reward_slope

    curve = [0.188, 0.125, 0.188, 0.25, 0.125, 0.375, 0.188, 0.375, 0.438, 0.562]
    assert reward_slope(curve) == pytest.approx(np.polyfit(range(len(curve)), curve, 1)[0])
    assert reward_slope(curve[::-1]) == pytest.approx(-reward_slope(curve)) and reward_slope(curve) > 0
    assert reward_slope([0.5] * 6) == 0.0 and reward_slope([0.3]) == 0.0 and reward_slope([]) == 0.0


def test_rl_checks_and_tables_come_from_the_engine():
    """The RL asset's checks and tables are engine functions: each check fails on what it guards
    (a missing reward, too many flags, a stale rollout, a NaN loss, unverified weights)."""
    from composer_dag.rl.report import flag_family_shares, rl_checks, step_time_table

    rows = [{"reward": 1.0, "flags": [], "staleness": 0, "step": 0, "flag_families": []},
            {"reward": 0.0, "flags": ["exit_call:x.py"], "staleness": 1, "step": 1, "flag_families": ["exit"]}]
    ok = rl_checks({"weights_verified": True}, rows, [{"step": 1, "loss": 0.1}], max_flag_rate=0.5, max_staleness=1)
    assert all(passed for passed, _ in ok.values()), ok
    bad = rl_checks({"weights_verified": False, "nan_loss_skipped": 1},
                    rows + [{"reward": None, "flags": [], "staleness": 2, "step": 1, "flag_families": []}],
                    [{"step": 1, "loss": float("nan")}], max_flag_rate=0.2, max_staleness=1)
    assert not any(passed for passed, _ in bad.values()), bad
    assert bad["staleness_within_bound"][1]["max_staleness_seen"] == 2
    assert flag_family_shares(rows) == [("exit", [0, 1], [0.0, 1.0])]
    table = step_time_table([{"step": 1, "generate_s": 1.5, "step_s": None}], fleet=False).splitlines()
    assert table[0].startswith("| step | generate") and table[2] == "| 1 | 1.50 | 0.00 | 0.00 | 0.00 |  |"


def test_rollout_rows_from_files_with_and_without_the_newer_columns(tmp_path):
    """The RL asset reads every rollout file the same way: a file written before a column existed
    gives None for it (no fallback that reads fewer columns, no error); every row is counted."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from composer_dag.rl.report import ROW_COLUMNS, read_rollout_rows

    st = Storage(str(tmp_path))
    pq.write_table(pa.table({"reward": [1.0, 0.0], "flags": [[], ["exit_call:x"]], "staleness": [0, 1]}),
                   tmp_path / "old.parquet")
    pq.write_table(pa.table({c: [None] for c in ROW_COLUMNS} | {"reward": [0.5], "step": [3], "server_id": ["s1"]}),
                   tmp_path / "new.parquet")
    rows = read_rollout_rows(st, [st.url("old.parquet"), st.url("new.parquet")])
    assert [set(r) for r in rows] == [set(ROW_COLUMNS)] * 3
    assert [(r["reward"], r["flags"], r["step"], r["server_id"]) for r in rows] == \
        [(1.0, [], None, None), (0.0, ["exit_call:x"], None, None), (0.5, None, 3, "s1")]


def test_logprobs_on_the_loss_positions_only_match_the_full_ones():
    """The trainer's logprobs take the output layer on the loss mask's tokens only: the same values
    there (and the same gradients through the loss) as the full logits, 0 elsewhere."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from composer_dag.rl.grpo import grpo_loss, token_logprobs

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=4, intermediate_size=128))
    ids = torch.randint(0, 256, (3, 24))
    att = torch.ones_like(ids)
    att[2, 18:] = 0
    mask = torch.zeros(3, 23)
    mask[0, 10:20], mask[1, 5:9], mask[2, 12:17] = 1, 1, 1
    old, adv = torch.randn(3, 23) * mask, torch.tensor([1.0, -0.5, 0.3])
    results = []
    for positions in (None, mask):
        model.zero_grad()
        lp = token_logprobs(model, ids, att, 0.7, positions)
        loss, _ = grpo_loss(lp, old, adv, mask, ref_logp=lp.detach() + 0.1 * mask, kl_coef=0.1)
        loss.backward()
        results.append((lp.detach(), loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (full, loss_full, g_full), (part, loss_part, g_part) = results
    assert torch.allclose(full * mask, part, atol=1e-5) and torch.all(part[mask == 0] == 0)
    assert torch.allclose(loss_full, loss_part, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g_full, g_part))


def test_a_server_cut_off_mid_response_is_down_not_a_failed_run():
    """A rollout server killed while it answers (here: it promises 100 bytes, sends 10 and closes)
    is ``ServerDown``, which the fleet's sync thread takes as a server to wait for, not as a broken
    publication that stops the run."""
    import socket

    from composer_dag.inference.server import ServerClient, ServerDown

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)

    def answer():
        for _ in range(2):
            conn, _ = sock.accept()
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"version\"")
            conn.close()

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    client = ServerClient(f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=10)
    for _ in range(2):
        with pytest.raises(ServerDown, match="IncompleteRead"):
            client._call("/weight_info")
    t.join(timeout=10)
    sock.close()
