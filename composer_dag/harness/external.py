"""Harnesses no one here wrote, declared in a spec file and played unchanged in an episode.

A spec (TOML, ``docs/harnesses.md``) names the harness and its pinned version, the packages its
own virtual environment installs (``install``), the command that plays one episode and the files
it reads (templates over ``{task}``, ``{model}``, ``{base_url}``, ``{api_key}``, ``{workdir}``,
``{docker}``, ``{out}``, ``{bin}``), the API it speaks and how a reference action is rendered in
its format for SFT (``demo``). ``composer_dag/harness/specs/`` holds the declared ones; a spec
file anywhere else works by its path.

One episode (``run_episode``): the runner issues the episode a key at the gateway, starts the
harness as a process of the host with that key and the gateway's URL, and serves the
harness's commands in the episode's sandbox through a ``docker``-compatible executable
(``docker_shim``): commands run in the project as the persona's user, what they start in the
background lives until the episode ends, and file edits land in the graded workspace. Every
command is an ``exec`` entry of the action log, which grading reads. The sandbox has no network
and sees neither the gateway's records, the key nor the runner's files.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from composer_dag.harness.base import Action
from composer_dag.harness.docker_shim import read_line

SPECS = Path(__file__).with_name("specs")
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class Install(BaseModel):
    packages: list[str] = Field(description="pip requirements of the harness's own environment, pinned")
    python: str = Field("python3", description="the interpreter the environment is made with")


class Run(BaseModel):
    command: list[str] = Field(description="argv template of one episode")
    env: dict[str, str] = Field(default_factory=dict, description="environment of the harness process (templates)")
    files: dict[str, str] = Field(default_factory=dict, description="files written in {out} first: name -> template")
    timeout_s: float = Field(900.0, description="wall clock of one episode; then the harness is killed")
    max_calls: int = Field(100, description="model calls per episode at the gateway")


class Api(BaseModel):
    kind: Literal["chat", "completions"] = "chat"
    stream: bool = False
    tool_call_parser: str | None = Field("hermes", description="what its server needs to return tool calls (None: text only)")


class Demo(BaseModel):
    """How a reference action is written in the harness's format (SFT demonstrations)."""

    style: Literal["tool-call", "text-block"] = "tool-call"
    tool: str = Field("bash", description="tool-call: the function that runs a command")
    argument: str = Field("command", description="tool-call: its argument holding the command")
    fence: str = Field("bash", description="text-block: the code fence's info string")
    submit: str = Field(SUBMIT, description="the command that ends the episode")
    submit_message: str | None = Field(None, description="harnesses that end on a final answer (no tool call): "
                                       "the answer a demonstration ends with; the episode counts as submitted "
                                       "when the harness exits 0 after the policy acted")


class HarnessSpec(BaseModel):
    name: str
    version: str
    description: str = ""
    install: Install
    run: Run
    api: Api = Api()
    demo: Demo = Demo()
    path: str | None = None  # the spec file it was read from

    @property
    def env_dir(self) -> Path:
        return harness_home() / f"{self.name}-{self.version}"

    @property
    def bin(self) -> Path:
        return self.env_dir / "bin"

    def installed(self) -> bool:
        return (self.env_dir / ".installed").read_text().strip() == self.requirements() \
            if (self.env_dir / ".installed").exists() else False

    def requirements(self) -> str:
        return "\n".join(self.install.packages)

    # -- reference actions
    def command_of(self, action: Action) -> str:
        """A reference action as one shell command (a harness with only a shell gets every action so)."""
        a, q = action.args, shlex.quote
        if action.kind == "exec":
            return a["command"]
        if action.kind == "submit":
            return self.demo.submit
        if action.kind == "read":
            start, end = a.get("start_line"), a.get("end_line")
            return f"sed -n '{start or 1},{end or '$'}p' {q(a['path'])}" if start or end else f"cat {q(a['path'])}"
        if action.kind == "list":
            return f"ls -p {q(a.get('path', '.'))}"
        if action.kind == "search":
            return f"grep -rn -E {q(a['pattern'])} {q(a.get('path', '.'))}"
        if action.kind == "write":
            if not a.get("old"):
                return f"mkdir -p \"$(dirname {q(a['path'])})\" && printf %s {q(a['new'])} > {q(a['path'])}"
            script = ("import sys;p,o,n=sys.argv[1:];t=open(p).read();assert t.count(o)==1,'old text not unique';"
                      "open(p,'w').write(t.replace(o,n,1))")
            return f"python3 -c {q(script)} {q(a['path'])} {q(a['old'])} {q(a['new'])}"
        raise ValueError(f"no command for action {action.kind!r}")

    def render_action(self, action: Action, thought: str = "") -> dict:
        """The assistant message of one reference action in the harness's format."""
        if action.kind == "submit" and self.demo.submit_message is not None:
            return {"role": "assistant", "content": self.demo.submit_message}
        cmd = self.command_of(action)
        if self.demo.style == "text-block":
            return {"role": "assistant", "content": f"{thought or 'THOUGHT: next step.'}\n\n```{self.demo.fence}\n{cmd}\n```"}
        return {"role": "assistant", "content": thought, "tool_calls": [{"id": "call_0", "type": "function", "function": {
            "name": self.demo.tool, "arguments": json.dumps({self.demo.argument: cmd})}}]}


