"""The harness seam: a harness defined here (one ``bash`` tool, calls as fenced shell blocks,
results as user messages) runs the real loop in a real sandbox: its prompt and calls reach the
policy and the episode, its reference actions solve a task, its episodes are graded, and its
action log, in harness-neutral terms, drives the same command-based cheat flags."""

import json
import re
import time

import pytest

from composer_dag import harness
from composer_dag.agent import AgentConfig, AgentLoop
from composer_dag.harness.base import Action, Harness, Parsed, Tool
from composer_dag.harness.episode import Episode
from composer_dag.inference.engine import Completion, Engine, EngineStats
from composer_dag.sft.trajectories import play, reference_calls
from composer_dag.tasks.format import TaskLimits, task_dirs
from composer_dag.tasks.sources.learnable import build_learnable_tasks

_BLOCK = re.compile(r"```bash\n(.*?)\n```", re.S)


class BashHarness(Harness):
    """Every action is a shell command; ``SUBMIT`` alone on a line ends the episode."""

    name, version = "toy-bash", "0.1"
    tools = (Tool({"type": "function", "function": {"name": "bash", "description": "Run a shell command.",
                   "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                                  "required": ["cmd"], "additionalProperties": False}}}, "exec", {"cmd": "command"}),
             Tool({"type": "function", "function": {"name": "submit", "description": "Finish.", "parameters": {
                 "type": "object", "properties": {}, "required": [], "additionalProperties": False}}}, "submit"))
    intro = "Run commands as ```bash blocks; write SUBMIT on a line of its own when done."
    control_tokens = ("<|im_start|>", "<|im_end|>", "```")
    no_call = "Error: write a ```bash block, or SUBMIT."

    def render_call(self, name, arguments):
        return "SUBMIT" if name == "submit" else f"```bash\n{arguments['cmd']}\n```"

    def parse(self, text):
        calls = [{"name": "bash", "arguments": {"cmd": body}} for body in _BLOCK.findall(text)]
        rest = _BLOCK.sub("", text).replace("<|im_end|>", "")
        if re.search(r"^SUBMIT$", rest, re.M):
            calls.append({"name": "submit", "arguments": {}})
        return Parsed(calls, [], re.sub(r"^SUBMIT$", "", rest, flags=re.M).strip())

    def result_message(self, content):
        return {"role": "user", "content": f"<output>\n{content}\n</output>"}

    def render_action(self, action):
        a = action.args
        if action.kind == "read":
            return [{"name": "bash", "arguments": {"cmd": f"sed -n '{a['start_line']},{a['end_line']}p' {a['path']}"}}]
        if action.kind == "write":
            script = (f"import pathlib; p = pathlib.Path({a['path']!r}); old, new = {a['old']!r}, {a['new']!r}\n"
                      "p.write_text(p.read_text().replace(old, new, 1) if old else new)")
            return [{"name": "bash", "arguments": {"cmd": f"python3 - <<'EOF'\n{script}\nEOF"}}]
        return super().render_action(action)


TOY = harness.register(BashHarness())


class _Tok:
    """Character-level tokenizer with ChatML specials as single ids."""
    SPECIAL = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
    eos_token_id = 0

    def convert_tokens_to_ids(self, t):
        return self.SPECIAL.index(t)

    def __call__(self, text, add_special_tokens=False):
        ids, i = [], 0
        while i < len(text):
            k = next((k for k, s in enumerate(self.SPECIAL) if text.startswith(s, i)), None)
            ids.append(100 + ord(text[i]) if k is None else k)
            i += 1 if k is None else len(self.SPECIAL[k])
        return type("E", (), {"input_ids": ids})()

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.SPECIAL[t] if t < 100 else chr(t - 100) for t in ids)

    def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=False):
        s = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs)
        return s + ("<|im_start|>assistant\n" if add_generation_prompt else "")


