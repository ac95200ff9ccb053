"""``composer-dag``: the engine from a shell, for users and for cluster payloads.

Every command prints progress on standard error and a JSON summary as the last line of
standard output. Errors are one clear line on standard error and exit status 2 (1 for an
unexpected internal error; ``COMPOSER_DEBUG=1`` shows its traceback).

S3 outputs and sources take their endpoint and credentials from the environment
(``COMPOSER_S3_ENDPOINT_URL`` or ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from composer_dag.runtime.errors import one_line
from composer_dag.storage import open_storage, storage_options_from_env


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cmd_corpus(args: argparse.Namespace) -> dict[str, Any]:
    from composer_dag.corpus import ingest, parse_source
    from composer_dag.corpus.sources import SourceEntry, load_sources

    if args.sources:  # SOURCE names an entry of a sources file, as a code_corpus partition does
        declared = {e.name: e for e in load_sources(args.sources)}
        if args.source not in declared:
            raise ValueError(f"no source named {args.source!r} in {args.sources} (declared: {', '.join(declared)})")
        entry = declared[args.source]
    else:
        spec = parse_source(args.source, name=args.name)
        entry = SourceEntry(name=spec.name, kind=spec.kind, uri=spec.uri, rev=spec.rev)
    limits = {k: v for k, v in (("max_file_mb", args.max_file_mb), ("max_total_mb", args.max_total_mb)) if v is not None}
    entry = entry.replace(**limits)
    storage = open_storage(args.out)
    spec = entry.spec(storage_options_from_env())
    return ingest(spec, storage, storage.root, entry.corpus_config(), progress=_progress).to_dict()


def cmd_dedup(args: argparse.Namespace) -> dict[str, Any]:
    from composer_dag.dedup import DedupConfig, dedup

    src = open_storage(args.corpus_dir)
    inputs = [u for u in src.find(src.root) if u.rsplit("/", 1)[-1].startswith("files-")]
    if not inputs:
        raise ValueError(f"{args.corpus_dir} holds no files-*.parquet: is it the output of `composer-dag corpus`?")
    if src.exists(src.url("manifest.json")):
        try:
            src.verify_manifest(src.root)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # not JSON, or not a manifest
            raise ValueError(f"{src.url('manifest.json')} is not a valid manifest: {type(exc).__name__}") from None
    out = open_storage(args.out)
    if out.protocol != src.protocol:
        raise ValueError("corpus and output must be on the same storage (both local or both s3://)")
    cfg = DedupConfig.load({"num_perm": args.num_perm, "threshold": args.threshold})
    return dedup(inputs, out, out.root, cfg, progress=_progress).to_dict()


def cmd_env_grade(args: argparse.Namespace) -> dict[str, Any]:
    from composer_dag.grading.grade import grade_cli

    for path, what in ((args.task_dir, "task directory"), (args.workspace_dir, "workspace")):
        if not os.path.isdir(path):
            raise ValueError(f"{what} {path} does not exist")
    if not os.path.exists(os.path.join(args.task_dir, "task.json")):
        raise ValueError(f"{args.task_dir} has no task.json: not a task directory")
    if args.actions and not os.path.isfile(args.actions):
        raise ValueError(f"action log {args.actions} does not exist")
    return grade_cli(args.task_dir, args.workspace_dir, args.actions)


def cmd_env_bootstrap(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    from composer_dag.repos.bootstrap import bootstrap
    from composer_dag.repos.config import BootstrapConfig

    cfg = BootstrapConfig.load({k: v for k, v in {"test_timeout": args.test_timeout, "store": args.store}.items()
                                if v is not None})
    r = bootstrap(args.src, Path(args.out), cfg, log=_progress)
    keys = ("ok", "reason", "test_command", "tests_passing", "tests_total", "seconds", "env_digest")
    return {**{k: r.get(k) for k in keys}, **({"error": r["error"]} if r.get("error") else {})}, 0 if r["ok"] else 1


def cmd_tasks_mine(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    from composer_dag.tasks.sources.repo_mined import mine

    if not os.path.exists(os.path.join(args.env_dir, "env.json")):
        raise ValueError(f"{args.env_dir} has no env.json: not an environment (make one with `env bootstrap`)")
    r = mine(Path(args.env_dir), Path(args.out), max_tasks=args.max, seed=args.seed, history=not args.no_history,
             log=_progress)
    return r, 0 if r["ok"] else 1


def cmd_tasks_import(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    from composer_dag.repos.config import BootstrapConfig
    from composer_dag.tasks.sources.swebench import import_instances

    if not os.path.isfile(args.instances):
        raise ValueError(f"{args.instances} does not exist")
    r = import_instances(Path(args.instances), args.repos, Path(args.out),
                         BootstrapConfig.load({"store": args.store} if args.store else {}), log=_progress)
    return r, 0 if r["ok"] else 1


def cmd_tasks_export(args: argparse.Namespace) -> dict[str, Any]:
    from composer_dag.tasks.sources.swebench import export_tasks

    if not os.path.isdir(args.tasks_dir):
        raise ValueError(f"{args.tasks_dir} is not a directory")
    return export_tasks(Path(args.tasks_dir), Path(args.out), Path(args.mirror_dir) if args.mirror_dir else None)


def _exec_command(args: argparse.Namespace) -> list[str]:
    """The command of ``sandbox exec``: what follows ``--``; options given between the workspace
    and ``--`` (``--timeout``) are read here, since everything after the workspace reaches
    ``cmd`` as it is."""
    cmd = list(args.cmd)
    if "--" not in cmd:
        return cmd
    cut = cmd.index("--")
    head, cmd = cmd[:cut], cmd[cut + 1:]
    opts = argparse.ArgumentParser(prog="composer-dag sandbox exec WORKSPACE", add_help=False)
    opts.add_argument("--timeout", type=float)
    ns, unknown = opts.parse_known_args(head)
    if unknown:
        raise ValueError(f"unknown option(s) before --: {' '.join(unknown)}")
    if ns.timeout is not None:
        args.timeout = ns.timeout
    return cmd


def cmd_sandbox_exec(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    from composer_dag.laptop.desktop import dressing
    from composer_dag.sandbox import Limits, Sandbox

    if not os.path.isdir(args.workspace_dir):
        raise ValueError(f"workspace {args.workspace_dir} does not exist")
    cmd = _exec_command(args)
    if not cmd:
        raise ValueError("no command given: composer-dag sandbox exec WORKSPACE -- CMD...")
    with Sandbox(args.workspace_dir, Limits(timeout=args.timeout), dressing=dressing()) as sb:
        r = sb.run(cmd)
    sys.stdout.write(r.stdout)
    if r.stdout and not r.stdout.endswith("\n"):
        sys.stdout.write("\n")
    sys.stderr.write(r.stderr)
    summary = {"exit_code": r.exit_code, "seconds": round(r.seconds, 3), "timed_out": r.timed_out,
               "truncated": r.truncated, "killed_reason": r.killed_reason}
    return summary, r.exit_code


def cmd_sandbox_realism(args: argparse.Namespace) -> dict[str, Any]:
    from composer_dag.laptop.probes import ALLOWLIST, PROBES, open_tells, run_battery, sandbox_realism

    if args.workspace_dir and not os.path.isdir(args.workspace_dir):
        raise ValueError(f"workspace {args.workspace_dir} does not exist")
    inside, host = sandbox_realism(args.workspace_dir), run_battery(None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sandbox": inside, "host": host}, f, indent=1)
    for name, why in inside["verdicts"].items():
        if why:
            answer = " | ".join(inside["outputs"].get(name, "").strip().splitlines()[:3])[:160]
            host_answer = " | ".join(host["outputs"].get(name, "").strip().splitlines()[:3])[:160]
            sys.stdout.write(f"{name}: {why}\n    sandbox: {answer}\n    host:    {host_answer}\n")
            if name in ALLOWLIST:
                sys.stdout.write(f"    allowed: {ALLOWLIST[name][0]}; a deployment: {ALLOWLIST[name][1]}\n")
    tells = open_tells(inside)
    sys.stdout.write(f"{inside['count']} of {len(PROBES)} probes tell the sandbox from a laptop "
                     f"(the host: {host['count']}); {inside['count'] - len(tells)} of them allowed "
                     f"(the host shows through, or isolation keeps them), {len(tells)} open\n")
    return {"probes": len(PROBES), "differences": inside["count"], "open": len(tells), "host_differences": host["count"]}


def cmd_eval(args: argparse.Namespace) -> dict[str, Any]:
    from composer_dag.evals.evaluate import eval_cli

    if not os.path.exists(os.path.join(args.checkpoint, "config.json")):
        raise ValueError(f"{args.checkpoint} has no config.json: not a Hugging Face checkpoint directory")
    if not os.path.isdir(args.tasks):
        raise ValueError(f"tasks directory {args.tasks} does not exist")
    opts = {"inference": {"engine": args.engine}, "samples_per_task": args.samples, "max_tasks": args.max_tasks,
            "agent": {"max_turns": args.max_turns, "system_style": args.system_style}}
    cfg = {k: ({kk: vv for kk, vv in v.items() if vv is not None} if isinstance(v, dict) else v)
           for k, v in opts.items() if v is not None}
    if args.samples:  # every pass@k the samples allow
        cfg["ks"] = [k for k in (1, 2, 4, 8, 16, 32) if k <= args.samples]
    if args.max_tasks == 0:
        cfg["max_tasks"] = None
    return eval_cli(args.checkpoint, args.tasks, out_dir=args.out, baseline=args.baseline, config=cfg)


def _home(*parts: str) -> str:
    return os.path.join(os.path.abspath(os.environ.get("COMPOSER_HOME", ".composer")), *parts)


def cmd_traces_validate(args):
    """Read session files as intake would: every line valid or counted under its reason."""
    from collections import Counter

    from composer_dag.traces.format import read_sessions, schema_errors

    out = {}
    for path in args.files:
        with open(path, "rb") as f:
            data = f.read()
        counts, first = Counter(), []
        for line, record, why in read_sessions(data):
            counts[why] += 1
            if why == "schema_violation" and len(first) < 5:
                first.append(f"line {line}: " + "; ".join(schema_errors(json.loads(data.split(b"\n")[line - 1]))[:3]))
        out[path] = {"lines": sum(counts.values()), **dict(counts), **({"errors": first} if first else {})}
    bad = any(k != "ok" for v in out.values() for k in v if k not in ("lines", "errors"))
    return out, 1 if bad else 0


def cmd_traces_delete(args):
    """Delete a user's sessions everywhere and list the checkpoints trained on them."""
    from composer_dag.catalog import Catalog
    from composer_dag.traces.intake import TraceConfig, incoming_url
    from composer_dag.traces.store import delete_user

    storage = open_storage(args.storage or os.environ.get("COMPOSER_STORAGE_ROOT") or _home("artifacts"))
    catalog = Catalog(args.catalog or os.environ.get("COMPOSER_CATALOG") or _home("catalog.duckdb"), storage)
    incoming = incoming_url(storage, args.incoming or TraceConfig().incoming)
    return delete_user(storage, catalog, args.user, incoming, log=lambda m: print(m, file=sys.stderr),
                       weights_uri=args.weights_uri)


