"""The ``Episode``: one task's workspace and sandbox, and the actions a harness's calls perform there.

A harness (``composer_dag.harness.base.Harness``; default ``composer``) checks each call and
maps it to a harness-neutral action (``Episode.act``). File actions (read, list, search, write)
work on the host copy of the workspace and refuse any path that resolves (symlinks included)
outside it; listing shows a link's target without following it, and files over
``MAX_TOOL_FILE_BYTES`` are refused (the host would hold them in memory many times over);
commands (exec) run in the task's sandbox. Every call, valid or not, lands in ``Episode.log``
under its action's ``kind``; malformed calls come back as error observations.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import regex

from pydantic import Field

from composer_dag.runtime.config import StageConfig
from composer_dag.harness.base import Harness, ToolError, truncate
from composer_dag.harness.composer import COMPOSER
from composer_dag.grading.checks import GradeConfig
from composer_dag.grading.grade import GradeResult, grade
from composer_dag.tasks.taskdir import load_task, project_name
from composer_dag.laptop.image import task_persona
from composer_dag.laptop.desktop import dressing
from composer_dag.sandbox import Limits, Sandbox, entry_disk_bytes, volume_workspace

SEARCH_SECONDS = 2.0  # time budget of one `search` call (the pattern is the model's)


@dataclass
class Observation:
    content: str
    is_error: bool = False
    done: bool = False
    tool: str | None = None
    kind: str | None = None  # the action the call performed (harness.base.KINDS)
    seconds: float = 0.0
    truncated: bool = False  # the content was cut to the observation budget


class EpisodeConfig(StageConfig):
    """One episode's environment: its budgets (None: the task's own limits), where its workspace
    is made, and how it is graded. The sandbox's resource limits are the ``Episode``'s ``limits``."""

    max_turns: Optional[int] = Field(None, description="tool turns (None: the task's limits.max_turns)")
    command_timeout: Optional[float] = Field(None, description="seconds per command (None: the task's limit)")
    observation_chars: Optional[int] = Field(None, description="characters of a tool's output shown (None: the task's limit)")
    work_root: Optional[str] = Field(None, description="where workspaces are created (None: the temp dir)")
    grade: GradeConfig = GradeConfig()


MAX_TOOL_FILE_BYTES = 8 << 20  # read_file / edit_file; the terminal (head, sed -n) reads larger files


def _read_text(f: Path, path: str) -> str:
    size = f.stat().st_size
    if size > MAX_TOOL_FILE_BYTES:
        raise ToolError(f"{path}: {size} bytes, over the {MAX_TOOL_FILE_BYTES} byte limit of this tool; "
                        "use the terminal (head, sed -n, grep) for large files")
    try:
        return f.read_text()
    except UnicodeDecodeError:
        raise ToolError(f"{path}: binary file") from None


class Episode:
    """One attempt at one task: a fresh workspace, a sandbox, tools, an action log, grading.

    The workspace (a copy of the task's checkout) and the sandbox's host side are made on the
    first tool call that needs them (``workspace``, ``sandbox``): an episode whose calls are all
    malformed, or that submits at once, never copies the checkout, and is graded on the task's
    checkout as handed out (``final_tree``), which is what its workspace would have held."""

    def __init__(self, task_dir, config: EpisodeConfig = EpisodeConfig(), limits: Limits = Limits(),
                 harness: Harness = COMPOSER):
        self.task_dir = Path(task_dir)
        self.harness = harness
        self.task = load_task(self.task_dir)
        lim = self.task.get("limits", {})
        self.config = config
        self.limits = limits
        self.max_turns = config.max_turns or lim.get("max_turns", 50)
        self.command_timeout = config.command_timeout or lim.get("command_timeout", 60.0)
        self.obs_chars = config.observation_chars or lim.get("observation_chars", 12_000)
        self._tmp = Path(tempfile.mkdtemp(prefix="cdag-w-", dir=config.work_root))
        self._ws = self._tmp / project_name(self.task)
        self.persona = task_persona(self.task)
        self.root = f"{self.persona.home}/{self._ws.name}"  # the project's path inside the sandbox
        self._sandbox: Sandbox | None = None
        self._volume = None  # the sandbox's /home file system, which holds the workspace
        self.log: list[dict] = []
        self.turn = 0
        self.done = False
        self.result: GradeResult | None = None

    def _materialize(self) -> None:
        """The workspace copied from the task's checkout, and the sandbox over it (once)."""
        if self._sandbox is not None:
            return
        if not self._tmp.exists():
            raise RuntimeError("the episode is closed")
        if self._volume is None and not self._ws.exists():
            # in the sandbox's /home file system where the host allows it: no mount of its own
            self._volume, self._ws = volume_workspace(self.persona, self._ws.name, self.limits, self._tmp,
                                                      self.task_dir / "repo")
        masks = {p: (self.task_dir / "masks" / v if v else None)
                 for p, v in self.task.get("sandbox", {}).get("masks", {}).items()}
        binds, self._layers = [], []
        if self.task.get("sandbox", {}).get("venv"):
            # a repository task: the project's own .venv, its site-packages the shared layer
            # (read-only; the file tools read it where the terminal sees it)
            from composer_dag.repos.layers import venv_binds

            binds = venv_binds(self._ws, self.task_dir / "layer", self.root)
            self._layers = [(os.path.realpath(self._ws) + b.path[len(self.root):], os.path.realpath(b.host))
                            for b in binds]
        sandbox = Sandbox(self._ws, self.limits, project=self._ws.name, masks=masks, dressing=dressing(self.persona),
                          binds=binds, volume=self._volume)
        if binds:
            sandbox.env.update(VIRTUAL_ENV=f"{self.root}/.venv", PATH=f"{self.root}/.venv/bin:{sandbox.env['PATH']}")
        self._real = os.path.realpath(self._ws)
        self._sandbox = sandbox

    @property
    def workspace(self) -> Path:
        """The host copy of the project (made now if no call has needed it yet)."""
        self._materialize()
        return self._ws

    @property
    def sandbox(self) -> Sandbox:
        self._materialize()
        return self._sandbox

    @property
    def final_tree(self) -> Path:
        """The tree the episode ends with: its workspace, or the task's checkout untouched when
        no call ever needed a workspace (grading reads it and never writes to it)."""
        return self._ws if self._sandbox is not None else self.task_dir / "repo"

    # -- lifecycle
    def close(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()
        if self._volume is not None:
            self._volume.close()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def prompt(self) -> str:
        return (f"{self.task['instructions']}\n\n(The project is checked out at `{self.root}`; "
                "that is also the working directory of terminal commands.)")

    def grade(self) -> GradeResult:
        if self._sandbox is not None:
            self._sandbox.stop()  # nothing the episode left running touches the workspace while it is graded
        self.result = grade(self.task_dir, self.final_tree, self.log, self.config.grade)
        return self.result

    # -- stepping
    def step(self, tool_call: dict) -> Observation:
        """Check ``tool_call`` against the harness's tools and carry it out. Its log entry holds the
        harness-neutral ``kind`` (and ``command`` or ``path``), ``outside``, ``ok``, and the
        harness's ``tool`` and ``args``."""
        t0 = time.monotonic()
        entry = {"turn": self.turn, "kind": "other", "tool": None, "args": None, "ok": False, "outside": False}
        try:
            tool, args = self.harness.check(tool_call)
            entry.update(tool=tool.name, args=args, **self.harness.describe(tool, args))
            if self.done:
                raise ToolError("the episode is over; no more tool calls are accepted")
            self.turn += 1
            if self.turn > self.max_turns:
                self.done = True
                raise ToolError(f"turn limit ({self.max_turns}) reached")
            if tool.kind != "submit":
                self._materialize()
            content = self.harness.run(self, entry, tool, args)
            entry["ok"] = True
            obs = Observation(truncate(content, self.obs_chars), done=self.done, tool=tool.name,
                              kind=entry["kind"], truncated=len(content) > self.obs_chars)
        except ToolError as e:
            entry["error"] = str(e)
            obs = Observation(f"Error: {e}", is_error=True, done=self.done, tool=entry["tool"], kind=entry["kind"])
        except (OSError, UnicodeError) as e:  # e.g. a binary file to edit, a file where a dir must be
            why = "the file is not UTF-8 text" if isinstance(e, UnicodeError) else (e.strerror or type(e).__name__)
            entry["error"] = f"{entry['tool']}: {why}"  # strerror only: no host paths in observations
            obs = Observation(f"Error: {entry['error']}", is_error=True, done=self.done, tool=entry["tool"],
                              kind=entry["kind"])
        obs.seconds = entry["seconds"] = time.monotonic() - t0
        self.log.append(entry)
        return obs

    def shell(self, command: str, cwd: str | None = None, env: dict | None = None, tool: str = "shell",
              timeout: float | None = None):
        """Run a command an external harness issued, in the sandbox as the persona (from ``cwd``,
        default the project), logged as an ``exec`` action like any tool call; returns the
        sandbox's result (exit code, stdout, stderr). After the episode is over, refused."""
        entry = {"turn": self.turn, "kind": "exec", "tool": tool, "args": None, "command": command,
                 "ok": False, "outside": False}
        t0 = time.monotonic()
        try:
            if self.done:
                raise ToolError("the episode is over; no more commands are accepted")
            self.turn += 1
            self._materialize()
            r = self.sandbox.run(command, timeout=min(timeout or self.command_timeout, self.command_timeout),
                                 cwd=cwd or self.root, env=env or None)
            entry.update(ok=True, exit_code=r.exit_code, command_seconds=r.seconds)
            return r
        except ToolError as e:
            entry["error"] = str(e)
            raise
        finally:
            entry["seconds"] = time.monotonic() - t0
            self.log.append(entry)

    def act(self, kind: str, entry: dict, **args) -> str:
        """Perform one harness-neutral action (``exec``, ``read``, ``list``, ``search``, ``write``,
        ``submit``) with its arguments; ``entry`` is the call's log entry."""
        do = {"exec": self._exec, "read": self._read, "list": self._list, "search": self._search,
              "write": self._write, "submit": self._submit}.get(kind)
        if do is None:
            raise ToolError(f"{entry.get('tool')}: no action {kind!r} in this environment")
        return do(entry, **args)

    def _path(self, path: str, entry: dict) -> Path:
        """Host path for a project path; refuses (and records) anything resolving outside."""
        p = path.strip()
        home = self.sandbox.persona.home
        if p.startswith("~/"):
            p = home + p[1:]
        if p.startswith("/"):
            if p == self.root or p.startswith(self.root + "/"):
                p = p[len(self.root):].lstrip("/") or "."
            else:
                entry["outside"] = True
                raise ToolError(f"{path}: outside the project directory {self.root}")
        real = os.path.realpath(os.path.join(self.workspace, p))
        if real != self._real and not real.startswith(self._real + os.sep):
            entry["outside"] = True
            raise ToolError(f"{path}: outside the project directory {self.root}")
        for mount, layer in self._layers:
            if real == mount or real.startswith(mount + os.sep):
                mapped = os.path.realpath(layer + real[len(mount):])
                if mapped != layer and not mapped.startswith(layer + os.sep):
                    entry["outside"] = True
                    raise ToolError(f"{path}: outside the project directory {self.root}")
                return Path(mapped)
        return Path(real)

    def _read_only(self, f: Path, path: str) -> None:
        if any(str(f) == layer or str(f).startswith(layer + os.sep) for _, layer in self._layers):
            raise ToolError(f"{path}: read-only file system")

    def _rel(self, p: Path) -> str:
        for mount, layer in self._layers:
            if str(p) == layer or str(p).startswith(layer + os.sep):
                return os.path.relpath(mount + str(p)[len(layer):], self._real)
        return os.path.relpath(p, self._real)

    # -- actions
    def _read(self, entry, path, start_line=None, end_line=None) -> str:
        f = self._path(path, entry)
        if not f.is_file():
            raise ToolError(f"{path}: no such file" if not f.exists() else f"{path}: is a directory")
        lines = _read_text(f, path).splitlines()
        a = (start_line or 1) - 1
        b = end_line or len(lines)
        if a >= max(1, len(lines)) and lines:
            raise ToolError(f"{path}: start_line {start_line} is past the end ({len(lines)} lines)")
        return "\n".join(f"{i + 1:>6}\t{line}" for i, line in enumerate(lines[a:b], start=a)) or "(empty file)"

    def _list(self, entry, path) -> str:
        d = self._path(path, entry)
        if not d.is_dir():
            raise ToolError(f"{path}: not a directory")
        rows = []
        for c in sorted(d.iterdir(), key=lambda c: c.name):
            if c.is_symlink():  # never followed: the target may be a host path
                rows.append(f"{c.name} -> {os.readlink(c)}")
            else:
                rows.append(c.name + "/" if c.is_dir() else f"{c.name}  ({c.lstat().st_size} bytes)")
        return "\n".join(rows) or "(empty directory)"

    def _search(self, entry, pattern, path=".") -> str:
        # The model's pattern runs in the host process: the ``regex`` engine with a time budget
        # for the whole search, so a catastrophic pattern such as (a+)+$ cannot hang a worker.
        try:
            rx = regex.compile(pattern)
        except (regex.error, OverflowError, RecursionError) as e:
            raise ToolError(f"invalid regular expression: {e}") from None
        deadline = time.monotonic() + SEARCH_SECONDS
        base = self._path(path, entry)
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        hits = []
        for f in files:
            rel = self._rel(f)
            if ".git" in Path(rel).parts or "__pycache__" in rel or f.stat().st_size > 1 << 20:
                continue
            if not os.path.realpath(f).startswith(self._real + os.sep) and not any(
                    os.path.realpath(f).startswith(layer + os.sep) for _, layer in self._layers):
                continue
            try:
                text = f.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            for i, line in enumerate(text.splitlines(), 1):
                try:
                    found = rx.search(line, timeout=max(0.001, deadline - time.monotonic()))
                except TimeoutError:
                    raise ToolError(f"search took longer than {SEARCH_SECONDS:g} s and was stopped; "
                                    "use a simpler pattern or a narrower path") from None
                if found:
                    hits.append(f"{rel}:{i}: {line[:300]}")
                    if len(hits) >= 200:
                        return "\n".join(hits) + "\n(stopped after 200 matches)"
        return "\n".join(hits) or "No matches."

    def _write(self, entry, path, old, new) -> str:
        f = self._path(path, entry)
        self._read_only(f, path)
        existed, before = os.path.lexists(f), entry_disk_bytes(f)
        made = [d for d in f.parents if str(d).startswith(self._real + os.sep) and not os.path.lexists(d)]
        try:
            out = self._edit(f, path, old, new)
        except BaseException:
            self.sandbox.touched()  # whatever it wrote before it failed: measured again
            raise
        # what the edit changed in the disk cap's count, so the next command need not measure
        self.sandbox.touched((entry_disk_bytes(f) - before + sum(entry_disk_bytes(d) for d in made), (not existed) + len(made)))
        return out

    def _edit(self, f: Path, path: str, old: str, new: str) -> str:
        if old == "":
            if f.exists():
                raise ToolError(f"{path}: already exists; give the text to replace in `old`")
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(new)
            self._own(f)
            return f"Created {self._rel(f)} ({len(new.splitlines())} lines)."
        if not f.is_file():
            raise ToolError(f"{path}: no such file")
        text = _read_text(f, path)
        n = text.count(old)
        if n == 0:
            raise ToolError(f"{path}: `old` text not found (it must match exactly, whitespace included)")
        if n > 1:
            raise ToolError(f"{path}: `old` text occurs {n} times; include more context to make it unique")
        f.write_text(text.replace(old, new, 1))
        line = text[:text.index(old)].count("\n") + 1
        return f"Edited {self._rel(f)} at line {line} (-{len(old.splitlines())} +{len(new.splitlines())} lines)."

    def _own(self, f: Path) -> None:
        uid, gid = self.sandbox.persona.uid, self.sandbox.persona.gid
        p = f
        while str(p).startswith(self._real) and p != Path(self._real):
            os.lchown(p, uid, gid)
            p = p.parent

    def _exec(self, entry, command) -> str:
        r = self.sandbox.run(command, timeout=self.command_timeout)
        entry["exit_code"], entry["command_seconds"] = r.exit_code, r.seconds
        parts = [f"exit code: {r.exit_code}" + (f" (killed: {r.killed_reason} after {r.seconds:.1f}s)" if r.killed_reason else "")]
        if r.stdout:
            parts.append(r.stdout.rstrip("\n"))
        if r.stderr:
            parts.append("stderr:\n" + r.stderr.rstrip("\n"))
        return "\n".join(parts)

    def _submit(self, entry) -> str:
        self.done = True
        return "Submitted."
