"""External harnesses played unchanged in episodes: mini-swe-agent (its own CLI and config, in
its own environment, installed by ``make harnesses``) and harnesses declared in spec files
written here, by their path. The policy is a scripted upstream where an episode checks the
plumbing (what a command can do and reach), and a real tiny model through the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from composer_dag.harness.base import Action


@pytest.fixture(scope="module")
def mini():
    from composer_dag.harness.external import install, load_spec

    spec = load_spec("mini-swe-agent")
    install(spec)  # done by `make harnesses`; a no-op then
    return spec


@pytest.fixture(scope="module")
def tok(learnable_base):
    from composer_dag.train.tokenizer import load_tokenizer

    return load_tokenizer(learnable_base["policy_dir"])


def task(learnable_base, i=0) -> Path:
    return sorted(Path(learnable_base["tasks_dir"]).rglob("task.json"))[i].parent


def call(cmd: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "bash", "arguments": {"command": cmd}}) + "\n</tool_call>"


def play(spec, task_dir, tok, replies, out, **kw):
    from composer_dag.gateway.core import Gateway
    from composer_dag.gateway.server import GatewayServer
    from composer_dag.gateway.upstream import Scripted
    from composer_dag.harness.external import run_episode

    gw = Gateway(Scripted(tok, replies), tok, "policy", max_model_len=1 << 15, records_dir=str(out / "records"))
    with GatewayServer(gw) as server:
        r = run_episode(spec, task_dir, server, "policy", out / "run", timeout_s=kw.pop("timeout_s", 120), **kw)
    return r, server


def observations(out: Path) -> list[str]:
    t = json.loads((out / "run" / "trajectory.json").read_text())
    return [json.loads(m["content"])["output"] for m in t["messages"] if m["role"] == "tool" and '"output"' in m["content"]]


def test_mini_swe_agent_plays_an_episode_in_the_sandbox(mini, learnable_base, tok, tmp_path):
    """Its commands run in the project as the persona's user, a background process lives on to
    the next command, its edit is the graded workspace, and no command reaches the gateway, the
    key, the records or the runner's files."""
    from composer_dag.laptop.image import task_persona
    from composer_dag.tasks.taskdir import load_task, project_name

    t = task(learnable_base)
    word = load_task(t)["instructions"].split("word ")[1].split()[0]
    probe_env = "env | grep -c 'ep-\\|COMPOSER_\\|OPENAI'; ls {records} 2>&1 | head -1; ls -a /tmp"
    probe_net = ("for p in {ports}; do (echo > /dev/tcp/127.0.0.1/$p) 2>/dev/null && echo open $p || echo refused $p; "
                 "done; cat /proc/*/cmdline 2>/dev/null | tr '\\0' ' ' | grep -c '[p]ytest\\|[c]omposer\\|[m]inisweagent'")
    from composer_dag.gateway.core import Gateway
    from composer_dag.gateway.server import GatewayServer
    from composer_dag.gateway.upstream import Scripted
    from composer_dag.harness.external import run_episode

    replies = ["Let me look.\n" + call("sleep 300 & echo $! > /tmp/bg.pid; whoami; pwd"),
               call("kill -0 $(cat /tmp/bg.pid) && echo alive"),
               call(mini.command_of(Action("write", {"path": "answer.txt", "old": "", "new": word + "\n"}))),
               call(probe_env.format(records=tmp_path / "records")), "the probe of the gateway's ports, once known",
               call(mini.demo.submit)]
    gw = Gateway(Scripted(tok, replies), tok, "policy", max_model_len=1 << 15, records_dir=str(tmp_path / "records"))
    with GatewayServer(gw) as server:
        ports = [server.url.rsplit(":", 1)[1].split("/")[0], server.admin_url.rsplit(":", 1)[1]]
        gw.upstream.replies[4] = call(probe_net.format(ports=" ".join(ports)))
        r = run_episode(mini, t, server, "policy", tmp_path / "run", timeout_s=120)
    assert r["end_reason"] == "submitted" and not r["infra_failure"], r
    assert r["reward"] == 1.0 and r["flags"] == [] and r["harness"] == "mini-swe-agent" and r["version"] == "2.4.6"
    assert r["calls"] == 6 and r["segments"] == 1 and r["extension_rate"] == 1.0 and r["commands"] == 6, r["rollout"]["extension"]
    obs = observations(tmp_path)
    persona = task_persona(load_task(t))
    assert obs[0].split() == [persona.user, f"{persona.home}/{project_name(load_task(t))}"], obs[0]
    assert obs[1].strip() == "alive"
    env, net = obs[3].splitlines(), obs[4].splitlines()
    assert env[0] == "0", obs[3]  # no key, no runner variable in the command's environment
    assert "No such file" in env[1] and not any("cdag-h-" in x or "shell.sock" in x for x in env), obs[3]
    assert net == [f"refused {p}" for p in ports] + ["0"], obs[4]  # neither port; no host process in sight
    log = r["rollout"]["action_log"]
    assert [e["kind"] for e in log] == ["exec"] * 6 and log[1]["command"] == "kill -0 $(cat /tmp/bg.pid) && echo alive"
    recorded = [json.loads(x) for x in (tmp_path / "records").glob("*.jsonl").__next__().read_text().splitlines()]
    assert len(recorded) == 6 and all(x["completion_ids"][-1] == tok.convert_tokens_to_ids("<|im_end|>") for x in recorded)