def cmd_serve(args):
    """Serve an earlier promoted version again (a rollback)."""
    from composer_dag.traces import registry

    storage = open_storage(args.storage or os.environ.get("COMPOSER_STORAGE_ROOT") or _home("artifacts"))
    line = registry.serve(storage, args.version, args.weights_uri)
    return {"served": line, "promoted": registry.current(storage)}


# the subcommands by group: `corpus`, `dedup`, `eval`; `env grade|bootstrap`; `tasks mine|import|export`;
# `traces validate|delete`, `serve`; `sandbox exec|realism`
def _add_data_commands(sub) -> None:
    c = sub.add_parser("corpus", help="ingest a source (directory, git URL/path[@rev], s3://prefix, or 'python')")
    c.add_argument("source")
    c.add_argument("--out", required=True, help="output directory or s3:// URL")
    c.add_argument("--name", default=None, help="source name (default: derived from SOURCE)")
    c.add_argument("--sources", default=None, help="a sources file (like sources.yaml): SOURCE is the name of one of its entries")
    c.add_argument("--max-file-mb", type=float, default=None, help="skip files larger than this (default 1)")
    c.add_argument("--max-total-mb", type=float, default=None, help="stop ingesting after this much text (default: no cap)")
    c.set_defaults(func=cmd_corpus)

    d = sub.add_parser("dedup", help="filter, deduplicate, decontaminate and redact a corpus")
    d.add_argument("corpus_dir", help="what `composer-dag corpus` wrote")
    d.add_argument("--out", required=True)
    d.add_argument("--num-perm", type=int, default=256)
    d.add_argument("--threshold", type=float, default=0.7)
    d.set_defaults(func=cmd_dedup)

    v = sub.add_parser("eval", help="evaluate a checkpoint on held-out tasks (pass@k, HumanEval, cost)")
    v.add_argument("checkpoint", help="a Hugging Face checkpoint directory")
    v.add_argument("--tasks", required=True, help="a directory of task directories (e.g. an eval_tasks artifact)")
    v.add_argument("--out", default=None, help="output directory (default ./eval-<digest>)")
    v.add_argument("--engine", choices=["vllm", "hf"], default=None)
    v.add_argument("--samples", type=int, default=None, help="samples per task (pass@k needs k <= samples)")
    v.add_argument("--max-tasks", type=int, default=None, help="the first N tasks (0: every task)")
    v.add_argument("--max-turns", type=int, default=None)
    v.add_argument("--system-style", choices=["full", "compact"], default=None)
    v.add_argument("--baseline", default=None, help="a summary.json to gate against")
    v.set_defaults(func=cmd_eval)


