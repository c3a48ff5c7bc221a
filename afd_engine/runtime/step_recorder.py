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
    chunks), and the monotonic start and end of the forward (`--record-steps`)."""

    def __init__(self, path: str, execute: Callable) -> None:
        self.file = open(path, "w", buffering=1)
        self.execute = execute
        self.step = 0

    def __call__(self, prepared):
        plan = prepared.plan  # committed: num_cached already counts this step's tokens
        t0 = time.monotonic()
        out = self.execute(prepared)
        t1 = time.monotonic()
        ext = sum(n for _, n in plan.extend)
        pairs = sum(n * (r.num_cached - n) + n * (n + 1) / 2 for r, n in plan.extend)
        kv = sum(r.num_cached for r in plan.decode)
        rec = [self.step, ext + len(plan.decode), len(plan.extend) + len(plan.decode), kv, pairs, t0, t1]
        self.file.write(json.dumps(dict(zip(STEP_FIELDS, rec))) + "\n")
        self.step += 1
        return out


STEP_FIELDS = ("step", "tokens", "seqs", "kv", "pairs", "t0", "t1")
