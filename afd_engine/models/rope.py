"""Rotary position embedding with optional YaRN scaling, as DeepSeek configs describe it."""

from __future__ import annotations

import math

import torch

from afd_engine.model_config import RopeConfig
from kernels.cpu_rope import apply_rope


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(rope: RopeConfig, qk_head_dim: int) -> float:
    """Attention scale: 1/sqrt(d), times mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = qk_head_dim**-0.5
    if rope.kind != "default" and rope.mscale_all_dim:
        m = yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * m * m
    return scale


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """Blend interpolated and extrapolated frequencies over a linear ramp of dimensions."""

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # keeps the ramp finite
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (rope.factor * pos_freqs)
    return interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight


def _attention_factor(rope: RopeConfig) -> float:
    if rope.kind == "default":
        return 1.0
    if rope.attention_factor is not None:
        return float(rope.attention_factor)
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


class RotaryEmbedding:
    """Applies rope to the rotary slice of queries and keys at given positions.

    DeepSeek checkpoints pair dimensions (0,1), (2,3), ... (`interleave`); the output is laid out
    de-interleaved ([rotated evens, rotated odds]). Queries and keys get the same permutation, so
    their dot products, the only thing attention reads, are unchanged.
    """

    def __init__(self, rope: RopeConfig, dim: int) -> None:
        self.interleave = rope.interleave
        with torch.device("cpu"):  # a table, not a weight: real even when the model is built on meta
            self.inv_freq = (
                _yarn_inv_freq(rope, dim)
                if rope.kind == "yarn"
                else 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            )
        self.scaling = _attention_factor(rope)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> cos, sin [T, dim/2] in `dtype`; computed once per step."""
        if self.inv_freq.device != positions.device:  # the table follows the model to its device once
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self.inv_freq  # [T, dim/2]
        return (freqs.cos() * self.scaling).to(dtype), (freqs.sin() * self.scaling).to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, dim] (or [T, dim]); cos/sin [T, dim/2]. fp32 CPU tensors go to the C kernel
        (kernels/cpu_rope.py), the same numbers in one pass."""
        return rotate(x, cos, sin, self.interleave)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rope over the whole last dimension of x [T, heads, dim] (or [T, dim]): pairs (0,1), (2,3), ...
    with `interleave` (output de-interleaved), else halves (i, i + dim/2)."""
    out = apply_rope(x, cos, sin, interleave)
    if out is not None:
        return out
    if x.dim() == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