@pytest.fixture(scope="module")
def agents_sdk():
    from composer_dag.harness.external import install, load_spec

    spec = load_spec("openai-agents")
    install(spec)  # done by `make harnesses`; a no-op then
    return spec


def test_openai_agents_sdk_plays_an_episode_through_the_gateway(agents_sdk, learnable_base, tok, tmp_path):
    """The SDK's own Runner with a function tool: its calls reach the sandbox as the persona,
    its edit is graded, its history extends every earlier call exactly (one segment), and its
    final answer without a tool call ends the episode as submitted."""
    from composer_dag.laptop.image import task_persona
    from composer_dag.tasks.taskdir import load_task

    t = task(learnable_base, 1)
    word = load_task(t)["instructions"].split("word ")[1].split()[0]
    write = agents_sdk.command_of(Action("write", {"path": "answer.txt", "old": "", "new": word + "\n"}))
    final = agents_sdk.render_action(Action("submit", {}))
    assert "tool_calls" not in final and final["content"] == agents_sdk.demo.submit_message
    r, server = play(agents_sdk, t, tok, ["I will look first.\n" + call("whoami; cat answer.txt 2>&1 | head -1"),
                                         call(write), final["content"]], tmp_path)
    assert r["end_reason"] == "submitted" and not r["infra_failure"] and r["exit_code"] == 0, r
    assert r["harness"] == "openai-agents" and r["version"] == "0.24.0" and r["reward"] == 1.0 and r["flags"] == [], r
    assert r["calls"] == 3 and r["segments"] == 1 and r["extension_rate"] == 1.0 and r["commands"] == 2, r["rollout"]["extension"]
    log = r["rollout"]["action_log"]
    assert [e["kind"] for e in log] == ["exec", "exec"] and log[1]["command"] == write
    seen = tok.decode(r["rollout"]["records"][1]["prompt_ids"])  # what the model was shown of the first command
    assert f"exit code 0\n{task_persona(load_task(t)).user}\n" in seen, seen[-400:]


def test_commands_of_an_external_harness_raise_the_flags_of_commands(mini, learnable_base, tok, tmp_path):
    r, _ = play(mini, task(learnable_base, 1), tok, [call("git log -p --all | head -3"), call(mini.demo.submit)], tmp_path)
    assert any(f.startswith("git_history") for f in r["flags"]) and r["reward"] == 0.0, r