def _add_env_commands(sub) -> None:
    e = sub.add_parser("env", help="RL environments").add_subparsers(dest="env_command", required=True)
    g = e.add_parser("grade", help="grade a workspace as if submitted: reward, per-test results, cheat flags")
    g.add_argument("task_dir")
    g.add_argument("workspace_dir")
    g.add_argument("--actions", default=None, metavar="LOG",
                   help="the episode's action log (JSON array or JSON lines), so that the flags of commands fire")
    g.set_defaults(func=cmd_env_grade)
    b = e.add_parser("bootstrap", help="make a repository (directory, git PATH[@REV], sdist file or URL) an "
                                       "environment whose own tests run in the sandbox, offline")
    b.add_argument("src")
    b.add_argument("--out", required=True, help="the environment directory to write")
    b.add_argument("--test-timeout", type=float, default=None, help="seconds per run of the suite")
    b.add_argument("--store", default=None, help="the wheel store (default $COMPOSER_HOME/wheel-store)")
    b.set_defaults(func=cmd_env_bootstrap)


def _add_tasks_commands(sub) -> None:
    t = sub.add_parser("tasks", help="RL tasks").add_subparsers(dest="tasks_command", required=True)
    m = t.add_parser("mine", help="synthetic-bug tasks from an environment made by `env bootstrap`")
    m.add_argument("env_dir")
    m.add_argument("--out", required=True, help="the directory to write task directories into")
    m.add_argument("--max", type=int, default=10, help="tasks at most")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--no-history", action="store_true", help="no tasks from the repository's git history")
    m.set_defaults(func=cmd_tasks_mine)
    i = t.add_parser("import", help="SWE-bench-style instances (JSON lines) as tasks, verified in the sandbox")
    i.add_argument("instances")
    i.add_argument("--repos", required=True, help="a directory of mirrors (<owner>__<name> or <name>) or a git URL prefix")
    i.add_argument("--out", required=True)
    i.add_argument("--store", default=None, help="the wheel store (default $COMPOSER_HOME/wheel-store)")
    i.set_defaults(func=cmd_tasks_import)
    x = t.add_parser("export", help="the repository tasks of a directory as SWE-bench-style instances")
    x.add_argument("tasks_dir")
    x.add_argument("--out", required=True, help="the JSON-lines file to write")
    x.add_argument("--mirror-dir", default=None, help="also write a bare mirror per repository with every base commit")
    x.set_defaults(func=cmd_tasks_export)


