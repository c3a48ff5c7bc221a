"""A simulated request's state as it moves through ranks, and a cached prefix block."""

from __future__ import annotations

import math

INF = math.inf

# where a request is: queued, computing its prompt, about to decode, decoding; under PD also holding
# pages on its decode rank while its prompt is computed elsewhere, and its KV on the wire
WAITING, PREFILL, JOINING, DECODE, RESERVED, SENDING, DONE = range(7)


class Request:
    """One request of the trace as the simulation sees it. While it decodes, its KV length, tokens
    generated and private (uncached) tokens are not updated every step but follow from the step it
    started decoding at (`s0`) and their values then (`t0`, `g0`, `u0`); `epoch` changes when it
    stops decoding, which voids the finish its rank had scheduled for it."""

    __slots__ = (
        "i",
        "arrival",
        "input_len",
        "output_len",
        "keys",
        "state",
        "target",
        "kv",
        "held",
        "priv",
        "gen",
        "order",
        "s0",
        "t0",
        "g0",
        "u0",
        "phase",
        "epoch",
        "first",
        "finish",
        "preempts",
        "queued",
        "rank",
        "prefill_rank",
        "decode_rank",
        "sent",
        "xfer_end",
        "admitted",
        "outcome",
        "d_held",
        "d_priv",
        "draws",
        "drawn",
        "gains",
        "pages_held",
    )

    def __init__(self, i: int, arrival: float, input_len: int, output_len: int, keys: tuple) -> None:
        self.i, self.arrival, self.input_len, self.output_len, self.keys = i, arrival, input_len, output_len, keys
        self.state = WAITING
        self.target = input_len  # tokens to prefill: the prompt, plus the output so far after a preemption
        self.kv = self.held = self.priv = self.gen = self.order = 0
        self.s0 = self.t0 = self.g0 = self.u0 = self.phase = self.epoch = 0
        self.first = self.finish = INF
        self.preempts = self.queued = 0
        self.rank = self.prefill_rank = self.decode_rank = None
        self.sent, self.xfer_end, self.admitted, self.outcome = 0, 0.0, False, "ok"
        self.d_held = self.d_priv = 0  # PD: blocks and private tokens reserved on the decode rank
        # speculative decoding (drafting_rank.py): tokens each of its verifies keeps, how many it
        # used, tokens gained before each verify of this decode, private pages it holds
        self.draws = self.gains = None
        self.drawn = self.pages_held = 0

    def key(self, n: int):
        """Block n's cache key: the trace's id for a full prompt block, else one of its own."""
        return self.keys[n] if n < len(self.keys) else (self.i, n)


class Block:
    """A cached prefix block: locked by `ref` requests, parent of `children` cached blocks (only a
    leaf can be evicted), last used at `stamp` (the simulation's counter)."""

    __slots__ = ("ref", "children", "stamp", "parent")

    def __init__(self, stamp: int, parent) -> None:
        self.ref, self.children, self.stamp, self.parent = 1, 0, stamp, parent
