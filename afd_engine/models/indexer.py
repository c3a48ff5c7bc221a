"""DeepSeek-V3.2's lightning indexer: which cached tokens each query token's MLA attends to.

Per token the indexer projects `index_n_heads` query heads from the q-LoRA residual (the output of
`q_a_layernorm`) and one key from the hidden state (LayerNorm), both rotated over their first
`qk_rope_head_dim` dimensions by halves (MLA itself pairs neighbours). A cached token j scores

    I[t, j] = sum_h w[t, h] * relu(scale * q[t, h] . k[j]),   w = weights_proj(x) / sqrt(heads)

and query t keeps its `index_topk` best causal tokens. The reference scores with a Hadamard
rotation and fp8 operands; this is the plain-precision equivalent (the rotation preserves dot
products), computed in fp32 as transformers' DeepseekV32 does.

The key is cached in the same row as MLA's latent (`[latent | k_pe | index key]`, see
ModelConfig.kv_cache_dim), so pages, prefix-cache entries and PD transfers carry it unchanged.
With --index-cache-dtype fp8 the key is stored as the reference stores it: e4m3 values scaled by
the token's largest magnitude, followed by that fp32 scale's bytes (132 bytes at index_head_dim 128).

The selection comes back as cache slots per query token, `-1` where a query has fewer causal
tokens than `index_topk`: what the sparse MLA kernels take (kernels/sparse_mla.py).
"""

from __future__ import annotations

import torch
from torch import nn

from afd_engine.model_config import ModelConfig
from afd_engine.models.forward_batch import ForwardBatch
from afd_engine.models.norm import linear
from afd_engine.models.rope import rotate

