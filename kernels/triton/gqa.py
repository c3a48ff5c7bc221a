"""GQA attention backend `triton`: decode with a split-KV (flash-decoding) kernel that reads the paged
K/V cache through the page table.

Decode is one query token per sequence, bound by reading the cache. The G = H / KVH query heads
that share a key/value head read the same keys and values, so one program serves all of them: it
loads each K/V tile once and multiplies it against a [G, D] block of queries (G padded to >= 16,
tl.dot's minimum). Each sequence's tokens are divided into num_splits chunks, giving the GPU
B * KVH * num_splits programs; the split and the merge of the chunks' partial softmaxes
(log-sum-exp trick, base 2) are kernels/triton/split_kv.py's, shared with MLA. Tiles come from
`split_kv_tiles`:

    grid (b, g, s):  queries q[b, g*G : (g+1)*G]  x  tokens [lo_s, hi_s) of sequence b, kv-head g
                     -> o_part[b, g*G : (g+1)*G, s] (normalised), lse_part[b, g*G : (g+1)*G, s]
    merge (b, h):    out[b, h] = sum_s 2^(lse_s - max lse) o_s / sum_s 2^(lse_s - max lse)

Extend (prefill) stays on the torch reference; see `TritonGQA.extend` for why.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gqa import gqa_extend_attention
from kernels.mla import PagedKV
from kernels.triton import split_kv
from kernels.triton.launch import Launch, is_interpreted
from kernels.triton.split_kv import SplitKVTiles

MIN_BLOCK_G = 16  # query heads per program are padded to this (tl.dot needs M >= 16) and masked


def split_kv_tiles(group: int, dtype: torch.dtype) -> SplitKVTiles:
    """Tiles of the split-KV kernel: a roofline estimate, checked by `python -m kernels.aot` (no
    spill at sm_90/sm_100) and timed once on a GPU (benchmarks/README.md, "Lab notes").

    Per cached token a program reads its kv-head's key and value, 2 * D * 2 B = 512 B in bf16
    (Qwen3: D = 128), and does 2 * G * 2D FLOPs: 8 FLOP/B at G = 8, far below any GPU's ridge, so
    the kernel is bound by reading the cache and the tiles need only keep bytes in flight: 64
    tokens a step and 3 stages (39 KB of shared memory) keep enough, where 128 tokens need two
    stages (74 KB) for little more. Registers per thread: the query block [BLOCK_G, D] bf16 as
    each warp's mma.sync A operand, 16 * 128 * 2 B / 32 lanes = 32, and the fp32 accumulator
    [BLOCK_G, D], 16 * 128 * 4 B / 128 threads = 16: 100 at 4 warps with the tiles in flight.
    fp32 multiplies in "ieee" fp32 on the FMA units, where each thread holds its outputs' operands
    along D: 32 tokens at 4 warps spill (255 registers); at 8 warps they take ~65, no spill.
    """
    block_g = triton.next_power_of_2(max(group, MIN_BLOCK_G))
    if dtype == torch.float32:
        return SplitKVTiles(block_m=block_g, block_n=32, num_warps=8, num_stages=2)
    return SplitKVTiles(block_m=block_g, block_n=64, num_warps=4, num_stages=3)


@triton.jit(do_not_specialize=split_kv.VARYING)
def _split_kv_kernel(
    q_ptr,
    cache_ptr,
    pages_ptr,
    kv_lens_ptr,
    o_part_ptr,
    lse_part_ptr,
    qk_scale,
    num_splits,
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
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program: sequence b, kv-head g (query heads g*G .. g*G + G - 1), split s -> o_part, lse_part.
    UPCAST (the interpreter only): tiles in fp32."""
    b, g, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_h = g * G + tl.arange(0, BLOCK_G)  # query heads of kv-head g
    offs_d = tl.arange(0, BLOCK_D)
    h_mask, d_mask = tl.arange(0, BLOCK_G) < G, offs_d < D

    q_ptrs = q_ptr + b * stride_q_b + offs_h[:, None] * stride_q_h + offs_d[None, :]
    q = split_kv.load_tile(q_ptrs, h_mask[:, None] & d_mask[None, :], UPCAST)  # [BLOCK_G, BLOCK_D]

    lo, hi, m_i, l_i, acc = split_kv.split_start(kv_lens_ptr, b, s, num_splits, BLOCK_N, BLOCK_G, BLOCK_D)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        row = split_kv.page_rows(pages_ptr, b, stride_pages_b, offs_n, n_mask, PAGE_SIZE, stride_cache)  # [BLOCK_N]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_ptrs = cache_ptr + row[:, None] + g * D + offs_d[None, :]  # keys of kv-head g
        k = split_kv.load_tile(k_ptrs, kv_mask, UPCAST)  # [BLOCK_N, BLOCK_D]
        v = split_kv.load_tile(k_ptrs + KVH * D, kv_mask, UPCAST)  # its values, [BLOCK_N, BLOCK_D]

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        m_i, l_i, acc = split_kv.softmax_step(scores, n_mask, m_i, l_i, acc, v, DOT_PRECISION)

    o_ptrs = o_part_ptr + b * stride_o_b + offs_h[:, None] * stride_o_h + s * stride_o_s + offs_d[None, :]
    lse_ptrs = lse_part_ptr + b * stride_lse_b + offs_h * stride_lse_h + s
    split_kv.store_split(o_ptrs, lse_ptrs, acc, m_i, l_i, h_mask[:, None] & d_mask[None, :], h_mask)


