"""The engine loop behind its control sockets, driven directly (no API server in front to validate):
one request's content fails that request only, the loop keeps serving, and each rank's loop takes
the requests sent to that rank only."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import msgspec
import pytest
import zmq

from afd_engine import Engine, SamplingParams
from afd_engine.control import loop as loop_module
from afd_engine.control import messages as msgs
from afd_engine.control.loop import ControlAddrs, EngineLoop, FrontEndSockets

GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)


def ipc_addrs(tmp_path) -> ControlAddrs:
    return ControlAddrs(*(f"ipc://{tmp_path}/{n}" for n in ("requests", "broadcast", "outputs")))


@contextmanager
def serving(tmp_path, engines: list):
    """The front end's sockets, with one engine loop per rank (engine i is rank i) serving behind
    them in threads; every loop must stop on Shutdown."""
    addrs = ipc_addrs(tmp_path)
    ctx = zmq.Context()
    socks = FrontEndSockets.bind(ctx, addrs, len(engines))
    threads = [threading.Thread(target=EngineLoop(e, addrs, r).run, daemon=True) for r, e in enumerate(engines)]
    for thread in threads:
        thread.start()
    try:
        yield socks
    finally:
        socks.pub.send(msgs.encode(msgs.Shutdown()))
        for thread in threads:
            thread.join(timeout=30)
            assert not thread.is_alive(), "the loop did not stop on Shutdown"
        socks.close()
        ctx.term()


def engine_loops(model_path: str, tmp_path, num_ranks: int):
    return serving(tmp_path, [Engine(model_path=model_path, num_threads=1) for _ in range(num_ranks)])


@pytest.fixture
def loop(tiny_v3, tmp_path):
    with engine_loops(tiny_v3, tmp_path, num_ranks=1) as socks:
        yield socks


def until_done(socks: FrontEndSockets, rid: str):
    """The request's Rejected message, or its token ids once it finished."""
    tokens, deadline = [], time.monotonic() + 30  # heartbeats arrive twice a second: poll alone never ends
    while time.monotonic() < deadline and socks.pull.poll(1000):
        msg = msgs.decode_output(socks.pull.recv())
        if isinstance(msg, msgs.Rejected) and msg.rid == rid:
            return msg
        for u in getattr(msg, "updates", []):
            if u.request_id == rid:
                tokens += u.token_ids
                if u.finish_reason is not None:
                    return tokens
    raise AssertionError(f"no answer for {rid}")


def raw_add(rid: str, prompt_ids, params: dict) -> bytes:
    return msgspec.msgpack.encode(["AddRequest", rid, prompt_ids, params, None])


def test_bad_requests_are_rejected_and_the_loop_keeps_serving(loop, tiny_v3):
    with Engine(model_path=tiny_v3, num_threads=1) as ref:
        expected = ref.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY)[0].token_ids
    good = msgs.AddRequest("ok-1", [5, 6, 7], GREEDY)
    loop.push[0].send(msgs.encode(good))
    assert until_done(loop, "ok-1") == expected
    params = msgspec.msgpack.decode(msgs.encode(good))[3]
    bad = {
        "empty-stop": raw_add("empty-stop", [5], {**params, "stop": [""]}),
        "unknown-field": raw_add("unknown-field", [5], {**params, "bogus": 1}),
        "token-out-of-vocab": raw_add("token-out-of-vocab", [10**9], params),
        "not-a-list": raw_add("not-a-list", "abc", params),
    }
    answers = {}
    for rid, raw in bad.items():
        loop.push[0].send(raw)
        answers[rid] = until_done(loop, rid)
        assert isinstance(answers[rid], msgs.Rejected), (rid, answers[rid])
    assert answers["empty-stop"].param == "stop" and "non-empty" in answers["empty-stop"].message
    assert "bogus" in answers["unknown-field"].message
    assert answers["token-out-of-vocab"].param == "prompt_token_ids"
    loop.push[0].send(b"not json at all")
    loop.push[0].send(msgs.encode(msgs.AddRequest("ok-2", [5, 6, 7], GREEDY)))
    assert until_done(loop, "ok-2") == expected


def test_each_rank_serves_the_requests_sent_to_it_only(tiny_v3, tmp_path):
    sent = {"a": 1, "b": 0, "c": 1, "d": 1}  # request id -> rank
    served: dict[str, set[int]] = {}  # request id -> ranks whose outputs carried its updates
    with engine_loops(tiny_v3, tmp_path, num_ranks=2) as socks:
        for sock in socks.push:  # a send to a rank that never connects would wait for ever
            sock.setsockopt(zmq.SNDTIMEO, 10_000)
        for rid, rank in sent.items():
            socks.push[rank].send(msgs.encode(msgs.AddRequest(rid, [5, 6, 7], GREEDY)))
        finished, deadline = set(), time.monotonic() + 30
        while finished != set(sent) and time.monotonic() < deadline and socks.pull.poll(1000):
            msg = msgs.decode_output(socks.pull.recv())
            for u in msg.updates:
                served.setdefault(u.request_id, set()).add(msg.rank)
                if u.finish_reason is not None:
                    finished.add(u.request_id)
    assert served == {rid: {rank} for rid, rank in sent.items()}


