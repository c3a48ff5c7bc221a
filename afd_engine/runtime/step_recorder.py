"""`--record-steps PATH`: one JSONL line per step with the rank's load and the forward's times.

The simulator (planner/) fits its step-time model to these records.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable


class StepRecorder:
    """Wraps a runner's `execute`: one JSONL line per step with this rank's load, as the simulator
    counts it (tokens, sequences, KV positions its decodes read, query-key pairs of its prefill
    chunks), and the monotonic start and end of the forward (`--record-steps`); then what the
    CPU attention computes padded (`ext_pad`: query-key pairs of the chunks padded to the longest
    chunk and context; `dec_pad`: KV positions of the decodes padded to the longest context), and
    the micro-batches with tokens the step ran in (`micro_batches`: an AFD attention rank's split),
    and when the engine began the step's round (`ts`: set by the engine as `began`, once the
    requests it had received were in; before `t0` by the step's scheduling), how many requests
    joined the step from a prefill instance (`joins`: set by the engine, their KV and first token
    taken in during the step's round) and how many left the rank since its previous step (`left`:
    set by the engine, finished, failed or handed to a decode instance)."""

    def __init__(self, path: str, execute: Callable) -> None:
        self.file = open(path, "w", buffering=1)
        self.execute = execute
        self.step = 0
        self.began = 0.0
        self.joins = self.left = 0

    def __call__(self, prepared):
        plan = prepared.plan  # committed: num_cached already counts this step's tokens
        t0 = time.monotonic()
        out = self.execute(prepared)
        t1 = time.monotonic()
        ext = sum(n for _, n in plan.extend)
        pairs = sum(n * (r.num_cached - n) + n * (n + 1) / 2 for r, n in plan.extend)
        kv = sum(r.num_cached for r in plan.decode)
        # what the CPU attention computes once padded: every chunk to the longest chunk and the
        # longest context of the step's chunks, every decode to the longest decode context
        ext_pad = len(plan.extend) * max((n for _, n in plan.extend), default=0)
        ext_pad *= max((r.num_cached for r, _ in plan.extend), default=0)
        dec_pad = len(plan.decode) * max((r.num_cached for r in plan.decode), default=0)
        rec = [self.step, ext + len(plan.decode), len(plan.extend) + len(plan.decode), kv, pairs, t0, t1]
        micro = sum(1 for b in prepared.batches if b["fb"].num_tokens > 0)
        rec += [ext_pad, dec_pad, micro, min(self.began, t0) if self.began else t0, self.joins, self.left]
        self.joins = self.left = 0
        self.file.write(json.dumps(dict(zip(STEP_FIELDS, rec))) + "\n")
        self.step += 1
        return out


STEP_FIELDS = (
    *("step", "tokens", "seqs", "kv", "pairs", "t0", "t1"),
    *("ext_pad", "dec_pad", "micro_batches", "ts", "joins", "left"),
)
