"""FP8 e4m3 activation quantization with one fp32 scale per 128 values, as Triton kernels.

Bit-exact to the torch wire format in comm/wire.py (`quantize_fp8`, `dequantize_fp8`): the same
group of 128 along the last dim, scale = max(amax / 448, 1e-12), q = x / scale rounded to nearest
even, a last group shorter than 128 treated as if zero-padded. Divisions are `div_rn` because
Triton's `/` on fp32 is an approximate (2 ulp) division on NVIDIA GPUs; torch divides exactly.

Narrowing casts go through `round_to_e4m3` / `round_to_bf16`, which round in fp32 integer
arithmetic to a value the narrow type holds exactly, so that the cast itself never rounds. The
GPU's casts already round to nearest even, but Triton's interpreter does not (fp32 -> bf16
truncates; fp32 -> fp8 rounds half up and loses the carry into the exponent, 124.3 -> 64), and the
CPU tests must see the bytes the GPU writes.

One program handles one (row, group): a 128-wide tile, so the grid is [T, ceil(H / 128)].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from comm.wire import FP8_GROUP, FP8_MAX
from kernels.triton.launch import Launch

_MIN_SCALE = 1e-12  # comm.wire's clamp: an all-zero group keeps a finite scale
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def round_to_e4m3(v):
    """fp32 v with |v| <= 464 -> fp32 holding the nearest float8_e4m3fn value, ties to even."""
    bits = v.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    sign = bits ^ mag
    # normal e4m3 (|v| >= 2^-6): keep 3 of fp32's 23 mantissa bits; a carry moves into the exponent
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) << 20
    # subnormal e4m3: multiples of 2^-9; adding 1.5 * 2^14 (whose ulp is 2^-9) rounds to them
    a = mag.to(tl.float32, bitcast=True)
    subnormal = ((a + 24576.0) - 24576.0).to(tl.int32, bitcast=True)
    mag = tl.where(a < 0.015625, subnormal, normal)
    return (mag | sign).to(tl.float32, bitcast=True)


@triton.jit
def round_to_bf16(v):
    """fp32 v (finite) -> fp32 holding the nearest bfloat16 value, ties to even."""
    bits = v.to(tl.int32, bitcast=True)
    return (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)


@triton.jit
def cast_rtne(v, dtype: tl.constexpr):
    """fp32 v -> dtype (fp32, bf16 or fp16), rounded to nearest even on GPU and interpreter alike."""
    if dtype == tl.bfloat16:
        v = round_to_bf16(v)
    return v.to(dtype)


@triton.jit
def _quantize_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    H,
    stride_xt,
    stride_xh,
    stride_qt,
    stride_st,
    GROUP: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)  # row offsets can pass 2^31 elements
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)  # [GROUP]
    mask = cols < H
    x = tl.load(x_ptr + t * stride_xt + cols * stride_xh, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), FP8_MAX), MIN_SCALE)
    q = round_to_e4m3(tl.math.div_rn(x, scale)).to(tl.float8e4nv)
    tl.store(q_ptr + t * stride_qt + cols, q, mask=mask)
    tl.store(s_ptr + t * stride_st + g, scale)


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, out_ptr, H, stride_qt, stride_qh, stride_st, stride_ot, GROUP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # row offsets can pass 2^31 elements
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)  # [GROUP]
    mask = cols < H
    q = tl.load(q_ptr + t * stride_qt + cols * stride_qh, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(s_ptr + t * stride_st + g)
    tl.store(out_ptr + t * stride_ot + cols, cast_rtne(q * scale, out_ptr.dtype.element_ty), mask=mask)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-128-group fp8 quantization of activations (one kernel launch).

    x [T, H] fp32, bf16 or fp16, any strides; H need not be a multiple of 128 and T may be 0.
    Returns q [T, H] float8_e4m3fn contiguous and scales [T, ceil(H/128)] fp32 contiguous, with
    x[t, h] ~= q[t, h] * scales[t, h // 128]; bit-identical to comm.wire.quantize_fp8(x).
    """
    if x.dim() != 2 or x.dtype not in _TL_DTYPES:
        raise ValueError(f"quantize_fp8 takes x [T, H] fp32/bf16/fp16, got {tuple(x.shape)} {x.dtype}")
    q, scales, launch = quantize_launch(x)
    if x.numel():
        launch()
    return q, scales


def quantize_launch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Launch]:
    """q [T, H] and scales [T, ceil(H/128)] (allocated, not yet written) and the launch that fills
    them: one program per (row, 128-group), grid [T, ceil(H/128)] (x as in `quantize_fp8`)."""
    T, H = x.shape
    groups = triton.cdiv(H, FP8_GROUP)
    q = torch.empty(T, H, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(T, groups, dtype=torch.float32, device=x.device)
    args = (x, q, scales, H, x.stride(0), x.stride(1), q.stride(0), scales.stride(0))
    launch = Launch(_quantize_kernel, (T, groups), args, dict(GROUP=FP8_GROUP, FP8_MAX=FP8_MAX, MIN_SCALE=_MIN_SCALE))
    return q, scales, launch


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize_fp8` (one kernel launch).

    q [T, H] float8_e4m3fn, any strides; scales [T, ceil(H/128)] fp32 with unit stride along groups.
    Returns [T, H] contiguous in dtype (fp32, bf16 or fp16), computed as fp32 q * scale and then
    rounded to dtype; bit-identical to comm.wire.dequantize_fp8(q, scales, dtype).
    """
    T, H = q.shape
    groups = triton.cdiv(H, FP8_GROUP)
    if q.dtype != torch.float8_e4m3fn or dtype not in _TL_DTYPES:
        raise ValueError(f"dequantize_fp8 takes float8_e4m3fn values to fp32/bf16/fp16, got {q.dtype} -> {dtype}")
    if scales.shape != (T, groups) or scales.dtype != torch.float32 or (T and scales.stride(1) != 1):
        raise ValueError(
            f"scales must be [{T}, {groups}] fp32 with unit group stride, got {tuple(scales.shape)} {scales.dtype}"
        )
    out, launch = dequantize_launch(q, scales, dtype)
    if q.numel():
        launch()
    return out


def dequantize_launch(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, Launch]:
    """out [T, H] in dtype (allocated, not yet written) and the launch that fills it, grid
    [T, ceil(H/128)] (arguments as in `dequantize_fp8`)."""
    T, H = q.shape
    out = torch.empty(T, H, dtype=dtype, device=q.device)
    args = (q, scales, out, H, q.stride(0), q.stride(1), scales.stride(0), out.stride(0))
    return out, Launch(_dequantize_kernel, (T, triton.cdiv(H, FP8_GROUP)), args, dict(GROUP=FP8_GROUP))
