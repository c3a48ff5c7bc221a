"""Grouped-query attention (Qwen3-MoE, GLM-4.5, MiniMax-M2): q/k RMSNorm per head (Qwen3, optional
in GLM) or over the layer's whole query and key vectors (MiniMax), q/k/v biases (GLM), rope over the
whole head or its first `partial_rotary_factor` share (GLM, MiniMax), K and V of every KV head
cached per token (`2 * num_kv_heads * head_dim` values) in the paged pool."""

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
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(h, nh * d, bias=bias)
        self.k_proj, self.v_proj = nn.Linear(h, nkv * d, bias=bias), nn.Linear(h, nkv * d, bias=bias)
        self.o_proj = linear(nh * d, h)
        if cfg.qk_norm:  # over each head, or over all of them at once (MiniMax-M2)
            q_dim, k_dim = (nh * d, nkv * d) if cfg.qk_norm_per_layer else (d, d)
            self.q_norm, self.k_norm = RMSNorm(q_dim, cfg.rms_norm_eps), RMSNorm(k_dim, cfg.rms_norm_eps)
        self.rot = cfg.rope_dim  # dims of each head rope rotates (the first ones)
        self.scale = d**-0.5

    def prepare(self) -> None:
        """Nothing to derive after loading (MLA absorbs its decode weights here)."""

    def forward(self, x: torch.Tensor, fb: ForwardBatch, cos_sin, cache: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]; writes this step's keys and values into `cache` [slots, 2 * KVH * D]."""
        cfg = self.cfg
        T, nkv = x.shape[0], cfg.num_kv_heads
        q = self._rope(self.q_proj(x), "q_norm", cfg.num_heads, cos_sin)
        k = self._rope(self.k_proj(x), "k_norm", nkv, cos_sin)
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

    def _rope(self, x: torch.Tensor, norm: str, heads: int, cos_sin) -> torch.Tensor:
        """x [T, heads * D] -> [T, heads, D]: normed (where the model norms queries and keys: each
        head, or the whole vector), rope over the first `self.rot` dims of each head."""
        cfg = self.cfg
        if cfg.qk_norm and cfg.qk_norm_per_layer:
            x = getattr(self, norm)(x)
        x = x.view(len(x), heads, cfg.head_dim)
        if cfg.qk_norm and not cfg.qk_norm_per_layer:
            x = getattr(self, norm)(x)
        cos, sin = cos_sin
        if self.rot == x.shape[-1]:
            return self.rotary.apply(x, cos, sin)
        return torch.cat((self.rotary.apply(x[..., : self.rot].contiguous(), cos, sin), x[..., self.rot :]), dim=-1)
