"""MLA attention backend `triton`: absorbed decode with a split-KV (flash-decoding) kernel that reads
the paged latent cache through the page table.

One program serves BLOCK_H heads of one sequence over one split of its tokens: per step of BLOCK_N
cached tokens it loads their latents [BLOCK_N, C] and rotated keys [BLOCK_N, R] once and uses the
latents twice, as keys (scores = q_latent . latent + q_pe . k_pe) and as values (acc += p . latent).
The splits are merged by `split_kv._merge_splits_kernel`; see kernels/triton/split_kv.py for the
split and the log-sum-exp merge. Tiles per shape and dtype come from `split_kv_tiles`.

    grid (head block hb, sequence b, split s):
        q_latent[b, hb*BLOCK_H : (hb+1)*BLOCK_H] x tokens [lo_s, hi_s) of sequence b
        -> o_part[b, hb*BLOCK_H : (hb+1)*BLOCK_H, s] (normalised), lse_part[b, ..., s]

Extend (prefill) stays on the torch reference; see `TritonMLA.extend` for why.
"""

from __future__ import annotations

import functools

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
from kernels.triton import split_kv, tuned
from kernels.triton.launch import Launch, is_interpreted
from kernels.triton.sparse_mla import sparse_mla_core_triton
from kernels.triton.split_kv import MAX_SPLITS, SplitKVTiles, num_splits_for  # noqa: F401 (MAX_SPLITS: this backend's API)

KERNEL = "mla_decode"  # the kernel's name in tuned config files (kernels/triton/tuned.py)


def default_tiles(num_heads: int, dtype: torch.dtype) -> SplitKVTiles:
    """The split-KV kernel's tiles when no tuned file names the GPU and shape: a roofline estimate
    that holds kernels.aot's budgets (no spill, shared memory) at sm_90 and sm_100.

    Per cached token a head block reads (C + R) * 2 B of bf16 cache and does 2 * heads * (2C + R)
    FLOPs: at DeepSeek-V3's 128 heads (C = 512, R = 64) 242 FLOP/B, near a Hopper GPU's ridge, so
    its decode is bound by the tensor cores as much as by memory; V2-Lite's 16 heads make 30 FLOP/B,
    bound by memory. The heads / BLOCK_H head blocks of one (sequence, split) read the same tokens;
    head blocks are the grid's fastest axis, so they run together and re-read from L2. Registers:
    tl.dot with M = BLOCK_H < 64 is mma.sync with the warps side by side along N, each holding the
    query block [16, C] as its A operand (128 registers in bf16 at C = 512), and the fp32
    accumulator [BLOCK_H, C] adds BLOCK_H * C * 4 B / (32 * num_warps): 32 heads at 8 warps fit
    without a spill. fp32 (the accuracy path) multiplies in "ieee" fp32 on the FMA units, where each
    thread holds its outputs' operands along K: 16 tokens a step at 8 warps keeps the registers low
    (32 tokens at 4 warps spill).
    """
    if dtype == torch.float32:
        return SplitKVTiles(block_m=16, block_n=16, num_warps=8, num_stages=2)
    if num_heads >= 32:
        return SplitKVTiles(block_m=32, block_n=64, num_warps=8, num_stages=3)
    return SplitKVTiles(block_m=16, block_n=32, num_warps=4, num_stages=3)


def tuned_shape(num_heads: int, latent: int, rope: int, dtype: torch.dtype) -> dict:
    """The fields a tuned file of MLA decode is keyed by (besides the device)."""
    return {"dtype": tuned.dtype_name(dtype), "heads": num_heads, "C": latent, "R": rope}


@functools.lru_cache(maxsize=64)
def _tuned(num_heads: int, latent: int, rope: int, dtype: torch.dtype, device: str, folder) -> tuple | None:
    """(tuned batch sizes, their tiles) from the file for this device and shape, or None."""
    shape = tuple(tuned_shape(num_heads, latent, rope, dtype).items())
    entries = tuned.table(KERNEL, shape, device, folder)
    if not entries:
        return None
    return tuple(size for size, _ in entries), tuple(SplitKVTiles(**config) for _, config in entries)


