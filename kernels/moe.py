"""Routed-expert compute: torch reference implementations of a fused MoE.

Experts are stacked: ``w13 [E, 2I, H]`` (gate rows then up rows) and ``w2 [E, H, I]``.
``topk_ids`` index these local experts; -1 marks a slot whose expert lives elsewhere (another
rank in expert parallelism), which contributes nothing here.

Three forms of the same sum: two batched matmuls over per-expert blocks padded to the fullest
expert; the same over only the experts a small batch uses, when that is at most half of them; and
one matmul pair per expert, straight on the stacked weights, for a batch that uses at most
`_LOOP_MAX_EXPERTS` experts (a decode step of one or two sequences: the batched forms first copy
the experts' weights into blocks) and for routings so skewed that the padded blocks would be
mostly padding. The loop wins for one token over a couple of experts and loses once a few tokens
spread over more of them (the CPU timings that set `_LOOP_MAX_EXPERTS`: benchmarks/README.md, "Lab
notes").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Above this padding overhead the grouped form wastes more than the per-expert loop costs.
_MAX_PAD_RATIO = 4
# Up to this many experts used, the per-expert loop beats copying their weights into blocks.
_LOOP_MAX_EXPERTS = 4


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """Weighted sum over each token's local experts of SwiGLU(x).

    x [T, H]; topk_ids [T, K] int64 (local expert index or -1); topk_weights [T, K] fp32.
    Returns [T, H] in x.dtype.
    """
    T, K = topk_ids.shape
    E = w13.shape[0]
    if T == 0:
        return x.new_zeros(x.shape)
    flat = topk_ids.reshape(-1)
    bucket = torch.where(flat >= 0, flat, E)  # not-local slots go to a dropped bucket E
    counts = torch.bincount(bucket, minlength=E + 1)[:E]
    cap = int(counts.max())
    if cap == 0:
        return x.new_zeros(x.shape)
    active = counts.nonzero().flatten()
    if active.numel() <= _LOOP_MAX_EXPERTS or E * cap > _MAX_PAD_RATIO * T * K:
        return _moe_per_expert(x, w13, w2, topk_ids, topk_weights, active)
    if 2 * active.numel() <= E:  # a small batch: read the weights of the experts it uses only
        slot_of = torch.full((E + 1,), active.numel(), dtype=bucket.dtype, device=bucket.device)
        slot_of[active] = torch.arange(active.numel(), device=bucket.device)
        bucket, counts, w13, w2 = slot_of[bucket], counts[active], w13[active], w2[active]
    return _moe_grouped(x, w13, w2, bucket, topk_weights.reshape(-1), counts, cap, K)


def _moe_grouped(x, w13, w2, bucket, weights, counts, cap, K):
    """All experts in two batched matmuls over per-expert blocks padded to `cap` rows."""
    E, H = w13.shape[0], x.shape[1]
    sorted_e, order = bucket.sort(stable=True)
    keep = sorted_e < E
    sorted_e, order = sorted_e[keep], order[keep]
    starts = torch.cumsum(counts, 0) - counts  # [E]
    row = torch.arange(sorted_e.numel(), device=x.device) - starts[sorted_e]  # position inside the block
    token = order // K
    blocks = x.new_zeros(E, cap, H)
    blocks[sorted_e, row] = x[token]
    h = torch.bmm(blocks, w13.transpose(1, 2))  # [E, cap, 2I]
    gate, up = h.chunk(2, dim=-1)
    y = torch.bmm(F.silu(gate) * up, w2.transpose(1, 2))  # [E, cap, H]
    contrib = y[sorted_e, row] * weights[order, None]  # [N, H] fp32 weights promote
    out = torch.zeros(x.shape, dtype=contrib.dtype, device=x.device)
    out.index_add_(0, token, contrib)
    return out.to(x.dtype)


def _moe_per_expert(x, w13, w2, topk_ids, topk_weights, active):
    """One matmul pair per expert that received tokens (`active`, ascending)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in active.tolist():
        token, slot = torch.where(topk_ids == e)
        gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e])
        out.index_add_(0, token, y * topk_weights[token, slot, None])
    return out.to(x.dtype)


class TorchMoE:
    """The torch reference backend of routed-expert compute (any device, any float dtype)."""

    name = "torch"

    def fused_moe(
        self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """See the module function `fused_moe`: x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_ids [T, K]
        int64 local expert or -1, topk_weights [T, K] fp32 -> [T, H] in x.dtype."""
        return fused_moe(x, w13, w2, topk_ids, topk_weights)