def harness_home() -> Path:
    """Where harness environments live: ``$COMPOSER_HARNESS_HOME``, else ``.harnesses`` in the checkout."""
    return Path(os.environ.get("COMPOSER_HARNESS_HOME") or Path(__file__).resolve().parents[2] / ".harnesses")


def declared() -> list[HarnessSpec]:
    return [load_spec(p) for p in sorted(SPECS.glob("*.toml"))]


def load_spec(name_or_path) -> HarnessSpec:
    """A spec by its path, or by the name of a declared one; ``ValueError`` says what is wrong."""
    p = Path(name_or_path)
    if not p.is_file():
        p = SPECS / f"{name_or_path}.toml"
        if not p.is_file():
            known = ", ".join(s.stem for s in sorted(SPECS.glob("*.toml")))
            raise ValueError(f"no harness spec {name_or_path!r} (a file, or one of: {known})")
    try:
        raw = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p}: not TOML ({e})") from None
    try:
        return HarnessSpec(**raw, path=str(p))
    except Exception as e:
        raise ValueError(f"{p}: not a harness spec: {e}") from None


def install(spec: HarnessSpec, log=print) -> Path:
    """Make the harness's own virtual environment and install its packages (once per version)."""
    if spec.installed():
        return spec.env_dir
    spec.env_dir.parent.mkdir(parents=True, exist_ok=True)
    log(f"installing {spec.name} {spec.version} into {spec.env_dir}")
    subprocess.run([spec.install.python, "-m", "venv", "--clear", str(spec.env_dir)], check=True)
    if spec.install.packages:
        subprocess.run([str(spec.bin / "pip"), "install", "-q", "--disable-pip-version-check", *spec.install.packages],
                       check=True)
    (spec.env_dir / ".installed").write_text(spec.requirements() + "\n")
    return spec.env_dir


class ShellBridge:
    """The runner's end of ``docker_shim``: a unix socket in the runner's own directory (outside
    the sandbox) whose requests run in the episode's sandbox."""

    def __init__(self, episode, where: Path, tool: str, log_every=None):
        self.episode, self.tool = episode, tool
        self.path = str(where / "shell.sock")
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(self.path)
        os.chmod(self.path, 0o600)
        self.server.listen(16)
        self.commands = 0
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True, name="shell-bridge")
        self._thread.start()
        self.docker = where / "bin" / "docker"
        self.docker.parent.mkdir(exist_ok=True)
        self.docker.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -I "
                               f"{shlex.quote(str(Path(__file__).with_name('docker_shim.py')))} \"$@\"\n")
        self.docker.chmod(0o755)
        self.secrets: list[str] = []

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn) -> None:
        with conn:
            data = read_line(conn)
            if not data:
                return
            try:
                req = json.loads(data)
                out = self._answer(req)
            except Exception as e:  # a request this side cannot serve: the harness sees a failed command
                out = {"exit_code": 125, "output": f"{type(e).__name__}: {e}\n"}
            conn.sendall(json.dumps(out).encode() + b"\n")

    def _answer(self, req: dict) -> dict:
        if req.get("op") == "start":
            return {"container": f"episode-{id(self.episode):x}"}
        argv = [str(a) for a in req.get("argv") or []]
        # bash -lc CMD (the usual form): CMD is what the policy wrote
        command = argv[2] if len(argv) == 3 and argv[1] in ("-c", "-lc") and argv[0].endswith(("sh", "bash")) else shlex.join(argv)
        env = {str(k): str(v) for k, v in (req.get("env") or {}).items()
               if not any(s and s in str(v) for s in self.secrets)}  # never the episode's key
        with self._lock:
            self.commands += 1
            try:
                r = self.episode.shell(command, cwd=req.get("cwd") or None, env=env, tool=self.tool)
            except Exception as e:
                return {"exit_code": 125, "output": f"{e}\n"}
        return {"exit_code": r.exit_code, "output": r.stdout + r.stderr}

    def close(self) -> None:
        self._stop = True
        try:
            self.server.close()
        finally:
            try:
                os.unlink(self.path)
            except OSError:
                pass


