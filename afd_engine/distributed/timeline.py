"""Timing events of the pipeline, recorded per rank to a JSONL file (`--record-timeline PATH`).

Each event: {"rank", "step", "kind", "mb", "layer", "tokens", "t0", "t1"} with wall-clock seconds,
so the events of all processes on one machine share a time axis; "tokens" is the rows the operation
computed on (-1 where not known). `afd plan calibrate` fits stage times to them. Kinds on attention ranks: "attention"
(compute, injected delay included), "wait" (blocked on combine); on expert ranks: "recv" (blocked
on dispatch), "ffn" (expert compute). benchmarks/bench_pipeline.py draws them.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager


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
            self._events.append({"role": self.role, "rank": self.rank, "step": self.step, "kind": kind, "mb": mb,
                                 "layer": layer, "tokens": tokens, "t0": t0, "t1": time.time()})

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