def _spec(tmp_path: Path, name: str, command: list[str], files: dict | None = None, packages=()) -> Path:
    body = {"name": name, "version": "0.1", "install": {"packages": list(packages)},
            "run": {"command": command, "files": files or {}, "timeout_s": 60, "max_calls": 6}}
    lines = [f'name = "{name}"', 'version = "0.1"', "[install]", f"packages = {json.dumps(list(packages))}", "[run]",
             f"command = {json.dumps(command)}", f"timeout_s = {body['run']['timeout_s']}", "max_calls = 6", "[run.files]"]
    lines += [f"{json.dumps(k)} = {json.dumps(v)}" for k, v in (files or {}).items()]
    p = tmp_path / f"{name}.toml"
    p.write_text("\n".join(lines) + "\n")
    return p


AGENT = '''import json, os, subprocess, sys, urllib.request
base, key, docker = sys.argv[1:4]
msgs = [{"role": "user", "content": open("task.txt").read()}]
tools = [{"type": "function", "function": {"name": "sh", "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]
for _ in range(6):
    req = urllib.request.Request(base + "/chat/completions", json.dumps({"model": "m", "messages": msgs, "tools": tools}).encode(),
                                 {"Authorization": "Bearer " + key, "Content-Type": "application/json"})
    reply = json.loads(urllib.request.urlopen(req).read())["choices"][0]["message"]
    msgs.append(reply)
    for c in reply.get("tool_calls") or []:
        cmd = json.loads(c["function"]["arguments"])["cmd"]
        if cmd == "DONE":
            sys.exit(0)
        out = subprocess.run([docker, "exec", "x", "sh", "-c", cmd], capture_output=True, text=True).stdout
        msgs.append({"role": "tool", "tool_call_id": c["id"], "content": out})
'''


def test_a_spec_file_no_one_here_wrote_works_by_its_path_and_failures_are_accounted(learnable_base, tok, tmp_path):
    """A 20-line harness of its own (standard library only) declared in a spec file beside it;
    then harnesses that crash before asking anything (the infrastructure's failure), hang after
    the first completion (the policy's) and flood the gateway (the policy's)."""
    from composer_dag.harness.external import install, load_spec

    files = {"agent.py": AGENT, "task.txt": "{task}"}
    spec = load_spec(_spec(tmp_path, "tiny-agent", ["{python}", "agent.py", "{base_url}", "{api_key}", "{docker}"], files))
    install(spec)
    t = task(learnable_base)
    from composer_dag.tasks.taskdir import load_task

    word = load_task(t)["instructions"].split("word ")[1].split()[0]
    sh = lambda cmd: "<tool_call>\n" + json.dumps({"name": "sh", "arguments": {"cmd": cmd}}) + "\n</tool_call>"
    r, _ = play(spec, t, tok, [sh(f"echo {word} > answer.txt"), sh("DONE")], tmp_path / "ok")
    assert r["reward"] == 1.0 and r["end_reason"] == "exited" and not r["infra_failure"] and r["extension_rate"] == 1.0, r

    crash = load_spec(_spec(tmp_path, "tiny-agent", ["{python}", "-c", "import sys; sys.exit(3)"]))
    r, _ = play(crash, t, tok, [], tmp_path / "crash")
    assert (r["end_reason"], r["infra_failure"], r["calls"]) == ("crashed", True, 0), r
    hang = load_spec(_spec(tmp_path, "tiny-agent", ["{python}", "hang.py", "{base_url}", "{api_key}"], {"hang.py": (
        "import json, sys, time, urllib.request\n"
        "req = urllib.request.Request(sys.argv[1] + '/completions', json.dumps({'prompt': 'x', 'max_tokens': 4}).encode(),"
        " {'Authorization': 'Bearer ' + sys.argv[2], 'Content-Type': 'application/json'})\n"
        "urllib.request.urlopen(req).read(); time.sleep(600)\n")}))
    r, _ = play(hang, t, tok, ["hello"], tmp_path / "hang", timeout_s=8)
    assert (r["end_reason"], r["infra_failure"], r["calls"]) == ("timeout", False, 1), r
    flood = load_spec(_spec(tmp_path, "tiny-agent", ["{python}", "agent.py", "{base_url}", "{api_key}", "{docker}"], files))
    r, _ = play(flood, t, tok, [sh("true")] * 20, tmp_path / "flood")
    assert r["calls"] == 6 and not r["infra_failure"], r  # six calls, then the episode's limit
    with pytest.raises(ValueError, match="not a harness spec"):
        bad = tmp_path / "bad.toml"
        bad.write_text('name = "x"\n')
        load_spec(bad)


