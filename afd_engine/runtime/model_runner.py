"""Runs the model on a scheduled step: builds the batch tensors, forwards, returns logits.

`StepRunner` is the whole protocol the engine and its control loop use; `ModelRunner` is the
single-process one. A rank of a deployment brings its own (distributed/attention_runner.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from afd_engine.runtime.forward_batch import ForwardBatch, SeqChunk
from afd_engine.runtime.kv_cache import KVPool
from afd_engine.runtime.request import Request
from afd_engine.runtime.scheduler import StepPlan


@dataclass
class StepInputs:
    """A step's sequences in batch order (extend chunks, then decodes) and who samples."""

    extend: list[SeqChunk]
    decode: list[SeqChunk]
    samples: list[bool]  # per sequence, in the same order: does it sample a token this step
    samplers: list[Request]

    @staticmethod
    def of(plan: StepPlan) -> StepInputs:
        extend = [SeqChunk(r.row, r.num_cached, r.tokens(r.num_cached, r.num_cached + n)) for r, n in plan.extend]
        decode = [SeqChunk(r.row, r.num_cached, r.tokens(r.num_cached, r.num_cached + 1)) for r in plan.decode]
        # A request samples when this step completes its pending tokens: the last token of a
        # finished prefill chunk, and every decode token.
        samples = [n == r.pending for r, n in plan.extend] + [True] * len(plan.decode)
        samplers = [r for (r, _), s in zip(plan.extend, samples) if s] + list(plan.decode)
        return StepInputs(extend, decode, samples, samplers)


def logit_rows(chunks: list[SeqChunk], samples: list[bool], device: torch.device | str = "cpu") -> torch.Tensor:
    """Rows (last token of each sampling sequence) in the flat token order of `chunks`."""
    ends = torch.tensor([len(c.tokens) for c in chunks], dtype=torch.int64).cumsum(0) - 1
    return (ends[torch.tensor(samples, dtype=torch.bool)] if chunks else ends).to(device)


def commit(plan: StepPlan) -> None:
    """The step's tokens are now in the cache."""
    for req, n in plan.extend:
        req.num_cached += n
    for req in plan.decode:
        req.num_cached += 1


class StepRunner(ABC):
    """What runs the engine's steps.

    Lockstep runners (ranks of a deployment) take part in every step their peers agree on, with
    or without work of their own, and stop in an agreed round; the others step when they have work
    and stop at once.
    """

    lockstep: bool = False

    def __init__(self) -> None:
        self.stopped = False  # once true the engine loop ends; set by request_stop or an agreed round

    @abstractmethod
    def begin_step(self, plan: StepPlan) -> bool:
        """Called every round; True when a forward step runs now (`run` must follow)."""

    @abstractmethod
    def run(self, plan: StepPlan) -> tuple[list[Request], torch.Tensor]:
        """Forwards the step; returns the requests that sample now and their logits [n, V] fp32."""

    def request_stop(self) -> None:
        """Asks to stop; a lockstep runner stops in the next round its peers agree on."""
        self.stopped = True

    def close(self) -> None:
        """Releases what the runner holds (peers, threads)."""


class ModelRunner(StepRunner):
    """One process holds the whole model; a step runs whenever this engine has work."""

    def __init__(self, model: torch.nn.Module, pool: KVPool) -> None:
        super().__init__()
        self.model, self.pool = model, pool

    def begin_step(self, plan: StepPlan) -> bool:
        return not plan.empty

    def run(self, plan: StepPlan) -> tuple[list[Request], torch.Tensor]:
        inputs = StepInputs.of(plan)
        fb = ForwardBatch.build(
            inputs.extend, inputs.decode, self.pool.page_table, self.pool.page_size, self.pool.device
        )
        rows = logit_rows(inputs.extend + inputs.decode, inputs.samples, self.pool.device)
        logits = self.model(fb, self.pool.cache, rows)
        commit(plan)
        return inputs.samplers, logits
