"""The gateway in front of the session's two vLLM rollout servers: sixteen sessions at once,
streaming and not, each call routed to the less busy server and recorded as it sampled it."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from tests.gateway.test_gateway import BASH


def test_sixteen_sessions_through_the_gateway_are_recorded_as_the_servers_sampled(servers, learnable_base):
    import openai

    from composer_dag.gateway.core import Gateway
    from composer_dag.gateway.server import GatewayServer
    from composer_dag.gateway.upstream import Servers
    from composer_dag.inference.server import ServerClient
    from composer_dag.train.tokenizer import load_tokenizer

    tok = load_tokenizer(learnable_base["policy_dir"])
    gw = Gateway(Servers(servers.urls), tok, "policy", max_model_len=1024, default_max_tokens=16)

    def session(i: int) -> str:
        key = gw.issue(f"s{i}")
        c = openai.OpenAI(base_url=server.url, api_key=key, max_retries=0, timeout=120)
        msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": f"task {i}"}]
        for turn in range(2):
            kw = dict(model="policy", messages=msgs, tools=BASH, temperature=1.0, seed=100 * i + turn, max_tokens=12)
            if i % 2:
                chunks = list(c.chat.completions.create(stream=True, **kw))
                content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
                calls = [t.model_dump() for ch in chunks if ch.choices for t in ch.choices[0].delta.tool_calls or []]
                msgs.append({"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})})
            else:
                msgs.append(c.chat.completions.create(**kw).choices[0].message.model_dump(exclude_none=True))
            msgs.append({"role": "user", "content": f"go on {turn}"})
        return key

    with GatewayServer(gw) as server, ThreadPoolExecutor(16) as pool:
        keys = list(pool.map(session, range(16)))
    recs = [gw.records(k) for k in keys]
    assert all(len(r["records"]) == 2 and r["extension"]["rate"] == 1.0 and len(r["segments"]) == 1 for r in recs), \
        [r["extension"] for r in recs if r["extension"]["rate"] != 1.0][:2]
    calls = [x for r in recs for x in r["records"]]
    assert {x["server"] for x in calls} == set(servers.urls)  # both servers took calls
    assert all(x["completion_ids"] and len(x["logprobs"]) == len(x["completion_ids"]) and x["error"] is None for x in calls)
    # what was recorded is what the server sampled: its own prompt logprobs of the recorded
    # sequence agree with the recorded sampling logprobs (temperature 1) within the fleet's probe tolerance
    for x in calls[:6]:
        again = ServerClient(x["server"]).score(x["prompt_ids"] + x["completion_ids"])[len(x["prompt_ids"]) - 1:]
        assert max(abs(a - b) for a, b in zip(again, x["logprobs"])) < 1e-3, json.dumps([again[:3], x["logprobs"][:3]])


def test_the_fleet_plays_an_external_harness_on_the_server_it_picks(servers, learnable_base, tmp_path):
    """``ExternalLoop.run(engine=...)`` as the fleet's orchestrator calls it: each episode's key
    is bound to the server picked for it, so the harness's calls are sampled there (with that
    server's logprobs); a server that is down ends the episode with ``ServerDown``, which the
    orchestrator answers by playing it again elsewhere."""
    import pytest

    from composer_dag.agent import AgentConfig, ExternalLoop, agent_loop
    from composer_dag.harness.external import install, load_spec
    from composer_dag.inference.server import ServerClient, ServerDown, ServerEngine
    from composer_dag.train.tokenizer import load_tokenizer
    from tests.conftest import _free_port
    from tests.harness.test_external import AGENT, _spec, task

    path = _spec(tmp_path, "tiny-agent", ["{python}", "agent.py", "{base_url}", "{api_key}", "{docker}"],
                 {"agent.py": AGENT, "task.txt": "{task}"})
    install(load_spec(path))
    tok = load_tokenizer(learnable_base["policy_dir"])
    loop = agent_loop(None, tok, AgentConfig(harness=str(path), max_context=1024, max_new_tokens=16, workers=2))
    assert isinstance(loop, ExternalLoop)
    try:
        eng = ServerEngine(ServerClient(servers.urls[0]))
        t = str(task(learnable_base, 0))
        rows = loop.run([(t, "g", 0), (t, "g", 1)], version=0, engine=eng)
        assert all(r["harness"] == "tiny-agent" and r["infra_error"] is None and r["segments"] for r in rows), rows
        assert eng.completions == sum(r["num_turns"] for r in rows) > 0
        lp = [x for r in rows for s in r["segments"] for x, m in zip(s["logprobs"], s["mask"]) if m]
        assert lp and all(x <= 0.0 for x in lp) and any(x < 0.0 for x in lp)  # the server's sampling logprobs
        with pytest.raises(ServerDown):
            loop.run([(t, "g", 2)], version=0, engine=ServerEngine(ServerClient(f"http://127.0.0.1:{_free_port()}", timeout=5)))
    finally:
        loop.close()
