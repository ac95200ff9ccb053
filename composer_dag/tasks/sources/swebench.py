"""The SWE-bench task format, both ways, and tasks from a repository's history.

An instance (one JSON object per line; SWE-bench, SWE-Gym, SWE-smith and R2E-Gym share it)::

    instance_id, repo, base_commit, patch, test_patch, problem_statement,
    FAIL_TO_PASS, PASS_TO_PASS     lists of pytest node ids, or (SWE-bench's own encoding)
                                   JSON-encoded strings of such lists

``import_instances`` checks each instance's base commit out of a local mirror (``REPOS/<owner>__<name>``,
``REPOS/<name>``, or a git URL prefix), bootstraps the environment at that commit
(``repo_env.bootstrap``), takes ``test_patch`` as the hidden tests and ``patch`` as the
reference, and verifies in the sandbox that every ``FAIL_TO_PASS`` test fails at the base and
passes with the patch, and that every ``PASS_TO_PASS`` test passes in both. A refused instance
is counted by reason (``IMPORT_REASONS``), and nothing of it is left behind.

``export_tasks`` writes the repository tasks (``framework: pytest``) of a directory as instances;
other tasks are counted as skipped. With ``mirror_dir`` it also makes a bare mirror per
repository holding every exported base commit, so the file can be imported back.

``history_instances`` reads an environment's git history: every commit that changes code and
tests together, whose new tests fail on the parent and pass on the commit, is an instance,
ready for ``import_instances``. Its problem statement is a user's report (``user_report``): the
commit message's first sentence (or the changelog's entry when the message says nothing) turned
from the fixer's words into the reporter's, and the new tests' failure on the parent; the
message itself is kept as ``hints_text``.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from composer_dag.repos.bootstrap import bootstrap, load_env
from composer_dag.repos.config import BootstrapConfig
from composer_dag.repos.layout import detect_layout, is_package_shim, record_tests
from composer_dag.repos.suite import run_tests
from composer_dag.laptop.image import persona_for
from composer_dag.tasks.registry import BuildRequest, task_source
from composer_dag.tasks.sources.repo_task import add_repo_canaries, environment_tasks, write_pytest_task
from composer_dag.tasks.taskdir import load_task

SOURCE = "swe-instances"
IMPORT_REASONS = ("bad_record", "no_mirror", "no_base_commit", "patch_does_not_apply", "bootstrap_failed",
                  "fail_to_pass_passes_at_base", "reference_fails", "pass_to_pass_fails", "duplicate_id")
FIELDS = ("instance_id", "repo", "base_commit", "patch", "test_patch", "problem_statement", "FAIL_TO_PASS",
          "PASS_TO_PASS")


def _git(cwd, *args, check=True, input=None):
    return subprocess.run(["git", "-c", "safe.directory=*", "-c", "user.name=cdag", "-c", "user.email=cdag@localhost",
                           *args], cwd=cwd, capture_output=True, text=True, check=check, input=input)


def _ids(value) -> list[str]:
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError("FAIL_TO_PASS / PASS_TO_PASS must be a list of test ids (or its JSON encoding)")
    return value


def _diff(a: Path, b: Path, paths: list[str]) -> str:
    """A git-style unified diff of ``paths`` from tree ``a`` to tree ``b`` (missing = absent)."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for rel in sorted(paths):
            x, y = a / rel, b / rel
            left, right = (x if x.exists() else Path("/dev/null")), (y if y.exists() else Path("/dev/null"))
            r = subprocess.run(["git", "diff", "--no-index", "--no-color", "--binary", str(left), str(right)],
                               capture_output=True, text=True, cwd=tmp)
            text = r.stdout
            if not text:
                continue
            for side, path in (("a", left), ("b", right)):
                if str(path) != "/dev/null":
                    text = text.replace(f"{side}{path}", f"{side}/{rel}")
            out.append(text)
    return "".join(out)


# ------------------------------------------------------------------------------------ export