@pytest.fixture(scope="module")
def long_model(learnable_base, tmp_path_factory):
    """A tiny real model on the learnable tokenizer with room for mini-swe-agent's prompts (4,096
    positions), untrained."""
    from composer_dag.rl.learnable import TEST_MODEL
    from composer_dag.train.model import build_base_model

    model = tmp_path_factory.mktemp("long") / "model"
    build_base_model("tiny", learnable_base["tokenizer_dir"], str(model), **{**TEST_MODEL, "max_position_embeddings": 4096})
    return model


@pytest.fixture(scope="module")
def short_spec(mini, tmp_path_factory):
    """mini-swe-agent's spec, same version (so its environment), given by path, with two steps of
    24 tokens an episode."""
    p = tmp_path_factory.mktemp("spec") / "short.toml"
    p.write_text(Path(mini.path).read_text().replace('"step_limit": 30', '"step_limit": 2').replace(
        '"max_tokens": 256', '"max_tokens": 24'))
    return p


def test_rl_step_on_rollouts_a_published_harness_played(long_model, short_spec, learnable_base):
    """The loop of an external harness (``AgentConfig.harness``: a spec file) gives rollouts with
    the gateway's segments, named by harness and version; a GRPO step trains on them."""
    from composer_dag.agent import AgentConfig, ExternalLoop, agent_loop
    from composer_dag.inference.engine import HFEngine
    from composer_dag.train.tokenizer import load_tokenizer

    tok = load_tokenizer(str(long_model))
    loop = agent_loop(HFEngine(str(long_model)), tok, AgentConfig(harness=str(short_spec), max_context=4096,
                                                                 max_new_tokens=24, workers=2))
    assert isinstance(loop, ExternalLoop)
    try:
        rows = loop.run([(str(task(learnable_base, 0)), "g0", 0), (str(task(learnable_base, 0)), "g0", 1)], version=3)
    finally:
        loop.close()
    assert all(r["harness"] == "mini-swe-agent" and r["harness_version"] == "2.4.6" and r["policy_version"] == 3 for r in rows)
    assert all(r["segments"] and r["infra_error"] is None and r["generated_tokens"] > 0 for r in rows), \
        [(r["end_reason"], r["infra_error"]) for r in rows]
    from composer_dag.rl.grpo import training_rows

    for r in rows:  # what the trainer takes: one row per segment, loss on the sampled tokens only
        r["advantage"] = 1.0
        got = training_rows(r)
        assert sum(sum(x["loss_mask"]) for x in got) == r["generated_tokens"] and len(got) == len(r["segments"])


def test_harness_run_from_the_command_line_with_a_real_model(long_model, short_spec, learnable_base, tmp_path):
    """``composer-dag harness run`` with mini-swe-agent (its step limit cut by a spec of the same
    version given by path) and a tiny real model served in the process: one JSON line last."""
    model = long_model
    proc = subprocess.run([sys.executable, "-m", "composer_dag.cli", "harness", "run", str(short_spec),
                           str(task(learnable_base)), "--model", str(model), "--out", str(tmp_path / "out"),
                           "--timeout", "240"], capture_output=True, text=True, timeout=400,
                          env={**os.environ, "COMPOSER_HOME": str(tmp_path)})
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"harness", "version", "reward", "flags", "calls", "segments", "extension_rate", "infra_failure"} <= set(r), r
    assert r["harness"] == "mini-swe-agent" and r["calls"] >= 1 and not r["infra_failure"] and proc.returncode == 0, (r, proc.stderr[-800:])
    rollout = json.loads((tmp_path / "out" / "rollout.json").read_text())
    assert sum(len(s["ids"]) for s in rollout["segments"]) >= sum(len(x["completion_ids"]) for x in rollout["records"])


