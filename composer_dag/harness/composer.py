"""The built-in harness, ``composer``: six tools (read_file, list_dir, search, edit_file,
run_terminal_cmd, submit) and calls written as ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`` blocks."""

from __future__ import annotations

import json
import re

from composer_dag.harness.base import Harness, Parsed, Tool


def _fn(name: str, description: str, props: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": required, "additionalProperties": False}}}


_S, _I = {"type": "string"}, {"type": "integer"}
TOOLS = (
    Tool(_fn("read_file", "Read a text file of the project. Lines are numbered from 1; give start_line/end_line "
             "(inclusive) to read part of a long file.",
             {"path": {**_S, "description": "Path relative to the project root (or absolute inside it)."},
              "start_line": {**_I, "minimum": 1}, "end_line": {**_I, "minimum": 1}}, ["path"]), "read"),
    Tool(_fn("list_dir", "List a directory of the project (directories end with '/').",
             {"path": {**_S, "description": "Directory, relative to the project root; '.' for the root."}}, ["path"]),
         "list"),
    Tool(_fn("search", "Search file contents with a Python regular expression, like grep -rn. Returns path:line: text.",
             {"pattern": {**_S, "description": "Regular expression."},
              "path": {**_S, "description": "File or directory to search (default: the whole project)."}}, ["pattern"]),
         "search"),
    Tool(_fn("edit_file", "Replace the exact text `old` with `new` in a file. `old` must occur exactly once. "
             "With old = \"\" and a path that does not exist, create the file with content `new`.",
             {"path": _S, "old": _S, "new": _S}, ["path", "old", "new"]), "write"),
    Tool(_fn("run_terminal_cmd", "Run a bash command in the project directory on the user's machine and return its "
             "exit code and output. A command that runs past the timeout is killed with everything it started; "
             "what a command starts in the background keeps running until the session ends.",
             {"command": _S}, ["command"]), "exec"),
    Tool(_fn("submit", "Finish: the work is done and ready for review.", {}, []), "submit"),
)
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


class ComposerHarness(Harness):
    name = "composer"
    version = "1"
    tools = TOOLS
    intro = ("You are a coding agent working in the user's project on their machine. Act only through "
             "tools: write each call as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>. "
             "Call submit when the work is done.")
    control_tokens = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                      "<tool_response>", "</tool_response>")
    no_call = ("Error: no tool call found. Write a call as <tool_call>{\"name\": \"...\", \"arguments\": {...}}"
               "</tool_call>; call submit when the work is done.")

    def render_call(self, name: str, arguments: dict) -> str:
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"

    def parse(self, text: str) -> Parsed:
        """``errors`` holds one message per ``<tool_call>`` block that is not a JSON object with a
        string name; ``prose`` is the text outside the blocks."""
        calls, errors = [], []
        for body in _CALL.findall(text):
            try:
                obj = json.loads(body.strip())
            except json.JSONDecodeError as e:
                errors.append(f"Error: the tool call is not valid JSON ({e.msg} at char {e.pos}).")
                continue
            except (ValueError, RecursionError) as e:  # an over-long integer, nesting too deep
                errors.append(f"Error: the tool call is not usable JSON ({type(e).__name__}).")
                continue
            fn = obj.get("function", obj) if isinstance(obj, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                calls.append(obj)
            else:
                errors.append("Error: a tool call must be a JSON object with a string 'name' and 'arguments'.")
        prose = _CALL.sub("", text).replace("<|im_end|>", "").replace("<|endoftext|>", "").strip()
        return Parsed(calls, errors, prose)


COMPOSER = ComposerHarness()