def export_tasks(tasks_dir: Path, out_jsonl: Path, mirror_dir: Path | None = None) -> dict:
    """Every repository task under ``tasks_dir`` as a SWE-bench instance line."""
    tasks_dir, out_jsonl = Path(tasks_dir), Path(out_jsonl)
    written, skipped = 0, {}
    lines = []
    for d in sorted(p.parent for p in tasks_dir.rglob("task.json")):
        task = load_task(d)
        if task.get("framework") != "pytest":
            skipped["not_a_repository_task"] = skipped.get("not_a_repository_task", 0) + 1
            continue
        base = _git(d / "repo", "rev-parse", "HEAD").stdout.strip()
        ref = d / "reference" / "files"
        code = [r for r in task["reference"]["files"]]
        tests_added = sorted(p.relative_to(ref).as_posix() for p in ref.rglob("*") if p.is_file()
                             and p.relative_to(ref).as_posix() not in code)
        with tempfile.TemporaryDirectory() as tmp:
            fixed = Path(tmp) / "fixed"
            shutil.copytree(d / "repo", fixed, symlinks=True, ignore=shutil.ignore_patterns(".git"))
            for rel in code:
                (fixed / rel).write_bytes((ref / rel).read_bytes())
            patch = _diff(d / "repo", fixed, code)
            # the hidden tests: every file of the recorded tree that differs from the base
            hidden = d / "hidden_tests"
            changed = sorted(p.relative_to(hidden).as_posix() for p in hidden.rglob("*") if p.is_file()
                             and p.name != "pytest.ini" and not is_package_shim(p)
                             and (not (d / "repo" / p.relative_to(hidden)).is_file()
                                  or (d / "repo" / p.relative_to(hidden)).read_bytes() != p.read_bytes()))
            test_patch = _diff(d / "repo", hidden, sorted(set(changed) | set(tests_added)))
        repo = (task.get("origin") or {}).get("repository") or task.get("project")
        lines.append(json.dumps({
            "instance_id": task["id"], "repo": repo, "base_commit": base, "patch": patch, "test_patch": test_patch,
            "problem_statement": task["instructions"], "FAIL_TO_PASS": json.dumps(task["tests"]["FAIL_TO_PASS"]),
            "PASS_TO_PASS": json.dumps(task["tests"]["PASS_TO_PASS"]), "version": (task.get("origin") or {}).get("version"),
            "environment_setup_commit": base, "created_at": None, "hints_text": ""}, sort_keys=True))
        if mirror_dir is not None:
            m = Path(mirror_dir) / repo.replace("/", "__")
            if not m.exists():
                m.mkdir(parents=True)
                _git(m, "init", "-q", "--bare")
            _git(m, "fetch", "-q", "--no-tags", str((d / "repo").resolve()), f"HEAD:refs/tasks/{task['id']}")
        written += 1
    out_jsonl.parent.mkdir(parents=True, exist_ok=True)
    out_jsonl.write_text("".join(l + "\n" for l in lines))
    return {"ok": True, "written": written, "skipped": skipped, "out": str(out_jsonl)}


# ------------------------------------------------------------------------------------ import

class Refused(Exception):
    def __init__(self, reason: str, message: str):
        assert reason in IMPORT_REASONS, reason
        super().__init__(message)
        self.reason = reason


def _mirror(repos: str, repo: str) -> str:
    if re.match(r"^(https?|git|ssh)://|^git@", repos):
        return f"{repos.rstrip('/')}/{repo}.git"
    for cand in (Path(repos) / repo.replace("/", "__"), Path(repos) / repo.rsplit("/", 1)[-1], Path(repos) / repo):
        if cand.is_dir():
            return str(cand.resolve())
    raise Refused("no_mirror", f"no mirror of {repo} under {repos}")


def _apply(tree: Path, patch: str) -> list[str]:
    """Apply a git-style patch to ``tree`` (not a repository); the paths it touches."""
    if not patch.strip():
        return []
    r = subprocess.run(["git", "apply", "--unsafe-paths", "--whitespace=nowarn", "-"], cwd=tree, input=patch,
                       capture_output=True, text=True)
    if r.returncode:
        raise Refused("patch_does_not_apply", r.stderr.strip()[-300:])
    return sorted(set(re.findall(r"^\+\+\+ b/(.+)$", patch, re.M) + re.findall(r"^--- a/(.+)$", patch, re.M)))


