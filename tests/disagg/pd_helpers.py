"""A prefill and a decode engine driven together, as `afd router` drives two instances: each
request goes to both under one room; tokens come from the decode side."""

from __future__ import annotations

import itertools
import time

from afd_engine import Engine
from afd_engine.disagg.bootstrap import BootstrapServer
from afd_engine.offline import OfflineEngine
from afd_engine.processes.rendezvous import free_port

# what the tests' P and D engines share: small pools and chunks, so prompts prefill in pieces
COMMON = {"dtype": "float32", "num_threads": 1, "kv_cache_memory_mb": 8, "max_num_batched_tokens": 32}


class PDPair(OfflineEngine):
    """`prefill`: an Engine in this process (--disaggregation-mode prefill); `decode`: an Engine or
    a DistributedEngine (--disaggregation-mode decode). The prefill side's outputs are kept in
    `prefill_outputs`."""

    def __init__(self, prefill: Engine, decode) -> None:
        self.prefill, self.decode = prefill, decode
        port = free_port("127.0.0.1")
        self.bootstrap = BootstrapServer("127.0.0.1", port, [prefill.disagg.address], prefill.disagg.description)
        self.address = f"127.0.0.1:{port}"
        self._rooms = itertools.count(1 << 20, 1 << 8)
        self.prefill_outputs = {}
        # prompts this short go to the decode side alone (`afd router --local-prefill-max-tokens`)
        self.local_max_tokens = 0

    def add_request(self, prompt=None, params=None, prompt_token_ids=None, request_id=None, to_prefill=True) -> str:
        room = next(self._rooms)
        rid = request_id or f"pd-{room}"
        ids = prompt_token_ids
        if len(ids) <= self.local_max_tokens:
            return self.decode.add_request(prompt_token_ids=ids, params=params, request_id=rid)
        self.decode.add_request(
            prompt_token_ids=ids,
            params=params,
            request_id=rid,
            disaggregation={"room": room, "bootstrap": self.address},
        )
        if to_prefill:
            self.prefill.add_request(
                prompt_token_ids=ids, params=params, request_id=f"p-{rid}", disaggregation={"room": room}
            )
        return rid

    def step(self):
        for out in self.prefill.step():
            self.prefill_outputs[out.request_id] = out
        return self.decode.step()

    def has_unfinished(self) -> bool:
        return self.decode.has_unfinished() or self.prefill.has_unfinished()

    def abort(self, request_id):
        return self.decode.abort(request_id)

    def run_until(self, done, timeout: float = 30.0) -> list:
        """Steps both until `done()`; returns the decode side's finished outputs."""
        outs, deadline = [], time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, "the PD pair did not finish in time"
            outs += self.step()
        return outs

    def close(self) -> None:
        self.bootstrap.close()
        self.prefill.close()
        self.decode.close()


def idle_pages(engine: Engine) -> bool:
    """Every used page belongs to the prefix cache: nothing is held for a request."""
    return engine.pool.used_pages == engine.cache.num_pages and not engine.scheduler.has_work()
