"""Fleet benchmarks: the size of the published bf16 weight deltas against the full bf16
checkpoint at RL learning rates, and the time to publish, rebuild and reload a version.

    .venv/bin/python benchmarks/bench_fleet.py deltas --out /tmp/bench_fleet [--model tiny] [--steps 4]
        [--lrs 1e-6,3e-6,1e-5] [--levels 3,19]
    .venv/bin/python benchmarks/bench_fleet.py run --out /tmp/bench_fleet [--steps 4]

    .venv/bin/python benchmarks/bench_fleet.py server-start --out /tmp/bench_fleet [--rounds 2]
    .venv/bin/python benchmarks/bench_fleet.py learn --out /tmp/bench_fleet [--steps 10] [--sandboxes 4,16]
        [--repeat 1] [--set JSON] [--no-one-process]

``learn``: the learnable family (``environment: learnable``'s settings, ``--steps`` updates) once
in one process and in the distributed mode for each ``--sandboxes`` cap (``max_staleness`` 1,
``full_every`` 4), on one pair of rollout servers started here (server i on core i) and shared
by the distributed runs; each distributed run ``--repeat`` times (the distributed mode is not
deterministic: which version samples which episode depends on timing). ``--set`` merges JSON
into every run's config (a dict value into the setting's dict), e.g.
``'{"trainer": {"lr": 0.0015, "kl_coef": 0}}'``. Reported per run: wall seconds, mean step
seconds, the reward curve, its least-squares slope per step, the mean reward of its first and
last four steps, and ``collapsed``: the last three steps' reward all 0 (a policy that solves
nothing gets no group-relative signal back).

``server-start``: one rollout server (``ServerProcess``, the arguments the fleet uses) on the
``deltas`` base model, started and stopped ``--rounds`` times in each mode, alternating: ``uni``
(what the fleet runs: the model inside vLLM's engine core process) and ``mp`` (vLLM's CPU
default: a third, worker process). Reported per mode: seconds from the command to a healthy
``/health``, processes in the server's group, and the token ids of one greedy completion
(the same in both modes, or the script says so).

``deltas``: a fresh Llama of the ``--model`` config on a BPE tokenizer trained on the stdlib
``json`` package, trained with AdamW (betas 0.9/0.99, as the GRPO trainer) on next-token loss
over the stdlib's source for ``--steps`` updates per learning rate, each update published with
``WeightPublisher`` in bf16 (version 0 full, the others deltas). Reported per learning rate and
zstd level: the delta bytes over the full bf16 bytes (mean, max over the updates), the share of
bf16 values that changed, publish and rebuild (``WeightCache``) seconds.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def deltas(args) -> dict:
    import torch

    from composer_dag.rl.weights import WeightCache, WeightPublisher, cast_state
    from composer_dag.storage import Storage
    from composer_dag.train.model import build_base_model
    from composer_dag.train.tokenizer import load_tokenizer, train_tokenizer
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    src = os.path.dirname(json.__file__)
    texts = [open(f, encoding="utf-8").read() for f in sorted(glob.glob(src + "/*.py"))]
    tok_dir = os.path.join(out, "tok")
    if not os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
        train_tokenizer(texts, tok_dir, vocab_size=args.vocab)
    base = os.path.join(out, f"base-{args.model}")
    if not os.path.exists(os.path.join(base, "config.json")):
        build_base_model(args.model, tok_dir, base, seed=0)
    tok = load_tokenizer(tok_dir)
    corpus = [f for f in sorted(glob.glob(os.path.dirname(os.__file__) + "/*.py"))][:200]
    ids = []
    for f in corpus:
        ids += tok(open(f, encoding="utf-8", errors="replace").read(), add_special_tokens=False).input_ids
        if len(ids) > args.batch * args.seq * (args.steps + 1):
            break
    data = torch.tensor(ids[:args.batch * args.seq * args.steps]).view(args.steps, args.batch, args.seq)
    rows = []
    for lr in [float(x) for x in args.lrs.split(",")]:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        n_params = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
        pubs = {lv: WeightPublisher(Storage(os.path.join(out, f"w-{lr:g}-{lv}")), "", full_every=1 << 30,
                                    dtype="bfloat16", level=lv) for lv in [int(x) for x in args.levels.split(",")]}
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        infos = {lv: [p.publish(0, sd)] for lv, p in pubs.items()}
        changed = []
        prev_bf = cast_state(sd, "bfloat16")
        for s in range(args.steps):
            x = data[s]
            loss = model(input_ids=x, labels=x).loss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
            bf = cast_state(sd, "bfloat16")
            n = sum(v.numel() for v in bf.values())
            changed.append(sum((bf[k].view(torch.int16) != prev_bf[k].view(torch.int16)).sum().item() for k in bf) / n)
            prev_bf = bf
            for lv, p in pubs.items():
                infos[lv].append(p.publish(s + 1, sd))
        for lv, p in pubs.items():
            cache = WeightCache(p.storage, "")
            cache.get(0)
            rebuild = []
            for v in range(1, args.steps + 1):
                cache.get(v)
                rebuild.append(cache.last_seconds)
            d = [i for i in infos[lv] if i["kind"] == "delta"]
            rows.append({"lr": lr, "zstd_level": lv, "params": n_params, "full_bf16_bytes": infos[lv][0]["bytes"],
                         "delta_fraction_mean": statistics.mean(i["fraction"] for i in d),
                         "delta_fraction_max": max(i["fraction"] for i in d),
                         "delta_bytes_mean": statistics.mean(i["bytes"] for i in d),
                         "changed_bf16_values": statistics.mean(changed),
                         "publish_s_mean": statistics.mean(i["seconds"] for i in d),
                         "rebuild_s_mean": statistics.mean(rebuild)})
            print(json.dumps(rows[-1]), flush=True)
    return {"model": args.model, "steps": args.steps, "batch": args.batch, "seq": args.seq, "rows": rows}


def _rl_run(cfg: dict, path: str, mode: str) -> tuple[dict, float]:
    """``python -m composer_dag.rl.run`` on ``cfg`` (written to ``path``): its result.json and wall seconds."""
    import subprocess

    with open(path, "w") as f:
        json.dump(cfg, f)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "composer_dag.rl.run", "--config", path], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{mode}: {r.stderr[-2000:]}")
    wall = time.perf_counter() - t0
    with open(os.path.join(cfg["out_dir"], "result.json")) as f:
        return json.load(f), wall


def run(args) -> dict:
    """The same RL config (learnable tasks, the small test policy, vLLM) once in one process and
    once in the distributed mode (2 rollout servers started by the run); the step time split."""
    import torch

    from composer_dag.rl.learnable import make_learnable_setup

    out = os.path.abspath(args.out)
    setup = os.path.join(out, "learnable")
    if not os.path.exists(os.path.join(setup, "policy", "config.json")):
        torch.set_num_threads(1)
        make_learnable_setup(setup, n_tasks=8, seed=0, words=("red", "blue"), warmup_steps=60)
    base = {"policy_dir": os.path.join(setup, "policy"), "tasks_dir": os.path.join(setup, "tasks"),
            "steps": args.steps, "tasks_per_step": 2, "group_size": 4, "torch_threads": 1, "max_staleness": 1,
            "full_every": 5, "trainer": {"lr": 1e-5, "micro_batch": 8},
            "orchestrator": {"max_turns": 2, "max_new_tokens": 24, "max_context": 512, "system_style": "compact",
                             "workers": 2},
            "inference": {"engine": "vllm", "max_model_len": 1024, "kv_cache_mb": 64}}
    res = {}
    for mode in ("one_process", "fleet"):
        cfg = {**base, "out_dir": os.path.join(out, mode)}
        if mode == "fleet":
            cfg["fleet"] = {"servers": 2, "max_sandboxes": 4}
        import shutil

        shutil.rmtree(cfg["out_dir"], ignore_errors=True)
        result, wall = _rl_run(cfg, os.path.join(out, f"{mode}.json"), mode)
        res[mode] = {"wall_s": wall,
                     "step_seconds": {k: v.get("mean") for k, v in result["step_seconds"].items()},
                     "reward_curve": result["reward_curve"]}
        if mode == "fleet":
            res[mode]["reload_s"] = {sid: [x["reload_s"] for x in s["reloads"]]
                                     for sid, s in result["fleet"]["servers"].items()}
            res[mode]["probe_diff_max"] = max(x["probe_diff"] for s in result["fleet"]["servers"].values()
                                              for x in s["reloads"])
            res[mode]["servers_per_step"] = [b["servers"] for b in result["fleet"]["batches"]]
        else:
            res[mode]["reload_s"] = result["weight_sync_seconds"]
        print(json.dumps({mode: res[mode]}), flush=True)
    return res


def learn(args) -> dict:
    """One process against the distributed mode on the learnable family (see the module's text)."""
    import shutil

    import torch

    from composer_dag.inference.server import ServerProcess
    from composer_dag.cluster.spec import free_port
    from composer_dag.rl.learnable import make_learnable_setup
    from composer_dag.rl.report import reward_slope
    from composer_dag.rl.run import LEARNABLE_RUN

    out = os.path.abspath(args.out)
    setup = os.path.join(out, "learnable-warm")
    if not os.path.exists(os.path.join(setup, "policy", "config.json")):
        torch.set_num_threads(2)
        make_learnable_setup(setup, n_tasks=8, seed=0, words=("red", "blue"), warmup_steps=100)
    policy, tasks = os.path.join(setup, "policy"), os.path.join(setup, "tasks")
    res = {"runs": {}, "set": json.loads(args.set)}
    servers = []
    modes = [] if args.no_one_process else ["one_process"]
    modes += [f"fleet_{n}" + (f"_r{k}" if args.repeat > 1 else "") for n in args.sandboxes.split(",")
              for k in range(args.repeat)]
    try:
        for mode in modes:
            cfg = {**LEARNABLE_RUN, "policy_dir": policy, "tasks_dir": tasks, "out_dir": os.path.join(out, mode, "run"),
                   "steps": args.steps, "seed": 0}
            if mode != "one_process":
                if not servers:
                    t0 = time.perf_counter()
                    servers = [ServerProcess(policy, free_port(), log_path=os.path.join(out, f"server_{i}.log"), cpu=i % 2,
                                             max_model_len=1024, kv_cache_mb=32).start() for i in range(2)]
                    for s in servers:
                        s.wait_ready(900)
                    res["servers_up_s"] = time.perf_counter() - t0
                cfg.update(max_staleness=1, full_every=4, fleet={"urls": [s.url for s in servers],
                                                                 "max_sandboxes": int(mode.split("_")[1])})
            for key, v in res["set"].items():  # last, so that --set overrides the mode's settings too
                cfg[key] = {**(cfg.get(key) or {}), **v} if isinstance(v, dict) else v
            shutil.rmtree(os.path.join(out, mode), ignore_errors=True)
            os.makedirs(os.path.join(out, mode))
            result, wall = _rl_run(cfg, os.path.join(out, mode, "cfg.json"), mode)
            curve = [v for _, v in result["reward_curve"]]
            res["runs"][mode] = {"wall_s": round(wall, 1),
                                 "step_s_mean": round(result["step_seconds"]["step_s"]["mean"], 2),
                                 "reward_curve": [round(v, 3) for v in curve], "slope_per_step": round(reward_slope(curve), 4),
                                 "first4": round(statistics.mean(curve[:4]), 3), "last4": round(statistics.mean(curve[-4:]), 3),
                                 "collapsed": len(curve) >= 3 and not any(curve[-3:])}
            print(json.dumps({mode: res["runs"][mode]}), flush=True)
    finally:
        for s in servers:
            s.stop()
    fleet = [r for m, r in res["runs"].items() if m.startswith("fleet")]
    if fleet:
        res["fleet_summary"] = {"runs": len(fleet), "collapsed": sum(r["collapsed"] for r in fleet),
                                "slope_positive": sum(r["slope_per_step"] > 0 for r in fleet),
                                "slope_mean": round(statistics.mean(r["slope_per_step"] for r in fleet), 4),
                                "slope_min": min(r["slope_per_step"] for r in fleet)}
        print(json.dumps(res["fleet_summary"]), flush=True)
    return res


def base_model(args) -> str:
    """The ``deltas`` base model under ``--out`` (built once)."""
    from composer_dag.train.model import build_base_model
    from composer_dag.train.tokenizer import train_tokenizer

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    tok_dir, base = os.path.join(out, "tok"), os.path.join(out, f"base-{args.model}")
    if not os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
        src = os.path.dirname(json.__file__)
        train_tokenizer([open(f, encoding="utf-8").read() for f in sorted(glob.glob(src + "/*.py"))], tok_dir,
                        vocab_size=args.vocab)
    if not os.path.exists(os.path.join(base, "config.json")):
        build_base_model(args.model, tok_dir, base, seed=0)
    return base


def server_start(args) -> dict:
    import subprocess

    from composer_dag.inference.engine import Sampling
    from composer_dag.cluster.spec import free_port
    from composer_dag.rl.fleet import server as srv

    model = base_model(args)
    rows = {"uni": [], "mp": []}
    for r in range(args.rounds):
        for mode in ("uni", "mp"):
            port = free_port()
            cmd = srv.server_command(model, port)
            env = srv.server_env(0)
            if mode == "mp":  # vLLM's own CPU default: engine core and a worker process
                cmd = cmd[:cmd.index("--distributed-executor-backend")] + cmd[cmd.index("--distributed-executor-backend") + 2:]
                env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
            t0 = time.perf_counter()
            with open(os.path.join(args.out, f"server_{mode}_{r}.log"), "wb") as log:
                proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            client = srv.ServerClient(f"http://127.0.0.1:{port}")
            while not client.healthy():
                if proc.poll() is not None:
                    raise SystemExit(f"{mode} server exited {proc.returncode}: see {log.name}")
                time.sleep(0.2)
            up = time.perf_counter() - t0
            group = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
            out = client.complete(list(range(5, 20)), Sampling(1, 0.0, 1.0, 16, (), 0), seed=0)
            ps = srv.ServerProcess(model, port)
            ps.proc = proc
            ps.stop()
            rows[mode].append({"up_s": round(up, 1), "processes": len(group), "tokens": out.token_ids})
            print(json.dumps({"round": r, "mode": mode, **rows[mode][-1]}), flush=True)
    res = {m: {"up_s_median": statistics.median(x["up_s"] for x in v), "up_s": [x["up_s"] for x in v],
               "processes": v[0]["processes"]} for m, v in rows.items()}
    res["same_tokens"] = all(x["tokens"] == rows["uni"][0]["tokens"] for v in rows.values() for x in v)
    res["speedup"] = round(res["mp"]["up_s_median"] / res["uni"]["up_s_median"], 2)
    print(json.dumps(res), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["deltas", "run", "server-start", "learn"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lrs", default="1e-6,3e-6,1e-5")
    ap.add_argument("--levels", default="3,19")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sandboxes", default="4,16", help="learn: the distributed runs' max_sandboxes")
    ap.add_argument("--repeat", type=int, default=1, help="learn: runs of each distributed setting")
    ap.add_argument("--set", default="{}", help="learn: JSON merged into every run's config")
    ap.add_argument("--no-one-process", action="store_true", help="learn: the distributed runs only")
    args = ap.parse_args()
    res = {"deltas": deltas, "run": run, "server-start": server_start, "learn": learn}[args.what](args)
    with open(os.path.join(args.out, f"{args.what}.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
