"""The GPU check's sparse MLA part (DeepSeek-V3.2): the Triton sparse kernel checked on the device,
then timed against dense MLA decode and beside the lightning indexer that chooses its slots.

Correctness first: `sparse_mla_core_triton` against the torch reference `kernels.sparse_mla.
sparse_mla_core` on the device, bf16, V3.2's head dims at a few tokens; the cache is the MLA share
of wider rows whose index-key columns hold NaN (a kernel that reads past C + R returns NaN), and
rows hold -1 entries trailing (fewer causal tokens than index_topk), leading (whole blocks of -1)
and all but one. Both of the kernel's paths run: one split (output written directly, as prefill)
and three (partial results merged, as decode). The largest absolute error against the reference
must be within the bf16 tolerance of tests/kernels/test_sparse_mla_triton.py; the errors of both
against an fp32 reference on the same inputs are recorded beside it.

Then timings, bf16, CUDA events, median of `reps` after warm-up (gpu_timings.median_seconds), at
V3.2's shapes: H = 128 heads, latent C = 512, rope R = 64, index_topk K = 2048, cache rows
C + R + 128 wide (the index key after MLA's share, which the kernels read as a strided view).
The decode batch is 64 sequences of 32K cached tokens; each query token's K slots are the top K of
random scores over its sequence (distinct, in score order as the indexer gives them):

    sparse_decode    64 tokens x 2048 slots (one decode step of 64 sequences)
    sparse_single    1 token x 2048 slots
    sparse_prefill   a prefill chunk of 4096 tokens x 2048 slots each, from one 32K sequence
    dense_2k         dense MLA decode core (kernels/triton/mla.py, paged, page size 64) at 64 x 2048:
                     the same tokens attended, so sparse_decode / dense_2k is the cost of the gather
    dense_32k        the same at 64 x 32768: what V3.2's sparse attention avoids
    indexer          the indexer's decode scoring at 64 tokens x 32K (64 heads x 128 dims, torch):
                     Indexer._decode's own code (load the keys, score, top-K) on device tensors

Both kernels' cores are timed (absorbed latent queries in, latents out; the absorb and unabsorb
matmuls around them are equal for both). FLOPs: 2 * T * H * N * (2C + R) for T query tokens of N
attended tokens each (scores over C + R, output over C). Bytes, each operand counted once: the
attended rows (C + R) * 2 per slot per query token (T * N rows; a row that several query tokens
choose is counted for each, so prefill's GB/s is a gather rate that can exceed HBM bandwidth), the
queries T * H * (C + R) * 2 and outputs T * H * C * 2, and the slot lists (sparse: T * K * 8 int64;
dense: the page table). The indexer: 2 * T * h * L * (d + 1) FLOPs, and its keys T * L * d * 2, the
slots T * L * 8, the queries T * h * d * 4 and the chosen slots T * K * 8 bytes.

Ratios: dense_32k / sparse_decode (the speed-up sparse attention buys at 32K), sparse_decode /
dense_2k (the gather's overhead), and indexer / (indexer + sparse_decode) (the indexer's share of
a layer's attention at long context). The dry run: tiny shapes on the CPU (Triton's interpreter),
one repetition; its times say nothing, the mechanics are what it checks.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple

import torch

from afd_engine.models.indexer import Indexer
from benchmarks.kernels import bench_kernels as bk
from benchmarks.kernels.gpu_timings import median_seconds, with_fractions
from benchmarks.part_runner import run_cases
from kernels.sparse_mla import sparse_mla_core

TOLERANCE = {"atol": 1e-2, "rtol": 1e-2}  # bf16, as the kernel's own tests
CHECK_SPLITS = {"direct": 1, "split": 3}  # the kernel's two paths: output written directly, or merged
INDEX_BYTES = 8  # int64 slots, as the indexer returns them


class Shapes(NamedTuple):
    heads: int
    latent: int
    rope: int
    index_heads: int
    index_dim: int
    topk: int
    decode: int  # decode batch: query tokens, one per sequence
    prefill: int  # query tokens of the prefill chunk
    context: int  # cached tokens per sequence
    check_tokens: int
    check_topk: int
    check_slots: int


V32 = Shapes(128, 512, 64, 64, 128, 2048, 64, 4096, 32768, 4, 600, 4096)
TINY = Shapes(4, 32, 8, 4, 16, 16, 4, 8, 64, 4, 80, 128)


class IndexerScoring:
    """The lightning indexer's decode selection without its projections: Indexer's own functions
    (load each sequence's cached keys, score them, keep the top K) bound to what they read of it."""

    _load, _scores, _select, _decode = Indexer._load, Indexer._scores, Indexer._select, Indexer._decode

    def __init__(self, dim: int, topk: int):
        self.dim, self.topk, self.scale, self.fp8 = dim, topk, dim**-0.5, False


def wide_cache(g: torch.Generator, rows: int, s: Shapes, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [rows, C + R + index_dim]: MLA's latent and rope key, then the index key."""
    return bk.randn(g, (rows, s.latent + s.rope + s.index_dim), dtype)


def queries(g: torch.Generator, tokens: int, s: Shapes, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed queries: q_latent [T, H, C], q_pe [T, H, R]."""
    return bk.randn(g, (tokens, s.heads, s.latent), dtype), bk.randn(g, (tokens, s.heads, s.rope), dtype)


def chosen_slots(g: torch.Generator, tokens: int, first: torch.Tensor, length: int, topk: int) -> torch.Tensor:
    """[T, K] int64: for each query token, the top K of random scores over the `length` slots from
    `first[t]` on (distinct, in score order: what the indexer returns)."""
    scores = torch.rand(tokens, length, generator=g, device=g.device)
    return scores.topk(topk, dim=-1).indices + first[:, None]


# -- correctness ------------------------------------------------------------------------------------


def check_kernel(s: Shapes, device: torch.device) -> dict:
    """The Triton kernel against the torch reference on the device (see the module docstring)."""
    from kernels.triton.sparse_mla import sparse_mla_core_triton

    T, K, S, C, R = s.check_tokens, s.check_topk, s.check_slots, s.latent, s.rope
    g = torch.Generator(device).manual_seed(1)
    wide = wide_cache(g, S, s, torch.bfloat16)
    wide[:, C + R :] = float("nan")
    cache = wide[:, : C + R]
    indices = chosen_slots(g, T, torch.zeros(T, dtype=torch.long, device=device), S, K)
    indices[0, K // 2 :] = -1  # trailing: fewer causal tokens than index_topk
    indices[1, : K // 2 + 8] = -1  # leading: whole slot blocks with no slot at all
    indices[2, :] = -1
    indices[2, K // 3] = S - 1  # one slot: the output is that slot's latent
    q_latent, q_pe = queries(g, T, s, torch.bfloat16)
    scale = (C + R) ** -0.5
    ref = sparse_mla_core(q_latent, q_pe, cache, indices, scale).float()
    exact = sparse_mla_core(q_latent.float(), q_pe.float(), cache.float(), indices, scale)
    paths = {}
    for name, splits in CHECK_SPLITS.items():
        out = sparse_mla_core_triton(q_latent, q_pe, cache, indices, scale, num_splits=splits).float()
        err = (out - ref).abs()
        within = bool((err <= TOLERANCE["atol"] + TOLERANCE["rtol"] * ref.abs()).all())  # False on NaN
        paths[name] = {
            "splits": splits,
            "max_abs_err": float(err.max()),
            "max_abs_err_fp32_ref": float((out - exact).abs().max()),
            "within": within,
        }
    shape = {"tokens": T, "heads": s.heads, "latent": C, "rope": R, "topk": K, "cache_rows": S}
    return {
        "shape": shape | {"cache_row_stride": cache.stride(0)},
        "tolerance": TOLERANCE,
        "paths": paths,
        "torch_max_abs_err_fp32_ref": float((ref - exact).abs().max()),
        "max_abs_err": max(p["max_abs_err"] for p in paths.values()),
        "ok": all(p["within"] for p in paths.values()),
    }


# -- timings ----------------------------------------------------------------------------------------


def sparse_row(cache, q_latent, q_pe, indices, device, reps: int) -> dict:
    from kernels.triton.sparse_mla import sparse_mla_core_triton

    T, H, C = q_latent.shape
    R, K = q_pe.shape[-1], indices.shape[-1]
    scale = (C + R) ** -0.5
    seconds = median_seconds(lambda: sparse_mla_core_triton(q_latent, q_pe, cache, indices, scale), device, reps)
    nbytes = (T * K * (C + R) + T * H * (2 * C + R)) * q_latent.element_size() + T * K * INDEX_BYTES
    flops = 2 * T * H * K * (2 * C + R)
    return {"kernel": "sparse_mla", "tokens": T, "attended": K, **bk.rates(seconds, nbytes, flops)}


def dense_row(batch: int, context: int, s: Shapes, device, reps: int) -> dict:
    """The dense MLA decode core over bench_kernels' paged case (page size 64, scattered pages)."""
    from kernels.triton.mla import mla_decode_core_triton

    H, C, R = s.heads, s.latent, s.rope
    args, _, _ = bk.mla_case((batch, context, H, C, R, 1, 1), torch.bfloat16, device)
    _, q_pe, cache, kv = args[:4]
    q_latent = bk.randn(torch.Generator(device).manual_seed(2), (batch, H, C), torch.bfloat16)
    scale = (C + R) ** -0.5
    seconds = median_seconds(lambda: mla_decode_core_triton(q_latent, q_pe, cache, kv, scale), device, reps)
    nbytes = (batch * context * (C + R) + batch * H * (2 * C + R)) * cache.element_size() + kv.pages.numel() * 8
    flops = 2 * batch * H * context * (2 * C + R)
    return {"kernel": "mla_decode", "tokens": batch, "attended": context, **bk.rates(seconds, nbytes, flops)}


def indexer_row(wide: torch.Tensor, s: Shapes, device, reps: int) -> dict:
    """Indexer._decode for the decode batch against every cached token of its sequences, the keys
    read from the cache rows' index columns; its chosen slots must lie in their own sequences."""
    T, L, h, d = s.decode, s.context, s.index_heads, s.index_dim
    g = torch.Generator(device).manual_seed(3)
    keys = wide[:, s.latent + s.rope :]
    slots = torch.arange(T * L, device=device).view(T, L)
    batch = SimpleNamespace(dec_slots=slots, dec_bias=torch.zeros(T, 1, L, device=device))
    q = torch.randn(T, h, d, generator=g, device=device)
    weights = torch.randn(T, h, generator=g, device=device) * h**-0.5
    scoring = IndexerScoring(d, s.topk)
    seconds = median_seconds(lambda: scoring._decode(q, weights, batch, keys), device, reps)
    chosen = scoring._decode(q, weights, batch, keys)
    own = bool((chosen // L == torch.arange(T, device=device)[:, None]).all())
    nbytes = T * L * (d * wide.element_size() + 8) + T * h * d * 4 + T * s.topk * 8
    row = {"kernel": "indexer", "tokens": T, "context": L, "index_heads": h, "index_dim": d, "topk": s.topk}
    return row | bk.rates(seconds, nbytes, 2 * T * h * L * (d + 1)) | {"slots_in_own_sequence": own, "ok": own}


def timed_cases(s: Shapes, device: torch.device, reps: int) -> dict:
    """name -> fn() -> row. The decode sequences' cache (64 x 32K rows at V3.2's shapes) is shared."""
    g = torch.Generator(device).manual_seed(0)
    wide = wide_cache(g, s.decode * s.context, s, torch.bfloat16)
    cache = wide[:, : s.latent + s.rope]

    def sparse(tokens: int, per_sequence: bool):
        first = torch.arange(tokens, device=device) * (s.context if per_sequence else 0)
        indices = chosen_slots(g, tokens, first, s.context, s.topk)
        return sparse_row(cache, *queries(g, tokens, s, torch.bfloat16), indices, device, reps)

    return {
        "sparse_decode": lambda: sparse(s.decode, per_sequence=True),
        "sparse_single": lambda: sparse(1, per_sequence=True),
        "sparse_prefill": lambda: sparse(s.prefill, per_sequence=False),
        "dense_2k": lambda: dense_row(s.decode, s.topk, s, device, reps),
        "dense_32k": lambda: dense_row(s.decode, s.context, s, device, reps),
        "indexer": lambda: indexer_row(wide, s, device, reps),
    }


def ratio(rows: dict, num: str, den: str) -> float | None:
    us = [rows.get(name, {}).get("us") for name in (num, den)]
    return us[0] / us[1] if all(us) else None


def sparse_mla(ctx) -> dict:
    """The part: the correctness check, then the timings (each case on its own), then the ratios."""
    s = TINY if ctx.dry_run else V32
    reps = 1 if ctx.dry_run else (5 if ctx.quick else 20)
    check = check_kernel(s, ctx.device)
    failures = [] if check["ok"] else [f"correctness: max abs error {check['max_abs_err']:.3g} over the tolerance"]
    rows, case_failures = run_cases(timed_cases(s, ctx.device, reps))
    with_fractions([r for r in rows.values() if "gb_s" in r], ctx)
    index_us, sparse_us = rows["indexer"].get("us"), rows["sparse_decode"].get("us")
    ratios = {
        "dense_32k_over_sparse_2k": ratio(rows, "dense_32k", "sparse_decode"),
        "sparse_over_dense_2k": ratio(rows, "sparse_decode", "dense_2k"),
        "indexer_share": index_us / (index_us + sparse_us) if index_us and sparse_us else None,
    }
    shapes = s._asdict() | {"dtype": "bfloat16", "reps": reps}
    headline = f"sparse {s.decode}x{s.topk} {sparse_us or float('nan'):.0f} us"
    headline += f", dense {s.context}/sparse {ratios['dense_32k_over_sparse_2k'] or float('nan'):.1f}x"
    headline += f", indexer {ratios['indexer_share'] or float('nan'):.0%}, err {check['max_abs_err']:.1e}"
    out = {"shapes": shapes, "correctness": check, "cases": rows, "ratios": ratios}
    return out | {"failures": failures + case_failures, "headline": headline[:100]}
