"""Runs the model on a scheduled step: builds the batch tensors, forwards, returns logits.

`StepRunner` is the whole protocol the engine and its control loop use; `ModelRunner` is the
single-process one. A rank of a deployment brings its own (ranks/attention_runner.py).
A step is prepared (its tensors built, on the scheduling thread) apart from being executed
(on the forward thread when scheduling overlaps), so that step n+1 is built while step n runs.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from afd_engine.models.forward_batch import ForwardBatch, SeqChunk
from afd_engine.runtime.kv_cache import KVPool
from afd_engine.runtime.request import Request
from afd_engine.runtime.scheduler import StepPlan


@dataclass(frozen=True)
class Scored:
    """Prompt logprobs of one request in a step: `count` rows of the step's logits from `first`,
    predicting its prompt tokens from `req.next_scored` on."""

    req: Request
    first: int
    count: int


@dataclass
class StepInputs:
    """A step's sequences in batch order (extend chunks, then decodes) and which of their tokens'
    logits the step returns: each sampler's last token, and the prompt positions being scored."""

    extend: list[SeqChunk]
    decode: list[SeqChunk]
    rows: list[list[int]]  # per sequence, in the same order: offsets in its chunk of the logit rows
    samplers: list[Request]
    sample_rows: list[int]  # each sampler's row in the step's logits
    scored: list[Scored]
    scoring_done: list[Request]  # requests that only score their prompt (max_new_tokens 0) and end now
    # speculative decoding: per sampler, its logit rows from sample_rows[i] on (1 + its drafts)
    sample_counts: list[int] | None = None

    @staticmethod
    def of(plan: StepPlan) -> StepInputs:
        extend = [SeqChunk(r.row, r.num_cached, r.tokens(r.num_cached, r.num_cached + n)) for r, n in plan.extend]
        decode = [SeqChunk(r.row, r.num_cached, [r.newest_token()]) for r in plan.decode]
        # verifying decodes (speculative decoding) join the decode segment as one row per position
        # (newest token, then each draft), each attending the cache up to its own position: the
        # decode path that plain decoding takes, with the rows' writes made before any reads
        decode += [
            SeqChunk(r.row, r.num_cached + j, [t])
            for r, n in plan.verify
            for j, t in enumerate([r.newest_token(), *r.draft_ids[: n - 1]])
        ]
        rows, samplers, sample_rows, scored, scoring_done, total = [], [], [], [], [], 0
        for r, n in plan.extend:
            start, mine = r.num_cached, []
            # position p's logits score prompt token p + 1
            lo, hi = max(start, r.next_scored - 1), min(start + n, len(r.prompt_ids) - 1)
            if hi > lo:
                scored.append(Scored(r, total, hi - lo))
                mine = list(range(lo - start, hi - start))
            # A request samples when this step completes its pending tokens (unless it only
            # scores its prompt): the last token of a finished prefill chunk.
            if n == r.pending and r.params.max_new_tokens > 0:
                samplers.append(r)
                sample_rows.append(total + len(mine))
                mine.append(n - 1)
            elif n == r.pending:
                scoring_done.append(r)
            rows.append(mine)
            total += len(mine)
        for r in plan.decode:  # and every decode token (but a prompt's last one that only scores)
            sampling = r.params.max_new_tokens > 0
            if sampling:
                samplers.append(r)
                sample_rows.append(total)
            else:
                scoring_done.append(r)
            rows.append([0] if sampling else [])
            total += sampling
        counts = None
        if plan.verify:
            counts = [1] * len(samplers)
            for r, n in plan.verify:  # every position's logits: each may be the token's draw
                samplers.append(r)
                sample_rows.append(total)
                counts.append(n)
                rows += [[0]] * n
                total += n
        return StepInputs(extend, decode, rows, samplers, sample_rows, scored, scoring_done, counts)


def logit_rows(chunks: list[SeqChunk], rows: list[list[int]], device: torch.device | str = "cpu") -> torch.Tensor:
    """`rows` (offsets within each chunk) as indices in the flat token order of `chunks`."""
    starts = itertools.accumulate((len(c.tokens) for c in chunks), initial=0)
    flat = [start + o for start, offsets in zip(starts, rows) for o in offsets]
    return torch.tensor(flat, dtype=torch.int64).to(device)


@dataclass
class PreparedStep:
    """A step's inputs and its batch tensors, built ahead of the forward: one batch (a
    ForwardBatch "fb" and its logit "rows") per micro-batch."""

    plan: StepPlan
    inputs: StepInputs
    batches: list[dict]

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens

    def resolve(self, previous: torch.Tensor | None) -> None:
        """Puts the tokens sampled by the previous step where the step was built with their
        placeholders (-1 - row, see Request.tokens)."""
        if previous is None or not len(previous):
            return
        for batch in self.batches:
            ids = batch["fb"].input_ids
            if ids.device.type == "cpu":  # (numpy: small torch ops would wake the thread pool)
                host, sampled = ids.numpy(), previous.numpy()
                under_way = host < 0
                host[under_way] = sampled[-1 - host[under_way]]
            else:
                ids.copy_(torch.where(ids < 0, previous[(-1 - ids).clamp(min=0)], ids))


