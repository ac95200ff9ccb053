"""The gateway as a harness meets it: the published OpenAI SDK against its endpoint, each call
recorded token-exact, prompts that extend the previous call when the harness keeps its history,
and the refusals a harness can run into. In front of an in-process engine here (a real tiny
model), in front of the session's vLLM rollout servers in ``test_gateway_servers``."""

from __future__ import annotations

import json

import pytest

BASH = [{"type": "function", "function": {"name": "bash", "description": "Run a command.", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


@pytest.fixture(scope="module")
def policy(learnable_base):
    return learnable_base["policy_dir"]


@pytest.fixture(scope="module")
def tok(policy):
    from composer_dag.train.tokenizer import load_tokenizer

    return load_tokenizer(policy)


@pytest.fixture(scope="module")
def gateway(policy, tok):
    from composer_dag.gateway.core import Gateway
    from composer_dag.gateway.server import GatewayServer
    from composer_dag.gateway.upstream import InProcess
    from composer_dag.inference.engine import HFEngine

    gw = Gateway(InProcess(HFEngine(policy), version="7"), tok, "policy", max_model_len=1024,
                 default_max_tokens=24, max_calls=6)
    with GatewayServer(gw) as server:
        yield server


def client(server, key):
    import openai

    return openai.OpenAI(base_url=server.url, api_key=key, max_retries=0, timeout=60)


def scored(policy, ids: list[int]) -> list[float]:
    """log p(x_t | x_<t) of ``ids`` under the policy at temperature 1 (transformers)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [lp[t - 1, ids[t]].item() for t in range(1, len(ids))]


def test_chat_calls_are_recorded_token_exact(gateway, policy, tok):
    gw = gateway.gateway
    key = gw.issue("e1")
    c = client(gateway, key)
    tools = BASH
    msgs = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "List the files."}]
    r = c.chat.completions.create(model="policy", messages=msgs, tools=tools, temperature=1.0, seed=3)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls") and r.usage.prompt_tokens > 0
    chunks = list(c.chat.completions.create(model="policy", messages=msgs, tools=tools, stream=True, seed=4,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens >= 1 and chunks[-2].choices[0].finish_reason is not None
    rec = gw.records(key)
    first, second = rec["records"]
    # the prompt the server saw is the chat template's rendering of the request, tools included
    want = tok(tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False).input_ids
    assert first["prompt_ids"] == want and second["prompt_ids"] == want
    assert "# Tools" in tok.decode(want) and '"bash"' in tok.decode(want)
    for x, out in ((first, r.usage.completion_tokens), (second, chunks[-1].usage.completion_tokens)):
        assert len(x["completion_ids"]) == out == len(x["logprobs"]) and x["policy_version"] == "7"
        again = scored(policy, x["prompt_ids"] + x["completion_ids"])[len(x["prompt_ids"]) - 1:]
        assert max(abs(a - b) for a, b in zip(again, x["logprobs"])) < 1e-3, (again[:4], x["logprobs"][:4])
    text = tok.decode(first["completion_ids"], skip_special_tokens=False).removesuffix("<|im_end|>")
    assert (r.choices[0].message.content or "") in text  # the reply is the sampled text less its calls
    assert len(rec["segments"]) == 2 and rec["extension"]["extended"] == 0  # two forks of one prompt


def _resent(reply, style: int) -> dict:
    """The reply as a harness might send it back: the SDK's own dump with ids and nulls, the keys
    in another order, the arguments re-serialized, special tokens stripped from the content."""
    d = reply.model_dump(exclude_none=style == 0)
    if style == 1:
        d = dict(reversed(list(d.items())))
        for c in d.get("tool_calls") or []:
            c["function"]["arguments"] = json.dumps(json.loads(c["function"]["arguments"]), indent=1)
    if style == 2 and d.get("content"):
        d["content"] = d["content"].replace("<|im_end|>", "").replace("<|endoftext|>", "") + "\n"
    return d


def test_prompts_extend_while_the_harness_keeps_its_history(gateway):
    from composer_dag.gateway.records import CallRecord, segments

    gw = gateway.gateway
    key = gw.issue("e2")
    c = client(gateway, key)
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "Fix the bug."}]
    for turn in range(4):
        r = c.chat.completions.create(model="policy", messages=msgs, tools=BASH, seed=turn,
                                      max_tokens=16)
        m = r.choices[0].message
        msgs.append(_resent(m, turn % 3))
        for call in m.tool_calls or [None]:
            msgs.append({"role": "tool", "tool_call_id": call.id if call else "none", "content": f"out {turn}\n\n"})
        if not m.tool_calls:
            msgs[-1] = {"role": "user", "content": f"observation {turn}"}
    rec = gw.records(key)
    assert rec["extension"] == {"pairs": 3, "extended": 3, "rate": 1.0, "misses": []}, rec["extension"]
    (seg,) = rec["segments"]
    last = rec["records"][-1]
    assert seg["ids"] == last["prompt_ids"] + last["completion_ids"]
    assert sum(seg["mask"]) == sum(len(x["completion_ids"]) for x in rec["records"])
    assert [i for i, m in enumerate(seg["mask"]) if m] == [
        i for x in rec["records"] for i in range(len(seg["ids"]))
        if x["prompt_ids"] == seg["ids"][:len(x["prompt_ids"])] and len(x["prompt_ids"]) <= i < len(x["prompt_ids"]) + len(x["completion_ids"])]
    # a harness that drops its turns: the next call starts a segment of its own, and says why
    c.chat.completions.create(model="policy", messages=[msgs[0], msgs[-1]], tools=BASH, seed=9, max_tokens=8)
    rec = gw.records(key)
    assert len(rec["segments"]) == 2 and rec["extension"]["extended"] == 3
    (miss,) = rec["extension"]["misses"]
    assert miss["call"] == 4 and miss["why"] == "the request has 2 messages; call 3 was given 8, then replied", miss
    assert len(segments([CallRecord.from_dict(x) for x in rec["records"]])) == 2


def test_what_a_harness_can_run_into(gateway, tok):
    import openai

    gw = gateway.gateway
    with pytest.raises(openai.AuthenticationError):
        client(gateway, "ep-not-a-key").chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
    key = gw.issue("e3", max_calls=2)
    c = client(gateway, key)
    with pytest.raises(openai.BadRequestError) as e:  # a prompt over the servers' context
        c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "word " * 1100}])
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="policy", messages=[{"role": 3}])
    r = c.completions.create(model="policy", prompt="def f():", max_tokens=4, seed=1)
    assert r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.RateLimitError):  # the episode's call limit
        c.completions.create(model="policy", prompt="x", max_tokens=2)
    rec = gw.records(key)
    assert rec["refused"] == {"context_length_exceeded": 1, "call limit": 1}, rec["refused"]
    assert [x["error"] is None for x in rec["records"]] == [False, True]
    gw.revoke(key)
    with pytest.raises(openai.AuthenticationError):
        c.completions.create(model="policy", prompt="x", max_tokens=2)
    # the admin API is on its own port and wants its own token
    import urllib.request, urllib.error
    req = urllib.request.Request(gateway.admin_url + "/admin/records/" + key, headers={"Authorization": f"Bearer {key}"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 401
    req = urllib.request.Request(gateway.admin_url + "/admin/records/" + key,
                                 headers={"Authorization": f"Bearer {gateway.admin_token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert len(json.loads(r.read())["records"]) == 2


def test_a_sampled_tool_call_sent_back_in_another_form_renders_as_sampled(tok):
    """The reply's call re-serialized by the harness (an id, its arguments re-indented, content
    null) still continues the sampled tokens; the template alone would render it otherwise."""
    from composer_dag.gateway.chat import Renderer, Turn, normal, parse_reply

    ren = Renderer(tok)
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "go"}]
    prompt, extends, _ = ren.render(msgs, BASH, [])
    assert extends is None
    sampled = ren.encode('Looking.\n<tool_call>\n{"name": "bash",  "arguments": {"command": "ls  -la"}}\n</tool_call>')
    sampled += [tok.convert_tokens_to_ids("<|im_end|>")]
    content, calls = parse_reply(tok.decode(sampled[:-1], skip_special_tokens=False), True)
    assert content == "Looking." and calls[0]["function"] == {"name": "bash", "arguments": '{"command": "ls  -la"}'}
    reply = {"role": "assistant", "content": content, "tool_calls": calls}
    turn = Turn([normal(m) for m in msgs], normal(reply), json.dumps(BASH, sort_keys=True), prompt + sampled, True, 0)
    back = {"tool_calls": [{"type": "function", "id": "x1", "function": {
        "arguments": json.dumps({"command": "ls  -la"}, indent=2), "name": "bash"}}], "content": "Looking.\n", "role": "assistant"}
    nxt = msgs + [back, {"role": "tool", "tool_call_id": "x1", "content": "a.py"}]
    ids, extends, miss = ren.render(nxt, BASH, [turn])
    assert extends == 0 and miss is None and ids[:len(prompt + sampled)] == prompt + sampled
    assert tok.decode(ids[len(prompt + sampled):]) == "\n<|im_start|>tool\n<tool_response>\na.py\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    plain = ren.encode(ren.template(nxt, BASH, True))
    assert plain[:len(prompt + sampled)] != prompt + sampled  # what re-rendering would have sent
    # another call's arguments, or other tools: no continuation
    other = [*msgs, {**back, "tool_calls": [{"function": {"name": "bash", "arguments": '{"command": "ls"}'}}]}, nxt[-1]]
    assert ren.render(other, BASH, [turn])[1:] == (None, "message 2 (assistant) is not call 0's reply")
    assert ren.render(nxt, None, [turn])[1:] == (None, "the tools differ from call 0's")


def test_a_product_session_closed_at_the_admin_api_is_taken_in_as_composer_session_2(policy, tok, tmp_path):
    """Production through the gateway: a session's key issued and closed at the admin API; the
    closed session is a ``composer-session/2`` line under the hour it ended in, which the
    production traces' intake takes in with every call's exact ids."""
    import urllib.error
    import urllib.request

    import openai

    from composer_dag.gateway.core import Gateway
    from composer_dag.gateway.server import GatewayServer
    from composer_dag.gateway.upstream import InProcess
    from composer_dag.inference.engine import HFEngine
    from composer_dag.traces.intake import intake, partition_key

    gw = Gateway(InProcess(HFEngine(policy), version="7"), tok, "policy", max_model_len=1024, default_max_tokens=12,
                 sessions_dir=str(tmp_path / "incoming"))
    with GatewayServer(gw) as server:
        def admin(path, body):
            req = urllib.request.Request(server.admin_url + path, json.dumps(body).encode(), method="POST", headers={
                "Authorization": f"Bearer {server.admin_token}", "Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        _, issued = admin("/admin/keys", {"episode": "sess-1"})
        client = openai.OpenAI(base_url=server.url, api_key=issued["key"], max_retries=0)
        msgs = [{"role": "system", "content": "You help."}, {"role": "user", "content": "list the files"}]
        for turn in range(2):
            msgs.append(client.chat.completions.create(model="policy", messages=msgs, tools=BASH, seed=turn)
                        .choices[0].message.model_dump(exclude_none=True))
            msgs.append({"role": "user", "content": "and then?"})
        assert admin(f"/admin/keys/{issued['key']}/session", {"user_id": "u1"})[0] == 400  # what a session needs
        meta = {"user_id": "u1", "training_consent": True, "model": {"version": "v7", "digest": "d7"},
                "tokenizer_digest": "t", "harness": {"name": "product", "version": "1.0"}, "outcome": {"rating": 1}}
        status, rec = admin(f"/admin/keys/{issued['key']}/session", meta)
        assert status == 200 and rec["format"] == "composer-session/2" and len(rec["calls"]) == 2, rec
        with pytest.raises(openai.AuthenticationError):  # the session's key is closed
            client.chat.completions.create(model="policy", messages=msgs)
    [f] = list((tmp_path / "incoming").rglob("*.jsonl"))
    rows, summary = intake([(f.name, f.read_bytes())], partition_key(f.parent.name), known_models={"v7": "d7"})
    assert summary["kept"] == 1 and summary["records_in"] == 1, summary
    kept = json.loads(rows[0]["record"])
    assert kept["format"] == "composer-session/2" and kept["calls"] == rec["calls"] and kept["harness"]["name"] == "product"
    assert [c["completion_ids"] for c in kept["calls"]][-1][-1] == tok.convert_tokens_to_ids("<|im_end|>") or \
        kept["calls"][-1]["finish_reason"] == "length"
