"""Tasks mined from a repository environment (``repo_env``): synthetic bugs over the whole
package, each caught by some of the environment's kept tests.

A candidate is one change to one function of the package: an operator, a comparison, a
constant or a condition (``tasks_bugfix.mutation_sites``), a removed statement, or the whole body
removed with its signature and docstring kept ("implement this"). It becomes a task when the
kept tests that now fail (``FAIL_TO_PASS``) are at least one and the rest (``PASS_TO_PASS``)
still pass. The task directory is today's format (``task_format``) with ``format`` 2:

    repo/          the environment's repository with the change folded into its last commit and
                   the test files holding FAIL_TO_PASS tests removed (they are the hidden tests)
    hidden_tests/  the environment's recorded test tree and ``pytest.ini``: grading runs these
    layer/         the environment's site-packages, bound into the episode's ``.venv``
    reference/     the function as it was
    canaries/      a copy of a FAIL_TO_PASS file with expected values changed, which the
                   reference fails (``checks.canaries[...].replaces`` names the file)

``task.json`` records ``framework: pytest``, ``tests.FAIL_TO_PASS`` and ``tests.PASS_TO_PASS``
(pytest node ids), and ``origin`` (repository, commit, environment digest, licence, the change).
The problem statement is what a user sees: the failing call and its wrong result, as pytest
reports it, never a test's file or function name, never the fix.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from .repo_env import _norm, load_env, package_files, run_tests
from .rootfs import persona_for
from .task_dir import TASK_FORMAT, check_name
from .task_format import TaskLimits
from .tasks_bugfix import _parse, apply_mutation, mutation_sites

KINDS = ("comparison", "operator", "boolean", "off_by_one", "constant", "negation", "removed_branch",
         "removed_statement", "implement")


def _functions(tree) -> list[ast.FunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _doc_len(fn) -> int:
    return 1 if fn.body and isinstance(fn.body[0], ast.Expr) and isinstance(
        getattr(fn.body[0], "value", None), ast.Constant) and isinstance(fn.body[0].value.value, str) else 0


def candidates(source: str) -> list[tuple[str, object]]:
    """Every change of this module a task may be made from: (kind, site), in source order."""
    tree = _parse(source)
    out: list[tuple[str, object]] = list(mutation_sites(source))
    for fn in _functions(tree):
        body = fn.body[_doc_len(fn):]
        if len(body) >= 2:
            for stmt in body[:-1]:  # the last statement is often the return: removing it is trivial
                if isinstance(stmt, (ast.Assign, ast.AugAssign, ast.Expr, ast.If, ast.For)) and \
                        not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)):
                    out.append(("removed_statement", stmt))
        if len(body) >= 3 and not fn.name.startswith("__"):
            out.append(("implement", fn))
    return out


def apply_candidate(source: str, kind: str, node) -> str:
    lines = source.splitlines(keepends=True)
    if kind == "removed_statement":
        indent = re.match(r"\s*", lines[node.lineno - 1]).group(0)
        return "".join(lines[:node.lineno - 1] + [f"{indent}pass\n"] + lines[node.end_lineno:])
    if kind == "implement":
        body = node.body[_doc_len(node):]
        first, last = body[0].lineno, node.end_lineno
        indent = re.match(r"\s*", lines[first - 1]).group(0)
        return "".join(lines[:first - 1] + [f"{indent}raise NotImplementedError\n"] + lines[last:])
    return apply_mutation(source, kind, node)


def _enclosing(tree, node) -> str:
    """The qualified name of the function holding ``node``."""
    best = ""
    for parent in ast.walk(tree):
        if isinstance(parent, ast.ClassDef):
            for fn in parent.body:
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.lineno <= node.lineno <= fn.end_lineno:
                    best = f"{parent.name}.{fn.name}"
        elif isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)) and parent.lineno <= node.lineno <= parent.end_lineno:
            best = best or parent.name
    return best


def statement(kind: str, package: str, module: str, function: str, message: str, hidden_names: list[str]) -> str:
    """What a user sees, in at most three sentences: the failing call and its wrong result."""
    if kind == "implement":
        return (f"`{function}` in `{module}` is not implemented yet: it raises NotImplementedError. "
                f"Implement it so that it does what its name, signature and docstring say, consistently with the "
                f"rest of `{package}`.")
    lines = [l for l in message.splitlines() if l.strip() and not any(h in l for h in hidden_names)
             and "/var/tmp/" not in l and not re.search(r"\btest_\w+", l)]
    shown = "\n".join(lines[:6])[:700] or "an exception"
    return (f"Since the last change, `{package}` gives wrong results. Here is what I get:\n\n```\n{shown}\n```\n\n"
            f"Please find the cause and fix it without changing the public API.")


def mine(env_dir: Path, out_dir: Path, max_tasks: int = 10, seed: int = 0, max_attempts: int | None = None,
         canaries: bool = True, history: bool = True, log=lambda m: None) -> dict:
    """Tasks from the environment at ``env_dir`` into ``out_dir/<task id>``: up to ``max_tasks``
    synthetic bugs, and (``history``) the tasks of its git history (``swebench.history_instances``,
    none for a repository of one commit); the JSON summary."""
    t0 = time.monotonic()
    env_dir, out_dir = Path(env_dir), Path(out_dir)
    env = load_env(env_dir)
    layout = env["layout"]
    kept = list(env["kept"])
    project = env_dir / "repo"
    tests_tree, layer = env_dir / "tests", env_dir / "layer"
    persona = persona_for(env["persona_seed"])
    paths = sorted({t.split("::", 1)[0] for t in kept})
    out_dir.mkdir(parents=True, exist_ok=True)

    class L:  # the layout as package_files wants it
        src_dir, packages = layout["src_dir"], layout["packages"]

    files = package_files(project, L)
    sites = []
    for rel in files:
        try:
            src = (project / rel).read_text()
            sites += [(rel, k, n) for k, n in candidates(src)]
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
    rng = random.Random(f"{seed}:{env['env_digest']}")
    rng.shuffle(sites)
    # spread the kinds: the n-th candidate of each kind before the (n+1)-th of any
    by_kind: dict[str, list] = {}
    for s in sites:
        by_kind.setdefault(s[1], []).append(s)
    order = [k for k in KINDS if k in by_kind]
    sites = [by_kind[k][i] for i in range(max(map(len, by_kind.values()), default=0)) for k in order if i < len(by_kind[k])]
    max_attempts = max_attempts or 4 * max_tasks
    # tried = accepted + rejected (by reason); runs: the candidates run against the tests
    stats = {"candidates": len(sites), "tried": 0, "runs": 0, "accepted": 0, "rejected": {}}
    built, seen = [], set()

    def reject(why):
        stats["rejected"][why] = stats["rejected"].get(why, 0) + 1

    for rel, kind, node in sites:
        if len(built) >= max_tasks or stats["runs"] >= max_attempts:
            break
        stats["tried"] += 1
        original = (project / rel).read_text()
        try:
            mutant = apply_candidate(original, kind, node)
            if ast.dump(_parse(mutant)) == ast.dump(_parse(original)) or mutant in seen:
                reject("no_change")
                continue
        except SyntaxError:
            reject("syntax")
            continue
        seen.add(mutant)
        stats["runs"] += 1
        with tempfile.TemporaryDirectory(prefix="cdag-mine-") as tmp:
            ws = Path(tmp) / project.name
            shutil.copytree(project, ws, symlinks=True, ignore=shutil.ignore_patterns(".git"))
            (ws / rel).write_text(mutant)
            # a change can make the suite loop: five times its time at bootstrap, at least 30 s
            timeout = max(30.0, 5 * float(env.get("suite_seconds") or 12.0))
            res, det = run_tests(ws, tests_tree, layer, persona, paths, timeout)
        if det["timed_out"]:
            reject("timeout")
            continue
        f2p = sorted(t for t in kept if res.get(t) in ("failed", "error") or t not in res)
        p2p = sorted(t for t in kept if res.get(t) == "passed")
        if not f2p:
            reject("survived")
            continue
        if not p2p:
            reject("everything_fails")
            continue
        tree = _parse(original)
        function = node.name if kind == "implement" else _enclosing(tree, node) or "?"
        msg = next((det["messages"].get(t) for t in f2p if det["messages"].get(t)), "")
        hidden_files_ = sorted({t.split("::", 1)[0] for t in f2p})
        names = [Path(h).stem for h in hidden_files_] + [t.split("::")[-1].split("[")[0] for t in f2p]
        digest = hashlib.sha256(f"{rel}\0{mutant}".encode()).hexdigest()[:8]
        tid = f"mined-{_norm(env['name'])}-{digest}"
        d = write_repo_task(out_dir / tid, env, env_dir, rel, original, mutant, kind, function, f2p, p2p,
                            statement(kind, env["name"], rel, function, msg, names))
        if canaries:
            add_repo_canaries(d)
        built.append(d)
        stats["accepted"] += 1
        log(f"{tid}: {kind} in {rel}:{function}, {len(f2p)} FAIL_TO_PASS, {len(p2p)} PASS_TO_PASS")
    if history:
        from .repo_env import BootstrapConfig
        from .swebench import history_instances, import_instances

        hist = history_instances(env_dir)
        stats["history"] = {"commits": hist["commits"], "skipped": hist["skipped"], "instances": len(hist["instances"])}
        if hist["instances"]:
            with tempfile.TemporaryDirectory(prefix="cdag-hist-") as tmp:
                jsonl = Path(tmp) / "history.jsonl"
                jsonl.write_text("".join(json.dumps(i) + "\n" for i in hist["instances"]))
                (Path(tmp) / "mirrors").mkdir()
                (Path(tmp) / "mirrors" / env["name"]).symlink_to(project.resolve())
                got = import_instances(jsonl, str(Path(tmp) / "mirrors"), out_dir, BootstrapConfig(), log=log,
                                       canaries=canaries)
            stats["history"].update(imported=got["imported"], refused=got["refused"])
            built += [out_dir / t for t in got["tasks"]]
    stats["seconds"] = round(time.monotonic() - t0, 2)
    return {"ok": bool(built), "tasks": [p.name for p in built], **stats, "env_digest": env["env_digest"],
            "out": str(out_dir)}


def _git(repo: Path, *args, env=None):
    return subprocess.run(["git", "-c", "safe.directory=*", *args], cwd=repo, capture_output=True, text=True,
                          env=env, check=True)


def write_repo_task(task_dir: Path, env: dict, env_dir: Path, rel: str, original: str, mutant: str, kind: str,
                    function: str, f2p: list[str], p2p: list[str], instructions: str) -> Path:
    """One mined task: the change folded into the repository's last commit, the FAIL_TO_PASS
    files taken out of it (they come back with the reference)."""
    hidden = sorted({t.split("::", 1)[0] for t in f2p})
    return write_pytest_task(
        task_dir, env, env_dir, changes={rel: mutant, **{h: None for h in hidden}},
        reference={rel: original.encode(), **{h: (env_dir / "tests" / h).read_bytes() for h in hidden}},
        hidden_tree=env_dir / "tests", f2p=f2p, p2p=p2p, instructions=instructions, source="repo-mined",
        source_file=f"{_norm(env['name'])}:{rel}", reference_meta={"files": [rel], "kind": "bugfix", "mutation": kind,
                                                             "function": function},
        origin_extra={"change": kind, "file": rel, "function": function})


def write_pytest_task(task_dir: Path, env: dict, env_dir: Path, *, changes: dict[str, str | None],
                      reference: dict[str, bytes], hidden_tree: Path, f2p: list[str], p2p: list[str],
                      instructions: str, source: str, source_file: str, reference_meta: dict,
                      origin_extra: dict) -> Path:
    """Write a task run by pytest (replacing any there), staged beside it and renamed into place:
    ``repo/`` is the environment's repository with ``changes`` ({path: text, or None to delete})
    folded into its last commit, nothing of the earlier state left in the object store;
    ``hidden_tests/`` is ``hidden_tree``; ``reference/files`` is ``reference``."""
    staging = Path(tempfile.mkdtemp(prefix=f".{task_dir.name}.tmp-", dir=task_dir.parent))
    try:
        repo = staging / "repo"
        shutil.copytree(env_dir / "repo", repo, symlinks=True)
        for rel, text in changes.items():
            if text is None:
                if (repo / rel).exists():
                    (repo / rel).unlink()
            else:
                (repo / rel).write_text(text)
        if changes:
            head = _git(repo, "log", "-1", "--format=%an%x00%ae%x00%ad%x00%cd%x00%B", "--date=raw").stdout.split("\0")
            genv = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(repo), "GIT_CONFIG_NOSYSTEM": "1",
                    "GIT_AUTHOR_NAME": head[0], "GIT_AUTHOR_EMAIL": head[1], "GIT_AUTHOR_DATE": head[2],
                    "GIT_COMMITTER_NAME": head[0], "GIT_COMMITTER_EMAIL": head[1], "GIT_COMMITTER_DATE": head[3]}
            _git(repo, "add", "-A", env=genv)
            _git(repo, "commit", "-q", "--amend", "--no-edit", "--allow-empty", env=genv)
            for obj in ("reflog", "gc"):  # the pre-amend commit must not be reachable or lying around
                args = ["expire", "--expire=now", "--all"] if obj == "reflog" else ["--prune=now", "-q"]
                _git(repo, obj, *args, env=genv)
        shutil.copytree(hidden_tree, staging / "hidden_tests")
        shutil.copytree(env_dir / "layer", staging / "layer", symlinks=True)
        for rel, data in reference.items():
            (staging / "reference" / "files" / rel).parent.mkdir(parents=True, exist_ok=True)
            (staging / "reference" / "files" / rel).write_bytes(data)
        task = {"format": TASK_FORMAT, "id": task_dir.name, "source": source, "source_file": source_file,
                "project": project_dir_name(env), "instructions": instructions, "limits": TaskLimits().to_dict(),
                "framework": "pytest", "tests": {"FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p},
                "reference": {"files": sorted(reference), **reference_meta},
                "origin": {"repository": env["name"], "version": env.get("version"), "source": env.get("origin") or {},
                           "commit": _git(env_dir / "repo", "rev-parse", "HEAD").stdout.strip(),
                           "env_digest": env["env_digest"], "licence": env.get("licence"), **origin_extra},
                "sandbox": {"venv": True},
                "checks": {"expected": sorted(f2p + p2p)}}
        (staging / "task.json").write_text(json.dumps(task, indent=2, sort_keys=True))
        if task_dir.exists():
            shutil.rmtree(task_dir)
        staging.rename(task_dir)
        return task_dir
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def project_dir_name(env: dict) -> str:
    """The checkout's directory name on the laptop: the distribution's name, as cloned."""
    return _norm(env["name"])


def add_repo_canaries(task_dir: Path, candidates_per_file: int = 2, keep: int = 1) -> dict:
    """Canaries of a mined task: copies of a FAIL_TO_PASS file with expected values changed (the
    sites not in any file the policy can read), each run alone against the reference; those the
    reference fails are kept (``checks.canaries``: the file it replaces, the tests it fails)."""
    from .canaries import _visible_text, make_canaries
    from .checks import outcomes, run_checks
    from .task_dir import apply_reference

    task_dir = Path(task_dir)
    task = json.loads((task_dir / "task.json").read_text())
    f2p = task["tests"]["FAIL_TO_PASS"]
    files = sorted({t.split("::", 1)[0] for t in f2p})
    visible = _visible_text(task_dir / "repo")
    kept: dict = {}
    (task_dir / "canaries").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cdag-k-") as tmp:
        ref_ws = apply_reference(task_dir, Path(tmp) / "ws")
        for rel in files:
            text = (task_dir / "hidden_tests" / rel).read_text()
            for src in make_canaries(text, seed=f"{task['id']}:{rel}", visible=visible, n=candidates_per_file):
                if len(kept) >= keep:
                    break
                name = check_name(src.encode()) + ".py"
                path = task_dir / "canaries" / name
                path.write_text(src)
                task.setdefault("checks", {}).setdefault("canaries", {})[name] = {"replaces": rel, "failing": []}
                (task_dir / "task.json").write_text(json.dumps(task, indent=2, sort_keys=True))
                res, det = run_checks(task_dir, ref_ws, [path])
                failing = sorted(k for k, v in outcomes(res).items() if v in ("failed", "error"))
                if det["valid"] and not det["tamper"] and failing:
                    task["checks"]["canaries"][name]["failing"] = failing
                    kept[name] = task["checks"]["canaries"][name]
                else:
                    del task["checks"]["canaries"][name]
                    path.unlink()
    if kept:
        task["checks"]["canaries"] = kept
    else:
        task.get("checks", {}).pop("canaries", None)
        shutil.rmtree(task_dir / "canaries", ignore_errors=True)
    (task_dir / "task.json").write_text(json.dumps(task, indent=2, sort_keys=True))
    return kept
