"""What bends a step's logits before the sampler picks: grammars, logit bias, min_tokens, penalties.

Built once per step on the scheduling thread (:meth:`LogitControls.build`, from the rows that
sample), applied on the forward thread between the forward and the sampler, so with overlapped
scheduling the step sees the tokens its predecessor sampled: a grammar's next-token mask and the
penalties' token counts both depend on them. Every operation is batched over the rows that use it
(index_put / where over [rows, V]); the only per-row Python is xgrammar's matcher calls, one per
constrained row and step.

Order and semantics follow vLLM: grammar mask, logit bias, min_tokens (EOS and stop token ids
forbidden), then the penalties: repetition (prompt and output tokens: positive logits divided,
negative ones multiplied), frequency (minus penalty x count of each output token), presence (minus
penalty once per output token). Temperature, min_p, top-k and top-p follow in the sampler. The
logprobs a request asks for stay those of the model's own distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd_engine.runtime.grammar import Matcher, apply_bitmask, new_bitmask
from afd_engine.runtime.request import Request


class Penalties:
    """One request's token counts for the penalties (forward thread only after creation)."""

    __slots__ = ("counts", "seen_in_prompt")

    def __init__(self, req: Request, vocab_size: int, device: torch.device) -> None:
        ids = torch.tensor(req.output_ids, dtype=torch.int64)
        self.counts = torch.bincount(ids, minlength=vocab_size)[:vocab_size].to(device, torch.int32)
        self.seen_in_prompt = None
        if req.params.repetition_penalty != 1.0:
            seen = torch.zeros(vocab_size, dtype=torch.bool)
            seen[torch.tensor(req.prompt_ids, dtype=torch.int64)] = True
            self.seen_in_prompt = seen.to(device)


@dataclass
class LogitControls:
    """One step's processing of its sampling rows (row i = the step's i-th sampler)."""

    vocab_size: int
    device: torch.device
    grammar_rows: list[int]
    matchers: list[Matcher]
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, token ids, values
    banned: tuple[torch.Tensor, torch.Tensor] | None  # rows, token ids set to -inf (min_tokens)
    penalty_rows: list[int]
    penalties: list[Penalties]
    presence: torch.Tensor | None = None  # [P] per penalized row
    frequency: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    counts: torch.Tensor | None = None  # [P, V]: the penalized rows' counts, stacked once in apply

    @staticmethod
    def build(
        reqs: list[Request],
        offsets: list[int],
        stop_ids: frozenset[int],
        vocab_size: int,
        device: torch.device,
    ) -> LogitControls | None:
        """None when no row needs processing. `offsets[i]`: how many tokens row i has generated
        before this one. A constrained request's grammar is compiled before it is scheduled."""
        if not any(r.params.processed for r in reqs):
            return None
        grammar_rows, matchers, penalty_rows, penalties = [], [], [], []
        bias_rows, bias_ids, bias_values, ban_rows, ban_ids = [], [], [], [], []
        for i, (req, offset) in enumerate(zip(reqs, offsets)):
            p = req.params
            if not p.processed:
                continue
            if p.guide is not None:
                if req.matcher is None:
                    req.matcher = Matcher(req.grammar, req.output_ids)
                grammar_rows.append(i)
                matchers.append(req.matcher)
            for token, value in p.logit_bias:
                bias_rows.append(i)
                bias_ids.append(token)
                bias_values.append(value)
            if offset < p.min_tokens:
                banned = (stop_ids if not p.ignore_eos else frozenset()) | set(p.stop_token_ids)
                ban_rows += [i] * len(banned)
                ban_ids += sorted(banned)
            if p.penalized:
                if req.penalties is None:
                    req.penalties = Penalties(req, vocab_size, device)
                penalty_rows.append(i)
                penalties.append(req.penalties)

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        controls = LogitControls(
            vocab_size,
            device,
            grammar_rows,
            matchers,
            (tensor(bias_rows, torch.int64), tensor(bias_ids, torch.int64), tensor(bias_values, torch.float32))
            if bias_rows
            else None,
            (tensor(ban_rows, torch.int64), tensor(ban_ids, torch.int64)) if ban_rows else None,
            penalty_rows,
            penalties,
        )
        if penalty_rows:
            params = [reqs[i].params for i in penalty_rows]
            controls.presence = tensor([p.presence_penalty for p in params], torch.float32)
            controls.frequency = tensor([p.frequency_penalty for p in params], torch.float32)
            controls.repetition = tensor([p.repetition_penalty for p in params], torch.float32)
        return controls

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed logits [B, V] float32, a new tensor (the model's logits stay as they are,
        for the logprobs)."""
        logits = logits.to(torch.float32, copy=True)
        if self.grammar_rows:
            bitmask = new_bitmask(logits.shape[0], self.vocab_size)
            for row, matcher in zip(self.grammar_rows, self.matchers):
                matcher.fill(bitmask, row)
            apply_bitmask(logits, bitmask, self.grammar_rows)
        if self.bias is not None:
            rows, ids, values = self.bias
            logits.index_put_((rows, ids), values, accumulate=True)
        if self.banned is not None:
            logits.index_put_(self.banned, torch.tensor(float("-inf"), device=logits.device))
        if self.penalty_rows:
            rows = torch.tensor(self.penalty_rows, device=logits.device)
            logits[rows] = self._penalize(logits[rows])
        return logits

    def _penalize(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [P, V] of the penalized rows -> penalized."""
        counts = self.counts = torch.stack([p.counts for p in self.penalties])  # [P, V]
        generated = counts > 0
        seen = generated
        prompt = [p.seen_in_prompt for p in self.penalties]
        if any(s is not None for s in prompt):
            none = torch.zeros(self.vocab_size, dtype=torch.bool, device=logits.device)
            seen = generated | torch.stack([none if s is None else s for s in prompt])
        rep = self.repetition[:, None]
        repeated = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, repeated, logits)
        logits = logits - self.frequency[:, None] * counts
        return logits - self.presence[:, None] * generated

    def accept(self, tokens: torch.Tensor, skip: frozenset[int] = frozenset()) -> list[int]:
        """After sampling: advances the grammars and counts past the sampled tokens; returns the
        rows whose grammar ended with this token (their output is complete). Grammar rows in `skip`
        are advanced by their owner (speculative decoding: runtime/spec_step.py)."""
        ended = []
        if self.grammar_rows:
            values = tokens.tolist()
            for row, matcher in zip(self.grammar_rows, self.matchers):
                if row not in skip and matcher.accept(values[row]):
                    ended.append(row)
        if self.penalty_rows:
            chosen = tokens[torch.tensor(self.penalty_rows, device=tokens.device)]
            counts = self.counts  # (apply stacked them for this step)
            counts[torch.arange(len(self.penalties), device=counts.device), chosen] += 1
            torch._foreach_copy_([p.counts for p in self.penalties], list(counts.unbind(0)))
        return ended