def _add_traces_commands(sub) -> None:
    tr = sub.add_parser("traces", help="production sessions").add_subparsers(dest="traces_command", required=True)
    x = tr.add_parser("validate", help="check session files (composer-session/1, JSON lines) against the schema")
    x.add_argument("files", nargs="+")
    x.set_defaults(func=cmd_traces_validate)
    x = tr.add_parser("delete", help="delete a user's sessions from every partition, the incoming files and the "
                                     "SFT trajectories; list the checkpoints trained on them and withdraw the "
                                     "promoted versions among them (the newest clean version serves instead)")
    x.add_argument("--user", required=True, help="the user id as the sessions carry it")
    x.add_argument("--storage", default=None, help="artifact root (default $COMPOSER_STORAGE_ROOT or $COMPOSER_HOME/artifacts)")
    x.add_argument("--catalog", default=None, help="DuckDB catalog (default $COMPOSER_CATALOG or $COMPOSER_HOME/catalog.duckdb)")
    x.add_argument("--incoming", default=None, help="the incoming prefix (default: traces/incoming under the root)")
    x.add_argument("--weights-uri", default=None, help="the serving fleet's weights prefix, where a clean version's "
                                                        "weights go out when the served one is withdrawn")
    x.set_defaults(func=cmd_traces_delete)

    x = sub.add_parser("serve", help="serve an earlier promoted version again: the registry points at it, the served "
                                     "log records since when, its weights go out at --weights-uri")
    x.add_argument("version", help="a promoted version (registry/history)")
    x.add_argument("--storage", default=None, help="artifact root (default $COMPOSER_STORAGE_ROOT or $COMPOSER_HOME/artifacts)")
    x.add_argument("--weights-uri", default=None, help="the serving fleet's weights prefix (default: none published)")
    x.set_defaults(func=cmd_serve)