class _Scripted(Engine):
    def __init__(self, tok, turns):
        self.tok, self.turns, self.calls, self.stats, self.prompts = tok, turns, 0, EngineStats(), []

    def generate(self, prompts, params):
        self.prompts.append(self.tok.decode(prompts[0]))
        text = self.turns[min(self.calls, len(self.turns) - 1)]
        self.calls += 1
        ids = self.tok(text).input_ids
        return self._account([Completion(p, ids, [-0.5] * len(ids), text, "stop") for p in prompts], time.perf_counter())


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    return build_learnable_tasks(tmp_path_factory.mktemp("tasks"), 1, seed=0, words=("red",),
                                 limits=TaskLimits(max_turns=10, command_timeout=10, test_timeout=30))


def _loop(turns, tasks):
    tok = _Tok()
    engine = _Scripted(tok, turns)
    loop = AgentLoop(engine, tok, AgentConfig(harness="toy-bash", max_turns=4, max_new_tokens=400,
                                              max_context=50_000, workers=1))
    (r,) = loop.run([(str(tasks[0]), "g", 0)], version=0)
    loop.close()
    return r, engine


def test_the_registry_knows_both_harnesses():
    assert {"composer", "toy-bash"} <= set(harness.names()) and harness.get("toy-bash") is TOY
    with pytest.raises(KeyError, match="unknown harness"):
        harness.get("no-such-harness")


def test_a_scripted_episode_through_the_toy_harness_is_solved_and_named(tasks):
    word = json.loads((tasks[0] / "task.json").read_text())["reference"]["word"]
    r, engine = _loop(["I will write it.\n```bash\necho " + word + " > answer.txt\n```<|im_end|>",
                       "SUBMIT<|im_end|>"], tasks)
    assert r["finish"] == "submit" and r["reward"] == 1.0 and r["flags"] == []
    assert (r["harness"], r["harness_version"]) == ("toy-bash", "0.1")
    msgs = json.loads(r["messages"])
    assert msgs[0]["content"].startswith(TOY.intro) and "bash(cmd: string)" in msgs[0]["content"]
    assert engine.prompts[0].startswith("<|im_start|>system\n" + TOY.intro)
    assert msgs[2]["tool_calls"] == [{"name": "bash", "arguments": {"cmd": f"echo {word} > answer.txt"}}]
    assert msgs[2]["content"] == "I will write it."
    assert msgs[3]["role"] == "user" and msgs[3]["content"].startswith("<output>\nexit code: 0")
    assert "<output>" in engine.prompts[1]  # the result, as the harness renders it, is what the policy saw next


def test_the_toy_harness_renders_reference_actions_that_solve_a_task(humaneval_tasks, tasks):
    out, _ = humaneval_tasks
    task = next(d for d in task_dirs(out, "rl_tasks") + task_dirs(out, "eval_tasks") if d.name == "humaneval-000")
    calls = reference_calls(task, json.loads((task / "task.json").read_text()), harness="toy-bash")
    assert [c["name"] for c in calls] == ["bash", "bash", "submit"] and calls[0]["arguments"]["cmd"].startswith("sed -n")
    messages, why = play(task, calls, harness="toy-bash")
    assert why == "ok" and messages[2]["role"] == "user" and messages[2]["content"].startswith("<output>\n")
    learnable = reference_calls(tasks[0], json.loads((tasks[0] / "task.json").read_text()), harness=TOY)
    assert play(tasks[0], learnable, harness=TOY)[1] == "ok"
    assert TOY.render_actions([Action("submit")]) == [{"name": "submit", "arguments": {}}]


def test_the_toy_harness_log_drives_the_command_flags(tasks):
    with Episode(tasks[0], harness=TOY) as ep:
        for call in TOY.parse("```bash\ngit log -p | head\n```\n```bash\ncat /etc/shadow\n```\nSUBMIT").calls:
            ep.step(call)
        assert [(e["kind"], e["tool"]) for e in ep.log] == [("exec", "bash"), ("exec", "bash"), ("submit", "submit")]
        assert ep.log[0]["command"] == "git log -p | head" and ep.log[0]["args"] == {"cmd": "git log -p | head"}
        flags = ep.grade().flags
    assert any(f.startswith("git_history:") for f in flags) and any(f.startswith("read_outside:") for f in flags), flags
