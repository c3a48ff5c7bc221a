"""Verification step of speculative decoding: which draft tokens a batch accepts, and the next token.

A draft model (DeepSeek's MTP module) proposes up to ``N`` tokens per request; the target model
scores them in one forward pass and returns ``N + 1`` rows of logits per request (one per draft
position plus one after the last draft). :func:`verify` decides, for every request at once, how
many drafts to keep and which token comes after them:

* Greedy rows (temperature 0) keep drafts while each equals the target's argmax and then emit
  the target's argmax, so the output is exactly what plain greedy decoding would produce.
* Sampled rows use speculative sampling (Leviathan et al. 2023, Chen et al. 2023): draft ``x``
  is kept with probability ``min(1, p(x) / q(x))``; at the first rejection the next token is
  drawn from ``normalize(max(0, p - q))``; after every draft is kept a bonus token is drawn from
  ``p`` at the next position. Each emitted token is then distributed exactly as if the target
  had sampled it alone. ``p`` and ``q`` are the processed distributions: temperature, min-p,
  top-k and top-p applied to the target's and the draft's logits with the request's settings,
  in the sampler's order, so that ``q`` is what the sampler really drew the drafts from.

Randomness comes from the sampler's counter-based RNG, keyed by the request's seed and the index
of the token concerned (``offset + position``), never by the batch: a request's result is the
same alone or anywhere in any batch. Verification draws from two streams of its own (one for
the acceptance tests, one for the correction or bonus token), derived from the seed, because the
draft is expected to sample with the sampler at the same ``(seed, offset)`` keys: reusing its
noise would tie the correction to the rejected draft token and bias the output.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from afd_engine.runtime.sampler import SamplingBatch, mix64, process_logits, random_uniforms

# Domain tags that turn a request's seed into the seeds of verification's own RNG streams
# (arbitrary odd 63-bit constants; mix64 then spreads them over all 64 bits).
_ACCEPT_STREAM = 0x2545F4914F6CDD1D
_DRAW_STREAM = 0x1B873593A5E1C3D7


class Verified(NamedTuple):
    """The outcome of :func:`verify` for a batch of ``B`` requests with up to ``N`` drafts each."""

    # [B] int64: how many leading draft tokens each request keeps, 0..num_drafts[b].
    accepted: torch.Tensor
    # [B, N + 1] int64: the kept drafts, then one token from the target (the correction at the
    # first rejection, or the bonus token when every draft was kept); -1 after it.
    tokens: torch.Tensor


def verify(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    batch: SamplingBatch,
    draft_logits: torch.Tensor | None = None,
) -> Verified:
    """Accept or reject every request's draft tokens and pick the token that follows.

    target_logits: [B, N + 1, V] (any float dtype, computed in fp32): row ``j`` is the target's
        prediction for the token at draft position ``j`` (row ``N`` follows the last draft).
        Logit processors that depend on earlier tokens (penalties, grammars) must already have
        been applied per position; this applies temperature, min-p, top-k and top-p.
    draft_tokens: [B, N] int64. Entries at positions >= ``num_drafts[b]`` are ignored (any value).
    num_drafts: [B] int64 in 0..N: how many drafts each request proposed.
    batch: the requests' sampling settings; ``batch.offsets[b]`` is the index, within request
        ``b``, of the token at position 0 (the first draft), so position ``j`` is token
        ``offsets[b] + j`` for the RNG.
    draft_logits: [B, N, V] raw draft logits (before temperature and filtering), from which the
        drafts were sampled with the same settings; ``q`` is their processed distribution.
        None for a deterministic draft (e.g. the draft's argmax): ``q`` is one-hot on the draft.
    """
    rows, positions, vocab = target_logits.shape
    n = positions - 1
    device = target_logits.device
    if draft_tokens.shape != (rows, n):
        raise ValueError(f"draft_tokens has shape {tuple(draft_tokens.shape)}, expected {(rows, n)}")
    if draft_logits is not None and draft_logits.shape != (rows, n, vocab):
        raise ValueError(f"draft_logits has shape {tuple(draft_logits.shape)}, expected {(rows, n, vocab)}")

    proposed = torch.arange(n, device=device)[None, :] < num_drafts[:, None]  # [B, N]
    drafts = draft_tokens.clamp(0, vocab - 1)  # padding stays addressable; `proposed` masks it
    argmax = torch.argmax(target_logits, dim=-1)  # [B, N + 1]: fp32 upcast would not change it
    greedy_accepted = _leading(proposed & (drafts == argmax[:, :n]))  # [B]
    if batch.all_greedy:
        return _assemble(draft_tokens, greedy_accepted, argmax.gather(1, greedy_accepted[:, None])[:, 0])

    greedy = batch.temperatures == 0.0  # [B]
    # Greedy rows get a dummy temperature of 1 (as in the sampler); their result is replaced below.
    temperatures = torch.where(greedy, torch.ones_like(batch.temperatures), batch.temperatures)
    p = _processed_probs(target_logits, batch, temperatures)  # [B, N + 1, V]
    p_drafts = p[:, :n].gather(2, drafts[:, :, None])[:, :, 0]  # [B, N]
    q = None if draft_logits is None else _processed_probs(draft_logits, batch, temperatures)  # [B, N, V]
    q_drafts = torch.ones_like(p_drafts) if q is None else q.gather(2, drafts[:, :, None])[:, :, 0]

    # Keep draft x with probability min(1, p(x)/q(x)): u < p/q, written without the division so
    # that q(x) = 0 needs no special case (u < 1, so q = p accepts surely).
    positions_idx = batch.offsets[:, None] + torch.arange(n, device=device)[None, :]  # [B, N]
    accept_seeds = _stream_seeds(batch.seeds, _ACCEPT_STREAM)[:, None].expand(rows, n)
    u = random_uniforms(accept_seeds.reshape(-1), positions_idx.reshape(-1), 1).view(rows, n)
    sampled_accepted = _leading(proposed & (u * q_drafts < p_drafts))  # [B]
    accepted = torch.where(greedy, greedy_accepted, sampled_accepted)

    # The next token, drawn at position `accepted`: from the residual max(0, p - q) after a
    # rejection, from p itself after every draft was kept (the bonus token).
    at = accepted[:, None, None].expand(rows, 1, vocab)
    target = p.gather(1, at)[:, 0]  # [B, V]
    dist = target
    if n > 0:
        rejected = accepted < num_drafts  # [B]
        before = accepted.clamp(max=n - 1)[:, None]  # [B, 1] (only read where rejected)
        if q is None:
            draft_q = torch.zeros_like(target).scatter_(1, drafts.gather(1, before), 1.0)
        else:
            draft_q = q.gather(1, before[:, :, None].expand(rows, 1, vocab))[:, 0]
        residual = (target - draft_q).clamp(min=0.0)
        # p > q somewhere is guaranteed at a rejection in exact arithmetic; should rounding leave
        # nothing, fall back to p rather than draw from an all-zero distribution.
        usable = rejected[:, None] & (residual.sum(dim=-1, keepdim=True) > 0.0)
        dist = torch.where(usable, residual, target)
    draw_seeds = _stream_seeds(batch.seeds, _DRAW_STREAM)
    gumbel = -torch.log(-torch.log(random_uniforms(draw_seeds, batch.offsets + accepted, vocab)))  # [B, V]
    drawn = torch.argmax(torch.log(dist) + gumbel, dim=-1)  # Gumbel-max; zero mass -> -inf, never chosen
    greedy_next = argmax.gather(1, accepted[:, None])[:, 0]
    return _assemble(draft_tokens, accepted, torch.where(greedy, greedy_next, drawn))


def _stream_seeds(seeds: torch.Tensor, stream: int) -> torch.Tensor:
    """A request's seed for one of verification's RNG streams ([B] int64 -> [B] int64)."""
    return mix64(seeds ^ stream)


def _leading(mask: torch.Tensor) -> torch.Tensor:
    """[B, N] bool -> [B] int64: how many leading entries of each row are True."""
    return torch.cumprod(mask.to(torch.int64), dim=1).sum(dim=1)


def _processed_probs(logits: torch.Tensor, batch: SamplingBatch, temperatures: torch.Tensor) -> torch.Tensor:
    """[B, M, V] logits -> [B, M, V] fp32 probabilities after the sampler's processing, per row.

    The same steps in the same order as :class:`~afd_engine.runtime.sampler.Sampler`
    (`sampler.process_logits`), so that these are the distributions it samples from.
    """
    rows, m, vocab = logits.shape
    flat = process_logits(logits.to(torch.float32).reshape(rows * m, vocab), batch, temperatures, repeat=m)
    return torch.softmax(flat, dim=-1).view(rows, m, vocab)


def _assemble(draft_tokens: torch.Tensor, accepted: torch.Tensor, next_token: torch.Tensor) -> Verified:
    """The kept drafts, then ``next_token`` at position ``accepted``, then -1."""
    rows, n = draft_tokens.shape
    padded = torch.cat([draft_tokens, draft_tokens.new_full((rows, 1), -1)], dim=1)  # [B, N + 1]
    kept = torch.arange(n + 1, device=draft_tokens.device)[None, :] < accepted[:, None]
    tokens = torch.where(kept, padded, torch.full_like(padded, -1))
    tokens.scatter_(1, accepted[:, None], next_token[:, None].to(tokens.dtype))
    return Verified(accepted, tokens)
