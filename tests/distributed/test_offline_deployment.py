"""The offline API of a deployment (`make_engine(mode="colocated", ...)`) over the control-plane
client: a request that finished before `step()` was called is still returned, and an aborted request
is stopped in its rank (its pages freed) and never returned."""

from __future__ import annotations

import time

import pytest

from afd_engine import make_engine
from afd_engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)


def wait_for(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.timeout(180)
def test_finished_requests_wait_for_step_and_aborted_ones_free_their_rank(tiny_v3):
    with make_engine(model_path=tiny_v3, mode="colocated", dp_size=2, num_threads=1, dispatch_dtype="fp32") as engine:
        rid = engine.add_request(prompt_token_ids=[8, 9], params=GREEDY)
        wait_for(lambda: not engine._pending)  # finished on the client's loop, not yet returned
        assert engine.has_unfinished()
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        assert [(o.request_id, len(o.token_ids), o.finish_reason) for o in outs] == [(rid, 3, "length")]

        long = SamplingParams(max_new_tokens=100_000, ignore_eos=True)
        wait_for(lambda: engine.stats.running == 0)  # the ranks' counters have seen the first one end
        endless = engine.add_request(prompt_token_ids=[5, 6, 7], params=long)
        wait_for(lambda: engine._pending[endless]["tokens"] and engine.stats.running == 1)
        engine.abort(endless)
        assert not engine.has_unfinished()
        wait_for(lambda: engine.stats.running == 0)  # the rank dropped it...
        # ...long before the context length (512 tokens, 32 pages of 16) would have ended it
        assert engine.stats.kv_pages_used < 24, engine.stats
        assert engine.step() == []
