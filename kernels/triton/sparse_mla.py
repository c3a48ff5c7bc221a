"""Sparse MLA (DeepSeek-V3.2) on Triton: each query token attends to the cache slots its indexer chose.

The attention of `kernels.sparse_mla.sparse_mla_core` in the absorbed form of MLA decode
(kernels/triton/mla.py), with a list of cache slots per query token in place of a page table. One
program serves BLOCK_H heads of one query token over one split of its K chosen slots: per step of
BLOCK_N slots it loads their latents [BLOCK_N, C] and rotated keys [BLOCK_N, R] by slot and uses the
latents as keys and as values. Unused entries (-1) are masked out of the loads and the softmax.

    grid (token t x head block hb, split s):
        q_latent[t, hb*BLOCK_H : (hb+1)*BLOCK_H] x indices[t, lo_s : hi_s]
        -> out[t, heads] directly (one split), or o_part / lse_part merged by split_kv's merge

Prefill and decode go through the same kernel: a prefill chunk's many tokens fill the GPU without
splitting, so it writes its output directly and needs no scratch (at one split per token the
partial results would be T * H * C fp32, gigabytes for a long chunk). A decode step of few tokens
splits its K slots the way paged decode splits a sequence (`split_kv.decode_splits`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import split_kv
from kernels.triton.launch import Launch, is_interpreted
from kernels.triton.split_kv import SplitKVTiles

# runtime arguments that change from step to step: the indexer keeps min(index_topk, context) slots
# per token, and the split count varies with the batch; none is specialised (one compile serves all)
VARYING = ("num_indices", "num_splits", "stride_idx_t", "stride_lse_t", "stride_lse_h")


def default_tiles(num_heads: int, dtype: torch.dtype) -> SplitKVTiles:
    """Tiles of the sparse kernel, holding kernels.aot's budgets (no spill, shared memory) at sm_90
    and sm_100. Its inner loop is paged MLA decode's with an index load in place of a page-table
    load, so the same registers bound it (see `kernels.triton.mla.default_tiles`): an fp32
    accumulator [BLOCK_H, C] over 8 warps beside the query block for 32 heads in bf16; fp32
    multiplies on the FMA units and keeps 16 slots a step."""
    if dtype == torch.float32:
        return SplitKVTiles(block_m=16, block_n=16, num_warps=8, num_stages=2)
    if num_heads >= 32:
        return SplitKVTiles(block_m=32, block_n=64, num_warps=8, num_stages=3)
    return SplitKVTiles(block_m=16, block_n=32, num_warps=4, num_stages=3)


@triton.jit
def _masked_softmax_step(scores, valid, m_i, l_i, acc, values, DOT_PRECISION: tl.constexpr):
    """`split_kv.softmax_step` for a step that may have no valid slot at all (a block of -1
    entries): the running maximum stays -inf there, so the rescale subtracts 0 in its place
    rather than forming -inf - -inf."""
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(values.dtype), values, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=VARYING)
def _sparse_mla_kernel(
    q_latent_ptr,
    q_pe_ptr,
    cache_ptr,
    indices_ptr,
    o_ptr,
    lse_ptr,
    qk_scale,
    num_heads,
    num_indices,
    num_splits,
    stride_ql_t,
    stride_ql_h,
    stride_qp_t,
    stride_qp_h,
    stride_cache,
    stride_idx_t,
    stride_o_t,
    stride_o_h,
    stride_o_s,
    stride_lse_t,
    stride_lse_h,
    C: tl.constexpr,
    R: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One program: heads [hb * BLOCK_H, (hb + 1) * BLOCK_H) of query token t, split s of its
    indices. SPLIT: write the normalised partial o [BLOCK_H, C] and lse [BLOCK_H] for the merge;
    otherwise the output itself in o's dtype. UPCAST (the interpreter only): tiles in fp32."""
    head_blocks = tl.cdiv(num_heads, BLOCK_H)
    pid, s = tl.program_id(0), tl.program_id(1)
    t, hb = pid // head_blocks, pid % head_blocks  # a token's head blocks run together: they share rows
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c, offs_r = tl.arange(0, BLOCK_C), tl.arange(0, BLOCK_R)
    h_mask, c_mask, r_mask = offs_h < num_heads, offs_c < C, offs_r < R

    q_lat = split_kv.load_tile(
        q_latent_ptr + t * stride_ql_t + offs_h[:, None] * stride_ql_h + offs_c[None, :],
        h_mask[:, None] & c_mask[None, :],
        UPCAST,
    )  # [BLOCK_H, BLOCK_C]
    q_pe = split_kv.load_tile(
        q_pe_ptr + t * stride_qp_t + offs_h[:, None] * stride_qp_h + offs_r[None, :],
        h_mask[:, None] & r_mask[None, :],
        UPCAST,
    )  # [BLOCK_H, BLOCK_R]

    split_len = tl.cdiv(tl.cdiv(num_indices, num_splits), BLOCK_N) * BLOCK_N
    lo = s * split_len
    hi = tl.minimum(lo + split_len, num_indices)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        slot = tl.load(indices_ptr + t * stride_idx_t + offs_n, mask=offs_n < hi, other=-1)
        valid = slot >= 0
        row = tl.where(valid, slot, 0).to(tl.int64) * stride_cache  # [BLOCK_N]; int64: slots x row width
        lat_ptrs, pe_ptrs = cache_ptr + row[:, None] + offs_c[None, :], cache_ptr + row[:, None] + C + offs_r[None, :]
        latent = split_kv.load_tile(lat_ptrs, valid[:, None] & c_mask[None, :], UPCAST)  # [BLOCK_N, BLOCK_C]
        k_pe = split_kv.load_tile(pe_ptrs, valid[:, None] & r_mask[None, :], UPCAST)  # [BLOCK_N, BLOCK_R]

        scores = tl.dot(q_lat, tl.trans(latent), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N] fp32
        scores = tl.dot(q_pe, tl.trans(k_pe), scores, input_precision=DOT_PRECISION) * qk_scale
        m_i, l_i, acc = _masked_softmax_step(scores, valid, m_i, l_i, acc, latent, DOT_PRECISION)

    o_ptrs = o_ptr + t * stride_o_t + offs_h[:, None] * stride_o_h + s * stride_o_s + offs_c[None, :]
    o_mask = h_mask[:, None] & c_mask[None, :]
    if SPLIT:
        lse_ptrs = lse_ptr + t * stride_lse_t + offs_h * stride_lse_h + s
        split_kv.store_split(o_ptrs, lse_ptrs, acc, m_i, l_i, o_mask, h_mask)
    else:  # every row names a slot, so l_i > 0
        tl.store(o_ptrs, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=o_mask)


