"""TritonGQA against the torch reference (TorchGQA), under Triton's interpreter on a CPU (tests/conftest.py
selects it). Pages are scrambled and padded with NaN rows as in test_triton_mla.py.
"""

from __future__ import annotations

import pytest
import torch

from kernels.gqa import TorchGQA
from kernels.mla import PagedKV
from kernels.triton.gqa import TritonGQA
from kernels.triton.mla import MAX_SPLITS
from tests.kernels.paged import DEVICE, make_gqa_case

RAGGED = [1, 5, 17, 100]
TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-5}, torch.bfloat16: {"rtol": 1e-2, "atol": 1e-2}}


def decode_both(kv_lens, page_size, heads, kv_heads, D, dtype, num_splits=None, seed=0):
    """(triton output, torch reference output) of one decode step."""
    q, cache, kv, scale = make_gqa_case(kv_lens, page_size, heads, kv_heads, D, dtype, seed)
    ref = TorchGQA().decode(q, cache, kv, kv_heads, scale)
    out = TritonGQA(num_splits).decode(q, cache, kv._replace(slots=None, bias=None), kv_heads, scale)
    assert out.shape == (len(kv_lens), heads, D) and out.dtype == dtype
    return out, ref


@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_decode_fp32_ragged(page_size, ratio):
    """Two kv-heads, G = 1, 4 or 8 query heads each, split in 3."""
    out, ref = decode_both(RAGGED, page_size, 2 * ratio, 2, 16, torch.float32, num_splits=3)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("ratio", [1, 8])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_bf16_ragged(page_size, ratio):
    out, ref = decode_both(RAGGED, page_size, 2 * ratio, 2, 16, torch.bfloat16, num_splits=3)
    torch.testing.assert_close(out, ref, **TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128])
def test_decode_wide_heads(D, dtype):
    """Qwen3's head_dim (128) and 64, GQA ratio 4 over 2 kv-heads."""
    out, ref = decode_both([3, 40, 70], 16, 8, 2, D, dtype, num_splits=2)
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_decode_qwen3_head_counts():
    """Qwen3-30B-A3B's attention: 32 query heads over 4 kv-heads (G = 8), D = 128, page size 64."""
    out, ref = decode_both([9, 80], 64, 32, 4, 128, torch.bfloat16, num_splits=2)
    torch.testing.assert_close(out, ref, **TOL[torch.bfloat16])


def test_decode_odd_dims():
    """D not a power of two and G = 3 (masked rows and columns), one kv-head per 3 query heads."""
    out, ref = decode_both([2, 33], 16, 9, 3, 24, torch.float32, num_splits=2)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_decode_group_above_16():
    """G = 32 > the minimum head block of 16: one program still serves every query head of a kv-head."""
    out, ref = decode_both([7, 20], 16, 32, 1, 16, torch.float32, num_splits=2)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_decode_default_splits_long_sequence():
    """A sequence long enough that the heuristic picks several splits (600 tokens: 3), beside a short one."""
    out, ref = decode_both([600, 3], 16, 4, 2, 16, torch.float32)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_decode_more_splits_than_blocks():
    """Many splits: most are empty for every sequence and must carry zero weight."""
    out, ref = decode_both(RAGGED, 16, 8, 2, 16, torch.float32, num_splits=MAX_SPLITS)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_decode_strided_query():
    """q sliced out of a fused qkv projection: batch and head strides are not the packed ones."""
    q, cache, kv, scale = make_gqa_case(RAGGED, 16, 8, 2, 16, torch.float32)
    fused = torch.cat((q, torch.randn_like(q)), dim=1)  # [B, 2H, D]: q is its first H heads
    out = TritonGQA(2).decode(fused[:, :8], cache, kv._replace(slots=None, bias=None), 2, scale)
    torch.testing.assert_close(out, TorchGQA().decode(q, cache, kv, 2, scale), **TOL[torch.float32])


def test_decode_empty_batch():
    q, cache, _, scale = make_gqa_case([1], 16, 4, 2, 16, torch.float32)
    empty = torch.zeros(0, 1, dtype=torch.int64, device=DEVICE)
    kv = PagedKV(None, None, empty, torch.zeros(0, dtype=torch.int64, device=DEVICE), 16)
    out = TritonGQA().decode(q[:0], cache, kv, 2, scale)
    assert out.shape == (0, 4, 16) and out.dtype == torch.float32


def test_extend_matches_reference():
    """Extend is delegated to the torch reference: same output through the same interface."""
    _, cache, kv, scale = make_gqa_case([5, 17], 16, 8, 2, 16, torch.float32)
    q = torch.randn(2, 3, 8, 16, device=DEVICE)
    q_positions = torch.tensor([[2, 3, 4], [14, 15, 16]], device=DEVICE)
    args = (q, cache, kv.slots, kv.kv_lens, q_positions, 2, scale)
    torch.testing.assert_close(TritonGQA().extend(*args), TorchGQA().extend(*args), rtol=0, atol=0)
    assert TritonGQA.name == "triton"
