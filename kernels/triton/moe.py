"""Routed-expert compute as Triton grouped GEMMs: the `triton` MoE backend.

Same contract as kernels.moe (the torch reference): experts stacked as ``w13 [E, 2I, H]`` (gate
rows then up rows) and ``w2 [E, H, I]``; ``topk_ids [T, K]`` local expert or -1 (another rank's
expert, contributes nothing); ``topk_weights [T, K]`` fp32.

Three steps, with N = T * K (token, slot) pairs and pair p = t * K + k::

    1. align (torch ops)     pairs sorted by expert, each expert's run padded to BLOCK_M rows:
                             sorted_pairs [R] = | e0 e0 e0 pad | e2 e2 e2 e2 | e2 pad pad pad | ...
                             block_expert [R / BLOCK_M] = | 0 | 2 | 2 | ...     (pad = N)
                             idle experts and -1 slots get no rows; the buffers are sized
                             by an upper bound (no host sync), blocks past the last: expert -1.
    2. gate_up kernel        grid (R / BLOCK_M, ceil(I / BLOCK_N)): rows of x gathered by token
                             inside the kernel, gate and up tiles of one expert, SwiGLU in the
                             epilogue -> act [R, I], one row per sorted position.
    3. down kernel           grid (R / BLOCK_M, ceil(H / BLOCK_N)): act @ w2[e]^T, times the
                             routing weight, stored at row p of contrib [N, H] fp32 (zeros for
                             -1 slots); out = contrib.view(T, K, H).sum(1), cast to x.dtype.

Each program owns one expert block, so a block never mixes experts; accumulation is fp32.
Writing each pair's row to its own place (no atomics) keeps the result deterministic.

FP8 (DeepSeek-V3 checkpoints): weights float8_e4m3fn with one fp32 scale per 128x128 block (the
checkpoint's weight_scale_inv), activations quantized per token per 128 values along the
reduction dim: x before step 2 (kernels.triton.fp8.quantize_fp8), act inside step 2's epilogue.
Each K tile is one fp8 x fp8 dot, scaled by activation scale x weight scale (per row x per
column) and added to the fp32 accumulator; a tile must sit inside one 128-block of both scales,
so BLOCK_K must be 128 or divide it. The fused act quantization needs the gate_up BLOCK_N to be
exactly one group (128). Output rows (N) need no alignment: scales are looked up per column.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from comm.wire import FP8_GROUP, FP8_MAX
from kernels.triton.fp8 import cast_rtne, quantize_fp8, round_to_e4m3
from kernels.triton.launch import Launch, is_interpreted
from kernels.triton.moe_tiles import (  # noqa: F401 (DEFAULT_BLOCKS, every_blocks: this backend's API)
    DEFAULT_BLOCKS,
    FP8_BLOCKS,
    KERNEL,
    MoEBlocks,
    every_blocks,
    moe_blocks,
    tuned_shape,
)

_FLOAT_DTYPES = (torch.float32, torch.bfloat16)


class ExpertBlocks(NamedTuple):
    """(token, slot) pairs grouped by expert, in BLOCK_M-row blocks of one expert each.

    sorted_pairs [R] int32: pair index p = t * K + k at each sorted row; N (= T * K) on padding.
    block_expert [R // BLOCK_M] int32: the expert of each block.
    """

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.sorted_pairs.numel()


def max_expert_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the BLOCK_M-row blocks of any routing of `num_pairs` pairs over
    `num_experts` experts: each active expert wastes less than one block on padding, and at most
    min(E, N) are active. Sizing by it (not by the routing) keeps shapes fixed for a batch size."""
    return triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """topk_ids [T, K] int64 (local expert in [0, E) or -1) -> ExpertBlocks.

    Torch ops, no host sync and no data-dependent shape (so a CUDA graph can capture it): the
    buffers have `max_expert_blocks` blocks, and the blocks past the routing's last one have
    expert -1 (the kernels return at once) and only padding. Pairs keep their original order
    within an expert (stable sort); experts appear in index order, idle ones with no block. Ids
    >= E are not checked (they would index out of range).
    """
    flat = topk_ids.reshape(-1)  # [N]
    n, dev = flat.numel(), flat.device
    blocks = max_expert_blocks(n, num_experts, block_m)
    bucket = torch.where(flat >= 0, flat, num_experts)  # -1 slots sort last, then go to the dump row
    ones = torch.ones_like(bucket)
    counts = torch.zeros(num_experts + 1, dtype=bucket.dtype, device=dev).scatter_add_(0, bucket, ones)[:-1]  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    ends = torch.cumsum(padded, 0)  # [E] one past the last sorted row of each expert
    order = torch.sort(bucket, stable=True).indices  # [N] pair ids by expert, -1 slots last
    expert = bucket[order]  # [N]
    local = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    rank = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[e]  # place within its expert
    dest = torch.where(local, ends[e] - padded[e] + rank, blocks * block_m)  # -1 slots: the dump row
    sorted_pairs = torch.full((blocks * block_m + 1,), n, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    first_rows = torch.arange(blocks, device=dev) * block_m  # [blocks]
    block_expert = torch.searchsorted(ends, first_rows, right=True)  # [blocks] E past the last block
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return ExpertBlocks(sorted_pairs[:-1], block_expert)


# the pair count changes every step: no 16-divisibility specialisation, one compiled kernel for all
VARYING = ("num_pairs",)


@triton.jit(do_not_specialize=VARYING)
def _gate_up_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    act_ptr,
    as_ptr,
    pairs_ptr,
    block_expert_ptr,
    num_pairs,
    H,
    I,
    topk,
    stride_xt,
    stride_xst,
    stride_we,
    stride_wn,
    stride_wk,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_at,
    stride_ast,
    FP8: tl.constexpr,
    UPCAST: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:  # a block past the routing's last one (buffers are sized by an upper bound)
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] sorted rows
    pair = tl.load(pairs_ptr + rows)
    valid = pair < num_pairs
    token = (pair // topk).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] in [0, I)
    col_ok = cols < I
    gate_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn  # [1, BLOCK_N]
    up_ptrs = gate_ptrs + I * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        k_ok = ks < H
        a = tl.load(x_ptr + token[:, None] * stride_xt + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(gate_ptrs + ks[:, None] * stride_wk, mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        w_up = tl.load(up_ptrs + ks[:, None] * stride_wk, mask=w_mask, other=0.0)
        if FP8:
            kb = k0 // GROUP
            a_s = tl.load(xs_ptr + token * stride_xst + kb, mask=valid, other=0.0)  # [BLOCK_M]
            ws_base = ws_ptr + expert * stride_wse + kb * stride_wsk
            g_s = tl.load(ws_base + (cols // GROUP) * stride_wsn, mask=col_ok, other=0.0)  # [BLOCK_N]
            u_s = tl.load(ws_base + ((I + cols) // GROUP) * stride_wsn, mask=col_ok, other=0.0)
            acc_gate += tl.dot(a, w_gate) * a_s[:, None] * g_s[None, :]
            acc_up += tl.dot(a, w_up) * a_s[:, None] * u_s[None, :]
        else:
            if UPCAST:
                a, w_gate, w_up = a.to(tl.float32), w_gate.to(tl.float32), w_up.to(tl.float32)
            acc_gate = tl.dot(a, w_gate, acc_gate, input_precision="ieee")
            acc_up = tl.dot(a, w_up, acc_up, input_precision="ieee")
    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up  # SwiGLU: silu(gate) * up, [BLOCK_M, BLOCK_N]
    out_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_at + cols[None, :]
    out_mask = valid[:, None] & col_ok[None, :]
    if FP8:  # this tile is one 128-group of each row: quantize as kernels.triton.fp8 does
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(act), axis=1), FP8_MAX), 1e-12)  # [BLOCK_M]
        q = round_to_e4m3(tl.math.div_rn(act, scale[:, None]))
        tl.store(out_ptrs, q.to(tl.float8e4nv), mask=out_mask)
        tl.store(as_ptr + rows.to(tl.int64) * stride_ast + pid_n, scale, mask=valid)
    else:
        tl.store(out_ptrs, cast_rtne(act, act_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=VARYING)
def _down_kernel(
    act_ptr,
    as_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    pairs_ptr,
    block_expert_ptr,
    weights_ptr,
    num_pairs,
    H,
    I,
    stride_at,
    stride_ast,
    stride_we,
    stride_wn,
    stride_wk,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_ot,
    FP8: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:  # a block past the routing's last one (buffers are sized by an upper bound)
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] sorted rows
    pair = tl.load(pairs_ptr + rows)
    valid = pair < num_pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] in [0, H)
    col_ok = cols < H
    a_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_at  # [BLOCK_M, 1]
    w_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn  # [1, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < I
        a = tl.load(a_ptrs + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptrs + ks[:, None] * stride_wk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if FP8:
            kb = k0 // GROUP
            a_s = tl.load(as_ptr + rows.to(tl.int64) * stride_ast + kb, mask=valid, other=0.0)  # [BLOCK_M]
            w_s = tl.load(
                ws_ptr + expert * stride_wse + (cols // GROUP) * stride_wsn + kb * stride_wsk, mask=col_ok, other=0.0
            )  # [BLOCK_N]
            acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        else:
            if UPCAST:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision="ieee")
    routing = tl.load(weights_ptr + pair, mask=valid, other=0.0)  # [BLOCK_M] fp32
    acc = acc * routing[:, None]
    out_ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_ot + cols[None, :]
    tl.store(out_ptrs, acc, mask=valid[:, None] & col_ok[None, :])


# Triton's interpreter stores bf16 as uint16 and its tl.dot multiplies those bit patterns as
# integers; there the bf16 GEMMs feed tl.dot fp32 copies (exact products). Known at import:
# triton.jit makes an InterpretedFunction iff TRITON_INTERPRET=1 was set before triton's import.
_INTERPRETED = is_interpreted(_down_kernel)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    blocks: MoEBlocks = MoEBlocks(),
) -> torch.Tensor:
    """Weighted sum over each token's local experts of SwiGLU(x); equals kernels.moe.fused_moe.

    x [T, H] fp32 or bf16 (rows may be strided; unit stride along H is made if missing).
    w13 [E, 2I, H] in x.dtype, any strides: gate_proj rows [0, I), up_proj rows [I, 2I).
    w2 [E, H, I] in x.dtype, any strides: down_proj.
    topk_ids [T, K] int64: local expert in [0, E), or -1 for a slot served by another rank.
    topk_weights [T, K] fp32: routing weight of each slot.
    Returns [T, H] in x.dtype: sum_k w[t, k] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])),
    e = topk_ids[t, k], fp32 accumulation; bf16 inputs round the SwiGLU output to bf16 before
    the down projection, like the torch reference. T = 0 or no local slot: zeros, no launch.
    Any H and I (edges are masked). blocks: tile sizes, see MoEBlocks.
    """
    _check_routing(x, w13, w2, topk_ids, topk_weights)
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"fused_moe: w13 {w13.dtype} and w2 {w2.dtype} must match x {x.dtype}")
    return _moe(x, w13, None, w2, None, topk_ids, topk_weights, blocks)


def fused_moe_fp8(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    blocks: MoEBlocks = FP8_BLOCKS,
) -> torch.Tensor:
    """`fused_moe` with FP8 block-quantized weights, as DeepSeek-V3 checkpoints ship them.

    x [T, H] fp32 or bf16; quantized here per token per 128 values along H (quantize_fp8).
    w13 [E, 2I, H] float8_e4m3fn, w13_scale [E, ceil(2I/128), ceil(H/128)] fp32: the checkpoint's
    weight_scale_inv, real weight = w13[e, n, h] * w13_scale[e, n // 128, h // 128]. The gate/up
    boundary at row I need not be a multiple of 128.
    w2 [E, H, I] float8_e4m3fn, w2_scale [E, ceil(H/128), ceil(I/128)] fp32, likewise.
    topk_ids [T, K] int64 (-1: other rank), topk_weights [T, K] fp32, as in `fused_moe`.
    Returns [T, H] in x.dtype. The SwiGLU output is re-quantized to fp8 per token per 128 values
    along I inside the gate_up kernel; both quantizations of activations cost ~1e-2 relative
    error against a reference that uses the dequantized weights and unquantized activations.
    Constraints: 128x128 weight blocks; blocks.block_k divides 128 and blocks.block_n == 128.
    """
    _check_routing(x, w13, w2, topk_ids, topk_weights)
    blocks.check_fp8()
    E, two_i, H = w13.shape
    I = two_i // 2
    expected = {
        "w13": (w13, (E, -(-two_i // FP8_GROUP), -(-H // FP8_GROUP))),
        "w2": (w2, (E, -(-H // FP8_GROUP), -(-I // FP8_GROUP))),
    }
    for (name, (w, shape)), scale in zip(expected.items(), (w13_scale, w2_scale)):
        if w.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32 or tuple(scale.shape) != shape:
            raise ValueError(
                f"fused_moe_fp8: {name} must be float8_e4m3fn with {name}_scale {list(shape)} fp32, "
                f"got {w.dtype} and {scale.dtype} {list(scale.shape)}"
            )
    return _moe(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, blocks)


def _check_routing(x, w13, w2, topk_ids, topk_weights) -> None:
    if x.dim() != 2 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"fused_moe: x must be [T, H] fp32 or bf16, got {list(x.shape)} {x.dtype}")
    T, H = x.shape
    E, two_i = w13.shape[:2]
    if w13.shape != (E, two_i, H) or two_i % 2 or w2.shape != (E, H, two_i // 2):
        raise ValueError(
            f"fused_moe: need w13 [E, 2I, {H}] and w2 [E, {H}, I], got {list(w13.shape)} and {list(w2.shape)}"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"fused_moe: topk_ids and topk_weights must be [{T}, K], got {list(topk_ids.shape)} "
            f"and {list(topk_weights.shape)}"
        )
    if topk_weights.dtype != torch.float32:
        raise ValueError(f"fused_moe: topk_weights must be fp32, got {topk_weights.dtype}")


def _moe(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, blocks: MoEBlocks) -> torch.Tensor:
    """Align, gate_up kernel, down kernel, sum over slots (see the module docstring)."""
    T, K = topk_ids.shape
    if T == 0:
        return x.new_zeros(x.shape)
    aligned = align_by_expert(topk_ids, w13.shape[0], blocks.block_m)  # no host sync
    if w13_scale is None:
        a, a_scale = (x if x.stride(1) == 1 else x.contiguous()), None
    else:
        a, a_scale = quantize_fp8(x)  # [T, H] fp8, [T, ceil(H/128)] fp32
    contrib, launches = expert_launches(a, a_scale, w13, w13_scale, w2, w2_scale, aligned, topk_weights, blocks)
    for launch in launches:
        launch()
    return contrib.view(T, K, -1).sum(1).to(x.dtype)


def expert_launches(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w13: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale: torch.Tensor | None,
    aligned: ExpertBlocks,
    topk_weights: torch.Tensor,
    blocks: MoEBlocks,
    interpreted: bool = _INTERPRETED,
) -> tuple[torch.Tensor, list[Launch]]:
    """contrib [T * K, H] fp32 (zeros; rows of -1 slots stay so) and the gate_up and down launches
    that fill it. a [T, H]: x with unit stride along H (bf16/fp32), or its fp8 quantization with
    a_scale [T, ceil(H/128)] fp32 (then w13_scale and w2_scale are given; else all three are None).
    Weights, aligned and topk_weights [T, K] as in `fused_moe`/`fused_moe_fp8`. `interpreted`: build
    the launches for Triton's interpreter (default: whether this process runs it)."""
    T, K = topk_weights.shape
    _, two_i, H = w13.shape
    I = two_i // 2
    fp8 = a_scale is not None
    R, bm, bn = aligned.num_rows, blocks.block_m, blocks.block_n
    if fp8:
        act = torch.empty(R, I, dtype=torch.float8_e4m3fn, device=a.device)
        act_scale = torch.empty(R, triton.cdiv(I, FP8_GROUP), dtype=torch.float32, device=a.device)
    else:
        a_scale = act_scale = w13_scale = w2_scale = torch.zeros(1, 1, 1, device=a.device)  # unused
        act = torch.empty(R, I, dtype=a.dtype, device=a.device)
    tiles = dict(
        FP8=fp8,
        UPCAST=interpreted and a.dtype == torch.bfloat16,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=blocks.block_k,
        GROUP=FP8_GROUP,
    )
    options = dict(num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    gate_up_args = (a, a_scale, w13, w13_scale, act, act_scale, *aligned, T * K, H, I, K, a.stride(0))
    gate_up_args += (a_scale.stride(0), *w13.stride(), *w13_scale.stride(), act.stride(0), act_scale.stride(0))
    gate_up_grid = (R // bm, triton.cdiv(I, bn))
    gate_up = Launch(_gate_up_kernel, gate_up_grid, gate_up_args, dict(FP8_MAX=FP8_MAX, **tiles), **options)
    contrib = torch.zeros(T * K, H, dtype=torch.float32, device=a.device)  # [T * K, H]
    weights = topk_weights.reshape(-1).contiguous()  # [T * K]
    down_args = (act, act_scale, w2, w2_scale, contrib, *aligned, weights, T * K, H, I, act.stride(0))
    down_args += (act_scale.stride(0), *w2.stride(), *w2_scale.stride(), contrib.stride(0))
    down = Launch(_down_kernel, (R // bm, triton.cdiv(H, bn)), down_args, tiles, **options)
    return contrib, [gate_up, down]


class TritonMoE:
    """The `triton` backend of routed-expert compute (CUDA GPU, or Triton's interpreter on a CPU).

    Same interface as kernels.moe.TorchMoE, plus `fused_moe_fp8` for block-quantized weights.
    Tiles come from `moe_blocks` (tuned per GPU and shape, by rows per expert) unless `blocks` /
    `fp8_blocks` fix them.
    """

    name = "triton"

    def __init__(self, blocks: MoEBlocks | None = None, fp8_blocks: MoEBlocks | None = None) -> None:
        if fp8_blocks is not None:
            fp8_blocks.check_fp8()
        self.blocks = blocks
        self.fp8_blocks = fp8_blocks

    @staticmethod
    def _blocks(kind: str, x: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor) -> MoEBlocks:
        """`moe_blocks` for this call: rows per expert T * K / E, the experts' H and I, x's device
        (shapes only: a wrong shape is the kernel's to report)."""
        E, two_i = w13.shape[:2]
        return moe_blocks(kind, topk_ids.numel() / max(1, E), x.shape[-1], two_i // 2, x.device)

    def fused_moe(
        self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """See the module function `fused_moe`: x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_ids [T, K]
        int64 local expert or -1, topk_weights [T, K] fp32 -> [T, H] in x.dtype."""
        kind = "fp32" if x.dtype == torch.float32 else "bf16"
        blocks = self.blocks or self._blocks(kind, x, w13, topk_ids)
        return fused_moe(x, w13, w2, topk_ids, topk_weights, blocks)

    def fused_moe_fp8(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w13_scale: torch.Tensor,
        w2: torch.Tensor,
        w2_scale: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor:
        """See the module function `fused_moe_fp8`: w13 [E, 2I, H] / w2 [E, H, I] float8_e4m3fn with
        fp32 scales per 128x128 block [E, ceil(2I/128), ceil(H/128)] / [E, ceil(H/128), ceil(I/128)]."""
        blocks = self.fp8_blocks or self._blocks("fp8", x, w13, topk_ids)
        return fused_moe_fp8(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, blocks)