def _add_sandbox_commands(sub) -> None:
    s = sub.add_parser("sandbox", help="the bubblewrap sandbox").add_subparsers(dest="sandbox_command", required=True)
    x = s.add_parser("exec", help="run a command in the sandbox; its exit code is passed through")
    x.add_argument("workspace_dir")
    x.add_argument("--timeout", type=float, default=60.0)
    x.add_argument("cmd", nargs=argparse.REMAINDER)
    x.set_defaults(func=cmd_sandbox_exec)
    rz = s.add_parser("realism", help="the realism battery: every probe a laptop would answer otherwise")
    rz.add_argument("workspace_dir", nargs="?", help="the project the sandbox opens (default: an empty one)")
    rz.add_argument("--json", metavar="FILE", help="also write both reports (outputs, verdicts) here")
    rz.set_defaults(func=cmd_sandbox_realism)


def cmd_harness_list(args: argparse.Namespace) -> dict[str, Any]:
    from composer_dag import harness as harnesses
    from composer_dag.harness.external import declared

    built = [{"name": n, "version": harnesses.get(n).version, "kind": "built-in"} for n in harnesses.names()]
    ext = [{"name": s.name, "version": s.version, "kind": "external", "api": s.api.kind, "installed": s.installed(),
            "spec": s.path, "description": s.description} for s in declared()]
    for h in built + ext:
        print(f"{h['name']:<20} {h['version']:<10} {h['kind']}" + ("" if h.get("installed", True) else " (not installed)"))
    return {"harnesses": built + ext}


