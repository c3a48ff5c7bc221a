"""The HTTP API as users reach it: the official `openai` client against a real `afd serve`."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from afd_engine import Engine, SamplingParams
from tests.server.conftest import Server

MODEL = "tiny"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_v3):
    with Engine(model_path=tiny_v3, num_threads=1) as eng:
        yield eng


def chat_ids(offline, text: str) -> list[int]:
    return list(
        offline.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
    )


def test_chat_matches_the_offline_engine_and_counts_usage(client, offline):
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=12, temperature=0
    )
    ids = chat_ids(offline, "Hello there")
    ref = offline.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_new_tokens=12, temperature=0))[0]
    assert resp.choices[0].message.content == ref.text
    assert resp.choices[0].finish_reason == ("length" if ref.finish_reason == "length" else "stop")
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(ids), len(ref.token_ids))
    assert resp.usage.total_tokens == len(ids) + len(ref.token_ids)


def test_chat_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Stream me"}], max_tokens=10, temperature=0)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[0].choices[0].delta.role == "assistant"


def test_greedy_over_http_equals_offline_token_ids(server, offline):
    prompt = [11, 22, 33, 44, 55]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
    out = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    ref = offline.generate(
        prompt_token_ids=[prompt], sampling_params=SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    )[0]
    assert out["output_ids"] == ref.token_ids
    assert out["meta_info"] == {
        "finish_reason": "length",
        "prompt_tokens": 5,
        "completion_tokens": 16,
        "cached_tokens": 0,  # less than a page: nothing to reuse
    }


def test_completions_with_text_and_token_prompts(client, offline):
    greedy = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    by_text = client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert by_text.choices[0].text == offline.generate(prompts=["Once upon"], sampling_params=greedy)[0].text
    by_ids = client.completions.create(
        model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    refs = offline.generate(prompt_token_ids=[[5, 6, 7], [8, 9]], sampling_params=greedy)
    assert [c.text for c in by_ids.choices] == [r.text for r in refs]
    assert by_ids.usage.prompt_tokens == 5 and by_ids.usage.completion_tokens == 16


def test_n_choices_and_seed_reproducibility(client):
    kwargs = dict(model=MODEL, prompt="Seeded", max_tokens=10, temperature=1.0, extra_body={"ignore_eos": True})
    a = client.completions.create(n=2, seed=3, **kwargs)
    b = client.completions.create(n=2, seed=3, **kwargs)
    c = client.completions.create(n=2, seed=4, **kwargs)
    assert [x.index for x in a.choices] == [0, 1]
    assert [x.text for x in a.choices] == [x.text for x in b.choices]
    assert [x.text for x in a.choices] != [x.text for x in c.choices]
    assert a.choices[0].text != a.choices[1].text  # each choice samples with its own stream
    assert a.usage.completion_tokens == 20


def test_stop_string(client):
    kwargs = dict(model=MODEL, prompt="Stop test", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    base = client.completions.create(**kwargs).choices[0].text
    stop = base[5:8]
    out = client.completions.create(stop=[stop, "never-appears"], **kwargs).choices[0]
    assert out.finish_reason == "stop"
    assert out.text == base[: base.index(stop)]


def test_logprobs(client):
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    assert all(abs(t.logprob - t.top_logprobs[0].logprob) < 1e-6 for t in content)  # greedy picks the top


def test_models_list(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_64_concurrent_streams_all_finish(server):
    async def one(aclient, i):
        stream = await aclient.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"request {i}"}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [c async for c in stream]
        return chunks[-1].usage.completion_tokens, [c.choices[0].finish_reason for c in chunks if c.choices][-1]

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(64)))

    assert asyncio.run(run()) == [(8, "length")] * 64


@pytest.mark.parametrize(
    "body, status, param",
    [
        ('{"model": "tiny", "messages": [', 400, None),
        ({"model": "tiny", "messages": "hello"}, 400, "messages"),
        ({"model": "tiny", "messages": []}, 400, "messages"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}, 400, "max_tokens"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": -3}, 400, "max_tokens"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9}, 400, "max_tokens"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
        ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, param):
    kwargs = (
        {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else {"json": body}
    )
    resp = httpx.post(server.url + "/v1/chat/completions", timeout=30, **kwargs)
    assert resp.status_code == status
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    assert httpx.get(server.url + "/health").status_code == 200


def test_prompt_longer_than_the_context(server):
    resp = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": [7] * 600, "max_tokens": 4})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded"


def aborted_count(server, endpoint: str) -> float:
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for sample in family.samples:
            if sample.name == "afd_requests_total" and sample.labels == {"endpoint": endpoint, "status": "aborted"}:
                return sample.value
    return 0.0


@pytest.fixture
def few_running(tiny_v3):
    """A server that runs 8 requests at a time: run to their end, 50 streams of 400 tokens take
    ~2,500 steps, far longer than any abort takes to arrive, even on a loaded machine."""
    srv = Server(tiny_v3, "--max-running-requests", "8")
    yield srv
    srv.stop()


def test_aborted_streams_free_their_kv_pages(few_running):
    """50 streams of 400 tokens each, closed after 3 events: aborted, their pages are freed and
    each abort is counted. That the engine stopped them early, not at their end, is read from the
    prefix cache, which every ended request's full pages join: a few pages each, not ~25."""
    server = few_running
    before = aborted_count(server, "chat")
    cache_before = server.metric("afd_prefix_cache_pages") + server.metric("afd_prefix_cache_evicted_pages_total")

    async def abort_midway(ac, i):
        stream = await ac.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"abort {i}"}],
            max_tokens=400,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        n = 0
        async for _ in stream:
            n += 1
            if n == 3:
                break
        await stream.close()

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as ac:
            await asyncio.gather(*(abort_midway(ac, i) for i in range(50)))

    start = time.monotonic()
    asyncio.run(run())
    deadline = time.monotonic() + 20  # generous for a loaded machine; the cache check below is the strict one

    def held() -> float:  # pages of requests; the prefix cache keeps its own on purpose
        return server.metric("afd_kv_pages_used") - server.metric("afd_prefix_cache_pages")

    while (held() != 0 or aborted_count(server, "chat") < before + 50) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert held() == 0, f"pages still held {time.monotonic() - start:.1f} s in"
    assert server.metric("afd_num_requests_running") == 0
    # pages the cache took in (what it holds now plus what it evicted since): run to the end, the
    # 50 requests add 50 x 25 pages of 16 tokens (1,250, seen when aborts are dropped); aborted
    # after 3 tokens, 1-2 each, plus what the engine computes before the abort arrives: 1-201
    # pages alone, up to 629 beside the rest of the suite (the front end is slow to run there,
    # and the engine's small batches got faster with the C MoE kernel). Under three quarters:
    # the engine stopped them early.
    inserted = server.metric("afd_prefix_cache_pages") + server.metric("afd_prefix_cache_evicted_pages_total")
    assert inserted - cache_before < 50 * 25 * 3 // 4, inserted - cache_before
    assert aborted_count(server, "chat") == before + 50
    assert httpx.get(server.url + "/health").status_code == 200