def test_evaluation_reports_pass_at_1_per_harness_and_the_gate_compares_them(long_model, short_spec, learnable_base, tmp_path):
    """``EvalConfig.harnesses``: mini-swe-agent (a spec file) plays the first tasks beside the
    built-in loop on the same engine; the summary has pass@1 per harness with its end reasons
    and extension rate, ``harness_results.parquet`` its rows (read back by pyarrow), the gate a
    row per harness and ``make run``'s table a column."""
    import pyarrow.parquet as pq

    from assets.evals import terminal_summary
    from composer_dag.evals.evaluate import evaluate
    from composer_dag.evals.gate import compare

    cfg = {"samples_per_task": 1, "max_tasks": 2, "every_task_of": [], "humaneval_ids": [], "inference": {"engine": "hf"},
           "agent": {"max_turns": 2, "max_new_tokens": 24, "max_context": 4096, "workers": 2},
           "harnesses": [str(short_spec)], "harness_max_tasks": 2, "harness_samples": 1}
    s = evaluate(str(long_model), learnable_base["tasks_dir"], tmp_path / "eval", cfg)
    assert set(s["by_harness"]) == {"composer", "mini-swe-agent"} and s["harness"] == "composer", s["by_harness"]
    mini = s["by_harness"]["mini-swe-agent"]
    assert mini["tasks"] + mini["infra_failures"] >= 1 and sum(mini["end_reasons"].values()) == 2, mini
    assert mini["harness_version"] == "2.4.6" and mini["pass@1"] is not None and mini["extension_rate"] is not None, mini
    assert s["by_harness"]["composer"]["pass@1"] == s["pass@1"]
    rows = pq.read_table(tmp_path / "eval" / "harness_results.parquet").to_pylist()
    assert len(rows) == mini["samples"] and {r["harness"] for r in rows} == {"mini-swe-agent"}
    cmp = compare(s, s)
    row = next(r for r in cmp["rows"] if r["metric"] == "pass@1 harness mini-swe-agent")
    assert row["delta"] == 0.0 and not row["gating"] and "min_tasks" in row["note"], row
    worse = {**s, "by_harness": {**s["by_harness"], "mini-swe-agent": {**mini, "pass@1": mini["pass@1"] - 0.5, "tasks": 40}}}
    better = {**s, "by_harness": {**s["by_harness"], "mini-swe-agent": {**mini, "pass@1": mini["pass@1"] + 0.5, "tasks": 40}}}
    failed = compare(worse, better)
    assert not failed["passed"] and any("harness mini-swe-agent" in r for r in failed["reasons"]), failed["reasons"]
    meta = {"rl_checkpoint.pass@1": 0.5, "rl_checkpoint.harness_pass@1.mini-swe-agent": 0.25, "gate_passed": True}
    table = terminal_summary(meta).splitlines()
    assert "harness mini-swe-agent" in table[0] and "0.250" in next(x for x in table if x.startswith("RL")), table


