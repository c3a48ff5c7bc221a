"""kernels.triton.fp8 against comm.wire's torch format: the same bytes, the same scales."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton's interpreter; must be set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from comm import wire  # noqa: E402
from kernels.triton.fp8 import dequantize_fp8, quantize_fp8  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _assert_same_quantization(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, scales = quantize_fp8(x)
    q_ref, scales_ref = wire.quantize_fp8(x)
    assert q.shape == q_ref.shape and q.dtype == torch.float8_e4m3fn and q.is_contiguous()
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), "fp8 bytes differ from comm.wire"
    assert torch.equal(scales, scales_ref), "scales differ from comm.wire"
    return q, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H", [(3, 128), (4, 300), (2, 100), (1, 1), (0, 200)])
def test_quantize_matches_wire_bytes(T, H, dtype):
    gen = torch.Generator().manual_seed(T * 1000 + H)
    # magnitudes over six decades, so some groups reach e4m3 subnormals
    x = (torch.randn(T, H, generator=gen) * torch.logspace(-3, 3, H)).to(dtype).to(DEVICE)
    if T:
        x[0, : min(H, 128)] = 0  # an all-zero group: the 1e-12 clamp
    q, scales = _assert_same_quantization(x)
    assert scales.shape == (T, -(-H // 128))


def test_quantize_rounds_ties_to_even_and_subnormals():
    """With the group's amax at 448 the scale is 1, so x / scale is x: each row holds exact
    midpoints between neighbouring e4m3 values (ties), subnormals and signed zeros."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # all finite >= 0
    mids = (grid[:-1] + grid[1:]) / 2  # [126] exact in fp32
    x = torch.zeros(2, 256)
    x[0, 0], x[0, 1:127] = 448.0, mids
    x[0, 128:254] = -mids
    x[0, 255] = -448.0
    x[1, :126] = grid[:126] * (1 + 2.0**-12)  # just above representable values
    x[1, 126], x[1, 127] = 448.0, -0.0
    x[1, 128:254] = -grid[1:127] * (1 - 2.0**-12)
    x[1, 254] = 448.0
    _assert_same_quantization(x.to(DEVICE))


def test_quantize_strided_input():
    base = torch.randn(300, 6, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    _assert_same_quantization(base.t())  # [6, 300] with stride (1, 6)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H", [(3, 300), (2, 128), (0, 64)])
def test_dequantize_matches_wire(T, H, out_dtype):
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(H)) * 7
    q, scales = wire.quantize_fp8(x)
    q, scales = q.to(DEVICE), scales.to(DEVICE)
    out = dequantize_fp8(q, scales, out_dtype)
    assert out.dtype == out_dtype and out.shape == (T, H)
    assert torch.equal(out, wire.dequantize_fp8(q, scales, out_dtype))


def test_round_trip_error_within_e4m3_precision():
    x = torch.randn(4, 384, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    back = dequantize_fp8(*quantize_fp8(x), torch.float32)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normals, plus the subnormal step
    scale = x.abs().view(4, 3, 128).amax(-1, keepdim=True) / 448
    bound = (x.abs().view(4, 3, 128) * 2.0**-4 + scale * 2.0**-10).view(4, 384)
    assert ((back - x).abs() <= bound).all()


def test_dequantize_rejects_wrong_scales():
    q, scales = wire.quantize_fp8(torch.randn(2, 300))
    with pytest.raises(ValueError, match=r"scales must be \[2, 3\] fp32"):
        dequantize_fp8(q, scales[:, :2], torch.float32)
