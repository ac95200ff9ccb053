"""RL benchmark: rollout tokens/s with vLLM vs transformers (same model, same batch, same
max_tokens, measured interleaved in one process tree), then a short vLLM-engine RL run with its
step time broken down, weight-sync seconds and delta size.

    .venv/bin/python benchmarks/bench_rl.py --out /tmp/bench_rl [--batch 32] [--new-tokens 64] [--reps 5] [--steps 4]
        [--model policy|tiny|small] [--no-rl]

Throughput: both engines are started first and stay up; the timed ``generate`` calls then
alternate (hf, vllm, vllm, hf, ...) so that both see the same machine load. The model is the
RL policy (``--model tiny``: a fresh Llama of the ``tiny`` config on the same tokenizer). Two
scenarios, same batch and max_tokens for both engines: ``fixed`` (synthetic prompts, no stop
tokens: every sequence runs to max_tokens unless the model samples its EOS, which ends it in
vLLM only) and ``rollout`` (the tasks' first-turn prompts and
the agent loop's stop tokens, as one rollout turn). The transformers engine runs with as many
torch threads as vLLM's CPU worker is bound to cores (``--hf-threads`` overrides). For each
call the benchmark records wall seconds, generated tokens, the CPU seconds of this process and
its children, and the CPU the rest of the machine used meanwhile (in cores), since the cores
are shared.

RL run: ``python -m composer_dag.rl.run`` with the vLLM engine on the learnable tasks, the
small test policy after a short format warm-up; its per-step metrics are summarised.
The entry point keeps the ``__main__`` guard, which vLLM's engine core needs when it runs in child
processes (``VLLM_ENABLE_V1_MULTIPROCESSING=1``; on CPU ``VLLMEngine`` runs it in this process).
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
            out.append({"name": c.name(), "pid": c.pid, "cpu_affinity": c.cpu_affinity()})
        except psutil.Error:
            pass
    return out


def rollout_prompts(policy_dir: str, tasks_dir: str, batch: int, system_style: str = "compact") -> list[list[int]]:
    """First-turn prompts of the learnable tasks, tokenized as the agent loop does."""
    from composer_dag.harness.episode import Episode
    from composer_dag.harness.composer import COMPOSER
    from composer_dag.rl.step import find_tasks
    from composer_dag.train.tokenizer import load_tokenizer

    tok = load_tokenizer(policy_dir)
    tasks = find_tasks(tasks_dir)
    prompts = []
    for t in tasks:
        with Episode(t) as ep:
            prompts.append(tok(COMPOSER.render_prompt(tok, ep.prompt(), system_style), add_special_tokens=False).input_ids)
    return [prompts[i % len(prompts)] for i in range(batch)]


def later_turn_prompts(policy_dir: str, tasks_dir: str, groups: int, group_size: int, context: int,
                       system_style: str = "compact") -> list[list[int]]:
    """Second-turn prompts as GRPO sees them: ``groups`` tasks, each repeated ``group_size`` times
    (the samples of one group share their prompt), the context being the first turn, a
    ``read_file`` call and its observation (the task's files, cut so the prompt is ``context``
    tokens long)."""
    from composer_dag.harness.episode import Episode
    from composer_dag.harness.composer import COMPOSER
    from composer_dag.rl.step import find_tasks
    from composer_dag.train.tokenizer import load_tokenizer

    tok = load_tokenizer(policy_dir)
    out = []
    for t in find_tasks(tasks_dir)[:groups]:
        with Episode(t) as ep:
            files = sorted(p for p in ep.workspace.rglob("*") if p.is_file() and ".git" not in p.parts)
            text = "\n\n".join(f"# {f.relative_to(ep.workspace)}\n{f.read_text()}" for f in files)
            while len(text) < 40 * context:
                text += "\n" + text
            msgs = [*COMPOSER.prompt_messages(ep.prompt(), system_style),
                    {"role": "assistant", "content": "", "tool_calls": [{"name": "read_file", "arguments": {"path": files[0].name}}]}]
            head = tok.apply_chat_template(msgs, tokenize=False)
            ids = tok(head + "<|im_start|>tool\n<tool_response>\n", add_special_tokens=False).input_ids
            tail = tok("\n</tool_response><|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids
            body = tok(text, add_special_tokens=False).input_ids[: max(0, context - len(ids) - len(tail))]
        out += [ids + body + tail] * group_size
    return out


def throughput(model_dir: str, scenarios: dict, new_tokens: int, reps: int, hf_threads: int | None) -> dict:
    """``scenarios``: name -> (prompts, stop_token_ids). Both engines stay up; every rep runs each
    scenario on both engines, the engine order alternating from rep to rep."""
    import psutil
    import torch

    from composer_dag.inference import HFEngine, Sampling, VLLMEngine

    me = psutil.Process()
    longest = max(len(p) for prompts, _ in scenarios.values() for p in prompts)
    t0 = time.perf_counter()
    vllm = VLLMEngine(model_dir, max_model_len=max(512, longest + new_tokens + 8), kv_cache_bytes=256 << 20)
    vllm_start = time.perf_counter() - t0
    procs = _vllm_procs(me)
    worker_cpus = [len(w["cpu_affinity"]) for w in procs if "Worker" in w["name"]]
    threads = hf_threads or (min(worker_cpus) if worker_cpus else 1)
    torch.set_num_threads(threads)  # as many threads as vLLM's worker is bound to
    t0 = time.perf_counter()
    hf = HFEngine(model_dir)
    hf_start = time.perf_counter() - t0
    engines = {"hf": hf, "vllm": vllm}

    for eng in engines.values():  # untimed: first-call allocations
        for prompts, stops in scenarios.values():
            eng.generate(prompts, Sampling(temperature=1.0, max_tokens=8, stop_token_ids=stops, seed=0))

    runs = []
    try:
        for r in range(reps):
            for name, (prompts, stops) in scenarios.items():
                for kind in (("hf", "vllm") if r % 2 == 0 else ("vllm", "hf")):
                    tree = _tree(me)
                    c0, m0, w0 = _cpu_s(tree), _machine_busy_s(), time.perf_counter()
                    outs = engines[kind].generate(prompts, Sampling(temperature=1.0, max_tokens=new_tokens,
                                                                    stop_token_ids=stops, seed=100 + r))
                    wall = time.perf_counter() - w0
                    own = _cpu_s(tree) - c0
                    other = max(0.0, _machine_busy_s() - m0 - own)
                    toks = sum(len(o.token_ids) for o in outs)
                    runs.append({"scenario": name, "engine": kind, "rep": r, "seconds": round(wall, 3),
                                 "tokens": toks, "tokens_per_s": round(toks / wall, 1), "own_cpu_s": round(own, 2),
                                 "tokens_per_cpu_s": round(toks / own, 1) if own else None,
                                 "other_load_cores": round(other / wall, 2)})
                    print(f"[throughput] rep {r} {name:>7} {kind:>4}: {toks} tokens in {wall:.2f}s = "
                          f"{toks / wall:.0f} tok/s (own cpu {own:.1f}s, other load {other / wall:.2f} cores)",
                          file=sys.stderr, flush=True)
    finally:
        vllm.close()

    def summary(rs):
        return {"tokens_per_s_median": statistics.median(x["tokens_per_s"] for x in rs),
                "tokens_per_s_min_max": [min(x["tokens_per_s"] for x in rs), max(x["tokens_per_s"] for x in rs)],
                "tokens_per_cpu_s_median": statistics.median(x["tokens_per_cpu_s"] or 0.0 for x in rs),
                "tokens_per_call": sorted({x["tokens"] for x in rs}),
                "other_load_cores_mean": round(statistics.mean(x["other_load_cores"] for x in rs), 2)}

    res = {"model_dir": model_dir, "max_tokens": new_tokens, "reps": reps, "hf_torch_threads": threads,
           "vllm_processes": procs, "startup_s": {"vllm": round(vllm_start, 1), "hf": round(hf_start, 1)},
           "scenarios": {}, "runs": runs}
    for name, (prompts, stops) in scenarios.items():
        h = [x for x in runs if x["scenario"] == name and x["engine"] == "hf"]
        v = [x for x in runs if x["scenario"] == name and x["engine"] == "vllm"]
        sh, sv = summary(h), summary(v)
        res["scenarios"][name] = {
            "batch": len(prompts), "prompt_len_mean": round(sum(map(len, prompts)) / len(prompts), 1),
            "stop_token_ids": list(stops), "hf": sh, "vllm": sv,
            "ratio_median": round(sv["tokens_per_s_median"] / sh["tokens_per_s_median"], 2),
            "ratio_per_rep": [round(b["tokens_per_s"] / a["tokens_per_s"], 2) for a, b in zip(h, v)],
            "ratio_per_cpu_s": round(sv["tokens_per_cpu_s_median"] / sh["tokens_per_cpu_s_median"], 2)}
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/bench_rl")
    p.add_argument("--model", choices=("policy", "tiny", "small"), default="policy",
                   help="throughput model: the RL policy, or a fresh Llama of the 'tiny' or 'small' config")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64, help="synthetic prompts of the 'fixed' scenario")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--hf-threads", type=int, default=None)
    p.add_argument("--warmup-steps", type=int, default=60)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--no-rl", action="store_true", help="throughput only")
    p.add_argument("--later-turn", type=int, default=0, metavar="TOKENS",
                   help="add a 'later_turn' scenario: prompts of TOKENS tokens, --group-size samples each")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--scenarios", default="", help="comma-separated subset of scenarios to time")
    a = p.parse_args()
    from composer_dag.rl.learnable import make_learnable_setup
    from composer_dag.train.model import build_base_model
    from composer_dag.train.tokenizer import load_tokenizer

    t_all = time.perf_counter()
    phases = {}
    os.makedirs(a.out, exist_ok=True)
    t0 = time.perf_counter()
    s = make_learnable_setup(os.path.join(a.out, "setup"), n_tasks=8, words=("red", "blue"),
                             warmup_steps=a.warmup_steps)  # the small test policy (TEST_MODEL)
    phases["setup"] = round(time.perf_counter() - t0, 1)
    res = {"date": time.strftime("%Y-%m-%d"), "host_cpus": os.cpu_count(),
           "loadavg_start": [round(x, 2) for x in os.getloadavg()], "warmup": s["warmup"]}
    if a.model in ("tiny", "small"):
        model_dir = os.path.join(a.out, a.model)
        info = build_base_model(a.model, s["tokenizer_dir"], model_dir, seed=0)
        res["throughput_model"] = {"config": f"{a.model} (fresh)", "params": info["params"]}
    else:
        from composer_dag.train.model import load_base_model, param_count

        model_dir = s["policy_dir"]
        res["throughput_model"] = {"config": "RL policy (learnable TEST_MODEL after the format warm-up)",
                                   "params": param_count(load_base_model(model_dir, "float32"))}
    tok = load_tokenizer(s["policy_dir"])
    scenarios = {
        # every sequence runs to max_tokens (no stop tokens; only the model's EOS ends one early in vLLM)
        "fixed": ([[(13 * i + 7 * j) % 500 + 10 for j in range(a.prompt_len)] for i in range(a.batch)], ()),
        # what a rollout turn is: the tasks' first-turn prompts, the agent loop's stop tokens
        "rollout": (rollout_prompts(s["policy_dir"], s["tasks_dir"], a.batch),
                    (tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id)),
    }
    if a.later_turn:  # a later turn of a GRPO group: long shared context, group_size samples each
        scenarios["later_turn"] = (
            later_turn_prompts(s["policy_dir"], s["tasks_dir"], groups=max(1, a.batch // a.group_size),
                               group_size=a.group_size, context=a.later_turn),
            (tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id))
    if a.scenarios:
        scenarios = {k: v for k, v in scenarios.items() if k in a.scenarios.split(",")}
    t0 = time.perf_counter()
    res["throughput"] = throughput(model_dir, scenarios, a.new_tokens, a.reps, a.hf_threads)
    phases["throughput"] = round(time.perf_counter() - t0, 1)

    if a.no_rl:
        res["phase_seconds"] = {**phases, "total": round(time.perf_counter() - t_all, 1)}
        res["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        with open(os.path.join(a.out, "result.json"), "w") as f:
            json.dump(res, f, indent=1)
        print(json.dumps(res, indent=1))
        return
    cfg = {"policy_dir": s["policy_dir"], "tasks_dir": s["tasks_dir"], "out_dir": os.path.join(a.out, "run"),
           "steps": a.steps, "tasks_per_step": 2, "group_size": 8, "full_every": a.steps + 1,
           "trainer": {"lr": 1e-3, "micro_batch": 16},
           "orchestrator": {"max_turns": 2, "max_new_tokens": 40, "max_context": 1024, "system_style": "compact",
                            "workers": 2},
           "inference": {"engine": "vllm", "max_model_len": 1024, "kv_cache_mb": 256}}
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
    with open(os.path.join(cfg["out_dir"], "metrics.jsonl")) as f:
        hist = [json.loads(line) for line in f]
    # a delta is only informative after a real update: a batch whose groups all got the same
    # reward has zero advantages, no gradient, and publishes (almost) unchanged weights
    res["rl"]["per_step"] = [{k: (round(h[k], 4) if isinstance(h[k], float) else h[k]) for k in (
        "step", "reward_mean", "grad_norm", "generated_tokens", "generate_s", "grade_s", "rollout_wall_s", "train_s",
        "sync_s", "wait_s", "save_weights_s", "publish_s", "publish_kind", "publish_fraction", "step_s")} for h in hist]
    real = [h["publish_fraction"] for h in hist if h["publish_kind"] == "delta" and h["grad_norm"] > 0]
    res["rl"]["delta_fraction_after_update"] = {"mean": statistics.mean(real), "n": len(real)} if real else None
    res["phase_seconds"] = {**phases, "total": round(time.perf_counter() - t_all, 1)}
    res["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    with open(os.path.join(a.out, "result.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