def test_metrics_count_tokens(server):
    before = server.metric("afd_generation_tokens_total")
    httpx.post(
        server.url + "/generate",
        json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}},
        timeout=30,
    )
    assert server.metric("afd_generation_tokens_total") == before + 5
    assert server.metric("afd_time_to_first_token_seconds_count") > 0


PAGE = 16  # the server's default --page-size


def cached_of(earlier: list[int], prompt: list[int]) -> int:
    """What the prefix cache serves of `prompt` after `earlier` ran: their common prefix in whole
    pages, short of the prompt's last token (always computed)."""
    common = next((i for i, (a, b) in enumerate(zip(earlier, prompt)) if a != b), min(len(earlier), len(prompt)))
    return min(common, len(prompt) - 1) // PAGE * PAGE


def test_usage_reports_cached_prompt_tokens(server, client, offline):
    system = "You are a terse assistant for the lighthouse keepers of the northern isles. " * 3
    asks = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in ("Hi", "Bye")]
    template = offline.tokenizer.apply_chat_template
    ids = [template(m, add_generation_prompt=True, tokenize=True)["input_ids"] for m in asks]
    hits_before = server.metric("afd_prefix_cache_hit_tokens_total")
    first, second = (client.chat.completions.create(model=MODEL, messages=m, max_tokens=3) for m in asks)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    expected = cached_of(ids[0], ids[1])
    assert expected >= 2 * PAGE
    assert second.usage.prompt_tokens_details.cached_tokens == expected
    assert server.metric("afd_prefix_cache_hit_tokens_total") == hits_before + expected
    assert server.metric("afd_prefix_cache_pages") > 0

    prompt = list(range(40, 90))  # the same token ids twice: all whole pages but the last token's
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=2, stream=True, stream_options={"include_usage": True})
    usages = [list(client.completions.create(**kwargs))[-1].usage for _ in range(2)]
    assert [u.prompt_tokens_details.cached_tokens for u in usages] == [0, 48]
    body = {"input_ids": prompt + [7], "sampling_params": {"max_new_tokens": 1}}
    assert httpx.post(server.url + "/generate", json=body, timeout=60).json()["meta_info"]["cached_tokens"] == 48


def test_api_key_is_enforced(tiny_v3):
    srv = Server(tiny_v3, "--api-key", "sesame")
    try:
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="sesame", max_retries=0)
        assert [m.id for m in good.models.list().data] == [MODEL]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert httpx.get(srv.url + "/health").status_code == 200
    finally:
        srv.stop()