_INTERPRETED = is_interpreted(_sparse_mla_kernel)


def sparse_mla_core_triton(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """`kernels.sparse_mla.sparse_mla_core` on Triton.

    q_latent [T, H, C], q_pe [T, H, R]: fp32 or bf16, the cache's dtype; last dim contiguous.
    cache [S, C + R]: row = one token, its latent then its rotated key; last dim contiguous, rows at
        any stride (the MLA share of rows that also hold the indexer's key).
    indices [T, K] int32 or int64: cache slots per query token, -1 unused, every row naming at least
        one slot (a row of -1 alone gives NaN); last dim contiguous.
    num_splits: chunks of the K slots per token; default `split_kv.decode_splits` (T, head blocks, K).
    Returns out_latent [T, H, C] in q_latent's dtype; softmax and output accumulate in fp32. With
    more than one split the partial results take T * H * num_splits * (C + 1) fp32 of scratch.
    """
    if q_latent.shape[0] == 0:
        return q_latent.new_empty(q_latent.shape)
    out, launches = sparse_launches(q_latent, q_pe, cache, indices, scale, num_splits)
    for launch in launches:
        launch()
    return out


def sparse_launches(
    q_latent,
    q_pe,
    cache,
    indices,
    scale: float,
    num_splits: int | None = None,
    interpreted: bool = _INTERPRETED,
    tiles: SplitKVTiles | None = None,
) -> tuple[torch.Tensor, list[Launch]]:
    """The output [T, H, C] (allocated, not yet written) and the launches that fill it: the sparse
    kernel alone at one split, then split_kv's merge at more (arguments as in
    `sparse_mla_core_triton`, T >= 1). `interpreted`: build them for Triton's interpreter (default:
    whether this process runs it). `tiles`: default `default_tiles`."""
    T, H, C = q_latent.shape
    R, K = q_pe.shape[-1], indices.shape[-1]
    assert cache.shape[-1] == C + R and cache.stride(-1) == 1, "cache rows must be [C + R], last dim contiguous"
    assert q_latent.stride(-1) == 1 and q_pe.stride(-1) == 1, "query head dims must be contiguous"
    assert indices.shape[0] == T and indices.stride(-1) == 1, "indices must be [T, K], last dim contiguous"
    tiles = tiles or default_tiles(H, q_latent.dtype)
    head_blocks = triton.cdiv(H, tiles.block_m)
    splits = num_splits or split_kv.decode_splits(T, head_blocks, K)
    out = q_latent.new_empty(T, H, C)
    if splits > 1:
        o, lse = split_kv.split_buffers(T, H, splits, C, q_latent.device)
        o_strides, lse_strides = o.stride()[:3], lse.stride()[:2]
    else:  # written in place: no scratch, no merge
        o, lse, o_strides, lse_strides = out, out, (*out.stride()[:2], 0), (0, 0)
    args = (q_latent, q_pe, cache, indices, o, lse, scale * split_kv.LOG2E, H, K, splits)
    strides = (*q_latent.stride()[:2], *q_pe.stride()[:2], cache.stride(0), indices.stride(0))
    constexprs = dict(
        C=C,
        R=R,
        SPLIT=splits > 1,
        UPCAST=interpreted and q_latent.dtype != torch.float32,
        DOT_PRECISION=split_kv.dot_precision(q_latent.dtype),
        BLOCK_H=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_C=triton.next_power_of_2(max(C, 16)),
        BLOCK_R=triton.next_power_of_2(max(R, 16)),
    )
    kernel = Launch(
        _sparse_mla_kernel,
        (T * head_blocks, splits),
        (*args, *strides, *o_strides, *lse_strides),
        constexprs,
        tiles.num_warps,
        tiles.num_stages,
    )
    return out, [kernel, split_kv.merge_launch(o, lse, out)] if splits > 1 else [kernel]
