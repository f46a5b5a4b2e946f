"""Load: 256 concurrent streaming clients (the official AsyncOpenAI client) against the real default model
on CPU, with random prompt and output lengths, both routes, greedy and seeded sampling, and a share of
clients that disconnect after their first token.

Afterwards: every client that stayed got a complete, well-formed stream (one finish per choice, usage
that adds up, exactly max_tokens tokens when EOS is ignored); every KV block is free and unreferenced;
the engine holds no request; and /metrics agrees with the clients' own counts (finished and aborted
requests, prompt and generated tokens, histogram counts). Bounded: 256 requests, at most 8 tokens each
for the clients that stay, and an overall deadline.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

NUM_CLIENTS = 256
DISCONNECT_SHARE = 0.15
DEADLINE_S = 420
WORDS = (
    "the a cat dog house river mountain blue quickly slowly runs jumps over under bright dark green "
    "small large ancient modern story poem number seven eleven"
).split()


def _plan(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    plans = []
    for i in range(NUM_CLIENTS):
        leaves = rng.random() < DISCONNECT_SHARE
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 20)))
        plans.append(
            {
                "id": i,
                "chat": rng.random() < 0.5,
                "prompt": prompt,
                "disconnect": leaves,
                # a client that leaves asks for many tokens, so the server cannot finish before it goes
                "max_tokens": 64 if leaves else rng.randint(1, 8),
                "ignore_eos": leaves or rng.random() < 0.7,
                "temperature": rng.choice([0.0, 0.8]),
                "seed": rng.randint(0, 1000),
            }
        )
    return plans


async def _client(aclient: openai.AsyncOpenAI, model: str, plan: dict) -> dict:
    kwargs = dict(
        model=model,
        max_tokens=plan["max_tokens"],
        temperature=plan["temperature"],
        seed=plan["seed"],
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": plan["ignore_eos"]},
    )
    if plan["chat"]:
        stream = await aclient.chat.completions.create(messages=[{"role": "user", "content": plan["prompt"]}], **kwargs)
    else:
        stream = await aclient.completions.create(prompt=plan["prompt"], **kwargs)
    result = {"plan": plan, "text": "", "finish": [], "usage": None, "chunks": 0, "left": False, "ids": set()}
    async for chunk in stream:
        result["chunks"] += 1
        result["ids"].add(chunk.id)
        if not chunk.choices:
            assert result["usage"] is None, "two usage chunks"
            result["usage"] = chunk.usage
            continue
        for choice in chunk.choices:
            assert choice.index == 0
            piece = (choice.delta.content or "") if plan["chat"] else choice.text
            result["text"] += piece
            if choice.finish_reason:
                result["finish"].append(choice.finish_reason)
        if plan["disconnect"] and (result["text"] or result["finish"]):
            await stream.close()  # drop the connection mid-stream
            result["left"] = True
            break
    return result


@pytest.mark.slow
def test_256_concurrent_streaming_clients(live_server, read_metrics):
    model = live_server.client().models.list().data[0].id
    before = read_metrics(live_server.url)
    plans = _plan()

    async def run_all():
        aclient = openai.AsyncOpenAI(
            base_url=live_server.url + "/v1", api_key=live_server.api_key, max_retries=0, timeout=DEADLINE_S
        )
        try:
            return await asyncio.wait_for(asyncio.gather(*(_client(aclient, model, p) for p in plans)), DEADLINE_S)
        finally:
            await aclient.close()

    start = time.monotonic()
    results = asyncio.run(run_all())
    elapsed = time.monotonic() - start
    stats = live_server.wait_idle(60)

    stayed = [r for r in results if not r["left"]]
    left = [r for r in results if r["left"]]
    assert len(stayed) + len(left) == NUM_CLIENTS
    assert len(left) == sum(p["disconnect"] for p in plans) > 0
    tokenizer = live_server.engine.tokenizer
    for r in stayed:
        plan, usage = r["plan"], r["usage"]
        assert len(r["ids"]) == 1, "one id per response"
        assert r["finish"] in (["stop"], ["length"]), r
        assert usage is not None and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert 1 <= usage.completion_tokens <= plan["max_tokens"]
        if plan["ignore_eos"]:
            assert r["finish"] == ["length"] and usage.completion_tokens == plan["max_tokens"]
        if not plan["chat"]:
            assert usage.prompt_tokens == len(tokenizer.encode(plan["prompt"]))

    # the engine is empty and every block is back in the pool, unreferenced
    engine = live_server.engine
    assert stats["kv_cache_blocks_free"] == stats["kv_cache_blocks_total"] > 0
    assert not engine.requests and not engine.has_unfinished_requests()
    assert all(block.ref_count == 0 for block in engine.block_manager.blocks)

    after = read_metrics(live_server.url)

    def delta(name, *labels):
        key = (name, tuple(sorted(labels)))
        return after.get(key, 0) - before.get(key, 0)

    finished = delta("kernel_lab_request_success_total", ("finished_reason", "stop")) + delta(
        "kernel_lab_request_success_total", ("finished_reason", "length")
    )
    assert finished == len(stayed)
    assert delta("kernel_lab_request_success_total", ("finished_reason", "abort")) == len(left)
    assert delta("kernel_lab_request_generation_tokens_total") == sum(r["usage"].completion_tokens for r in stayed)
    assert delta("kernel_lab_request_prompt_tokens_total") == sum(r["usage"].prompt_tokens for r in stayed)
    assert delta("kernel_lab_e2e_request_latency_seconds_count") == len(stayed)
    assert delta("kernel_lab_time_to_first_token_seconds_count") == NUM_CLIENTS
    assert delta("kernel_lab_generation_tokens_total") >= sum(r["usage"].completion_tokens for r in stayed) + len(left)
    assert after[("kernel_lab_num_requests_running", ())] == 0
    assert after[("kernel_lab_kv_cache_usage_perc", ())] == 0.0
    print(
        f"\n{NUM_CLIENTS} clients ({len(left)} left early) in {elapsed:.1f} s; "
        f"{sum(r['usage'].completion_tokens for r in stayed)} tokens to the clients that stayed"
    )