def cmd_harness_install(args: argparse.Namespace) -> dict[str, Any]:
    from composer_dag.harness.external import declared, install, load_spec

    specs = declared() if args.all else [load_spec(args.spec)] if args.spec else []
    if not specs:
        raise ValueError("name a harness (or a spec file), or give --all")
    return {"installed": [{"name": s.name, "version": s.version, "env": str(install(s, log=_progress))} for s in specs]}


def cmd_harness_run(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    from composer_dag.gateway.core import Gateway
    from composer_dag.gateway.server import GatewayServer
    from composer_dag.gateway.upstream import InProcess, Servers
    from composer_dag.harness.external import load_spec, run_episode
    from composer_dag.inference.engine import HFEngine, model_max_len
    from composer_dag.train.tokenizer import load_tokenizer

    spec = load_spec(args.spec)
    if not os.path.exists(os.path.join(args.task_dir, "task.json")):
        raise ValueError(f"{args.task_dir} has no task.json: not a task directory")
    if not os.path.isdir(args.model):
        raise ValueError(f"--model {args.model} is not a checkpoint directory")
    upstream = Servers(args.upstream) if args.upstream else InProcess(HFEngine(args.model))
    gw = Gateway(upstream, load_tokenizer(args.model), os.path.basename(args.model.rstrip("/")),
                 args.max_model_len or model_max_len(args.model) or 2048, records_dir=args.records)
    out = args.out or os.path.join(os.environ.get("COMPOSER_HOME", ".composer"), "harness-runs", spec.name)
    with GatewayServer(gw) as server:
        r = run_episode(spec, args.task_dir, server, gw.model, out, timeout_s=args.timeout, log=_progress)
    with open(os.path.join(out, "rollout.json"), "w") as f:
        json.dump(r.pop("rollout"), f, default=str)
    return r, 0 if not r["infra_failure"] else 1


def _add_harness_commands(sub) -> None:
    h = sub.add_parser("harness", help="agent harnesses: the built-in one and external ones declared in spec files")
    hs = h.add_subparsers(dest="harness_command", required=True)
    x = hs.add_parser("list", help="the declared harnesses, their versions and whether they are installed")
    x.set_defaults(func=cmd_harness_list)
    x = hs.add_parser("install", help="install an external harness into its own virtual environment")
    x.add_argument("spec", nargs="?", help="a declared harness's name or a spec file")
    x.add_argument("--all", action="store_true", help="every declared harness")
    x.set_defaults(func=cmd_harness_install)
    x = hs.add_parser("run", help="play one episode of a task with a harness, through the gateway")
    x.add_argument("spec", help="a declared harness's name or a spec file (TOML)")
    x.add_argument("task_dir")
    x.add_argument("--model", required=True, help="the checkpoint directory (its tokenizer; served in this "
                                                  "process unless --upstream names servers)")
    x.add_argument("--upstream", nargs="+", default=None, help="vLLM server URLs serving that checkpoint")
    x.add_argument("--max-model-len", type=int, default=None)
    x.add_argument("--timeout", type=float, default=None, help="seconds for the episode (default: the spec's)")
    x.add_argument("--records", default=None, help="a directory for the gateway's records (JSON lines per key)")
    x.add_argument("--out", default=None, help="the harness's working directory (its files, log, rollout.json)")
    x.set_defaults(func=cmd_harness_run)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="composer-dag", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_add_data_commands, _add_env_commands, _add_tasks_commands, _add_traces_commands,
                _add_sandbox_commands, _add_harness_commands):
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        summary = args.func(args)
    except (ValueError, RuntimeError, OSError) as exc:  # bad input (ArtifactError, git): the message says it
        print(f"composer-dag {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"composer-dag {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # anything else: still one line; COMPOSER_DEBUG=1 shows the traceback
        if os.environ.get("COMPOSER_DEBUG"):
            raise
        print(f"composer-dag {args.command}: error: {type(exc).__name__}: {one_line(exc)}", file=sys.stderr)
        return 1
    code = 0
    if isinstance(summary, tuple):
        summary, code = summary
    print(json.dumps(summary, sort_keys=True, default=str))
    return code


if __name__ == "__main__":
    sys.exit(main())
