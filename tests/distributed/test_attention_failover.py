"""--enable-fault-tolerance: an AFD or colocated deployment loses an attention rank (SIGKILL) in
the middle of decoding under load. The survivors and the expert ranks agree to go on without it,
and the front end resumes each of its requests on a survivor from the tokens handed on so far:
every request completes with the single engine's tokens (greedy, held to transformers, and seeded
sampling), nothing is repeated or missing, no page stays held, and the deployment serves new
requests. In AFD a replacement of the lost rank starts, is admitted and takes requests again.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import openai
import pytest

from afd_engine import Engine, SamplingParams, make_engine
from tests.distributed.test_ffn_fault_tolerance import settled_stats
from tests.engine_helpers import run_staggered, staggered_reference
from tests.process_helpers import proc_title
from tests.server.conftest import Server
from tests.server.test_engine_death import children

GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
LENGTHS = [5, 9, 17, 3, 12, 7, 21, 4, 15, 6, 10, 8]  # 12 requests
FT = dict(mode="afd", enable_ffn_fault_tolerance=True, num_threads=1, comm_timeout=5, dispatch_dtype="fp32")
AFD_2A_2X2 = dict(dp_size=2, ffn_nodes=2, ffn_ranks_per_node=2, micro_batches=3)


@pytest.fixture(scope="module")
def greedy_reference(tiny_v3):
    return staggered_reference(tiny_v3, LENGTHS, GREEDY, seed=7)


@pytest.fixture(scope="module")
def seeded_reference(tiny_v3, greedy_reference):
    prompts, _ = greedy_reference
    with Engine(model_path=tiny_v3, num_threads=1) as single:
        return run_staggered(single, prompts, SEEDED, every=2)


def attention_pid(rank: int, parent: int | None = None) -> int:
    title = f"afd::attention-{rank}"
    pids = [p for p in children(parent or os.getpid()) if proc_title(p) == title]
    assert len(pids) == 1, f"no single {title} among this process's descendants"
    return pids[0]


def run_with_attention_kill(engine, prompts, params, victim: int, after_tokens: int) -> list[list[int]]:
    """Two requests join every other step; once `after_tokens` tokens have come out (of requests
    still running, too) and the victim holds unfinished requests, its process gets SIGKILL."""
    killed = []

    def maybe_kill(finished_tokens: int) -> None:
        streamed = finished_tokens + sum(len(r["tokens"]) for r in engine._pending.values())
        on_victim = [rid for rid in engine._pending if engine.router.rank_of(rid) == 1]
        if not killed and streamed >= after_tokens and on_victim:
            os.kill(victim, signal.SIGKILL)
            killed.append(len(on_victim))

    outs = run_staggered(engine, prompts, params, every=2, after_step=maybe_kill)
    assert killed, "the requests finished before the kill"
    return outs


@pytest.mark.timeout(300)
def test_a_killed_attention_rank_loses_no_request_and_no_token(tiny_v3, greedy_reference, seeded_reference):
    prompts, expected = greedy_reference
    with make_engine(model_path=tiny_v3, **FT, **AFD_2A_2X2) as engine:
        victim_pid = attention_pid(1)
        greedy = run_with_attention_kill(engine, prompts, GREEDY, victim_pid, after_tokens=60)
        assert greedy == expected
        assert 1 in engine.client.failover.lost or engine.client.failover.resumed and engine.client.failover.resumed > 0
        stats = settled_stats(engine)
        assert stats.running == 0 and stats.kv_pages_used == stats.cache_pages  # no page held by a request
        # a replacement of rank 1 starts, is admitted, and takes requests again: seeded sampling
        # over both ranks draws what the single engine drew
        deadline = time.monotonic() + 120
        while engine.client.failover.lost and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not engine.client.failover.lost, "the replacement of attention rank 1 did not rejoin"
        assert attention_pid(1) != victim_pid
        again = run_staggered(engine, prompts, SEEDED, every=2)
        assert again == seeded_reference
        assert engine.client.rank_stats[1].prompt_tokens > 0  # the replacement's own count, from 0
        assert engine.deployment.alive()


async def _streams(url: str, kill=None) -> list[tuple[str, int, int]]:
    """12 streaming chat requests at once, half greedy, half seeded: per request its text and
    usage (prompt, completion tokens); an error event raises. `kill(chunks)` is called after every
    chunk with the content chunks received so far."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    seen = [0]

    async def one(i: int) -> tuple[str, int, int]:
        sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "top_p": 0.95, "seed": 100 + i}
        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": f"request {i}: " + "tell me more " * (i % 5)}],
            max_tokens=32,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            **sampling,
        )
        text, usage = [], None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
                seen[0] += 1
                if kill is not None:
                    kill(seen[0])
        return "".join(text), usage.prompt_tokens, usage.completion_tokens

    try:
        return await asyncio.gather(*(one(i) for i in range(12)))
    finally:
        await client.close()


