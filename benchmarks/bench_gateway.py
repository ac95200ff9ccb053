"""The gateway's cost: added latency per call and throughput of concurrent sessions, through the
gateway against calling the vLLM server directly, side by side on one server started here.

    .venv/bin/python benchmarks/bench_gateway.py --out /tmp/bench_gateway [--calls 200] [--sessions 16]
        [--turns 4] [--max-tokens 32] [--model DIR]

``latency``: ``--calls`` chat requests (one bash tool, temperature 0, ``max_tokens`` 1), sent in
alternation direct and through the gateway (ABAB, so drift hits both alike); reported: p50 and p99
of each and of the per-pair difference. ``throughput``: ``--sessions`` concurrent sessions of
``--turns`` calls each (the history kept, ``--max-tokens`` per call, temperature 1), direct, then
through the gateway, then direct again; completion tokens per second of each, the gateway over the
mean of the two direct runs. ``exactness``: for every gateway call of the throughput run, its
recorded completion ids and logprobs against the server's own prompt logprobs of the recorded
sequence (max abs difference), and the extension rate. The model: ``--model`` or the learnable
family's tiny policy, built here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BASH = [{"type": "function", "function": {"name": "bash", "description": "Run a command.", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/bench_gateway")
    ap.add_argument("--model", default=None)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    import openai

    from composer_dag.gateway.core import Gateway
    from composer_dag.gateway.server import GatewayServer
    from composer_dag.gateway.upstream import Servers
    from composer_dag.inference.server import ServerClient, ServerProcess
    from composer_dag.rl.learnable import make_learnable_setup
    from composer_dag.train.tokenizer import load_tokenizer

    model = a.model or make_learnable_setup(tempfile.mkdtemp(dir=a.out), n_tasks=2, warmup_steps=0)["policy_dir"]
    srv = ServerProcess(model, 18731, log_path=os.path.join(a.out, "server.log"), max_model_len=1024, kv_cache_mb=64)
    srv.start().wait_ready(600)
    try:
        tok = load_tokenizer(model)
        gw = Gateway(Servers([srv.url]), tok, "policy", max_model_len=1024)
        with GatewayServer(gw) as server:
            direct = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)

            def via_gateway():
                return openai.OpenAI(base_url=server.url, api_key=gw.issue(), max_retries=0, timeout=120)

            name = {direct: model}
            msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "List the files."}]

            def one(client, model_name):
                t0 = time.perf_counter()
                client.chat.completions.create(model=model_name, messages=msgs, tools=BASH, temperature=0.0, max_tokens=1)
                return time.perf_counter() - t0

            g = via_gateway()
            for _ in range(10):  # warm both paths
                one(direct, model), one(g, "policy")
            d_lat, g_lat = [], []
            for i in range(a.calls):
                g = via_gateway() if i % 50 == 0 else g  # a fresh key now and then (an episode's call limit)
                d_lat.append(one(direct, model))
                g_lat.append(one(g, "policy"))
            diff = [y - x for x, y in zip(d_lat, g_lat)]
            latency = {"calls": a.calls, "direct_p50_ms": pct(d_lat, .5) * 1e3, "direct_p99_ms": pct(d_lat, .99) * 1e3,
                       "gateway_p50_ms": pct(g_lat, .5) * 1e3, "gateway_p99_ms": pct(g_lat, .99) * 1e3,
                       "added_p50_ms": (pct(g_lat, .5) - pct(d_lat, .5)) * 1e3,
                       "added_p99_ms": (pct(g_lat, .99) - pct(d_lat, .99)) * 1e3,
                       "pair_diff_p50_ms": pct(diff, .5) * 1e3}

            def session(args):
                client, model_name, i = args
                h = list(msgs)
                toks = 0
                for t in range(a.turns):
                    r = client.chat.completions.create(model=model_name, messages=h, tools=BASH, temperature=1.0,
                                                       max_tokens=a.max_tokens, seed=1000 * i + t)
                    toks += r.usage.completion_tokens
                    h = h + [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"next {t}"}]
                return toks

            def run(gateway: bool) -> float:
                jobs = [(via_gateway(), "policy", i) if gateway else (direct, model, i) for i in range(a.sessions)]
                t0 = time.perf_counter()
                with ThreadPoolExecutor(a.sessions) as pool:
                    toks = sum(pool.map(session, jobs))
                return toks / (time.perf_counter() - t0)

            before = len(gw.keys)
            d1, gt, d2 = run(False), run(True), run(False)
            keys = list(gw.keys)[before:]
            recs = [gw.records(k) for k in keys]
            calls = [x for r in recs for x in r["records"]]
            client = ServerClient(srv.url)
            worst = max(max(abs(p - q) for p, q in zip(client.score(x["prompt_ids"] + x["completion_ids"])[len(x["prompt_ids"]) - 1:],
                                                       x["logprobs"])) for x in calls)
            pairs = sum(r["extension"]["pairs"] for r in recs)
            ext = sum(r["extension"]["extended"] for r in recs)
            result = {"latency": latency,
                      "throughput": {"sessions": a.sessions, "turns": a.turns, "direct_tok_s": [d1, d2], "gateway_tok_s": gt,
                                     "ratio": gt / statistics.mean([d1, d2])},
                      "exactness": {"calls": len(calls), "max_abs_logprob_diff": worst,
                                    "extension_rate": ext / pairs if pairs else None, "pairs": pairs}}
    finally:
        srv.stop()
    print(json.dumps(result, indent=1))
    with open(os.path.join(a.out, "result.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