def _fill(template: str, values: dict) -> str:
    out = template
    for k, v in values.items():
        out = out.replace("{" + k + "}", str(v))
    return out


def end_reason(proc_rc: int | None, timed_out: bool, records: dict, submitted: bool) -> tuple[str, bool]:
    """Why an external-harness episode ended, and whether that is an infrastructure failure.

    The rule: a failure is the infrastructure's (kept out of the advantages) when it came before
    the policy's first completion (the harness could not start, crashed or hung before it asked
    the model anything) or when the gateway found no server to answer; anything after the
    policy's first completion is the policy's (a context overrun, the call limit, a hang, a
    crash), and the episode scores as the grader says."""
    refused = records.get("refused", {})
    acted = any(r["completion_ids"] for r in records.get("records", []))
    if refused.get("server down"):
        return "upstream_down", True
    if submitted:
        return "submitted", False
    if refused.get("context_length_exceeded"):
        reason = "context_length_exceeded"
    elif refused.get("call limit"):
        reason = "call_limit"
    elif timed_out:
        reason = "timeout"
    elif proc_rc not in (0, None):
        reason = "crashed"
    else:
        reason = "exited"
    return reason, not acted


def run_episode(spec: HarnessSpec, task_dir, gateway, model: str, out_dir, episode_config=None,
                timeout_s: float | None = None, log=lambda m: None, key: str | None = None) -> dict:
    """Play one episode of ``task_dir`` with the harness of ``spec`` through ``gateway`` (a
    started ``GatewayServer``); returns the episode's summary and, under ``"rollout"``, its
    record: the gateway's calls, segments and extension, the action log and the grade.
    ``key``: the episode's key, issued by the caller (which may bind it to a server first)."""
    import tempfile

    from composer_dag.harness.episode import Episode, EpisodeConfig

    if not spec.installed():
        raise RuntimeError(f"harness {spec.name} {spec.version} is not installed (make harnesses, or "
                           f"composer-dag harness install {spec.path or spec.name})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    where = Path(tempfile.mkdtemp(prefix="cdag-h-"))
    t0 = time.monotonic()
    with Episode(task_dir, episode_config or EpisodeConfig()) as ep:
        key = key or gateway.gateway.issue(f"{spec.name}:{Path(task_dir).name}", spec.run.max_calls)
        bridge = ShellBridge(ep, where, tool=spec.name)
        bridge.secrets = [key, gateway.admin_token]
        values = {"task": ep.prompt(), "model": model, "base_url": gateway.url, "api_key": key, "workdir": ep.root,
                  "docker": bridge.docker, "out": out, "bin": spec.bin, "python": spec.bin / "python"}
        for name, body in spec.run.files.items():
            (out / name).write_text(_fill(body, {**values, "task": json.dumps(values["task"])[1:-1]}))
        argv = [_fill(a, values) for a in spec.run.command]
        env = {**{k: v for k, v in os.environ.items() if not k.startswith(("COMPOSER_", "AWS_", "OPENAI_"))},
               "OPENAI_BASE_URL": gateway.url, "OPENAI_API_KEY": key, "COMPOSER_SHELL_SOCKET": bridge.path,
               **{k: _fill(v, values) for k, v in spec.run.env.items()}}
        rc, timed_out = None, False
        with open(out / "harness.log", "wb") as hlog:
            try:
                proc = subprocess.Popen(argv, cwd=out, env=env, stdout=hlog, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
            except OSError as e:
                hlog.write(f"could not start {argv[0]}: {e}\n".encode())
                proc = None
            if proc is not None:
                try:
                    rc = proc.wait(timeout=timeout_s or spec.run.timeout_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                finally:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)  # the harness and all it started
                    except ProcessLookupError:
                        pass
                    proc.wait()
            else:
                rc = 127
        gateway.gateway.revoke(key)
        bridge.close()
        records = gateway.gateway.records(key)
        submitted = any(e.get("kind") == "exec" and e.get("command", "").strip() == spec.demo.submit for e in ep.log) \
            or (spec.demo.submit_message is not None and rc == 0 and not timed_out
                and any(r["completion_ids"] for r in records.get("records", [])))
        reason, infra = end_reason(rc, timed_out, records, submitted)
        ep.done = True
        g = ep.grade()
        log(f"{spec.name}: {reason}, reward {g.reward}, {len(records['records'])} calls, {bridge.commands} commands")
    import shutil

    shutil.rmtree(where, ignore_errors=True)
    ext = records["extension"]
    summary = {"harness": spec.name, "version": spec.version, "task_id": Path(task_dir).name,
               "reward": float(g.reward), "flags": list(g.flags), "calls": len(records["records"]),
               "segments": len(records["segments"]), "extension_rate": ext["rate"], "infra_failure": infra,
               "end_reason": reason, "commands": bridge.commands, "exit_code": rc,
               "tests_passed": g.passed, "tests_failed": g.failed, "seconds": round(time.monotonic() - t0, 2)}
    summary["rollout"] = {**records, "action_log": ep.log, "grade": {
        "reward": g.reward, "flags": list(g.flags), "families": list(getattr(g, "families", [])),
        "canary_passed": bool(getattr(g, "canary_passed", False)), "details": g.details}}
    return summary


def rollout_record(summary: dict, task_dir, group_id: str, sample: int, version: int) -> dict:
    """An external-harness episode (``run_episode``'s summary) as a rollout: the gateway's
    token-exact ``segments`` to train on, the grade, ``infra_error`` where the rule says the
    failure was the infrastructure's, and the harness with its version."""
    import uuid

    ro, g = summary["rollout"], summary["rollout"]["grade"]
    segs = [{"ids": s["ids"], "mask": s["mask"], "logprobs": s["logprobs"]} for s in ro["segments"]]
    return {
        "rollout_id": uuid.uuid4().hex[:16], "task_id": summary["task_id"], "task_dir": str(task_dir),
        "group_id": group_id, "sample_index": sample, "policy_version": version,
        "harness": summary["harness"], "harness_version": summary["version"],
        "messages": json.dumps(ro["action_log"], default=str), "prompt_ids": [], "completion_ids": [],
        "loss_mask": [], "logprobs": [], "segments": segs,
        "reward": float(g["reward"]), "unflagged_reward": float(g["details"].get("unflagged_reward", g["reward"])),
        "tests_passed": summary["tests_passed"], "tests_failed": summary["tests_failed"], "flags": list(g["flags"]),
        "flag_families": g["families"], "canary_passed": g["canary_passed"], "num_turns": summary["calls"],
        "malformed_calls": 0, "tool_errors": sum(1 for e in ro["action_log"] if e.get("exit_code") not in (0, None)),
        "finish": summary["end_reason"], "end_reason": summary["end_reason"],
        "generated_tokens": sum(sum(s["mask"]) for s in segs), "extension_rate": summary["extension_rate"],
        "episode_seconds": summary["seconds"],
        "gen_seconds": sum(r.get("server_s") or 0.0 for r in ro["records"]), "tool_seconds": None, "grade_seconds": None,
        "infra_error": summary["end_reason"] if summary["infra_failure"] else None,
    }


def assistant_text(renderer, message: dict) -> str:
    """What the policy samples for the assistant turn ``message`` under the chat template (its
    end-of-turn token left out): a demonstration's reply as the server would return it."""
    user = [{"role": "user", "content": "."}]
    body = renderer.template(user + [message], None, False)[len(renderer.template(user, None, True)):]
    return body[:body.rfind(renderer.end_text)]


def demonstrate(spec: HarnessSpec, task_dir, actions: list[Action], tokenizer, out_dir, episode_config=None):
    """Play reference ``actions`` through the harness itself: each is the reply of a scripted
    policy at a gateway, so the harness builds its own prompts, runs the commands in the
    episode's sandbox and renders the results as it always does. Returns ``(conversation,
    reason, summary)``: the harness's last request with the last reply (its messages and tools,
    as it sent them) when the episode took one call per action and passed unflagged, else None
    with the reason."""
    from composer_dag.gateway.chat import Renderer
    from composer_dag.gateway.core import Gateway
    from composer_dag.gateway.server import GatewayServer
    from composer_dag.gateway.upstream import Scripted

    renderer = Renderer(tokenizer)
    replies = [assistant_text(renderer, spec.render_action(a)) for a in actions]
    gw = Gateway(Scripted(tokenizer, replies), tokenizer, "policy", max_model_len=1 << 16,
                 default_max_tokens=1 << 12)
    with GatewayServer(gw) as server:
        s = run_episode(spec, task_dir, server, "policy", out_dir, episode_config)
    if s["infra_failure"]:
        return None, f"demo_infra:{s['end_reason']}", s
    if s["calls"] != len(actions) or s["rollout"]["conversation"] is None:
        return None, "demo_calls_mismatch", s
    if s["flags"]:
        return None, "reference_flagged", s
    if not (s["tests_passed"] > 0 and s["tests_failed"] == 0):
        return None, "reference_not_passing", s
    return s["rollout"]["conversation"], "ok", s