def settled(srv: Server, timeout: float = 10.0) -> tuple[float, float]:
    """(KV pages used, prefix-cache pages) once they agree (the ranks report twice a second)."""
    deadline = time.monotonic() + timeout
    while True:
        used, cached = srv.metric("afd_kv_pages_used"), srv.metric("afd_prefix_cache_pages")
        if used == cached or time.monotonic() > deadline:
            return used, cached
        time.sleep(0.2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "flags",
    [
        "--mode afd --dp-size 2 --ffn-nodes 2 --ffn-ranks-per-node 2 --micro-batches 3",
        "--mode colocated --dp-size 2 --micro-batches 2",
    ],
)
def test_streams_continue_through_the_loss_of_an_attention_rank(tiny_v3, flags):
    """`afd serve` with --enable-fault-tolerance, the official openai client, 12 concurrent streams:
    the run with attention rank 1 killed mid-decode streams exactly what the undisturbed run did."""
    common = "--num-threads 1 --enable-fault-tolerance --dispatch-dtype fp32"
    srv = Server(tiny_v3, *flags.split(), *common.split())
    try:
        undisturbed = asyncio.run(_streams(srv.url))
        victim, killed = attention_pid(1, srv.proc.pid), []

        def kill(chunks: int) -> None:
            if not killed and chunks >= 100:  # of 12 x 32: every stream is mid-way
                os.kill(victim, signal.SIGKILL)
                killed.append(chunks)

        disturbed = asyncio.run(_streams(srv.url, kill))
        assert killed, "the streams finished before the kill"
        assert disturbed == undisturbed  # text, and usage counting one request each
        assert all(completion == 32 for _, _, completion in disturbed)
        used, cached = settled(srv)
        assert used == cached  # no page held by a request
        assert srv.metric("afd_requests_resumed_total") > 0
        # AFD: a replacement of rank 1 rejoins (colocated: the survivor holds every expert, and
        # serves on alone)
        alive = 2 if "afd" in flags else 1
        deadline = time.monotonic() + 120
        while srv.metric("afd_attention_ranks_alive") != alive and time.monotonic() < deadline:
            time.sleep(0.2)
        assert srv.metric("afd_attention_ranks_alive") == alive
        assert asyncio.run(_streams(srv.url)) == undisturbed  # and the deployment serves on
        assert srv.proc.poll() is None
    finally:
        srv.stop()


@pytest.mark.timeout(300)
def test_colocated_dp2_loses_a_rank_and_the_survivor_serves_all_experts(tiny_v3, greedy_reference):
    """Colocated: rank 1 is an attention rank and an expert rank; the survivor grows to hold its
    experts too (read from the checkpoint) and resumes its requests."""
    prompts, expected = greedy_reference
    with make_engine(model_path=tiny_v3, **{**FT, "mode": "colocated"}, dp_size=2, micro_batches=2) as engine:
        greedy = run_with_attention_kill(engine, prompts, GREEDY, attention_pid(1), after_tokens=60)
        assert greedy == expected
        stats = settled_stats(engine)
        assert stats.running == 0 and stats.kv_pages_used == stats.cache_pages
        assert stats.experts_loaded_checkpoint == 24  # 3 MoE layers x the 8 experts rank 1 held
        again = engine.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        assert [o.token_ids for o in again] == expected