def commit(plan: StepPlan) -> None:
    """The step's tokens are now in the cache."""
    for req, n in plan.extend:
        req.num_cached += n
    for req in plan.decode:
        req.num_cached += 1
    for req, _ in plan.verify:  # its newest token; the drafts it keeps count once verified
        req.num_cached += 1


class StepRunner(ABC):
    """What runs the engine's steps.

    Lockstep runners (ranks of a deployment) take part in every step their peers agree on, with
    or without work of their own, and stop in an agreed round; the others step when they have work
    and stop at once.
    """

    lockstep: bool = False
    expert_map = None  # eplb.expert_map.ExpertMap of a rank that dispatches to expert ranks

    def __init__(self) -> None:
        self.stopped = False  # once true the engine loop ends; set by request_stop or an agreed round
        self.ran = False  # whether the last `begin_step` ran a step (some rank had work)

    @abstractmethod
    def begin_step(self, plan: StepPlan) -> bool:
        """Called every round (on the forward thread); True when the step runs now (`execute` follows)."""

    @abstractmethod
    def prepare(self, plan: StepPlan) -> PreparedStep:
        """Builds the step's tensors (before the plan is committed, on the scheduling thread)."""

    @abstractmethod
    def execute(self, step: PreparedStep) -> torch.Tensor:
        """Forwards a prepared step (after `begin_step` said it runs); returns the logits of its
        rows [len(rows), V] fp32: each sampler's last token and the scored prompt positions."""

    # speculative decoding (runtime/spec_step.py), on runners of a model that holds its MTP module

    def execute_spec(self, step: PreparedStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Like `execute`, plus every token's last hidden state before the final norm [T, H]."""
        raise NotImplementedError(f"{type(self).__name__} does not run speculative steps")

    def draft_extend(
        self, step: PreparedStep, next_ids: torch.Tensor, hidden: torch.Tensor, at: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP module over a step's tokens: each position's next token `next_ids` [T] and the
        target's hidden state there [T, H]; returns (fp32 logits, the module's output) at the flat
        token indices `at` (ascending)."""
        raise NotImplementedError(f"{type(self).__name__} does not run speculative steps")

    def draft_chain(
        self, chunks: list[SeqChunk], tokens: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One chained step of the MTP module: one token per chunk (its previous draft, fed the
        module's previous output `hidden`); returns (fp32 logits, the module's output) per chunk.
        A lockstep runner takes part with no chunk at all."""
        raise NotImplementedError(f"{type(self).__name__} does not run speculative steps")

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
        self.graphs = None  # runtime.cuda_graph.GraphRunner: decode steps from CUDA graphs (GPU)

    def begin_step(self, plan: StepPlan) -> bool:
        return not plan.empty

    def prepare(self, plan: StepPlan) -> PreparedStep:
        inputs = StepInputs.of(plan)
        fb = ForwardBatch.build(
            inputs.extend, inputs.decode, self.pool.page_table, self.pool.page_size, self.pool.device
        )
        rows = logit_rows(inputs.extend + inputs.decode, inputs.rows, self.pool.device)
        return PreparedStep(plan, inputs, [{"fb": fb, "rows": rows}])

    @torch.inference_mode()
    def execute(self, step: PreparedStep) -> torch.Tensor:
        batch = step.batches[0]
        if self.graphs is not None and self.graphs.can_run(batch["fb"]):
            return self.graphs.run(batch["fb"], batch["rows"])
        return self.model(batch["fb"], self.pool.cache, batch["rows"])

    @torch.inference_mode()
    def execute_spec(self, step: PreparedStep) -> tuple[torch.Tensor, torch.Tensor]:
        batch = step.batches[0]
        return self.model(batch["fb"], self.pool.cache, batch["rows"], hidden=True)

    @torch.inference_mode()
    def draft_extend(self, step, next_ids, hidden, at):
        embeds = self.model.model.embed_tokens(next_ids)
        return self.model.mtp[0](embeds, hidden, step.batches[0]["fb"], self.pool.cache, at, with_hidden=True)

    @torch.inference_mode()
    def draft_chain(self, chunks, tokens, hidden):
        pool = self.pool
        fb = ForwardBatch.build([], chunks, pool.page_table, pool.page_size, pool.device)
        rows = torch.arange(len(chunks), device=pool.device)
        embeds = self.model.model.embed_tokens(tokens)
        return self.model.mtp[0](embeds, hidden, fb, pool.cache, rows, with_hidden=True)