@pytest.mark.parametrize("name", ["mini-swe-agent", "openai-agents"])
def test_sft_demonstrations_in_a_harness_format_are_what_it_serves(name, mini, agents_sdk, learnable_base, tok, tmp_path):
    """Reference actions played through the harness itself give SFT rows in its own format (its
    system prompt, its task message, its observations), named by harness and version; SFT's
    tokenization of a row is token for token the sequence the gateway recorded when the policy
    sampled those replies, with loss on exactly the sampled tokens."""
    import pyarrow.parquet as pq

    from composer_dag.gateway.chat import Renderer
    from composer_dag.harness.external import demonstrate, load_spec
    from composer_dag.sft.run import tokenize
    from composer_dag.sft.trajectories import TrajectoryConfig, build, read_rows, reference_actions
    from composer_dag.tasks.taskdir import load_task

    spec = load_spec(name)
    t = task(learnable_base, 2)
    conv, why, s = demonstrate(spec, t, reference_actions(t, load_task(t)), tok, tmp_path / "demo")
    assert why == "ok" and s["reward"] == 1.0 and s["segments"] == 1, (why, s["end_reason"], s["rollout"]["extension"])
    seg = s["rollout"]["segments"][0]
    ids, mask = Renderer(tok).conversation(conv["messages"], conv["tools"])
    assert ids[:len(seg["ids"])] == seg["ids"] and mask[:len(seg["mask"])] == seg["mask"]
    assert not any(mask[len(seg["mask"]):]) and len(ids) - len(seg["ids"]) <= 2  # what follows the last turn's end
    assert conv["messages"][0]["role"] == "system" and conv["tools"][0]["function"]["name"] == "bash"

    # the set as the sft_trajectories asset builds it: the composer harness's references and this
    # harness's demonstrations, every task read accounted for once per harness
    summary = build(learnable_base["tasks_dir"], tmp_path / "traj",
                    TrajectoryConfig(max_per_source={"learnable": 2}, harnesses=[name]), tokenizer=tok)
    ref = summary["reference"]
    assert ref["in"] == ref["out"] + sum(ref["skipped"].values()) and ref["out"] == 4, ref
    assert summary["by_harness"] == {"composer": 2, spec.name: 2}, summary["by_harness"]
    rows = [r for r in read_rows(str(tmp_path / "traj" / "trajectories.parquet")) if r["harness"] == spec.name]
    assert {(r["harness"], r["harness_version"]) for r in rows} == {(spec.name, spec.version)}
    out = tokenize(str(tmp_path / "traj"), learnable_base["policy_dir"], str(tmp_path / "tok"), seq_len=4096)
    assert out["trajectories_in"] == 4 and out["skipped"] == {} and out["supervised_tokens"] > 0, out
    got = {r["trajectory_id"]: r for split in ("train", "val") if (tmp_path / "tok" / f"{split}.parquet").exists()
           for r in pq.read_table(tmp_path / "tok" / f"{split}.parquet").to_pylist()}
    for row in rows:
        want = Renderer(tok).conversation(json.loads(row["messages"]), json.loads(row["tools"]))
        assert (got[row["trajectory_id"]]["input_ids"], got[row["trajectory_id"]]["loss_mask"]) == want


def test_sessions_through_the_gateway_become_composer_session_2_and_train_on_their_ids(mini, learnable_base, tok, tmp_path):
    """A session mini-swe-agent played through the gateway, as a ``composer-session/2`` record:
    valid by the schema, read back by the session reader, its calls' exact ids; the off-policy
    path trains on segments built from those ids (never a rendering of the messages) and
    grades it again by replaying the harness's commands; a session whose text scrubbing changed
    keeps no ids."""
    from composer_dag.rl.grpo import training_rows
    from composer_dag.tasks.taskdir import load_task
    from composer_dag.traces.format import gateway_session, read_sessions, schema_errors
    from composer_dag.traces.intake import scrub
    from composer_dag.traces.offpolicy import session_rollouts

    t = task(learnable_base, 3)
    word = load_task(t)["instructions"].split("word ")[1].split()[0]
    write = mini.command_of(Action("write", {"path": "answer.txt", "old": "", "new": word + "\n"}))
    r, _ = play(mini, t, tok, ["Writing it.\n" + call(write), call(mini.demo.submit)], tmp_path)
    assert r["reward"] == 1.0 and r["segments"] == 1
    rec = gateway_session(r["rollout"], session_id="s-1", user_id="u-1", training_consent=True,
                          model={"version": "v1", "digest": "d"}, tokenizer_digest="t",
                          harness={"name": mini.name, "version": mini.version}, started_at="2026-12-07T10:00:00Z",
                          ended_at="2026-12-07T10:05:00Z", outcome={"rating": 1}, start={"snapshot": t.name})
    assert schema_errors(rec) == [] and rec["format"] == "composer-session/2" and len(rec["calls"]) == 2
    [(_, back, why)] = list(read_sessions((json.dumps(rec) + "\n").encode()))
    assert why == "ok" and back == rec
    assert schema_errors({**rec, "format": "composer-session/1"})  # /1 holds no calls
    rows, summary = session_rollouts([rec], tok, current_version="v1", versions=["v1"], max_staleness=1,
                                     tasks_dir=learnable_base["tasks_dir"])
    assert summary["out"] == 1 and rows[0]["reward_kind"] == "regraded" and rows[0]["reward"] == 1.0, summary
    seg = r["rollout"]["segments"][0]
    assert rows[0]["segments"] == [{"ids": seg["ids"], "mask": seg["mask"], "logprobs": seg["logprobs"]}]
    got = training_rows({**rows[0], "advantage": 1.0})
    assert got[0]["prompt_ids"] + got[0]["completion_ids"] == seg["ids"]
    leaky = {**rec, "client": {"user": "alice"}, "messages": rec["messages"] + [{"role": "user", "content": "thanks, alice"}]}
    cleaned, _, dropped = scrub(leaky)
    assert cleaned["calls"] == [] and dropped == 2 and "alice" not in json.dumps(cleaned["messages"])


