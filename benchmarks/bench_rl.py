"""RL benchmark: rollout tokens/s with vLLM vs transformers (same model, same batch, same
max_tokens, measured interleaved in one process tree), then a short vLLM-engine RL run with its
step time broken down, weight-sync seconds and delta size.

    .venv/bin/python benchmarks/bench_rl.py --out /tmp/bench_rl [--batch 32] [--new-tokens 64] [--reps 3] [--steps 4]

Throughput: both engines are started first and stay up; the timed ``generate`` calls then
alternate (hf, vllm, vllm, hf, ...) so that both see the same machine load. The model is a
freshly initialised Llama of the ``tiny`` config (``--model tiny``; ``--model policy`` uses the
RL policy instead) on the learnable-task tokenizer. The transformers engine runs with as many
torch threads as vLLM's CPU worker gets OpenMP threads (``--hf-threads`` overrides). For each
call the benchmark records wall seconds, generated tokens, the CPU seconds of this process and
its children, and the CPU the rest of the machine used meanwhile (in cores), since the cores
are shared.

RL run: ``python -m composer_dag.rl.run`` with the vLLM engine on the learnable tasks, the
small test policy after a short format warm-up; its per-step metrics are summarised.
The entry point keeps the ``__main__`` guard: vLLM's engine core runs in child processes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _tree(proc) -> list:
    return [proc] + proc.children(recursive=True)


def _cpu_s(procs) -> float:
    import psutil

    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _machine_busy_s() -> float:
    import psutil

    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0) + getattr(t, "steal", 0.0)


def _vllm_procs(me) -> list[dict]:
    import psutil

    out = []
    for c in me.children(recursive=True):
        try:
            env = c.environ()
            out.append({"name": c.name(), "pid": c.pid, "omp_num_threads": env.get("OMP_NUM_THREADS"),
                        "cpu_affinity": c.cpu_affinity()})
        except psutil.Error:
            pass
    return out


def throughput(model_dir: str, batch: int, prompt_len: int, new_tokens: int, reps: int,
               hf_threads: int | None) -> dict:
    import psutil
    import torch

    from composer_dag.inference import HFEngine, Sampling, VLLMEngine

    me = psutil.Process()
    t0 = time.perf_counter()
    vllm = VLLMEngine(model_dir, max_model_len=max(512, prompt_len + new_tokens + 8), kv_cache_bytes=256 << 20)
    vllm_start = time.perf_counter() - t0
    workers = _vllm_procs(me)
    omp = [int(w["omp_num_threads"]) for w in workers if w["omp_num_threads"]]
    threads = hf_threads or (min(omp) if omp else 1)
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    hf = HFEngine(model_dir)
    hf_start = time.perf_counter() - t0
    engines = {"hf": hf, "vllm": vllm}

    prompts = [[(13 * i + 7 * j) % 500 + 10 for j in range(prompt_len)] for i in range(batch)]
    for eng in engines.values():  # untimed: first-call allocations
        eng.generate(prompts, Sampling(temperature=1.0, max_tokens=8, seed=0))

    runs = []
    try:
        for r in range(reps):
            for kind in (("hf", "vllm") if r % 2 == 0 else ("vllm", "hf")):
                procs = _tree(me)
                c0, m0, w0 = _cpu_s(procs), _machine_busy_s(), time.perf_counter()
                outs = engines[kind].generate(prompts, Sampling(temperature=1.0, max_tokens=new_tokens, seed=100 + r))
                wall = time.perf_counter() - w0
                own = _cpu_s(procs) - c0
                other = max(0.0, _machine_busy_s() - m0 - own)
                toks = sum(len(o.token_ids) for o in outs)
                runs.append({"engine": kind, "rep": r, "seconds": round(wall, 3), "tokens": toks,
                             "tokens_per_s": round(toks / wall, 1), "own_cpu_s": round(own, 2),
                             "tokens_per_cpu_s": round(toks / own, 1) if own else None,
                             "other_load_cores": round(other / wall, 2), "loadavg_1m": os.getloadavg()[0]})
                print(f"[throughput] rep {r} {kind:>4}: {toks} tokens in {wall:.2f}s = {toks / wall:.0f} tok/s "
                      f"(own cpu {own:.1f}s, other load {other / wall:.2f} cores)", file=sys.stderr, flush=True)
    finally:
        vllm.close()

    def summary(kind):
        rs = [x for x in runs if x["engine"] == kind]
        return {"startup_s": round(vllm_start if kind == "vllm" else hf_start, 1),
                "tokens_per_s_median": statistics.median(x["tokens_per_s"] for x in rs),
                "tokens_per_s_best": max(x["tokens_per_s"] for x in rs),
                "tokens_per_cpu_s_median": statistics.median(x["tokens_per_cpu_s"] for x in rs if x["tokens_per_cpu_s"]),
                "tokens_per_rep": sorted({x["tokens"] for x in rs}),
                "other_load_cores_mean": round(statistics.mean(x["other_load_cores"] for x in rs), 2)}

    res = {"model_dir": model_dir, "batch": batch, "prompt_len": prompt_len, "max_tokens": new_tokens,
           "reps": reps, "hf_torch_threads": threads, "vllm_processes": workers,
           "hf": summary("hf"), "vllm": summary("vllm"), "runs": runs}
    pairs = [v["tokens_per_s"] / h["tokens_per_s"] for h, v in
             zip([x for x in runs if x["engine"] == "hf"], [x for x in runs if x["engine"] == "vllm"])]
    res["ratio_median"] = round(res["vllm"]["tokens_per_s_median"] / res["hf"]["tokens_per_s_median"], 2)
    res["ratio_per_rep"] = [round(x, 2) for x in pairs]
    res["ratio_per_cpu_s"] = round(res["vllm"]["tokens_per_cpu_s_median"] / res["hf"]["tokens_per_cpu_s_median"], 2)
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/bench_rl")
    p.add_argument("--model", choices=("tiny", "policy"), default="tiny", help="model for the throughput part")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--hf-threads", type=int, default=None)
    p.add_argument("--warmup-steps", type=int, default=60)
    p.add_argument("--steps", type=int, default=4)
    a = p.parse_args()
    from composer_dag.rl.learnable import make_learnable_setup
    from composer_dag.train.model import build_base_model

    t_all = time.perf_counter()
    phases = {}
    os.makedirs(a.out, exist_ok=True)
    t0 = time.perf_counter()
    s = make_learnable_setup(os.path.join(a.out, "setup"), n_tasks=8, words=("red", "blue"),
                             warmup_steps=a.warmup_steps)  # the small test policy (TEST_MODEL)
    phases["setup"] = round(time.perf_counter() - t0, 1)
    res = {"date": time.strftime("%Y-%m-%d"), "host_cpus": os.cpu_count(), "loadavg_start": os.getloadavg(),
           "warmup": s["warmup"]}
    if a.model == "tiny":
        model_dir = os.path.join(a.out, "tiny")
        info = build_base_model("tiny", s["tokenizer_dir"], model_dir, seed=0)
        res["throughput_model"] = {"config": "tiny", "params": info["params"]}
    else:
        model_dir = s["policy_dir"]
        res["throughput_model"] = {"config": "policy (learnable TEST_MODEL, warmed up)"}
    t0 = time.perf_counter()
    res["throughput"] = throughput(model_dir, a.batch, a.prompt_len, a.new_tokens, a.reps, a.hf_threads)
    phases["throughput"] = round(time.perf_counter() - t0, 1)

    cfg = {"policy_dir": s["policy_dir"], "tasks_dir": s["tasks_dir"], "out_dir": os.path.join(a.out, "run"),
           "steps": a.steps, "tasks_per_step": 2, "group_size": 8, "max_turns": 2, "max_new_tokens": 40,
           "max_context": 1024, "max_model_len": 1024, "lr": 1e-3, "micro_batch": 16, "system_style": "compact",
           "engine": "vllm", "workers": 2, "full_every": a.steps + 1, "kv_cache_mb": 256}
    with open(os.path.join(a.out, "run.json"), "w") as f:
        json.dump(cfg, f)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "composer_dag.rl.run", "--config", os.path.join(a.out, "run.json")],
                       capture_output=True, text=True)
    phases["rl_run"] = round(time.perf_counter() - t0, 1)
    with open(os.path.join(a.out, "rl_run.log"), "w") as f:
        f.write(r.stdout + "\n--- stderr ---\n" + r.stderr)
    if r.returncode:
        raise SystemExit(r.stderr[-4000:])
    with open(os.path.join(cfg["out_dir"], "result.json")) as f:
        run = json.load(f)
    res["rl"] = {k: run[k] for k in ("engine", "steps", "reward_curve", "gen_tokens_per_s", "step_seconds", "staleness",
                                      "dropped_stale_rollouts", "weight_sync_seconds", "delta_fraction",
                                      "publish_seconds", "reconstruct_seconds", "weights_verified")}
    res["phase_seconds"] = {**phases, "total": round(time.perf_counter() - t_all, 1)}
    res["loadavg_end"] = os.getloadavg()
    with open(os.path.join(a.out, "result.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
