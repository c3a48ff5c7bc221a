"""The split-KV (flash-decoding) machinery both paged decode kernels are made of (MLA in mla.py, GQA
in gqa.py): the split of a sequence's tokens, the page-table walk, one online-softmax step, the
store of a split's partial result, and the kernel that merges the splits.

Decode is one query token per sequence, bound by reading the cache (or, for MLA at 128 heads, close
to the tensor cores' limit). Each sequence's tokens are divided into `num_splits` chunks so that a
small batch still gives the GPU enough programs; a split writes its normalised output and
log-sum-exp, and the merge weighs the splits (base 2: scale * log2(e) is folded into the scores):

    split s of sequence b:  m_s = max_j score_j,  l_s = sum_j 2^(score_j - m_s),
                            o_s = sum_j 2^(score_j - m_s) value_j / l_s,  lse_s = m_s + log2 l_s
    merge:                  out = sum_s 2^(lse_s - max lse) o_s / sum_s 2^(lse_s - max lse)

The split count is a runtime argument, not a constexpr, and the arguments that vary with it or with
the batch are not specialised (`VARYING`): one compiled kernel serves every step's batch and split
count, so a decode step never waits for a compile, and `kernels.aot` sees every variant.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.triton.launch import Launch

MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more to merge than it saves in parallelism
MAX_SPLITS = 16
LOG2E = 1.4426950408889634
# runtime arguments whose values change from step to step: no 16-divisibility or ==1 specialisation
VARYING = ("num_splits", "stride_pages_b", "stride_lse_b", "stride_lse_h")


class SplitKVTiles(NamedTuple):
    """A split-KV kernel's tiles: query rows per program (heads for MLA, a kv-head's padded query
    group for GQA; a power of two >= 16, tl.dot's minimum), cached tokens per loop step, and the
    launch's warps and pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def num_splits_for(max_kv_len: int) -> int:
    """Splits per sequence: one per MIN_SPLIT_TOKENS of the longest sequence, 1..MAX_SPLITS.

    The bound comes from the page table's width (pages.shape[1] * page_size), not kv_lens, so
    choosing it needs no device-to-host copy. Each sequence divides its own tokens evenly among the
    splits (rounded up to the kernel's token block), so a short sequence in a long batch leaves
    trailing splits empty.
    """
    return max(1, min(MAX_SPLITS, triton.cdiv(max_kv_len, MIN_SPLIT_TOKENS)))


# programs a decode launch aims for: about one per multiprocessor of an H100/H200 (132), so that
# splitting a sequence further only adds merge traffic (o_part is B * H * splits * C fp32, written
# and read once: at 16 splits of DeepSeek-V3's 64 x 4096 step, 268 MB against the cache's 302 MB)
TARGET_PROGRAMS = 128


def decode_splits(batch: int, head_blocks: int, max_kv_len: int) -> int:
    """Splits per sequence of a decode launch of `batch` sequences x `head_blocks` programs each:
    enough for TARGET_PROGRAMS programs, at most `num_splits_for(max_kv_len)`. Shapes only (no
    host read). Checked on a GPU against every split count at DeepSeek-V3 batch x context shapes
    (benchmarks.kernels.tune_kernels; the figures: benchmarks/README.md, "Lab notes")."""
    wanted = triton.cdiv(TARGET_PROGRAMS, max(1, batch * head_blocks))
    return max(1, min(num_splits_for(max_kv_len), wanted))


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: fp32 tiles multiply in full fp32 ("ieee", no tf32) to match the
    fp32 reference; bf16 tiles multiply as bf16 with fp32 accumulation on a GPU (the setting is
    unused), and under the interpreter, upcast to fp32 (exact in tf32)."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def split_start(kv_lens_ptr, b, s, num_splits, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_X: tl.constexpr):
    """Split s of sequence b: its tokens [lo, hi) (the sequence divided evenly, chunks aligned to
    BLOCK_N) and the empty online-softmax state of BLOCK_M query rows: (lo, hi, m, l, acc [M, X])."""
    kv_len = tl.load(kv_lens_ptr + b)
    split_len = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
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
def load_tile(ptrs, mask, UPCAST: tl.constexpr):
    """A masked tile in its stored dtype, or in fp32 when UPCAST: Triton 3.9's interpreter
    multiplies bf16 tiles in tl.dot as their raw uint16 bits, so only there are they upcast."""
    tile = tl.load(ptrs, mask=mask, other=0.0)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def softmax_step(scores, n_mask, m_i, l_i, acc, values, DOT_PRECISION: tl.constexpr):
    """One online-softmax step (base 2): scores [M, BLOCK_N] fp32, values [BLOCK_N, X] ->
    (m, l, acc [M, X]). The probabilities enter tl.dot in the values' dtype (bf16 on a GPU: bf16 x
    bf16 tensor-core products, accumulated in fp32 into the rescaled acc)."""
    scores = tl.where(n_mask[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(values.dtype), values, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def store_split(o_ptrs, lse_ptrs, acc, m_i, l_i, o_mask, h_mask):
    """The split's normalised output and log-sum-exp; an empty split (a short sequence) writes
    o = 0, lse = -inf: zero weight in the merge."""
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    tl.store(o_ptrs, acc / l_safe[:, None], mask=o_mask)
    tl.store(lse_ptrs, tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=h_mask)


@triton.jit(do_not_specialize=VARYING)
def _merge_splits_kernel(
    o_part_ptr,
    lse_part_ptr,
    out_ptr,
    num_splits,
    stride_o_b,
    stride_o_h,
    stride_o_s,
    stride_lse_b,
    stride_lse_h,
    stride_out_b,
    stride_out_h,
    C: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One program: sequence b, head h -> out [C], the splits weighted by exp2(lse_s - max lse)."""
    b, h = tl.program_id(0), tl.program_id(1)
    offs_s, offs_c = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_C)
    s_mask, c_mask = offs_s < num_splits, offs_c < C

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


def split_buffers(B: int, H: int, splits: int, C: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch of the splits' partial results: o_part [B, H, splits, C] fp32, lse_part [B, H, splits] fp32."""
    o_part = torch.empty(B, H, splits, C, dtype=torch.float32, device=device)
    return o_part, torch.empty(B, H, splits, dtype=torch.float32, device=device)


def merge_launch(o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor) -> Launch:
    """The merge of the splits: o_part [B, H, S, C] fp32, lse_part [B, H, S] fp32 -> out [B, H, C]
    (fp32 or bf16), one program per (sequence, head). BLOCK_S, the split count's next power of two,
    is the one tile that varies (1, 2, 4, 8 or 16)."""
    B, H, splits, C = o_part.shape
    args = (o_part, lse_part, out, splits, *o_part.stride()[:3], *lse_part.stride()[:2], *out.stride()[:2])
    tiles = dict(C=C, BLOCK_S=triton.next_power_of_2(splits), BLOCK_C=triton.next_power_of_2(max(C, 16)))
    return Launch(_merge_splits_kernel, (B, H), args, tiles)
