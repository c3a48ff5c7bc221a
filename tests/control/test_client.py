"""ControlClient over real ZeroMQ sockets: a request goes to a connected rank at once, without
polling; to a rank that has not connected yet it waits until the rank connects; an engine that is
gone is reported instead of waited for, also to requests already waiting for tokens, while a slow
live one is waited for."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import zmq

from afd_engine.control import messages as msgs
from afd_engine.control.client import ControlClient, EngineUnavailable
from afd_engine.control.load_balance import LoadBalancer
from afd_engine.control.loop import ControlAddrs
from afd_engine.sampling_params import SamplingParams


def add(rid: str) -> msgs.AddRequest:
    return msgs.AddRequest(rid, [5, 6, 7], SamplingParams(max_new_tokens=2))


@pytest.fixture
def addrs(tmp_path):
    return ControlAddrs(f"ipc://{tmp_path}/req", f"ipc://{tmp_path}/bcast", f"ipc://{tmp_path}/out")


def rank_socket(ctx: zmq.Context, addrs: ControlAddrs) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.connect(addrs.requests_of(0))
    return sock


def test_a_connected_rank_gets_the_request_without_a_poll(addrs):
    async def run():
        client = ControlClient(addrs, LoadBalancer.of("round_robin", 1, 16))
        ctx = zmq.Context()
        rank = rank_socket(ctx, addrs)
        try:
            await asyncio.sleep(0.2)  # the connection is up

            async def no_poll(*_):
                raise AssertionError("polled a connected rank")

            client.push[0].poll = no_poll
            await client._submit(0, add("a"))
            assert rank.poll(2000)
            assert msgs.decode(rank.recv()).rid == "a"
        finally:
            rank.close(linger=0)
            ctx.term()
            client.sockets.close()

    asyncio.run(run())


def test_a_request_waits_for_its_rank_to_connect(addrs):
    async def run():
        client = ControlClient(addrs, LoadBalancer.of("round_robin", 1, 16))
        ctx = zmq.Context()
        try:
            submit = asyncio.ensure_future(client._submit(0, add("early")))
            await asyncio.sleep(0.3)
            assert not submit.done()  # nobody to take it yet
            rank = rank_socket(ctx, addrs)
            await asyncio.wait_for(submit, 5)
            assert rank.poll(2000)
            assert msgs.decode(rank.recv()).rid == "early"
            rank.close(linger=0)
        finally:
            ctx.term()
            client.sockets.close()

    asyncio.run(run())


def test_a_dead_engine_is_reported_not_waited_for(addrs):
    async def run():
        client = ControlClient(addrs, LoadBalancer.of("round_robin", 1, 16), alive=lambda: False)
        try:
            with pytest.raises(EngineUnavailable, match="stopped answering"):
                await asyncio.wait_for(client._submit(0, add("lost")), 10)
        finally:
            client.sockets.close()

    asyncio.run(run())


def _step_output(rid: str, token: int, finish: str | None) -> bytes:
    from afd_engine.runtime.request import TokenUpdate

    update = TokenUpdate(rid, [token], None, finish, None, None, 3, 1)
    return msgs.encode_output(msgs.StepOutput([update], msgs.EngineStats(), 0))


def test_a_waiting_request_fails_once_its_engine_dies(addrs):
    """The request is with a rank that never answers; the rank's process then dies. The stream
    raises within about a second of the death, and not before it."""

    async def run():
        alive = [True]
        client = ControlClient(addrs, LoadBalancer.of("round_robin", 1, 16), alive=lambda: alive[0])
        ctx = zmq.Context()
        rank = rank_socket(ctx, addrs)
        client.start()
        try:
            stream = client.generate("r", [5, 6, 7], SamplingParams(max_new_tokens=2))
            first = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(2.5)  # over two health checks with a live engine: still waiting
            assert not first.done()
            alive[0] = False
            died = time.monotonic()
            with pytest.raises(EngineUnavailable, match="stopped answering"):
                await asyncio.wait_for(first, 5)
            assert time.monotonic() - died < 1.5
        finally:
            await client.shutdown()
            rank.close(linger=0)
            ctx.term()

    asyncio.run(run())


def test_a_slow_live_engine_is_waited_for(addrs):
    """Tokens that take longer than a health check to come still reach the request."""

    async def run():
        client = ControlClient(addrs, LoadBalancer.of("round_robin", 1, 16))
        ctx = zmq.Context()
        rank = rank_socket(ctx, addrs)
        out = ctx.socket(zmq.PUSH)
        out.connect(addrs.outputs)
        client.start()
        try:
            got = asyncio.ensure_future(_collect(client.generate("s", [5, 6, 7], SamplingParams(max_new_tokens=2))))
            await asyncio.sleep(1.5)  # past one health check, with nothing from the engine
            out.send(_step_output("s", 11, None))
            await asyncio.sleep(1.2)
            out.send(_step_output("s", 12, "length"))
            updates = await asyncio.wait_for(got, 5)
            assert [u.token_ids for u in updates] == [[11], [12]]
            assert updates[-1].finish_reason == "length"
        finally:
            await client.shutdown()
            out.close(linger=0)
            rank.close(linger=0)
            ctx.term()

    asyncio.run(run())


async def _collect(stream) -> list:
    return [u async for u in stream]


def test_the_reason_the_engine_is_down_names_the_silent_rank_or_the_exit(addrs):
    """The grace for silence starts when the ranks are up (start()), not when the client was made:
    a deployment that took longer than DEAD_AFTER_S to start is healthy; a rank silent that long
    since is named; a rank process that exited is said so."""
    from afd_engine.control import client as ec

    async def run():
        alive = [True]
        client = ControlClient(addrs, LoadBalancer.of("round_robin", 2, 16), alive=lambda: alive[0])
        client.last_heard = {0: time.monotonic() - 2 * ec.DEAD_AFTER_S, 1: time.monotonic() - 2 * ec.DEAD_AFTER_S}
        client.start()  # (the ranks took long to start)
        try:
            assert client.healthy and client.down_reason() is None
            client.last_heard[1] -= ec.DEAD_AFTER_S + 2
            assert client.down_reason() == f"attention rank 1 has sent nothing for {ec.DEAD_AFTER_S + 2:.0f} s"
            with pytest.raises(EngineUnavailable, match=r"^the engine is not running: attention rank 1 has sent"):
                await client.generate("x", [5, 6], SamplingParams(max_new_tokens=2)).__anext__()
            alive[0] = False
            assert not client.healthy and client.down_reason() == "a rank process exited"
        finally:
            await client.shutdown()

    asyncio.run(run())


def test_a_request_routed_to_a_rank_lost_meanwhile_moves_to_a_live_one(addrs):
    """Fault tolerance: a request sent to rank 1 just before its loss was noticed waits for no
    connection that will never come: once rank 1 counts lost, it is resubmitted to rank 0."""

    async def run():
        lost: set[int] = set()
        client = ControlClient(addrs, LoadBalancer.of("round_robin", 2, 16), lost_ranks=lambda: lost)
        client.start()
        ctx = zmq.Context()
        rank0 = rank_socket(ctx, addrs)  # rank 1 never connects: its process is gone
        try:
            await asyncio.sleep(0.2)
            await client.open("a", [5, 6, 7], SamplingParams(max_new_tokens=2))  # round robin: rank 0
            assert msgs.decode(rank0.recv()).rid == "a"
            opening = asyncio.ensure_future(client.open("b", [5, 6, 7], SamplingParams(max_new_tokens=2)))
            await asyncio.sleep(0.3)
            assert not opening.done()  # waits for rank 1 to connect
            lost.add(1)
            await asyncio.wait_for(opening, 5)
            assert rank0.poll(5000)
            moved = msgs.decode(rank0.recv())
            assert moved.rid == "b" and moved.params.seed is not None  # (a seed of the front end's)
            assert client.failover.resumed == 1 and client.attention_ranks_alive == 1
        finally:
            for task in client._tasks:
                task.cancel()
            rank0.close(linger=0)
            ctx.term()
            client.sockets.close()

    asyncio.run(run())


def test_the_front_end_record_has_one_line_per_request_handed_over(addrs, tmp_path):
    """--record-steps: the API server writes when it handed each request to a rank, on the ranks'
    clock (time.monotonic), with the rank and the prompt's length."""
    path = tmp_path / "steps.frontend.jsonl"

    async def run():
        client = ControlClient(addrs, LoadBalancer.of("round_robin", 1, 16), record=str(path))
        ctx = zmq.Context()
        rank = rank_socket(ctx, addrs)
        try:
            await asyncio.sleep(0.2)
            before = time.monotonic()
            for rid, ids in (("a", [5, 6, 7]), ("b", [9] * 11)):
                await client.open(rid, ids, SamplingParams(max_new_tokens=2))
            after = time.monotonic()
            assert [msgs.decode(rank.recv()).rid for _ in range(2)] == ["a", "b"]
        finally:
            rank.close(linger=0)
            ctx.term()
            await client.shutdown()
        return before, after

    before, after = asyncio.run(run())
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["rank"], r["prompt_tokens"]) for r in lines] == [(0, 3), (0, 11)]
    assert before <= lines[0]["t"] <= lines[1]["t"] <= after
