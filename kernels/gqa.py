"""Grouped-query attention over a paged K/V cache: torch reference implementations.

The cache of one layer is a flat tensor ``[num_slots, 2 * KVH * D]``: per token the keys of its
KVH key/value heads (``[:KVH * D]``, head-major) followed by their values (``[KVH * D:]``). Query
head h reads key/value head ``h // (H / KVH)``. Slots come from the same page tables as MLA's
(see kernels.mla.PagedKV); padding entries point at slot 0 and are masked out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.mla import PagedKV


def split_kv(cache: torch.Tensor, slots: torch.Tensor, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cache [S, 2 * KVH * D], slots [B, L] -> keys, values [B, KVH, L, D] (one gather)."""
    B, L = slots.shape
    kv = cache.index_select(0, slots.flatten()).view(B, L, 2, num_kv_heads, -1)  # [B, L, 2, KVH, D]
    return kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)


def gqa_extend_attention(q, cache, slots, kv_lens, q_positions, num_kv_heads: int, scale: float) -> torch.Tensor:
    """Causal attention of padded query blocks against their sequences' cached keys and values.

    q [B, Q, H, D]; cache [S, 2 * KVH * D]; slots [B, L] int64 (padded); kv_lens [B] int64;
    q_positions [B, Q] int64 (padding rows: 0). H must be a multiple of KVH. Returns [B, Q, H, D].
    """
    B, Q, H, D = q.shape
    k, v = split_kv(cache, slots, num_kv_heads)  # [B, KVH, L, D]
    group = H // num_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [B, H, L, D]
    key_pos = torch.arange(slots.shape[1], device=slots.device)
    mask = (key_pos[None, None, :] <= q_positions[:, :, None]) & (key_pos[None, None, :] < kv_lens[:, None, None])
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=scale)
    return out.transpose(1, 2)  # [B, Q, H, D]


def gqa_decode_attention(q: torch.Tensor, cache: torch.Tensor, kv: PagedKV, num_kv_heads: int, scale: float):
    """One query token per sequence against its whole cache: q [B, H, D] -> [B, H, D].

    kv: where the tokens are (the slot tables and bias are used here; paged kernels read
    kv.pages, kv.kv_lens and kv.page_size instead).
    """
    B, H, D = q.shape
    k, v = split_kv(cache, kv.slots, num_kv_heads)  # [B, KVH, L, D]
    qg = q.view(B, num_kv_heads, H // num_kv_heads, D)  # query heads grouped by their K/V head
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale + kv.bias[:, :, None]  # [B, KVH, G, L]
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).view(B, H, D)


class TorchGQA:
    """The torch reference backend of GQA over the paged cache (any device, any float dtype)."""

    name = "torch"

    def extend(self, q, cache, slots, kv_lens, q_positions, num_kv_heads: int, scale: float):
        """See `gqa_extend_attention`: padded query blocks [B, Q, H, D] -> [B, Q, H, D]."""
        return gqa_extend_attention(q, cache, slots, kv_lens, q_positions, num_kv_heads, scale)

    def decode(self, q, cache, kv: PagedKV, num_kv_heads: int, scale: float):
        """See `gqa_decode_attention`: one query per sequence [B, H, D] -> [B, H, D]."""
        return gqa_decode_attention(q, cache, kv, num_kv_heads, scale)
