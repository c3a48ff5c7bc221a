"""The engine loop behind its control sockets, driven directly (no API server in front to validate):
one request's content fails that request only, and the loop keeps serving."""

from __future__ import annotations

import json
import threading
import time

import pytest
import zmq

from afd_engine import Engine, SamplingParams
from afd_engine.control import messages as msgs
from afd_engine.control.loop import ControlAddrs, EngineLoop, FrontEndSockets

GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture
def loop(tiny_v3, tmp_path):
    addrs = ControlAddrs(*(f"ipc://{tmp_path}/{n}" for n in ("requests", "broadcast", "outputs")))
    ctx = zmq.Context()
    socks = FrontEndSockets.bind(ctx, addrs)
    engine = Engine(model_path=tiny_v3, num_threads=1)
    thread = threading.Thread(target=EngineLoop(engine, addrs).run, daemon=True)
    thread.start()
    yield socks
    socks.pub.send(msgs.encode(msgs.Shutdown()))
    thread.join(timeout=30)
    assert not thread.is_alive(), "the loop did not stop on Shutdown"
    socks.close()
    ctx.term()


def until_done(socks: FrontEndSockets, rid: str):
    """The request's Rejected message, or its token ids once it finished."""
    tokens, deadline = [], time.monotonic() + 30  # heartbeats arrive twice a second: poll alone never ends
    while time.monotonic() < deadline and socks.pull.poll(1000):
        msg = msgs.decode(socks.pull.recv())
        if isinstance(msg, msgs.Rejected) and msg.rid == rid:
            return msg
        for u in getattr(msg, "updates", []):
            if u.request_id == rid:
                tokens += u.token_ids
                if u.finish_reason is not None:
                    return tokens
    raise AssertionError(f"no answer for {rid}")


def raw_add(rid: str, prompt_ids, params: dict) -> bytes:
    return json.dumps({"type": "AddRequest", "body": {"rid": rid, "prompt_ids": prompt_ids, "params": params}}).encode()


def test_bad_requests_are_rejected_and_the_loop_keeps_serving(loop, tiny_v3):
    with Engine(model_path=tiny_v3, num_threads=1) as ref:
        expected = ref.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY)[0].token_ids
    good = msgs.AddRequest("ok-1", [5, 6, 7], GREEDY)
    loop.push.send(msgs.encode(good))
    assert until_done(loop, "ok-1") == expected
    params = {**json.loads(msgs.encode(good))["body"]["params"]}
    bad = {
        "surrogate-stop": raw_add("surrogate-stop", [5], {**params, "stop": ["\ud800"]}),
        "unknown-field": raw_add("unknown-field", [5], {**params, "bogus": 1}),
        "token-out-of-vocab": raw_add("token-out-of-vocab", [10**9], params),
        "not-a-list": raw_add("not-a-list", "abc", params),
    }
    answers = {}
    for rid, raw in bad.items():
        loop.push.send(raw)
        answers[rid] = until_done(loop, rid)
        assert isinstance(answers[rid], msgs.Rejected), (rid, answers[rid])
    assert answers["surrogate-stop"].param == "stop" and "valid Unicode" in answers["surrogate-stop"].message
    assert "bogus" in answers["unknown-field"].message
    assert answers["token-out-of-vocab"].param == "prompt_token_ids"
    loop.push.send(b"not json at all")
    loop.push.send(msgs.encode(msgs.AddRequest("ok-2", [5, 6, 7], GREEDY)))
    assert until_done(loop, "ok-2") == expected