# Triton 3.9's interpreter casts fp32 -> bf16 by truncation (a GPU rounds to nearest even), which
# would cost the CPU tests a bf16 ulp against the reference. There the merge writes fp32 and torch
# rounds. triton.jit makes an InterpretedFunction iff TRITON_INTERPRET=1 was set before triton's import.
_INTERPRETED = is_interpreted(_split_kv_kernel)


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
    num_splits: chunks per sequence; default `split_kv.num_splits_for(P * page_size)`.
    Head dims: any D >= 1 (padded to a power of two >= 16 and masked); any G = H / KVH (padded to a
    power of two >= 16 and masked). Qwen3: D = 128, G = 4 or 8.
    Returns [B, H, D] in q's dtype; scores, softmax statistics and the output accumulate in fp32
    (the reference rounds bf16 scores and probabilities to bf16: equal to bf16 rounding). Partial
    results take B * H * num_splits * (D + 1) fp32 of scratch. B = 0: empty, no launch.
    """
    if q.shape[0] == 0:
        return q.new_empty(q.shape)
    out, launches = decode_launches(q, cache, kv, num_kv_heads, scale, num_splits)
    for launch in launches:
        launch()
    return out.to(q.dtype)  # a no-op except under the interpreter


def decode_launches(
    q,
    cache,
    kv: PagedKV,
    num_kv_heads: int,
    scale: float,
    num_splits: int | None = None,
    interpreted: bool = _INTERPRETED,
) -> tuple[torch.Tensor, list[Launch]]:
    """The output [B, H, D] (allocated, not yet written; fp32 under the interpreter, else q's dtype)
    and the two launches that fill it: the split-KV kernel and the merge (arguments as in
    `gqa_decode_attention_triton`, B >= 1). `interpreted`: build the launches for Triton's
    interpreter (default: whether this process runs it)."""
    B, H, D = q.shape
    assert H % num_kv_heads == 0, f"{H} query heads are not a multiple of {num_kv_heads} kv heads"
    assert cache.shape[-1] == 2 * num_kv_heads * D and cache.stride(-1) == 1, "cache rows must be [2*KVH*D], contiguous"
    assert q.stride(-1) == 1, "the query head dim must be contiguous"
    splits = num_splits or split_kv.num_splits_for(kv.pages.shape[1] * kv.page_size)
    o_part, lse_part = split_kv.split_buffers(B, H, splits, D, q.device)
    out = torch.empty(B, H, D, dtype=torch.float32 if interpreted else q.dtype, device=q.device)
    tiles = split_kv_tiles(H // num_kv_heads, q.dtype)
    args = (q, cache, kv.pages, kv.kv_lens, o_part, lse_part, scale * split_kv.LOG2E, splits)
    strides = (*q.stride()[:2], cache.stride(0), kv.pages.stride(0), *o_part.stride()[:3], *lse_part.stride()[:2])
    constexprs = dict(
        KVH=num_kv_heads,
        G=H // num_kv_heads,
        D=D,
        PAGE_SIZE=kv.page_size,
        UPCAST=interpreted and q.dtype != torch.float32,
        DOT_PRECISION=split_kv.dot_precision(q.dtype),
        BLOCK_G=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_D=triton.next_power_of_2(max(D, 16)),
    )
    split = Launch(
        _split_kv_kernel, (B, num_kv_heads, splits), (*args, *strides), constexprs, tiles.num_warps, tiles.num_stages
    )
    return out, [split, split_kv.merge_launch(o_part, lse_part, out)]


class TritonGQA:
    """The `triton` GQA backend: paged split-KV decode on Triton, extend on torch.

    Inputs fp32 or bf16 (cache and queries of one dtype). Page size: any. Head dims: any D, any
    H = G * KVH (Qwen3: D = 128). fp32 inputs multiply in full fp32 (no tf32); bf16 inputs in bf16
    on the tensor cores with fp32 accumulation (upcast to fp32 only under the interpreter, whose
    tl.dot multiplies bf16 tiles as their raw uint16 bits), so both match the torch reference to
    their dtype's rounding.
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
