"""The Triton sparse MLA kernel (kernels/triton/sparse_mla.py) against the torch reference
(kernels/sparse_mla.py), under Triton's interpreter on a CPU (tests/conftest.py selects it).

The cache is the MLA share of wider rows whose extra columns, and every row no query chose, hold
NaN: a kernel that assumes contiguous rows, reads an unused (-1) entry's slot or a slot past a row's
K returns NaN or another token's values.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import aot  # noqa: E402
from kernels.mla import TorchMLA, absorb_kv_b  # noqa: E402
from kernels.sparse_mla import sparse_mla_core  # noqa: E402
from kernels.triton import sparse_mla  # noqa: E402
from kernels.triton.mla import TritonMLA  # noqa: E402
from kernels.triton.sparse_mla import sparse_mla_core_triton  # noqa: E402
from tests.kernels.paged import DEVICE  # noqa: E402
from tests.kernels.test_aot import expected_sparse_uses, run_aot  # noqa: E402

TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-5}, torch.bfloat16: {"rtol": 1e-2, "atol": 1e-2}}
EXTRA = 7  # the indexer key's columns after each row's C + R (any width: rows at any stride)
SLOTS, USED = 400, 360  # cache rows; rows >= USED are never chosen (NaN)


def make_case(T, H, C, R, K, dtype, seed=0, index_dtype=torch.int64):
    """(q_latent, q_pe, cache view [S, C + R] of wider rows, indices [T, K], scale). Row 0 chooses a
    long run of -1 first (whole blocks with no slot), row 1 one slot, the last row every entry;
    chosen slots are distinct per row and, but for row 0's slot 0, never the row -1 would clamp to."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(SLOTS, C + R + EXTRA, generator=g)
    wide[:, C + R :] = float("nan")
    wide[USED:] = float("nan")
    indices = torch.stack([torch.randperm(USED - 1, generator=g)[:K] + 1 for _ in range(T)])
    indices[0, : K // 2 + 8] = -1
    indices[0, -1] = 0
    indices[1, :] = -1
    indices[1, K // 3] = USED - 1
    q_latent, q_pe = torch.randn(T, H, C, generator=g), torch.randn(T, H, R, generator=g)
    to = {"dtype": dtype, "device": DEVICE}
    cache = wide.to(**to)[:, : C + R]
    return q_latent.to(**to), q_pe.to(**to), cache, indices.to(index_dtype).to(DEVICE), (C + R) ** -0.5


def both(T, H, C, R, K, dtype, num_splits=None, **kwargs):
    """(triton output, torch reference output) of sparse_mla_core."""
    q_latent, q_pe, cache, indices, scale = make_case(T, H, C, R, K, dtype, **kwargs)
    assert cache.stride(0) == C + R + EXTRA
    out = sparse_mla_core_triton(q_latent, q_pe, cache, indices, scale, num_splits)
    assert out.shape == (T, H, C) and out.dtype == dtype
    return out, sparse_mla_core(q_latent, q_pe, cache, indices, scale)


@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_core_matches_reference(dtype, num_splits):
    """20 heads (a full head block of 16 and a masked one), K = 37 (no multiple of the slot block),
    odd C and R; one split writes the output directly, three go through the merge (row 1's slot
    sits in its first split, the others empty)."""
    assert sparse_mla.default_tiles(20, dtype).block_m == 16
    out, ref = both(T=4, H=20, C=24, R=6, K=37, dtype=dtype, num_splits=num_splits)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_single_slot_row_is_that_slots_latent():
    """A query attending to one slot gets exactly its latent, whatever the scores."""
    q_latent, q_pe, cache, indices, scale = make_case(3, 4, 16, 8, 20, torch.float32)
    out = sparse_mla_core_triton(q_latent, q_pe, cache, indices, scale, num_splits=2)
    torch.testing.assert_close(out[1], cache[USED - 1, :16].expand(4, 16), rtol=0, atol=1e-6)


def test_int32_indices_and_split_count_per_shape():
    """int32 slots read as int64 ones; a single-token step splits its 300 slots in two
    (decode_splits), a step of 128 tokens does not."""
    args = make_case(3, 4, 16, 8, 300, torch.float32, index_dtype=torch.int32)
    indices64 = args[3].long()
    out = sparse_mla_core_triton(*args)
    torch.testing.assert_close(out, sparse_mla_core(*args[:3], indices64, args[4]), **TOL[torch.float32])
    q_latent, q_pe, step = aot.meta(128, 4, 16), aot.meta(128, 4, 8), aot.meta(128, 300, dtype=torch.int64)
    one = sparse_mla.sparse_launches(q_latent[:1], q_pe[:1], aot.meta(400, 24), step[:1], 0.1)[1]
    wide = sparse_mla.sparse_launches(q_latent, q_pe, aot.meta(400, 24), step, 0.1)[1]
    assert [launch.grid for launch in one] == [(1, 2), (1, 4)] and one[0].constexprs["SPLIT"]
    assert [launch.grid for launch in wide] == [(128, 1)] and not wide[0].constexprs["SPLIT"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v32_dims_default_tiles(dtype):
    """DeepSeek-V3.2's head dims with its default tiles: 128 heads (bf16: 4 head blocks of 32, a
    64-slot block wider than the 40 indices)."""
    out, ref = both(T=2, H=128, C=512, R=64, K=40, dtype=dtype)
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_sparse_matches_torch_backend(dtype):
    """TritonMLA.sparse absorbs the query and unabsorbs the output as TorchMLA.sparse does."""
    H, Dn, Dv, C, R = 4, 8, 12, 16, 8
    _, q_pe, cache, indices, scale = make_case(3, H, C, R, 20, dtype)
    g = torch.Generator().manual_seed(1)
    w_uk, w_uv = absorb_kv_b((torch.randn(H * (Dn + Dv), C, generator=g) * 0.3).to(dtype), H, Dn, Dv)
    q_nope = torch.randn(3, H, Dn, generator=g).to(dtype)
    args = (q_nope, q_pe, cache, indices, w_uk, w_uv, scale)
    out = TritonMLA().sparse(*args)
    assert out.shape == (3, H, Dv) and out.dtype == dtype
    torch.testing.assert_close(out, TorchMLA().sparse(*args), **TOL[dtype])
    empty = TritonMLA().sparse(q_nope[:0], q_pe[:0], cache, indices[:0], w_uk, w_uv, scale)
    assert empty.shape == (0, H, Dv)


def test_aot_compiles_the_sparse_launches_within_budget(tmp_path):
    """`python -m kernels.aot --only sparse_mla` compiles every sparse launch for both targets at
    V3.2's shapes over the strided cache, within the budgets; one kernel per dtype serves every
    split count above one (the count is a runtime value)."""
    code, report, err = run_aot(tmp_path / "r.json", "--target", "sm_90", "sm_100", "--only", "sparse_mla")
    assert code == 0, err[-4000:]
    for target in ("sm_90", "sm_100"):
        entries = [e for e in report["configs"] if e["target"] == target]
        assert sorted(u for e in entries for u in e["uses"]) == sorted(expected_sparse_uses())
        kernel = [e for e in entries if e["kernel"] == "sparse_mla" and e["constexprs"]["SPLIT"] == "True"]
        assert [len(e["uses"]) for e in kernel] == [4, 4]
        assert all(e["constexprs"]["UPCAST"] == "False" for e in entries if e["kernel"] == "sparse_mla")