# Scores computed at once (query tokens x heads x keys): bounds the indexer's working memory.
_SCORE_BUDGET = 1 << 24
_E4M3_MAX = 448.0  # the largest finite float8_e4m3fn value: a token's largest key value maps onto it


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads, self.dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.rot = cfg.qk_rope_head_dim
        self.wq_b = linear(cfg.q_lora_rank, self.heads * self.dim)
        self.wk = linear(cfg.hidden_size, self.dim)
        self.k_norm = nn.LayerNorm(self.dim, eps=1e-6)
        self.weights_proj = linear(cfg.hidden_size, self.heads)  # held in fp32 (keep_fp32), as the reference
        self.scale = self.dim**-0.5
        self.fp8 = cfg.index_cache_fp8  # keys cached as e4m3 bytes and a scale (--index-cache-dtype fp8)

    def keep_fp32(self) -> None:
        """The head weights stay fp32 whatever the model's dtype (the reference keeps them so)."""
        self.weights_proj.float()

    def forward(
        self, x: torch.Tensor, q_resid: torch.Tensor, fb: ForwardBatch, cos_sin, keys: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H] hidden states, q_resid [T, q_lora_rank]; keys [S, index_head_dim]: this layer's
        index keys (a view of the cache rows), this step's written here first. Returns the chosen
        cache slots [T, K] int64 (-1: none), K = min(index_topk, longest context of the step)."""
        T = x.shape[0]
        cos, sin = cos_sin
        q = self._rope(self.wq_b(q_resid).view(T, self.heads, self.dim), cos, sin).float()
        self._store(keys, fb.out_slots, self._rope(self.k_norm(self.wk(x)), cos, sin))
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.heads**-0.5  # [T, h]
        n_ext = fb.num_extend_tokens
        parts = []
        if n_ext:
            parts.append(self._extend(q[:n_ext], weights[:n_ext], fb, keys))
        if T > n_ext:
            parts.append(self._decode(q[n_ext:], weights[n_ext:], fb, keys))
        if len(parts) == 1:
            return parts[0]
        width = max(p.shape[1] for p in parts)
        return torch.cat([nn.functional.pad(p, (0, width - p.shape[1]), value=-1) for p in parts])

    def _store(self, keys: torch.Tensor, slots: torch.Tensor, k: torch.Tensor) -> None:
        """k [T, d] into the cache rows `slots`: as they are, or as e4m3 values scaled by the
        token's largest magnitude, the fp32 scale's bytes after them."""
        if not self.fp8:
            keys[slots] = k
            return
        k = k.float()
        scale = k.abs().amax(-1, keepdim=True).clamp_(min=1e-12) / _E4M3_MAX  # [T, 1]
        packed = torch.cat(((k / scale).to(torch.float8_e4m3fn).view(torch.uint8), scale.view(torch.uint8)), dim=-1)
        keys.view(torch.uint8)[slots, : packed.shape[1]] = packed

    def _load(self, keys: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The keys of cache rows `slots` [B, L] -> [B, L, d] (fp32 where they are stored as fp8)."""
        rows = keys.index_select(0, slots.flatten())
        if self.fp8:
            raw = rows.view(torch.uint8)
            scale = raw[:, self.dim : self.dim + 4].contiguous().view(torch.float32)  # [N, 1]
            rows = raw[:, : self.dim].view(torch.float8_e4m3fn).float() * scale
        return rows.view(*slots.shape, self.dim)

    def _rope(self, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rope by halves over the first qk_rope_head_dim dimensions of v [T, (heads,) dim]."""
        return torch.cat((rotate(v[..., : self.rot], cos, sin, interleave=False), v[..., self.rot :]), dim=-1)

    def _scores(self, q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """q [B, Q, h, d] fp32, weights [B, Q, h], k [B, L, d] -> index scores [B, Q, L] fp32."""
        s = torch.einsum("bqhd,bld->bqhl", q, k.float()).mul_(self.scale).relu_()
        return torch.einsum("bqh,bqhl->bql", weights, s)

    def _select(self, scores: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """scores [B, Q, L] (-inf: not attendable), slots [B, L] -> the top slots [B, Q, K] (-1: none)."""
        best, where = scores.topk(min(self.topk, scores.shape[-1]), dim=-1)
        chosen = slots.gather(1, where.flatten(1)).view_as(where)
        return chosen.masked_fill_(best == float("-inf"), -1)

    def _extend(self, q: torch.Tensor, weights: torch.Tensor, fb: ForwardBatch, keys: torch.Tensor) -> torch.Tensor:
        """Prefill chunks: each query token against its sequence's tokens up to its own position."""
        valid, slots = fb.ext_valid, fb.ext_slots  # [Be, Q], [Be, L]
        B, Q = valid.shape
        L = slots.shape[1]
        pad_q = q.new_zeros(B, Q, self.heads, self.dim)
        pad_w = weights.new_zeros(B, Q, self.heads)
        pad_q[valid], pad_w[valid] = q, weights
        k = self._load(keys, slots)
        key_pos = torch.arange(L, device=slots.device)
        out = slots.new_empty(B, Q, min(self.topk, L))
        step = max(1, _SCORE_BUDGET // max(1, B * self.heads * L))  # query positions per block
        for lo in range(0, Q, step):
            hi = min(lo + step, Q)
            scores = self._scores(pad_q[:, lo:hi], pad_w[:, lo:hi], k)
            later = key_pos[None, None, :] > fb.ext_positions[:, lo:hi, None]  # causal (and past kv_len)
            out[:, lo:hi] = self._select(scores.masked_fill_(later, float("-inf")), slots)
        return out[valid]

    def _decode(self, q: torch.Tensor, weights: torch.Tensor, fb: ForwardBatch, keys: torch.Tensor) -> torch.Tensor:
        """One query per sequence against all its cached tokens (padding masked by dec_bias)."""
        slots = fb.dec_slots  # [Bd, L]
        k = self._load(keys, slots)
        scores = self._scores(q[:, None], weights[:, None], k) + fb.dec_bias  # [Bd, 1, L]
        return self._select(scores, slots)[:, 0]