class IdleLockstepEngine:
    """A lockstep rank with no work anywhere: it counts the agreement rounds the loop runs."""

    lockstep, peers_busy, stopped = True, False, False

    def __init__(self) -> None:
        self.rounds: list[float] = []  # monotonic time of each round
        self.scheduler = SimpleNamespace(running=[], waiting=[], cache_hit_tokens=0, prompt_tokens=0)
        self.pool = SimpleNamespace(used_pages=0, num_pages=1)
        self.cache = SimpleNamespace(num_pages=0, evicted_pages=0)
        self.args = SimpleNamespace(spec_steps=0)

    def has_unfinished(self) -> bool:
        return False

    def step_updates(self) -> list:
        self.rounds.append(time.monotonic())
        return []

    def request_stop(self) -> None:
        self.stopped = True

    def expert_rank_load(self) -> tuple:
        return ()

    def ffn_fault_counters(self) -> tuple:
        return 0, 0, 0

    def static_decode_batches(self) -> int:
        return 0

    def spec_counters(self) -> tuple:
        return 0, 0, 0, ()

    def experts_loaded(self) -> tuple:
        return 0, 0

    def close(self) -> None:
        """Nothing to release."""


def test_idle_lockstep_ranks_run_few_agreement_rounds(tmp_path):
    """An idle deployment waits: about 20 rounds a second (one per LOCKSTEP_IDLE_MS); a 5 ms
    period ran ~200, 10-15% of a core per rank with nothing to do."""
    engine = IdleLockstepEngine()
    with serving(tmp_path, [engine]):
        time.sleep(0.3)  # started
        before = len(engine.rounds)
        time.sleep(1.0)
        rounds = len(engine.rounds) - before
    assert rounds <= 25  # a round per 50 ms, and a little slack for the start of the window


def test_a_request_to_one_of_several_ranks_wakes_every_rank(tmp_path, monkeypatch):
    """With the idle check effectively off, the front end's wake-up alone starts a round on every
    rank, the ones that did not get the request too."""
    monkeypatch.setattr(loop_module, "LOCKSTEP_IDLE_MS", 600_000)
    engines = [IdleLockstepEngine(), IdleLockstepEngine()]
    with serving(tmp_path, engines) as socks:
        for sock in socks.push:
            sock.setsockopt(zmq.SNDTIMEO, 10_000)
        deadline = time.monotonic() + 10
        while not all(e.rounds for e in engines) and time.monotonic() < deadline:
            time.sleep(0.01)  # the first round of each loop (subscriptions settle meanwhile)
        time.sleep(0.3)
        before = [len(e.rounds) for e in engines]
        socks.push[0].send(msgs.encode(msgs.AddRequest("r", [5], GREEDY)))
        socks.wake_ranks()
        while [len(e.rounds) for e in engines] == before and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        after = [len(e.rounds) for e in engines]
    assert all(a > b for a, b in zip(after, before)), (before, after)


def test_a_single_rank_gets_no_wake_up(tmp_path):
    addrs = ipc_addrs(tmp_path)
    ctx = zmq.Context()
    for num_ranks, expected in ((1, []), (2, [msgs.Wake()])):
        socks = FrontEndSockets.bind(ctx, addrs, num_ranks)
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(addrs.broadcast)
        time.sleep(0.3)  # a PUB drops what it sends before the subscription arrives
        socks.wake_ranks()
        got = [msgs.decode(sub.recv())] if sub.poll(1000) else []
        assert got == expected, num_ranks
        sub.close(linger=0)
        socks.close()
    ctx.term()


def test_the_speculation_line_reports_each_interval_and_since_start(caplog, monkeypatch):
    """Every SPEC_LOG_S with verifications since the last line: their mean accepted length, and
    the mean since start; nothing in an interval without verifications."""
    loop_mod = loop_module
    counters = [(0, 0, 0, ())]
    engine = SimpleNamespace(spec_counters=lambda: counters[-1])
    lp = loop_mod.EngineLoop.__new__(loop_mod.EngineLoop)
    lp.engine, clock = engine, [100.0]
    monkeypatch.setattr(loop_mod.time, "monotonic", lambda: clock[0])
    lp._spec_logged = (100.0, 0, 0)
    caplog.set_level("INFO", logger="afd.engine")
    counters.append((10, 12, 6, (4, 6)))
    clock[0] = 105.0
    lp._log_speculation()  # before the interval ends: nothing
    clock[0] = 111.0
    lp._log_speculation()
    counters.append((30, 40, 26, (8, 22)))
    clock[0] = 122.0
    lp._log_speculation()
    clock[0] = 133.0
    lp._log_speculation()  # no verification since: nothing
    lines = [r.getMessage() for r in caplog.records if "speculative" in r.getMessage()]
    assert lines == [
        "speculative decoding: 10 verifications, mean accepted length 1.60 (1.60 since start)",
        "speculative decoding: 20 verifications, mean accepted length 2.00 (1.87 since start)",
    ]
