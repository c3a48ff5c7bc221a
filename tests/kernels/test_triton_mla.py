"""TritonMLA against the torch reference (TorchMLA), under Triton's interpreter on a CPU.

Every case scrambles the page order and points the page table's padding entries, and every cache
row no sequence owns, at NaN-filled pages: a kernel that ignores the page table or reads past
kv_lens returns NaN or another sequence's tokens. The Triton side gets no slot table or bias.
"""

from __future__ import annotations

import pytest
import torch

from kernels.mla import PagedKV, TorchMLA
from kernels.triton.mla import MAX_SPLITS, TritonMLA, num_splits_for
from tests.kernels.paged import DEVICE, make_mla_case

TINY = {"heads": 4, "C": 32, "R": 8, "Dn": 16, "Dv": 16}
V3 = {"C": 512, "R": 64, "Dn": 128, "Dv": 128}  # DeepSeek-V3's head dims
RAGGED = [1, 5, 17, 100]
TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-5}, torch.bfloat16: {"rtol": 1e-2, "atol": 1e-2}}


def decode_both(kv_lens, page_size, dims, dtype, num_splits=None, seed=0):
    """(triton output, torch reference output) of one decode step."""
    q_nope, q_pe, cache, kv, w_kv_b, scale = make_mla_case(kv_lens, page_size, **dims, dtype=dtype, seed=seed)
    H, Dn, Dv = dims["heads"], dims["Dn"], dims["Dv"]
    w_uk, w_uv = TorchMLA().absorb(w_kv_b, H, Dn, Dv)
    ref = TorchMLA().decode(q_nope, q_pe, cache, kv, w_uk, w_uv, scale)
    out = TritonMLA(num_splits).decode(q_nope, q_pe, cache, kv._replace(slots=None, bias=None), w_uk, w_uv, scale)
    return out, ref


@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_decode_tiny_fp32_ragged(page_size, num_splits):
    out, ref = decode_both(RAGGED, page_size, TINY, torch.float32, num_splits)
    assert out.shape == (4, 4, 16) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_tiny_bf16_ragged(page_size):
    out, ref = decode_both(RAGGED, page_size, TINY, torch.bfloat16, num_splits=3)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, **TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_v3_dims_16_heads(dtype):
    out, ref = decode_both([1, 37, 70], 64, dict(heads=16, **V3), dtype, num_splits=2)
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_v3_dims_128_heads(dtype):
    """DeepSeek-V3's full head count: 8 head blocks of 16."""
    out, ref = decode_both([40], 16, dict(heads=128, **V3), dtype, num_splits=2)
    assert out.shape == (1, 128, 128)
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_decode_odd_dims_partial_head_block():
    """C, R not powers of two and 20 heads (a full block plus a masked one)."""
    dims = {"heads": 20, "C": 24, "R": 6, "Dn": 10, "Dv": 12}
    out, ref = decode_both([3, 50], 16, dims, torch.float32, num_splits=2)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_decode_default_splits_long_sequence():
    """A sequence long enough that the heuristic picks several splits, beside a short one."""
    assert num_splits_for(600) == 3
    out, ref = decode_both([600, 3], 16, TINY, torch.float32)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_decode_more_splits_than_blocks():
    """Many splits: most are empty for every sequence and must carry zero weight."""
    out, ref = decode_both(RAGGED, 16, TINY, torch.float32, num_splits=MAX_SPLITS)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_decode_empty_batch():
    q_nope, q_pe, cache, _, w_kv_b, scale = make_mla_case([1], 16, **TINY, dtype=torch.float32)
    empty = torch.zeros(0, 1, dtype=torch.int64, device=DEVICE)
    kv = PagedKV(None, None, empty, torch.zeros(0, dtype=torch.int64, device=DEVICE), 16)
    w_uk, w_uv = TritonMLA().absorb(w_kv_b, 4, 16, 16)
    out = TritonMLA().decode(q_nope[:0], q_pe[:0], cache, kv, w_uk, w_uv, scale)
    assert out.shape == (0, 4, 16) and out.dtype == torch.float32


def test_num_splits_heuristic():
    assert [num_splits_for(n) for n in (1, 256, 257, 1000, 10**6)] == [1, 1, 2, 4, MAX_SPLITS]


def test_extend_matches_reference():
    """Extend is delegated to the torch reference: same output through the same interface."""
    q_nope, q_pe, cache, kv, w_kv_b, scale = make_mla_case([5, 17], 16, **TINY, dtype=torch.float32)
    q_nope = torch.randn(2, 3, 4, 16, device=DEVICE)
    q_pe = torch.randn(2, 3, 4, 8, device=DEVICE)
    q_positions = torch.tensor([[2, 3, 4], [14, 15, 16]], device=DEVICE)
    args = (q_nope, q_pe, cache, kv.slots, kv.kv_lens, q_positions, w_kv_b, 16, scale)
    torch.testing.assert_close(TritonMLA().extend(*args), TorchMLA().extend(*args), rtol=0, atol=0)
    assert TritonMLA.name == "triton"


def test_decode_splits_aim_at_one_program_per_multiprocessor():
    """The split count of a decode launch (kernels/triton/split_kv.py) from shapes alone: the counts
    that the H200 sweep found fastest at DeepSeek-V3's 2 head blocks (64 heads a program)."""
    from kernels.triton.split_kv import decode_splits

    measured = {(64, 4096): 1, (128, 4096): 1, (32, 8192): 2, (8, 4096): 8, (8, 32768): 8, (1, 1024): 4, (1, 32768): 16}
    assert {shape: decode_splits(shape[0], 2, shape[1]) for shape in measured} == measured
    assert decode_splits(0, 2, 4096) == MAX_SPLITS  # an empty batch still launches a valid grid
    assert decode_splits(3, 1, 100) == 1  # never more splits than MIN_SPLIT_TOKENS-long chunks
