"""Grouped-query attention (Qwen3-MoE): per-head q/k RMSNorm, rope over the whole head, K and V of
every KV head cached per token (`2 * num_kv_heads * head_dim` values) in the paged pool."""

from __future__ import annotations

import torch
from torch import nn

from afd_engine.model_config import ModelConfig
from afd_engine.models.forward_batch import ForwardBatch
from afd_engine.models.norm import RMSNorm, linear
from afd_engine.models.rope import RotaryEmbedding


class GQAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, kernels) -> None:
        super().__init__()
        self.cfg, self.rotary, self.kernels = cfg, rotary, kernels
        h, nh, nkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj, self.k_proj, self.v_proj = linear(h, nh * d), linear(h, nkv * d), linear(h, nkv * d)
        self.o_proj = linear(nh * d, h)
        self.q_norm, self.k_norm = RMSNorm(d, cfg.rms_norm_eps), RMSNorm(d, cfg.rms_norm_eps)
        self.scale = d**-0.5

    def prepare(self) -> None:
        """Nothing to derive after loading (MLA absorbs its decode weights here)."""

    def forward(self, x: torch.Tensor, fb: ForwardBatch, cos_sin, cache: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]; writes this step's keys and values into `cache` [slots, 2 * KVH * D]."""
        cfg = self.cfg
        T, nkv = x.shape[0], cfg.num_kv_heads
        cos, sin = cos_sin
        q = self.rotary.apply(self.q_norm(self.q_proj(x).view(T, cfg.num_heads, cfg.head_dim)), cos, sin)
        k = self.rotary.apply(self.k_norm(self.k_proj(x).view(T, nkv, cfg.head_dim)), cos, sin)
        cache[fb.out_slots] = torch.cat((k.flatten(1), self.v_proj(x)), dim=-1)
        n_ext = fb.num_extend_tokens
        out = torch.empty_like(q)  # [T, heads, D]
        if n_ext:
            pad = q.new_zeros(*fb.ext_valid.shape, *q.shape[1:])  # [Be, Q, heads, D]
            pad[fb.ext_valid] = q[:n_ext]
            ext = self.kernels.extend(pad, cache, fb.ext_slots, fb.ext_kv_lens, fb.ext_positions, nkv, self.scale)
            out[:n_ext] = ext[fb.ext_valid]
        if T > n_ext:
            out[n_ext:] = self.kernels.decode(q[n_ext:], cache, fb.paged_decode(), nkv, self.scale)
        return self.o_proj(out.flatten(1))  # T may be 0 (an empty micro-batch)