def split_kv_tiles(
    num_heads: int,
    dtype: torch.dtype,
    latent: int = 512,
    rope: int = 64,
    batch: int = 1,
    device: torch.device | str = "cpu",
    folder=tuned.CONFIG_DIR,
) -> SplitKVTiles:
    """Tiles of the split-KV kernel for `num_heads` heads of a `latent` + `rope` cache row in
    `dtype` at `batch` sequences on `device`: those tuned for the nearest batch in the file for
    this device and shape in `folder` (`python -m benchmarks.kernels.tune_kernels`), else
    `default_tiles`."""
    found = _tuned(num_heads, latent, rope, dtype, tuned.device_name(device), folder)
    if found is None:
        return default_tiles(num_heads, dtype)
    sizes, tiles = found
    return tiles[tuned.nearest(sizes, batch)]


def every_tiles(num_heads: int, latent: int, rope: int, dtype: torch.dtype, folder=tuned.CONFIG_DIR):
    """Every tile `split_kv_tiles` may give for this shape on any GPU: the default, then each tuned
    file's (for kernels.aot, which names its target instead of asking a device)."""
    found = [default_tiles(num_heads, dtype)]
    for config in tuned.every_config(KERNEL, tuned_shape(num_heads, latent, rope, dtype), folder):
        if SplitKVTiles(**config) not in found:
            found.append(SplitKVTiles(**config))
    return found


@triton.jit(do_not_specialize=split_kv.VARYING)
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
    num_splits,
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
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One program: heads [hb * BLOCK_H, (hb + 1) * BLOCK_H) of sequence b, split s -> o_part
    [BLOCK_H, C] and lse_part [BLOCK_H]. UPCAST (the interpreter only): tiles in fp32."""
    hb, b, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c, offs_r = tl.arange(0, BLOCK_C), tl.arange(0, BLOCK_R)
    h_mask, c_mask, r_mask = offs_h < num_heads, offs_c < C, offs_r < R

    q_lat = split_kv.load_tile(
        q_latent_ptr + b * stride_ql_b + offs_h[:, None] * stride_ql_h + offs_c[None, :],
        h_mask[:, None] & c_mask[None, :],
        UPCAST,
    )  # [BLOCK_H, BLOCK_C]
    q_pe = split_kv.load_tile(
        q_pe_ptr + b * stride_qp_b + offs_h[:, None] * stride_qp_h + offs_r[None, :],
        h_mask[:, None] & r_mask[None, :],
        UPCAST,
    )  # [BLOCK_H, BLOCK_R]

    lo, hi, m_i, l_i, acc = split_kv.split_start(kv_lens_ptr, b, s, num_splits, BLOCK_N, BLOCK_H, BLOCK_C)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        row = split_kv.page_rows(pages_ptr, b, stride_pages_b, offs_n, n_mask, PAGE_SIZE, stride_cache)  # [BLOCK_N]
        lat_ptrs, pe_ptrs = cache_ptr + row[:, None] + offs_c[None, :], cache_ptr + row[:, None] + C + offs_r[None, :]
        latent = split_kv.load_tile(lat_ptrs, n_mask[:, None] & c_mask[None, :], UPCAST)  # [BLOCK_N, BLOCK_C]
        k_pe = split_kv.load_tile(pe_ptrs, n_mask[:, None] & r_mask[None, :], UPCAST)  # [BLOCK_N, BLOCK_R]

        scores = tl.dot(q_lat, tl.trans(latent), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N] fp32
        scores = tl.dot(q_pe, tl.trans(k_pe), scores, input_precision=DOT_PRECISION) * qk_scale
        m_i, l_i, acc = split_kv.softmax_step(scores, n_mask, m_i, l_i, acc, latent, DOT_PRECISION)

    o_ptrs = o_part_ptr + b * stride_o_b + offs_h[:, None] * stride_o_h + s * stride_o_s + offs_c[None, :]
    lse_ptrs = lse_part_ptr + b * stride_lse_b + offs_h * stride_lse_h + s
    split_kv.store_split(o_ptrs, lse_ptrs, acc, m_i, l_i, h_mask[:, None] & c_mask[None, :], h_mask)


_INTERPRETED = is_interpreted(_split_kv_kernel)


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
    num_splits: chunks per sequence; default `split_kv.decode_splits` (batch, head blocks, P * page_size).
    Head dims: any H, C, R >= 1 (padded to powers of two and masked; C, R <= a few thousand).
    Returns out_latent [B, H, C] in q_latent's dtype; softmax statistics and the output accumulate
    in fp32. Partial results take B * H * num_splits * (C + 1) fp32 of scratch.
    """
    if q_latent.shape[0] == 0:
        return q_latent.new_empty(q_latent.shape)
    out, launches = decode_launches(q_latent, q_pe, cache, kv, scale, num_splits)
    for launch in launches:
        launch()
    return out


