"""Timing events of the pipeline, recorded per rank to a JSONL file (`--record-timeline PATH`).

Each event: {"rank", "step", "kind", "mb", "layer", "tokens", "t0", "t1"} with wall-clock seconds,
so the events of all processes on one machine share a time axis; "tokens" is the rows the operation
computed on (-1 where not known). `afd plan calibrate` fits stage times to them. Kinds on attention ranks: "attention"
(compute, injected delay included), "wait" (blocked on combine), "step" (the whole step, its
tokens), "eplb_plan" / "eplb_switch" (a rebalance's placement computed, before the step / switched
to, inside it; --enable-eplb); on FFN ranks: "recv" (blocked on
dispatch), "ffn" (expert compute). benchmarks/bench_pipeline.py draws them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import contextmanager

from afd_engine.operations import MicroBatchState, Operation


class Timeline:
    def __init__(self, path: str | None, role: str, rank: int) -> None:
        self.file = open(f"{path}.{role}{rank}.jsonl", "a") if path else None
        self.role, self.rank, self.step = role, rank, 0
        self._events: list[dict] = []

    @contextmanager
    def span(self, kind: str, mb: int, layer: int, tokens: int = -1):
        if self.file is None:
            yield
            return
        t0 = time.time()
        try:
            yield
        finally:
            self._events.append(
                {
                    "role": self.role,
                    "rank": self.rank,
                    "step": self.step,
                    "kind": kind,
                    "mb": mb,
                    "layer": layer,
                    "tokens": tokens,
                    "t0": t0,
                    "t1": time.time(),
                }
            )

    def timed(
        self,
        kind: str,
        tokens: Callable[[MicroBatchState], int] | None = None,
        delay_ms: float = 0.0,
        scaled_delay: tuple[Callable[[MicroBatchState], int], float] | None = None,
    ) -> Callable[[Operation], Operation]:
        """A wrapper for `ModelOps.wrap`: the operation runs inside a span of `kind`, followed by
        the injected delay; `tokens(state)`, read before it runs, is the rows it computes on.
        `scaled_delay` (count(state), us) adds us microseconds per counted item (experiments)."""
        count, per_item_us = scaled_delay or (None, 0.0)

        def wrap(op: Operation) -> Operation:
            if self.file is None and delay_ms <= 0 and per_item_us <= 0:
                return op  # nothing to record or inject: the hot path stays as it is

            def timed_op(st: MicroBatchState) -> None:
                extra_ms = per_item_us * count(st) / 1000 if per_item_us > 0 else 0.0
                with self.span(kind, st.micro_batch, op.layer, tokens(st) if tokens else -1):
                    op(st)
                    pause(delay_ms + extra_ms)

            return Operation(op.name, timed_op, op.layer)

        return wrap

    def end_step(self, step: int) -> None:
        if self.file is not None and self._events:
            self.file.write("".join(json.dumps(e) + "\n" for e in self._events))
            self.file.flush()
        self._events.clear()
        self.step = step + 1


def pause(ms: float) -> None:
    """An injected delay (experiments only)."""
    if ms > 0:
        time.sleep(ms / 1000)
