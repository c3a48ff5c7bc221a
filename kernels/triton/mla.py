"""MLA attention backend `triton`: absorbed decode with a split-KV (flash-decoding) kernel that reads
the paged latent cache through the page table.

Decode is one query token per sequence against its whole cached latent, so it is bound by reading
the cache; a sequence alone would occupy one program per head block. Splitting each sequence's
tokens into NUM_SPLITS chunks gives the GPU B * head_blocks * NUM_SPLITS programs, each reading a
slice of the cache; a second small kernel merges the slices with the log-sum-exp trick:

    split s of sequence b:  m_s = max_j score_j,  l_s = sum_j exp(score_j - m_s),
                            o_s = sum_j exp(score_j - m_s) latent_j / l_s,  lse_s = m_s + log l_s
    merge:                  out = sum_s exp(lse_s - max lse) o_s / sum_s exp(lse_s - max lse)

Scores are kept in base 2 (scale * log2(e) folded into the query scale) so the kernels use exp2.
Extend (prefill) stays on the torch reference; see `TritonMLA.extend` for why.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.mla import (
    PagedKV,
    absorb_kv_b,
    absorb_query,
    mla_extend_attention,
    unabsorb_output,
)

BLOCK_H = 16  # heads per program; tl.dot needs M >= 16, so fewer heads are masked, not a smaller block
BLOCK_N = 32  # cached tokens per inner-loop step
MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more to merge than it saves in parallelism
MAX_SPLITS = 16
LOG2E = 1.4426950408889634


def num_splits_for(max_kv_len: int) -> int:
    """Splits per sequence: one per MIN_SPLIT_TOKENS of the longest sequence, 1..MAX_SPLITS.

    The bound comes from the page table's width (pages.shape[1] * page_size), not kv_lens, so
    choosing it needs no device-to-host copy. Each sequence divides its own tokens evenly among the
    splits (rounded up to BLOCK_N), so a short sequence in a long batch leaves trailing splits empty.
    """
    return max(1, min(MAX_SPLITS, triton.cdiv(max_kv_len, MIN_SPLIT_TOKENS)))


def _dot_precision(dtype: torch.dtype) -> str:
    """The kernel upcasts every tile to fp32 before tl.dot. A bf16 (or fp16) value is exact in tf32,
    so tf32 tensor cores lose nothing there; fp32 inputs need "ieee" to match the fp32 reference.
    (Upcasting also sidesteps Triton 3.9's interpreter, whose tl.dot multiplies bf16 tiles as their
    raw uint16 bits.)"""
    return "ieee" if dtype == torch.float32 else "tf32"


# -- pieces both split-KV kernels (MLA here, GQA in gqa.py) are made of --------------------------


@triton.jit
def split_start(
    kv_lens_ptr, b, s, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_X: tl.constexpr
):
    """Split s of sequence b: its tokens [lo, hi) (the sequence divided evenly, chunks aligned to
    BLOCK_N) and the empty online-softmax state of BLOCK_M query rows: (lo, hi, m, l, acc [M, X])."""
    kv_len = tl.load(kv_lens_ptr + b)
    split_len = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = s * split_len
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    return lo, tl.minimum(lo + split_len, kv_len), m_i, l_i, tl.zeros([BLOCK_M, BLOCK_X], tl.float32)


@triton.jit
def page_rows(pages_ptr, b, stride_pages_b, offs_n, n_mask, PAGE_SIZE: tl.constexpr, stride_cache):
    """Cache row offsets [BLOCK_N] of tokens offs_n of sequence b, through the page table; padding
    pages past kv_len are never loaded (masked)."""
    page = tl.load(pages_ptr + b * stride_pages_b + offs_n // PAGE_SIZE, mask=n_mask, other=0)
    return (page * PAGE_SIZE + offs_n % PAGE_SIZE) * stride_cache


@triton.jit
def softmax_step(scores, n_mask, m_i, l_i, acc, values, DOT_PRECISION: tl.constexpr):
    """One online-softmax step (base 2): scores [M, BLOCK_N], values [BLOCK_N, X] -> (m, l, acc [M, X])."""
    scores = tl.where(n_mask[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p, values, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def store_split(o_ptrs, lse_ptrs, acc, m_i, l_i, o_mask, h_mask):
    """The split's normalised output and log-sum-exp; an empty split (a short sequence) writes
    o = 0, lse = -inf: zero weight in the merge."""
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    tl.store(o_ptrs, acc / l_safe[:, None], mask=o_mask)
    tl.store(lse_ptrs, tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=h_mask)


@triton.jit
def _split_kv_kernel(
    q_latent_ptr,
    q_pe_ptr,
    cache_ptr,
    pages_ptr,
    kv_lens_ptr,
    o_part_ptr,
    lse_part_ptr,
    qk_scale,
    num_heads,
    stride_ql_b,
    stride_ql_h,
    stride_qp_b,
    stride_qp_h,
    stride_cache,
    stride_pages_b,
    stride_o_b,
    stride_o_h,
    stride_o_s,
    stride_lse_b,
    stride_lse_h,
    C: tl.constexpr,
    R: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One program: sequence b, heads [h0, h0 + BLOCK_H), split s -> o_part [BLOCK_H, C], lse_part."""
    b, s = tl.program_id(0), tl.program_id(2)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c, offs_r = tl.arange(0, BLOCK_C), tl.arange(0, BLOCK_R)
    h_mask, c_mask, r_mask = offs_h < num_heads, offs_c < C, offs_r < R

    q_lat = tl.load(
        q_latent_ptr + b * stride_ql_b + offs_h[:, None] * stride_ql_h + offs_c[None, :],
        mask=h_mask[:, None] & c_mask[None, :],
        other=0.0,
    ).to(tl.float32)  # [BLOCK_H, BLOCK_C]
    q_pe = tl.load(
        q_pe_ptr + b * stride_qp_b + offs_h[:, None] * stride_qp_h + offs_r[None, :],
        mask=h_mask[:, None] & r_mask[None, :],
        other=0.0,
    ).to(tl.float32)  # [BLOCK_H, BLOCK_R]

    lo, hi, m_i, l_i, acc = split_start(kv_lens_ptr, b, s, NUM_SPLITS, BLOCK_N, BLOCK_H, BLOCK_C)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        row = page_rows(pages_ptr, b, stride_pages_b, offs_n, n_mask, PAGE_SIZE, stride_cache)  # [BLOCK_N]
        latent = tl.load(
            cache_ptr + row[:, None] + offs_c[None, :], mask=n_mask[:, None] & c_mask[None, :], other=0.0
        ).to(tl.float32)  # [BLOCK_N, BLOCK_C]
        k_pe = tl.load(
            cache_ptr + row[:, None] + C + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0
        ).to(tl.float32)  # [BLOCK_N, BLOCK_R]

        scores = tl.dot(q_lat, tl.trans(latent), input_precision=DOT_PRECISION)
        scores = tl.dot(q_pe, tl.trans(k_pe), scores, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
        m_i, l_i, acc = softmax_step(scores, n_mask, m_i, l_i, acc, latent, DOT_PRECISION)

    o_ptrs = o_part_ptr + b * stride_o_b + offs_h[:, None] * stride_o_h + s * stride_o_s + offs_c[None, :]
    lse_ptrs = lse_part_ptr + b * stride_lse_b + offs_h * stride_lse_h + s
    store_split(o_ptrs, lse_ptrs, acc, m_i, l_i, h_mask[:, None] & c_mask[None, :], h_mask)


@triton.jit
def _merge_splits_kernel(
    o_part_ptr,
    lse_part_ptr,
    out_ptr,
    stride_o_b,
    stride_o_h,
    stride_o_s,
    stride_lse_b,
    stride_lse_h,
    stride_out_b,
    stride_out_h,
    C: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One program: sequence b, head h -> out [C], the splits weighted by exp2(lse_s - max lse)."""
    b, h = tl.program_id(0), tl.program_id(1)
    offs_s, offs_c = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_C)
    s_mask, c_mask = offs_s < NUM_SPLITS, offs_c < C

    lse = tl.load(
        lse_part_ptr + b * stride_lse_b + h * stride_lse_h + offs_s, mask=s_mask, other=float("-inf")
    )  # [BLOCK_S]
    o = tl.load(
        o_part_ptr + b * stride_o_b + h * stride_o_h + offs_s[:, None] * stride_o_s + offs_c[None, :],
        mask=s_mask[:, None] & c_mask[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_C]
    lse_max = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))  # all-empty: weights 0
    total = tl.sum(weight, 0)
    out = tl.sum(o * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_out_b + h * stride_out_h + offs_c, out.to(out_ptr.dtype.element_ty), mask=c_mask)


def mla_decode_core_triton(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    kv: PagedKV,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """The attention core of absorbed MLA decode over the paged cache (`kernels.mla.mla_decode_core`).

    q_latent [B, H, C], q_pe [B, H, R]: fp32 or bf16, same dtype as the cache; last dim contiguous.
    cache [num_slots, C + R]: row = one token, its latent c_kv [C] then its rotated k_pe [R];
        rows contiguous. Page p holds rows [p * page_size, (p + 1) * page_size).
    kv.pages [B, P] int64: page ids of sequence b in token order; token j is cache row
        pages[b, j // page_size] * page_size + j % page_size. Entries past ceil(kv_lens[b] /
        page_size) are never read, so they may hold anything. kv.slots and kv.bias are not used.
    kv.kv_lens [B] int64, each >= 1 (a 0 gives a zero output row).
    kv.page_size: any positive int (a compile-time constant: one kernel variant per page size).
    num_splits: chunks per sequence; default `num_splits_for(P * page_size)`.
    Head dims: any H, C, R >= 1 (padded to powers of two and masked; C, R <= a few thousand).
    Returns out_latent [B, H, C] in q_latent's dtype; softmax statistics and the output accumulate
    in fp32. Partial results take B * H * num_splits * (C + 1) fp32 of scratch.
    """
    B, H, C = q_latent.shape
    R = q_pe.shape[-1]
    out = q_latent.new_empty(B, H, C)
    if B == 0:
        return out
    assert cache.shape[-1] == C + R and cache.stride(-1) == 1, "cache rows must be [C + R], contiguous"
    assert q_latent.stride(-1) == 1 and q_pe.stride(-1) == 1, "query head dims must be contiguous"
    splits = num_splits or num_splits_for(kv.pages.shape[1] * kv.page_size)
    o_part = torch.empty(B, H, splits, C, dtype=torch.float32, device=q_latent.device)
    lse_part = torch.empty(B, H, splits, dtype=torch.float32, device=q_latent.device)
    block_c = triton.next_power_of_2(max(C, 16))
    _split_kv_kernel[(B, triton.cdiv(H, BLOCK_H), splits)](
        q_latent,
        q_pe,
        cache,
        kv.pages,
        kv.kv_lens,
        o_part,
        lse_part,
        scale * LOG2E,
        H,
        q_latent.stride(0),
        q_latent.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        cache.stride(0),
        kv.pages.stride(0),
        *o_part.stride()[:3],
        *lse_part.stride()[:2],
        C=C,
        R=R,
        PAGE_SIZE=kv.page_size,
        NUM_SPLITS=splits,
        DOT_PRECISION=_dot_precision(q_latent.dtype),
        BLOCK_H=BLOCK_H,
        BLOCK_N=BLOCK_N,
        BLOCK_C=block_c,
        BLOCK_R=triton.next_power_of_2(max(R, 16)),
    )
    _merge_splits_kernel[(B, H)](
        o_part,
        lse_part,
        out,
        *o_part.stride()[:3],
        *lse_part.stride()[:2],
        *out.stride()[:2],
        C=C,
        NUM_SPLITS=splits,
        BLOCK_S=triton.next_power_of_2(splits),
        BLOCK_C=block_c,
    )
    return out


class TritonMLA:
    """The `triton` MLA backend: absorbed decode through a paged split-KV Triton kernel, extend on torch.

    Inputs fp32 or bf16 (cache, queries and weights of one dtype). Page size: any. Head dims: any
    (DeepSeek-V3: H = 128, C = kv_lora_rank = 512, R = qk_rope_head_dim = 64, Dn = 128, Dv = 128).
    Tiles are upcast to fp32 in the kernel: fp32 inputs multiply in full fp32 (no tf32), bf16 in tf32
    (exact for bf16 values), so both match the torch reference to their dtype's rounding.
    """

    name = "triton"

    def __init__(self, num_splits: int | None = None):
        self.num_splits = num_splits  # None: chosen per call by `num_splits_for`

    def absorb(self, w_kv_b: torch.Tensor, num_heads: int, qk_nope_head_dim: int, v_head_dim: int):
        """See `absorb_kv_b`: kv_b_proj [H * (Dn + Dv), C] -> (W_UK [H, Dn, C], W_UV [H, Dv, C])."""
        return absorb_kv_b(w_kv_b, num_heads, qk_nope_head_dim, v_head_dim)

    def extend(self, q_nope, q_pe, cache, slots, kv_lens, q_positions, w_kv_b, v_head_dim: int, scale: float):
        """See `mla_extend_attention`: padded query blocks [B, Q, H, *] -> [B, Q, H, Dv].

        Delegates to the torch reference on purpose. Extend has many queries per sequence, so it is
        compute-bound: it expands the latent to per-head keys and values once and runs a dense
        causal attention, which torch's scaled_dot_product_attention (a flash-attention kernel on
        GPU) already serves well. The paged, memory-bound decode is where a custom kernel pays.
        """
        return mla_extend_attention(q_nope, q_pe, cache, slots, kv_lens, q_positions, w_kv_b, v_head_dim, scale)

    def decode(self, q_nope, q_pe, cache, kv: PagedKV, w_uk, w_uv, scale: float):
        """`mla_decode_attention` with the core on Triton: q_nope [B, H, Dn], q_pe [B, H, R],
        cache [S, C + R], w_uk [H, Dn, C], w_uv [H, Dv, C] -> [B, H, Dv] (see `mla_decode_core_triton`).
        """
        q_latent = absorb_query(q_nope, w_uk).contiguous()  # [B, H, C]
        return unabsorb_output(
            mla_decode_core_triton(q_latent, q_pe.contiguous(), cache, kv, scale, self.num_splits), w_uv
        )