def test_the_sft_trajectories_asset_adds_a_harness_s_demonstrations(mini, learnable_base, tmp_path):
    """``sft_trajectories`` with ``harnesses`` set reads the policy's tokenizer (the ``tokenizer``
    asset, now among its parents) and adds the harness's demonstrations beside the composer
    harness's, shown by harness in its metadata; its accounting check holds."""
    import dagster as dg

    from composer_dag.definitions import build_defs
    from composer_dag.rl.learnable import build_learnable_tasks
    from composer_dag.storage import open_storage
    from tests.graph.test_graph_data import resources_for

    (tmp_path / "sources.yaml").write_text("sources: []\n")
    defs = build_defs(resources_for(str(tmp_path / "artifacts"), tmp_path, tmp_path / "sources.yaml"))
    assert dg.AssetKey("tokenizer") in defs.resolve_asset_graph().get(dg.AssetKey("sft_trajectories")).parent_keys
    storage = open_storage(str(tmp_path / "artifacts"))
    build_learnable_tasks(tmp_path / "eval_tasks", 2, seed=1, words=("green", "yellow"), request_file=False)
    with dg.instance_for_test() as instance:
        for key, local in (("eval_tasks", tmp_path / "eval_tasks"), ("rl_tasks", learnable_base["tasks_dir"]),
                           ("tokenizer", learnable_base["policy_dir"])):
            url = storage.url(key, "seed")
            digest = storage.publish_dir(str(local), url)
            instance.report_runless_asset_event(dg.AssetMaterialization(key, metadata={"dagster/uri": url,
                                                                                      "manifest_digest": digest}))
        config = {"harnesses": ["mini-swe-agent"], "max_per_source": {"learnable": 2}, "session_share": 0.0}
        result = defs.resolve_implicit_global_asset_job_def().execute_in_process(
            instance=instance, asset_selection=[dg.AssetKey("sft_trajectories")],
            run_config={"ops": {"sft_trajectories": {"config": config}}})
    assert result.success
    (mat,) = result.asset_materializations_for_node("sft_trajectories")
    meta = {k: v.value for k, v in mat.metadata.items()}
    assert "| mini-swe-agent | 2 |" in meta["by_harness"] and "| composer | 2 |" in meta["by_harness"], meta["by_harness"]
    assert {e.check_name: e.passed for e in result.get_asset_check_evaluations()} == {"trajectories_accounted": True}
    rows = storage.read_parquet(meta["dagster/uri"].rstrip("/") + "/trajectories.parquet").to_pylist()
    assert sorted(r["harness"] for r in rows) == ["composer"] * 2 + ["mini-swe-agent"] * 2
    assert all(json.loads(r["tools"])[0]["function"]["name"] == "bash" for r in rows if r["harness"] == "mini-swe-agent")