def decode_launches(
    q_latent,
    q_pe,
    cache,
    kv: PagedKV,
    scale: float,
    num_splits: int | None = None,
    interpreted: bool = _INTERPRETED,
    tiles: SplitKVTiles | None = None,
) -> tuple[torch.Tensor, list[Launch]]:
    """The output [B, H, C] (allocated, not yet written) and the two launches that fill it: the
    split-KV kernel and the merge (arguments as in `mla_decode_core_triton`, B >= 1). `interpreted`:
    build them for Triton's interpreter (default: whether this process runs it). `tiles`: the
    split-KV kernel's tiles (default `split_kv_tiles`; benchmarks.kernels.tune_kernels sweeps them)."""
    B, H, C = q_latent.shape
    R = q_pe.shape[-1]
    assert cache.shape[-1] == C + R and cache.stride(-1) == 1, "cache rows must be [C + R], contiguous"
    assert q_latent.stride(-1) == 1 and q_pe.stride(-1) == 1, "query head dims must be contiguous"
    tiles = tiles or split_kv_tiles(H, q_latent.dtype, C, R, B, q_latent.device)
    head_blocks = triton.cdiv(H, tiles.block_m)
    splits = num_splits or split_kv.decode_splits(B, head_blocks, kv.pages.shape[1] * kv.page_size)
    o_part, lse_part = split_kv.split_buffers(B, H, splits, C, q_latent.device)
    out = q_latent.new_empty(B, H, C)
    args = (q_latent, q_pe, cache, kv.pages, kv.kv_lens, o_part, lse_part, scale * split_kv.LOG2E, H, splits)
    strides = (*q_latent.stride()[:2], *q_pe.stride()[:2], cache.stride(0), kv.pages.stride(0))
    constexprs = dict(
        C=C,
        R=R,
        PAGE_SIZE=kv.page_size,
        UPCAST=interpreted and q_latent.dtype != torch.float32,
        DOT_PRECISION=split_kv.dot_precision(q_latent.dtype),
        BLOCK_H=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_C=triton.next_power_of_2(max(C, 16)),
        BLOCK_R=triton.next_power_of_2(max(R, 16)),
    )
    split = Launch(
        _split_kv_kernel,
        (head_blocks, B, splits),
        (*args, *strides, *o_part.stride()[:3], *lse_part.stride()[:2]),
        constexprs,
        tiles.num_warps,
        tiles.num_stages,
    )
    return out, [split, split_kv.merge_launch(o_part, lse_part, out)]


class TritonMLA:
    """The `triton` MLA backend: absorbed decode through a paged split-KV Triton kernel, extend on torch.

    Inputs fp32 or bf16 (cache, queries and weights of one dtype). Page size: any. Head dims: any
    (DeepSeek-V3: H = 128, C = kv_lora_rank = 512, R = qk_rope_head_dim = 64, Dn = 128, Dv = 128).
    fp32 inputs multiply in full fp32 (no tf32); bf16 inputs in bf16 on the tensor cores with fp32
    accumulation (upcast to fp32 only under the interpreter), so both match the torch reference
    to their dtype's rounding.
    """

    name = "triton"

    def __init__(self, num_splits: int | None = None):
        self.num_splits = num_splits  # None: chosen per call by `split_kv.decode_splits`

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

    def sparse(self, q_nope, q_pe, cache, indices, w_uk, w_uv, scale: float):
        """`kernels.mla.sparse_mla_attention` with the core on Triton: q_nope [T, H, Dn],
        q_pe [T, H, R], cache [S, C + R] (rows may be strided), indices [T, K] (-1: none), w_uk
        [H, Dn, C], w_uv [H, Dv, C] -> [T, H, Dv] (see `sparse_mla_core_triton`)."""
        q_latent = absorb_query(q_nope, w_uk).contiguous()  # [T, H, C]
        out = sparse_mla_core_triton(q_latent, q_pe.contiguous(), cache, indices.contiguous(), scale, self.num_splits)
        return unabsorb_output(out, w_uv)
