"""MLA attention over a paged latent KV cache: torch reference implementations.

The cache of one layer is a flat tensor ``[num_slots, kv_lora_rank + rope_dim]``: per token the
normalised latent ``c_kv`` followed by the rotated shared key ``k_pe``. A request's tokens live in
slots named by a slot table (built from its pages by the runtime); padding entries point at slot 0
and are masked out.

Two forms of the same attention:

* extend (prefill, chunked prefill): the latent is expanded to per-head keys and values through
  ``kv_b_proj`` and attended with a causal mask; cheap when queries are many.
* decode (absorbed): ``W_UK`` is folded into the query and ``W_UV`` into the output, so attention
  runs directly against the latent; no per-token expansion of the cache.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels.sparse_mla import sparse_mla_core


class PagedKV(NamedTuple):
    """Where each decode sequence's cached tokens live, in two equivalent forms: per-token slot
    tables (what the torch reference gathers with) and the page table (what paged kernels read).

    slots [B, L] int64: cache slot of token j of sequence b (padding: slot 0).
    bias [B, 1, L] fp32: 0 for tokens j < kv_lens[b], -inf for padding.
    pages [B, P] int64: page ids of sequence b in order, P >= ceil(max(kv_lens) / page_size)
    (entries past a sequence's last page are padding and must not be read).
    kv_lens [B] int64: cached tokens per sequence, this step's token included.
    page_size: tokens per page; token j of sequence b is at slot pages[b, j // page_size] *
    page_size + j % page_size of the cache [num_slots, C + R].
    """

    slots: torch.Tensor
    bias: torch.Tensor
    pages: torch.Tensor
    kv_lens: torch.Tensor
    page_size: int


def gather_latent(cache: torch.Tensor, slots: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cache [S, C + R], slots [B, L] -> latent [B, L, C], k_pe [B, L, R] (one gather)."""
    kv = cache.index_select(0, slots.flatten()).view(*slots.shape, cache.shape[-1])  # [B, L, C + R]
    return kv[..., :kv_lora_rank], kv[..., kv_lora_rank:]


def mla_extend_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    kv_lens: torch.Tensor,
    q_positions: torch.Tensor,
    w_kv_b: torch.Tensor,
    v_head_dim: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of padded query blocks against their sequences' cached latents.

    q_nope [B, Q, H, Dn], q_pe [B, Q, H, R]: queries, padded per sequence.
    slots [B, L] int64: cache slots of each sequence's tokens 0..L-1 (padded).
    kv_lens [B] int64; q_positions [B, Q] int64 (padding rows: 0).
    w_kv_b [H * (Dn + Dv), C]: the kv_b_proj weight.
    Returns [B, Q, H, Dv].
    """
    B, Q, H, Dn = q_nope.shape
    latent, k_pe = gather_latent(cache, slots, w_kv_b.shape[1])  # [B, L, C], [B, L, R]
    L = slots.shape[1]
    kv = F.linear(latent, w_kv_b).view(B, L, H, Dn + v_head_dim)
    k_nope, v = kv.split([Dn, v_head_dim], dim=-1)
    k = torch.cat((k_nope, k_pe[:, :, None, :].expand(B, L, H, k_pe.shape[-1])), dim=-1)  # [B, L, H, Dqk]
    q = torch.cat((q_nope, q_pe), dim=-1)  # [B, Q, H, Dqk]
    key_pos = torch.arange(L, device=slots.device)
    mask = (key_pos[None, None, :] <= q_positions[:, :, None]) & (key_pos[None, None, :] < kv_lens[:, None, None])
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None], scale=scale
    )  # [B, H, Q, Dv]
    return out.transpose(1, 2)


def absorb_kv_b(w_kv_b: torch.Tensor, num_heads: int, qk_nope_head_dim: int, v_head_dim: int):
    """Split kv_b_proj [H * (Dn + Dv), C] into W_UK [H, Dn, C] and W_UV [H, Dv, C] for decode."""
    w = w_kv_b.view(num_heads, qk_nope_head_dim + v_head_dim, -1)
    return w[:, :qk_nope_head_dim].contiguous(), w[:, qk_nope_head_dim:].contiguous()


def mla_decode_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    kv: PagedKV,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence against its whole cached latent, in the absorbed form.

    q_nope [B, H, Dn], q_pe [B, H, R]; cache [S, C + R]; kv: where the tokens are (slot tables
    used here); w_uk [H, Dn, C], w_uv [H, Dv, C]. Returns [B, H, Dv].
    """
    q_latent = absorb_query(q_nope, w_uk)  # [B, H, C]
    return unabsorb_output(mla_decode_core(q_latent, q_pe, cache, kv, scale), w_uv)


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [B, H, Dn], W_UK [H, Dn, C] -> the query in latent space [B, H, C]."""
    return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)


def unabsorb_output(out_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """out_latent [B, H, C], W_UV [H, Dv, C] -> per-head values [B, H, Dv]."""
    return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def sparse_mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    indices: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """DeepSeek-V3.2's sparse attention in the absorbed form: each query token attends to its own
    chosen cache slots. q_nope [T, H, Dn], q_pe [T, H, R]; cache [S, C + R] (rows may be strided);
    indices [T, K] (-1: unused; see kernels.sparse_mla.sparse_mla_core); w_uk [H, Dn, C],
    w_uv [H, Dv, C]. Returns [T, H, Dv]."""
    return unabsorb_output(sparse_mla_core(absorb_query(q_nope, w_uk), q_pe, cache, indices, scale), w_uv)


def mla_decode_core(
    q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, kv: PagedKV, scale: float
) -> torch.Tensor:
    """The attention core of absorbed MLA decode (what FlashMLA computes).

    q_latent [B, H, C], q_pe [B, H, R]; cache [S, C + R]. Returns out_latent [B, H, C]: per head,
    softmax(scale * (q_latent . latent_j + q_pe . k_pe_j)) over j < kv_lens[b], applied to latent_j.
    """
    latent, k_pe = gather_latent(cache, kv.slots, q_latent.shape[-1])  # [B, L, C], [B, L, R]
    scores = torch.baddbmm(torch.bmm(q_pe, k_pe.transpose(1, 2)), q_latent, latent.transpose(1, 2))  # [B, H, L]
    probs = torch.softmax(scores.float() * scale + kv.bias, dim=-1).to(latent.dtype)
    return torch.bmm(probs, latent)  # [B, H, C]


class TorchMLA:
    """The torch reference backend of MLA over the paged latent cache (any device, any float dtype).

    Page size: any (the kernels read the cache through slot tables, not pages). Head dims: any.
    """

    name = "torch"

    def absorb(self, w_kv_b: torch.Tensor, num_heads: int, qk_nope_head_dim: int, v_head_dim: int):
        """See `absorb_kv_b`: kv_b_proj [H * (Dn + Dv), C] -> (W_UK [H, Dn, C], W_UV [H, Dv, C])."""
        return absorb_kv_b(w_kv_b, num_heads, qk_nope_head_dim, v_head_dim)

    def extend(self, q_nope, q_pe, cache, slots, kv_lens, q_positions, w_kv_b, v_head_dim: int, scale: float):
        """See `mla_extend_attention`: padded query blocks [B, Q, H, *] -> [B, Q, H, Dv]."""
        return mla_extend_attention(q_nope, q_pe, cache, slots, kv_lens, q_positions, w_kv_b, v_head_dim, scale)

    def decode(self, q_nope, q_pe, cache, kv: PagedKV, w_uk, w_uv, scale: float):
        """See `mla_decode_attention`: one query per sequence [B, H, *] -> [B, H, Dv]."""
        return mla_decode_attention(q_nope, q_pe, cache, kv, w_uk, w_uv, scale)

    def sparse(self, q_nope, q_pe, cache, indices, w_uk, w_uv, scale: float):
        """See `sparse_mla_attention`: query tokens [T, H, *] attending to the cache slots
        `indices` [T, K] (-1: none) -> [T, H, Dv]."""
        return sparse_mla_attention(q_nope, q_pe, cache, indices, w_uk, w_uv, scale)