def import_instance(inst: dict, repos: str, out_dir: Path, cfg: BootstrapConfig, canaries: bool = True) -> Path:
    """One instance as a task directory under ``out_dir`` (see the module's docstring)."""
    missing = [f for f in FIELDS if f not in inst]
    if missing:
        raise Refused("bad_record", f"missing {', '.join(missing)}")
    try:
        f2p, p2p = _ids(inst["FAIL_TO_PASS"]), _ids(inst["PASS_TO_PASS"])
    except (ValueError, TypeError) as e:
        raise Refused("bad_record", str(e)) from e
    if not f2p or not re.fullmatch(r"[A-Za-z0-9_.\-]+", str(inst["instance_id"])):
        raise Refused("bad_record", "no FAIL_TO_PASS test, or an instance_id that is not a plain name")
    mirror = _mirror(repos, inst["repo"])
    with tempfile.TemporaryDirectory(prefix="cdag-imp-") as tmp:
        tmp = Path(tmp)
        co = tmp / Path(inst["repo"]).name
        co.mkdir()
        _git(co, "init", "-q", "-b", "main")
        if _git(co, "fetch", "-q", "--no-tags", mirror, inst["base_commit"], check=False).returncode:
            raise Refused("no_base_commit", f"{inst['base_commit']} is not in {mirror}")
        _git(co, "checkout", "-q", "-B", "main", "FETCH_HEAD")
        summary = bootstrap(str(co), tmp / "env", cfg)
        if not summary["ok"]:
            raise Refused("bootstrap_failed", f"{summary['reason']}: {summary.get('error', '')[:300]}")
        env_dir = tmp / "env"
        env = load_env(env_dir)
        # the hidden tests: the recorded tree with test_patch applied; the reference: patch applied
        base_tree = tmp / "base"
        shutil.copytree(env_dir / "repo", base_tree, symlinks=True, ignore=shutil.ignore_patterns(".git"))
        tested = tmp / "tested"
        shutil.copytree(base_tree, tested, symlinks=True)
        test_files = _apply(tested, inst["test_patch"])
        fixed = tmp / "fixed"
        shutil.copytree(tested, fixed, symlinks=True)
        code_files = _apply(fixed, inst["patch"])
        hidden = tmp / "hidden"
        shutil.copytree(env_dir / "tests", hidden)
        layout = detect_layout(tested)
        for rel in sorted(set(layout.test_paths + layout.support + test_files)):
            if (tested / rel).is_file() and rel not in code_files:
                (hidden / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(tested / rel, hidden / rel)
        persona = persona_for(env["persona_seed"])
        paths = sorted({t.split("::", 1)[0] for t in f2p + p2p})
        missing_files = [p for p in paths if not (hidden / p).is_file()]
        if missing_files:
            raise Refused("bad_record", f"test files named by the lists are not in the tests: {missing_files[:3]}")
        at_base, _ = run_tests(base_tree, hidden, env_dir / "layer", persona, paths, cfg.test_timeout)
        with_fix, _ = run_tests(fixed, hidden, env_dir / "layer", persona, paths, cfg.test_timeout)
        if any(at_base.get(t) == "passed" for t in f2p):
            raise Refused("fail_to_pass_passes_at_base", ", ".join(t for t in f2p if at_base.get(t) == "passed")[:300])
        if any(with_fix.get(t) != "passed" for t in f2p):
            raise Refused("reference_fails", ", ".join(t for t in f2p if with_fix.get(t) != "passed")[:300])
        bad = [t for t in p2p if at_base.get(t) != "passed" or with_fix.get(t) != "passed"]
        if bad:
            raise Refused("pass_to_pass_fails", ", ".join(bad)[:300])
        tid = str(inst["instance_id"])
        d = write_pytest_task(
            Path(out_dir) / tid, env, env_dir, changes={},
            reference={rel: (fixed / rel).read_bytes() for rel in code_files if (fixed / rel).is_file()},
            hidden_tree=hidden, f2p=f2p, p2p=p2p, instructions=inst["problem_statement"], source=SOURCE,
            source_file=f"{inst['repo']}:{','.join(code_files)}",
            reference_meta={"files": code_files, "kind": "patch"},
            origin_extra={"instance_id": tid, "repo": inst["repo"], "base_commit": inst["base_commit"]})
    if canaries:
        add_repo_canaries(d)
    return d


def import_instances(jsonl: Path, repos: str, out_dir: Path, cfg: BootstrapConfig = BootstrapConfig(),
                     log=lambda m: None, canaries: bool = True) -> dict:
    """Every instance of ``jsonl`` (one JSON object a line) into ``out_dir``; refusals by reason."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    done, refused, seen = [], {}, set()
    text = Path(jsonl).read_text()
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            try:
                inst = json.loads(line)
            except ValueError as e:
                raise Refused("bad_record", f"line {n}: not JSON: {e}") from e
            if not isinstance(inst, dict):
                raise Refused("bad_record", f"line {n}: not an object")
            if inst.get("instance_id") in seen:
                raise Refused("duplicate_id", str(inst.get("instance_id")))
            seen.add(inst.get("instance_id"))
            d = import_instance(inst, repos, out_dir, cfg, canaries)
            done.append(d.name)
            log(f"imported {d.name}")
        except Refused as e:
            refused.setdefault(e.reason, []).append(f"line {n}: {e}"[:300])
            log(f"refused line {n}: {e.reason}: {e}")
    counts = {k: len(v) for k, v in sorted(refused.items())}
    return {"ok": bool(done), "imported": len(done), "tasks": done, "refused": counts,
            "refused_examples": {k: v[:3] for k, v in sorted(refused.items())},
            "lines": len(done) + sum(counts.values())}


# ------------------------------------------------------------------------------------ history

def _changelog_entry(tree: Path, version: str | None) -> str:
    """The entry for ``version`` in a changelog (CHANGES*, CHANGELOG*, HISTORY*, NEWS*, or the
    README's history section), as one short paragraph; empty when none is found."""
    if not version:
        return ""
    cands = [p for pat in ("CHANGE*", "HISTORY*", "NEWS*", "README*") for p in sorted(tree.glob(pat)) if p.is_file()]
    for p in cands:
        lines = p.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if re.match(rf"^\s*[-*]?\s*v?{re.escape(version)}\b", line):
                entry = [re.sub(rf"^\s*[-*]?\s*v?{re.escape(version)}\s*[-:]?\s*", "", line).strip()]
                for nxt in lines[i + 1:i + 8]:
                    if not nxt.strip() or re.match(r"^\s*[-*]?\s*v?\d+\.\d+", nxt):
                        break
                    entry.append(nxt.strip())
                text = " ".join(e for e in entry if e and not set(e) <= set("-=~^"))
                if text:
                    return text[:600]
    return ""


_FIX_LEAD = re.compile(r"^(?:bug\s*)?fix(?:ed|es|ing)?\s*:?\s+(?:(?:a|an|the)\s+)?(?:(?:bug|issue|problem|regression|crash)"
                       r"\s+)?(?:(?:with|in|where|when|that|for|on)\s+)?", re.I)
_ADD_LEAD = re.compile(r"^(?:add(?:ed|s)?|implement(?:ed|s)?)\s+(?:support\s+for\s+)?", re.I)


def user_report(package: str, version: str | None, summary: str, failure: str, hidden_names: list[str]) -> str:
    """A history task's instructions as its user would report the problem: what goes wrong, never
    how it was fixed. The first sentence of the commit message or changelog entry is turned from
    the fixer's words into the reporter's ("Fix handling of X" -> "there is a problem with
    handling of X", "Add support for X" -> "it does not support X", "X can now Y" -> "X should be
    able to Y"; anything else is left out, since it may name the fix), then what the new tests
    show on the code before the fix (their failure, with test names and paths left out)."""
    first = re.split(r"(?<!i\.e\.)(?<!e\.g\.)(?<=[.!?])\s|\n", summary.strip(), maxsplit=1)[0].strip().rstrip(".!")
    first = re.sub(r"\s*\((?:#|gh-|closes |fixes )?\d+\)|\s*#\d+\b", "", first, flags=re.I).strip()
    lead = ""
    if _FIX_LEAD.match(first) and _FIX_LEAD.sub("", first).strip():
        lead = f"There is a problem with {_FIX_LEAD.sub('', first).strip()}."
    elif _ADD_LEAD.match(first) and _ADD_LEAD.sub("", first).strip():
        lead = f"`{package}` does not support {_ADD_LEAD.sub('', first).strip()}."
    elif re.search(r"\bcan now\b", first, re.I):
        lead = re.sub(r"\bcan now\b", "should be able to", first, flags=re.I) + ", but it cannot."
    lines = [l for l in failure.splitlines() if l.strip() and not any(h in l for h in hidden_names)
             and "/var/tmp/" not in l and not re.search(r"\btest_\w+", l)]
    shown = "\n".join(lines[:6])[:700] or "an exception"
    where = f"`{package}` {version}" if version else f"`{package}`"
    return (f"{lead + ' ' if lead else ''}Here is what I get with {where}:\n\n```\n{shown}\n```\n\n"
            f"Please fix it without changing the public API.")


_EMPTY_MESSAGE = re.compile(r"^(release|version|bump|v?\d+(\.\d+)*|update|wip|\.)\b.{0,30}$", re.I)


def history_instances(env_dir: Path, cfg: BootstrapConfig = BootstrapConfig(), max_commits: int = 50) -> dict:
    """Instances from the environment's git history (see the module's docstring); the reasons
    commits were passed over are counted."""
    env_dir = Path(env_dir)
    env = load_env(env_dir)
    repo = env_dir / "repo"
    persona = persona_for(env["persona_seed"])
    commits = _git(repo, "rev-list", "--first-parent", f"--max-count={max_commits}", "HEAD").stdout.split()
    out, skipped = [], {}

    def skip(why):
        skipped[why] = skipped.get(why, 0) + 1

    for c in commits:
        parents = _git(repo, "rev-list", "--parents", "-n", "1", c).stdout.split()[1:]
        if len(parents) != 1:
            skip("root_or_merge")
            continue
        p = parents[0]
        changed = _git(repo, "diff", "--name-only", p, c).stdout.split()
        is_test = lambda f: bool(re.search(r"(^|/)(tests?|testing)/|(^|/)test_[^/]*\.py$|_test\.py$", f))
        tests = [f for f in changed if f.endswith(".py") and is_test(f)]
        code = [f for f in changed if f.endswith(".py") and not is_test(f) and f not in ("setup.py", "conftest.py")]
        if not tests or not code:
            skip("not_code_and_tests")
            continue
        with tempfile.TemporaryDirectory(prefix="cdag-hist-") as tmp:
            tmp = Path(tmp)
            trees = {}
            for name, rev in (("parent", p), ("commit", c)):
                t = tmp / name / repo.name
                t.mkdir(parents=True)
                subprocess.run(f"git -c safe.directory='*' archive {rev} | tar -x -C '{t}'", shell=True, cwd=repo,
                               check=True, capture_output=True)
                trees[name] = t
            # the commit's tests against the parent's code: the new tests must fail there
            mixed = tmp / "mixed" / repo.name
            shutil.copytree(trees["parent"], mixed)
            for f in tests:
                if (trees["commit"] / f).is_file():
                    (mixed / f).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(trees["commit"] / f, mixed / f)
                elif (mixed / f).exists():
                    (mixed / f).unlink()
            lay = detect_layout(trees["commit"])
            hidden = tmp / "hidden"
            record_tests(trees["commit"], lay, hidden)
            paths = sorted({f for f in tests if f in lay.test_paths})
            if not paths:
                skip("no_test_module_changed")
                continue
            before, before_details = run_tests(mixed, hidden, env_dir / "layer", persona, paths, cfg.test_timeout)
            after, _ = run_tests(trees["commit"], hidden, env_dir / "layer", persona, paths, cfg.test_timeout)
            f2p = sorted(t for t, v in after.items() if v == "passed" and before.get(t) in ("failed", "error", None)
                         and "::" in t)
            p2p = sorted(t for t, v in after.items() if v == "passed" and before.get(t) == "passed")
            if not f2p:
                skip("no_fail_to_pass")
                continue
            message = _git(repo, "log", "-1", "--format=%B", c).stdout.strip()
            version = lay.version
            if not message or _EMPTY_MESSAGE.match(message.splitlines()[0]) and len(message.splitlines()) <= 2:
                message = _changelog_entry(trees["commit"], version) or message
            failure = "\n".join((before_details.get("messages") or {}).get(t, "") for t in f2p)
            try:
                base_version = detect_layout(trees["parent"]).version
            except Exception:  # noqa: BLE001 - a layout the parent's tree does not declare: no version named
                base_version = None
            report = user_report(env["name"], base_version, message, failure,
                                 sorted({t.split("::")[-1].split("[")[0] for t in f2p}))
            patch = _diff(trees["parent"], trees["commit"], code)
            test_patch = _diff(trees["parent"], trees["commit"], tests)
        out.append({"instance_id": f"history-{env['name']}-{c[:10]}", "repo": env["name"], "base_commit": p,
                    "patch": patch, "test_patch": test_patch, "problem_statement": report, "hints_text": message,
                    "FAIL_TO_PASS": json.dumps(f2p), "PASS_TO_PASS": json.dumps(p2p), "version": version,
                    "created_at": _git(repo, "log", "-1", "--format=%cI", c).stdout.strip(),
                    "environment_setup_commit": p})
    return {"instances": out, "commits": len(commits), "skipped": skipped,
            "digest": hashlib.sha256(json.dumps(out, sort_keys=True).encode()).hexdigest()[:16]}


@task_source(name=SOURCE, count=None)
def build(req: BuildRequest) -> list[Path]:
    """The tasks of each repository environment's history (``history_instances``, imported when
    the environment was mined)."""
    dirs = environment_tasks(req.environments, req.out, SOURCE)
    return dirs[:req.count] if req.count is not None else dirs
