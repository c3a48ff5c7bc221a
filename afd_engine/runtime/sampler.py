"""Batched next-token sampling: greedy, temperature, top-k, top-p, seeded and batch-invariant.

Why a counter-based RNG instead of one ``torch.Generator`` per request:

* A per-request generator means a Python loop over the batch (up to hundreds of rows) and
  one small kernel launch per row on every decoding step.
* A shared generator makes a request's draws depend on which other requests happen to be in
  the batch and on its row position, so a seeded request would not be reproducible.

Instead every random number is a pure function of ``(seed, offset, token index)``: a
splitmix64 hash evaluated with int64 tensor ops (wraparound multiplication, masked shifts).
The whole ``[B, V]`` noise tensor comes from a handful of element-wise kernels, works on any
device, and a request's draw depends only on its own seed, on how many tokens it has already
generated (``offset``) and on its own logits. The draw itself uses the Gumbel-max trick:
``argmax(log p_i + g_i)`` with ``g_i = -log(-log u_i)`` is an exact sample from ``p``, and
turns sampling into one more element-wise op plus an argmax, with no cumulative-sum search.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd_engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def _signed64(value: int) -> int:
    """The int64 (two's complement) reading of the low 64 bits of a Python int."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


# splitmix64 constants, stored as the signed int64 values torch scalars must be.
_GOLDEN = _signed64(0x9E3779B97F4A7C15)
_MIX1 = _signed64(0xBF58476D1CE4E5B9)
_MIX2 = _signed64(0x94D049BB133111EB)

# Uniforms use 23 random bits: (k + 0.5) / 2**23 is exact in float32 for every k, so the
# extremes are 2**-24 and 1 - 2**-24 and never round to 0 or 1 (which would make log(-log u)
# infinite). 24 bits would round the largest value up to exactly 1.0.
_UNIFORM_BITS = 23


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's ``>>`` is arithmetic: it copies the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser: a bijective, well-avalanched mix of 64-bit integers (int64 tensor)."""
    x = (x ^ _shr(x, 30)) * _MIX1  # int64 multiplication wraps modulo 2**64
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def random_bits(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """64 random bits per (row, token), a pure function of (seed, offset, token index).

    seeds, offsets: [B] int64 -> [B, V] int64.
    """
    # One independent stream key per (seed, offset) pair ...
    key = mix64(mix64(seeds + _GOLDEN) + offsets * _GOLDEN)  # [B]
    # ... then the token index walks that stream exactly as splitmix64 walks its state.
    index = torch.arange(1, vocab_size + 1, device=seeds.device, dtype=torch.int64)  # [V]
    return mix64(key[:, None] + index[None, :] * _GOLDEN)  # [B, V]


def random_uniforms(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniforms strictly inside (0, 1), float32 [B, V]; see :func:`random_bits`."""
    top_bits = _shr(random_bits(seeds, offsets, vocab_size), 64 - _UNIFORM_BITS)  # [B, V]
    return (top_bits.to(torch.float32) + 0.5) * (2.0**-_UNIFORM_BITS)


def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Set to -inf every token that top-k, then top-p (on the top-k renormalised distribution), drops.

    logits: [B, V] float32 (already divided by the temperature); top_ks [B] int64; top_ps [B] float32.
    Top-p keeps the smallest set of most probable tokens whose probability sums to >= top_p,
    i.e. a token stays if the mass strictly before it is < top_p, so the top token always stays.
    """
    # Stable sort: among equal logits the lower token index ranks first, deterministically.
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)  # [B, V]
    ranks = torch.arange(logits.shape[-1], device=logits.device)  # [V]
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_ks[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)  # [B, V]
    mass_before = torch.cumsum(probs, dim=-1) - probs  # [B, V] exclusive prefix sum
    # Rows with top_p == 1 are exempt: rounding can push the tail's prefix sum to >= 1.0.
    drop_sorted = (mass_before >= top_ps[:, None]) & (top_ps[:, None] < 1.0)
    drop_sorted |= torch.isneginf(sorted_logits)
    drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)  # back to token order
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Set to -inf every token whose probability is below min_p times the most likely token's.

    logits: [B, V] float32 (already divided by the temperature); min_ps [B] float32, 0 keeps all.
    p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p), with no softmax needed.
    """
    top = logits.max(dim=-1, keepdim=True).values  # [B, 1]
    threshold = top + torch.log(min_ps)[:, None]  # log(0) = -inf: nothing dropped
    return logits.masked_fill(logits < threshold, float("-inf"))


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters of one step, as tensors. Shapes [B]."""

    temperatures: torch.Tensor  # float32, 0 for greedy rows
    top_ps: torch.Tensor  # float32
    top_ks: torch.Tensor  # int64, vocab_size where disabled
    seeds: torch.Tensor  # int64
    offsets: torch.Tensor  # int64: index of the token being sampled within its request
    all_greedy: bool
    # False when no sampled row uses top-k or top-p: the sampler then skips the [B, V] sort.
    any_top_k_top_p: bool = True
    min_ps: torch.Tensor | None = None  # float32 [B], None when no sampled row uses min_p

    @staticmethod
    def greedy(device: torch.device | str = "cpu") -> SamplingBatch:
        """A batch whose rows all take the argmax: no per-row settings to gather."""
        none = torch.empty(0, device=device)
        return SamplingBatch(none, none, none.long(), none.long(), none.long(), True, False, None)

    @staticmethod
    def build(
        params: list[SamplingParams],
        seeds: list[int],
        offsets: list[int],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> SamplingBatch:
        """Gather the rows' settings into tensors, once per step (seeds reduced to 64 bits)."""
        sampled = [not p.greedy for p in params]
        if not any(sampled):
            return SamplingBatch.greedy(device)
        top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        filtered = any(s and (k < vocab_size or p.top_p < 1.0) for s, k, p in zip(sampled, top_ks, params))

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return SamplingBatch(
            temperatures=tensor([float(p.temperature) for p in params], torch.float32),
            top_ps=tensor([float(p.top_p) for p in params], torch.float32),
            top_ks=tensor(top_ks, torch.int64),
            seeds=tensor([_signed64(s) for s in seeds], torch.int64),
            offsets=tensor(list(offsets), torch.int64),
            all_greedy=not any(sampled),
            any_top_k_top_p=filtered,
            min_ps=tensor([float(p.min_p) for p in params], torch.float32)
            if any(s and p.min_p > 0.0 for s, p in zip(sampled, params))
            else None,
        )


class Sampler:
    """Picks the next token of every row of a batch in one vectorised pass."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits [B, V] (any float dtype; computed in fp32) -> next token ids [B] int64."""
        if batch.all_greedy:
            # Upcasting to fp32 is exact, so argmax of the raw logits is the same token.
            return torch.argmax(logits, dim=-1)
        logits = logits.to(torch.float32)
        greedy = batch.temperatures == 0.0  # [B]
        sampled = self._sample(logits, batch, greedy)  # [B]
        return torch.where(greedy, torch.argmax(logits, dim=-1), sampled)

    @staticmethod
    def _sample(logits: torch.Tensor, batch: SamplingBatch, greedy: torch.Tensor) -> torch.Tensor:
        """Temperature, top-k/top-p, then Gumbel-max; greedy rows get a dummy temperature of 1."""
        temperatures = torch.where(greedy, torch.ones_like(batch.temperatures), batch.temperatures)
        scaled = process_logits(logits, batch, temperatures)  # [B, V]
        uniforms = random_uniforms(batch.seeds, batch.offsets, logits.shape[-1])  # [B, V]
        gumbel = -torch.log(-torch.log(uniforms))  # [B, V]
        # log_softmax(scaled) differs from scaled by a per-row constant, which argmax ignores;
        # filtered tokens stay at -inf and so are never chosen.
        return torch.argmax(scaled + gumbel, dim=-1)


def process_logits(logits: torch.Tensor, batch: SamplingBatch, temperatures: torch.Tensor, repeat: int = 1):
    """[R * repeat, V] logits scaled by each row's temperature, then min-p, top-k and top-p: what the
    sampler draws from (filtered tokens at -inf). `repeat`: consecutive rows per request of `batch`
    (speculative verification processes every position of a request alike)."""

    def per_row(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(repeat) if repeat > 1 else t

    scaled = logits / per_row(temperatures)[:, None]
    if batch.min_ps is not None:
        scaled = apply_min_p(scaled, per_row(batch.min_ps))
    if batch.any_top_k_top_p:
        scaled = apply_top_k_top_p(scaled, per_row(batch.top_ks), per_row(batch.top_ps))
    return scaled
