"""Sparse MLA (DeepSeek-V3.2): each query token attends only to the cached tokens its indexer chose.

The core of the absorbed form of MLA decode (kernels/mla.py: `sparse_mla_attention` absorbs the
query and unabsorbs the output around it), with a per-query list of cache slots in
place of a per-sequence slot table: query token t attends to the slots `indices[t, :]`, entries
of -1 being unused. Prefill (chunked too) and decode run through it alike: a prefill token
attends to at most `index_topk` tokens, so the expanded per-head form buys nothing.

The cache passed in is MLA's share of each row, `[S, C + R]`; with sparse attention it is a
strided view of the wider rows that also hold the indexer's key (models/indexer.py).
"""

from __future__ import annotations

import torch

# Query tokens gathered at once by the torch reference: bounds its [tokens, K, C + R] gather.
_TOKENS_PER_BLOCK = 256


def sparse_mla_core(
    q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, indices: torch.Tensor, scale: float
) -> torch.Tensor:
    """q_latent [T, H, C], q_pe [T, H, R]; cache [S, C + R] (rows may be strided); indices [T, K]
    int (cache slots, -1: unused; every row names at least one slot). Returns out_latent [T, H, C]:
    per head, softmax(scale * (q_latent . latent_j + q_pe . k_pe_j)) over the named slots j,
    applied to latent_j."""
    C = q_latent.shape[-1]
    out = q_latent.new_empty(q_latent.shape)
    for lo in range(0, len(indices), _TOKENS_PER_BLOCK):
        hi = min(lo + _TOKENS_PER_BLOCK, len(indices))
        idx = indices[lo:hi].long()
        kv = cache.index_select(0, idx.clamp(min=0).flatten()).view(*idx.shape, cache.shape[-1])  # [t, K, C + R]
        latent, k_pe = kv[..., :C], kv[..., C:]
        scores = torch.baddbmm(
            torch.bmm(q_pe[lo:hi], k_pe.transpose(1, 2)), q_latent[lo:hi], latent.transpose(1, 2)
        )  # [t, H, K]
        bias = torch.zeros(idx.shape, dtype=torch.float32, device=idx.device).masked_fill_(idx < 0, float("-inf"))
        probs = torch.softmax(scores.float() * scale + bias[:, None, :], dim=-1).to(latent.dtype)
        out[lo:hi] = torch.bmm(probs, latent)
    return out
