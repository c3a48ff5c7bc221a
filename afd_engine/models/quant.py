"""FP8 block quantization of weights, as DeepSeek-V3 checkpoints store them: float8_e4m3fn values
with one fp32 scale per 128x128 block, real weight = q * scale.

`--ffn-weight-dtype fp8` quantizes the routed experts of a bf16/fp32 checkpoint with
`quantize_fp8_blocks` as they are read; so that single mode and every deployment compute the same
tokens, each checkpoint tensor (one expert projection) is quantized on its own, on the host,
before it is copied anywhere: the same bytes whichever process reads which expert.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
FP8_BLOCK = (128, 128)


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (any float dtype) -> (q [N, K] float8_e4m3fn, scale [ceil(N/bn), ceil(K/bk)] fp32).

    Per block scale = amax / 448 (1 for an all-zero block, whose values are 0 at any scale) and
    q = weight / scale rounded to the nearest e4m3 value, ties to even. N or K not a multiple of
    the block: the last blocks are zero-padded to full size before the amax (zeros never raise it,
    so a partial block's scale is the amax of its real values) and the padding is dropped from q.
    Deterministic for a given input and device; the loader runs it on the host."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_fp8_blocks takes a 2-D weight, got shape {tuple(weight.shape)}")
    (n, k), (bn, bk) = weight.shape, block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(nb * bn, kb * bk, dtype=torch.float32, device=weight.device)
    padded[:n, :k] = weight.float()
    blocks = padded.view(nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(1, 3))  # [nb, kb]
    # divided by a tensor, not a Python number: CUDA turns a division by a host scalar into a
    # multiplication by its reciprocal, which rounds differently
    fp8_max = torch.full((), FP8_MAX, device=weight.device)
    scale = torch.where(amax > 0, amax / fp8_max, torch.ones_like(amax))
    scaled = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)  # amax / scale may round past 448
    q = scaled.view(nb * bn, kb * bk)[:n, :k].contiguous().to(torch.float8_e4m3fn)
    return q, scale.contiguous()


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [N, K] float8_e4m3fn, scale_inv [ceil(N/bn), ceil(K/bk)] -> float32 [N, K]."""
    n, k = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return weight.float() * scale


def fp8_round_trip(weight: torch.Tensor) -> torch.Tensor:
    """float32 [N, K]: the values `weight` has once block-quantized (what an FP8 MoE kernel computes
    with), for backends that compute on unquantized weights."""
    return dequantize_fp8(*quantize_fp8_blocks(weight), FP8_BLOCK)
