"""The block quantizer of --ffn-weight-dtype fp8 (afd_engine/models/quant.py): 128x128 blocks of
float8_e4m3fn with an fp32 scale of amax / 448 each, partial blocks zero-padded."""

from __future__ import annotations

import pytest
import torch

from afd_engine.models.quant import dequantize_fp8, fp8_round_trip, quantize_fp8_blocks
from afd_engine.tiny_model import quantize_fp8_block


def test_a_small_block_quantizes_to_known_values_and_back():
    # amax 7: scale 7/448 = 1/64 exactly, so every value below is q / 64 with q an e4m3 value
    w = torch.tensor([[7.0, -3.5, 1.75], [0.4375, 0.0, -0.21875]])
    q, scale = quantize_fp8_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (2, 3)
    assert scale.dtype == torch.float32 and scale.tolist() == [[1 / 64]]
    assert q.float().tolist() == [[448.0, -224.0, 112.0], [28.0, 0.0, -14.0]]
    assert torch.equal(dequantize_fp8(q, scale, (128, 128)), w)


def test_values_round_to_the_nearest_e4m3_value_of_their_block():
    # x 64: 19.2 -> 20 (e4m3 steps by 2 between 16 and 32), 0.64 -> 0.625 (by 1/16 between 0.5 and 1)
    w = torch.tensor([[7.0, 0.3, -0.3, 0.01]])
    q, scale = quantize_fp8_blocks(w)
    assert q.float().tolist() == [[448.0, 20.0, -20.0, 0.625]]
    assert fp8_round_trip(w).tolist() == [[7.0, 0.3125, -0.3125, 0.625 / 64]]


def test_the_scale_is_each_blocks_amax_over_448_and_a_partial_block_is_padded():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(130, 200, generator=gen)  # blocks: rows 0-127 and 128-129, columns 0-127 and 128-199
    w[128:, 128:] *= 100  # the corner block (2 x 72 real values) has an amax of its own
    w[128:, :128] *= 1e-4  # and the other partial block a tiny one, which padding other than 0 would raise
    w[:128, :128] = 0  # an all-zero block
    q, scale = quantize_fp8_blocks(w)
    assert q.shape == (130, 200) and scale.shape == (2, 2)
    amax = [[w[r : r + 128, c : c + 128].abs().max() for c in (0, 128)] for r in (0, 128)]
    assert scale[0, 0] == 1  # nothing to scale: the block dequantizes to zeros at any scale
    for r, c in ((0, 1), (1, 0), (1, 1)):
        assert scale[r, c] == amax[r][c] / 448
    # the largest magnitude of each block (padding zeros aside) maps to e4m3's largest value
    for rows, cols in (
        (slice(0, 128), slice(128, 200)),
        (slice(128, 130), slice(0, 128)),
        (slice(128, 130), slice(128, 200)),
    ):
        assert q[rows, cols].float().abs().max() == 448
    assert torch.equal(q[:128, :128].float(), torch.zeros(128, 128))
    back = dequantize_fp8(q, scale, (128, 128))
    # e4m3 keeps 3 mantissa bits: within half a step (1/16 relative) of each value, or of its block's scale
    assert ((back - w).abs() <= (w.abs() / 16).clamp(min=scale.max() / 2**9)).all()
    assert not torch.equal(back, w)


def test_the_quantizer_matches_the_tiny_fp8_checkpoints_and_refuses_other_shapes():
    w = torch.randn(300, 64, generator=torch.Generator().manual_seed(1)) * 0.02
    q, scale = quantize_fp8_blocks(w)
    ref_q, ref_scale = quantize_fp8_block(w)  # how make_tiny_model(fp8=True) writes DeepSeek-V3's format
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale, ref_scale)
    with pytest.raises(ValueError, match="2-D weight"):
        quantize_fp8_blocks(torch.ones(2, 3, 4))
