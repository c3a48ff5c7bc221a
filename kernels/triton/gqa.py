"""GQA attention backend `triton`: decode with a split-KV (flash-decoding) kernel that reads the paged
K/V cache through the page table.

Decode is one query token per sequence, bound by reading the cache. The G = H / KVH query heads
that share a key/value head read the same keys and values, so one program serves all of them: it
loads each K/V tile once and multiplies it against a [G, D] block of queries (G padded to >= 16,
tl.dot's minimum). Each sequence's tokens are divided into NUM_SPLITS chunks, giving the GPU
B * KVH * NUM_SPLITS programs; the merge of the chunks' partial softmaxes (log-sum-exp trick, base 2)
is the MLA kernel's `_merge_splits_kernel`, shared rather than copied:

    grid (b, g, s):  queries q[b, g*G : (g+1)*G]  x  tokens [lo_s, hi_s) of sequence b, kv-head g
                     -> o_part[b, g*G : (g+1)*G, s] (normalised), lse_part[b, g*G : (g+1)*G, s]
    merge (b, h):    out[b, h] = sum_s 2^(lse_s - max lse) o_s / sum_s 2^(lse_s - max lse)

Extend (prefill) stays on the torch reference; see `TritonGQA.extend` for why.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kernels.gqa import gqa_extend_attention
from kernels.mla import PagedKV
from kernels.triton.mla import (
    BLOCK_N,
    LOG2E,
    _dot_precision,
    _merge_splits_kernel,
    num_splits_for,
    page_rows,
    softmax_step,
    split_start,
    store_split,
)

MIN_BLOCK_G = 16  # query heads per program are padded to this (tl.dot needs M >= 16) and masked


@triton.jit
def _split_kv_kernel(
    q_ptr,
    cache_ptr,
    pages_ptr,
    kv_lens_ptr,
    o_part_ptr,
    lse_part_ptr,
    qk_scale,
    stride_q_b,
    stride_q_h,
    stride_cache,
    stride_pages_b,
    stride_o_b,
    stride_o_h,
    stride_o_s,
    stride_lse_b,
    stride_lse_h,
    KVH: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program: sequence b, kv-head g (query heads g*G .. g*G + G - 1), split s -> o_part, lse_part."""
    b, g, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_h = g * G + tl.arange(0, BLOCK_G)  # query heads of kv-head g
    offs_d = tl.arange(0, BLOCK_D)
    h_mask, d_mask = tl.arange(0, BLOCK_G) < G, offs_d < D

    q = tl.load(
        q_ptr + b * stride_q_b + offs_h[:, None] * stride_q_h + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(tl.float32)  # [BLOCK_G, BLOCK_D]

    lo, hi, m_i, l_i, acc = split_start(kv_lens_ptr, b, s, NUM_SPLITS, BLOCK_N, BLOCK_G, BLOCK_D)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        row = page_rows(pages_ptr, b, stride_pages_b, offs_n, n_mask, PAGE_SIZE, stride_cache)  # [BLOCK_N]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_ptrs = cache_ptr + row[:, None] + g * D + offs_d[None, :]  # keys of kv-head g
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        v = tl.load(k_ptrs + KVH * D, mask=kv_mask, other=0.0).to(tl.float32)  # its values, [BLOCK_N, BLOCK_D]

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        m_i, l_i, acc = softmax_step(scores, n_mask, m_i, l_i, acc, v, DOT_PRECISION)

    o_ptrs = o_part_ptr + b * stride_o_b + offs_h[:, None] * stride_o_h + s * stride_o_s + offs_d[None, :]
    lse_ptrs = lse_part_ptr + b * stride_lse_b + offs_h * stride_lse_h + s
    store_split(o_ptrs, lse_ptrs, acc, m_i, l_i, h_mask[:, None] & d_mask[None, :], h_mask)


# Triton 3.9's interpreter casts fp32 -> bf16 by truncation (a GPU rounds to nearest even), which
# would cost the CPU tests a bf16 ulp against the reference. There the merge writes fp32 and torch
# rounds. triton.jit makes an InterpretedFunction iff TRITON_INTERPRET=1 was set before triton's import.
_INTERPRETED = isinstance(_split_kv_kernel, InterpretedFunction)


def gqa_decode_attention_triton(
    q: torch.Tensor, cache: torch.Tensor, kv: PagedKV, num_kv_heads: int, scale: float, num_splits: int | None = None
) -> torch.Tensor:
    """One query token per sequence against its paged K/V cache (`kernels.gqa.gqa_decode_attention`).

    q [B, H, D]: fp32 or bf16, same dtype as the cache; last dim contiguous (any batch/head strides).
        H must be a multiple of KVH = num_kv_heads; query head h reads kv-head h // (H / KVH).
    cache [num_slots, 2 * KVH * D]: row = one token: keys of kv-heads 0..KVH-1 (kv-head g at columns
        [g*D, (g+1)*D)), then their values (kv-head g at [KVH*D + g*D, KVH*D + (g+1)*D)); rows
        contiguous along the last dim. Page p holds rows [p * page_size, (p + 1) * page_size).
    kv.pages [B, P] int64: page ids of sequence b in token order; token j is cache row
        pages[b, j // page_size] * page_size + j % page_size. Entries past ceil(kv_lens[b] /
        page_size) are never read, so they may hold anything. kv.slots and kv.bias are not used.
    kv.kv_lens [B] int64, each >= 1 (a 0 gives a zero output row).
    kv.page_size: any positive int (a compile-time constant: one kernel variant per page size).
    scale: softmax scale of q . k (usually D ** -0.5).
    num_splits: chunks per sequence; default `num_splits_for(P * page_size)`.
    Head dims: any D >= 1 (padded to a power of two >= 16 and masked); any G = H / KVH (padded to a
    power of two >= 16 and masked). Qwen3: D = 128, G = 4 or 8.
    Returns [B, H, D] in q's dtype; scores, softmax statistics and the output accumulate in fp32
    (the reference rounds bf16 scores and probabilities to bf16: equal to bf16 rounding). Partial
    results take B * H * num_splits * (D + 1) fp32 of scratch. B = 0: empty, no launch.
    """
    B, H, D = q.shape
    if B == 0:
        return q.new_empty(B, H, D)
    assert H % num_kv_heads == 0, f"{H} query heads are not a multiple of {num_kv_heads} kv heads"
    assert cache.shape[-1] == 2 * num_kv_heads * D and cache.stride(-1) == 1, "cache rows must be [2*KVH*D], contiguous"
    assert q.stride(-1) == 1, "the query head dim must be contiguous"
    group = H // num_kv_heads
    splits = num_splits or num_splits_for(kv.pages.shape[1] * kv.page_size)
    o_part = torch.empty(B, H, splits, D, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(max(D, 16))
    out = torch.empty(B, H, D, dtype=torch.float32 if _INTERPRETED else q.dtype, device=q.device)
    _split_kv_kernel[(B, num_kv_heads, splits)](
        q,
        cache,
        kv.pages,
        kv.kv_lens,
        o_part,
        lse_part,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        cache.stride(0),
        kv.pages.stride(0),
        *o_part.stride()[:3],
        *lse_part.stride()[:2],
        KVH=num_kv_heads,
        G=group,
        D=D,
        PAGE_SIZE=kv.page_size,
        NUM_SPLITS=splits,
        DOT_PRECISION=_dot_precision(q.dtype),
        BLOCK_G=triton.next_power_of_2(max(group, MIN_BLOCK_G)),
        BLOCK_N=BLOCK_N,
        BLOCK_D=block_d,
    )
    _merge_splits_kernel[(B, H)](
        o_part,
        lse_part,
        out,
        *o_part.stride()[:3],
        *lse_part.stride()[:2],
        *out.stride()[:2],
        C=D,
        NUM_SPLITS=splits,
        BLOCK_S=triton.next_power_of_2(splits),
        BLOCK_C=block_d,
    )
    return out.to(q.dtype)  # a no-op except under the interpreter


class TritonGQA:
    """The `triton` GQA backend: paged split-KV decode on Triton, extend on torch.

    Inputs fp32 or bf16 (cache and queries of one dtype). Page size: any. Head dims: any D, any
    H = G * KVH (Qwen3: D = 128). Tiles are upcast to fp32 in the kernel: fp32 inputs multiply in
    full fp32 (no tf32), bf16 in tf32 (exact for bf16 values), so both match the torch reference to
    their dtype's rounding. (The upcast also sidesteps Triton 3.9's interpreter, whose tl.dot
    multiplies bf16 tiles as their raw uint16 bits.)
    """

    name = "triton"

    def __init__(self, num_splits: int | None = None):
        self.num_splits = num_splits  # None: chosen per call by `num_splits_for`

    def extend(self, q, cache, slots, kv_lens, q_positions, num_kv_heads: int, scale: float):
        """See `gqa_extend_attention`: padded query blocks [B, Q, H, D] -> [B, Q, H, D].

        Delegates to the torch reference on purpose. Extend has many queries per sequence, so it is
        compute-bound: one gather of the keys and values and a dense causal attention, which torch's
        scaled_dot_product_attention (a flash-attention kernel on GPU) already serves well. The
        paged, memory-bound decode is where a custom kernel pays.
        """
        return gqa_extend_attention(q, cache, slots, kv_lens, q_positions, num_kv_heads, scale)

    def decode(self, q, cache, kv: PagedKV, num_kv_heads: int, scale: float):
        """`gqa_decode_attention` on Triton: q [B, H, D], cache [S, 2 * KVH * D] -> [B, H, D]
        (see `gqa_decode_attention_triton`)."""
        return gqa_decode_attention_triton(q, cache, kv, num_kv_heads, scale, self.num_splits)
