#!/usr/bin/env python3
"""Sweeps the Triton kernels' tiles at DeepSeek-V3 shapes on one CUDA GPU and writes the fastest as
config files for this GPU into kernels/triton/configs/ (kernels/triton/tuned.py), which the kernels
read: MLA decode's split-KV tiles (`mla.split_kv_tiles`) per batch, fused MoE's (`moe.moe_blocks`)
per rows per expert. The split counts it also sweeps check `split_kv.decode_splits`.

Sections (each under its own time limit; the JSON is rewritten after each):

    ceilings   device-to-device copy GB/s, bf16 and fp8 (torch._scaled_mm, e4m3) 8192^3 TFLOP/s
    mla        the split-KV decode core (the kernel and the merge of its splits) over tiles x split
               count: DeepSeek-V3 (128 heads, C 512, R 64, page 64, bf16) first at 64 x 4096, then
               the best tiles at batch 1-256 x context 1K-32K; V2-Lite (16 heads) at 64 x 4096
    moe_bf16   fused MoE (align, gate_up, down, sum) at DeepSeek-V3's experts (256 x 7168 x 2048,
    moe_fp8    top-8) in bf16 and with fp8 weights, over tiles x tokens per expert (1-512)

Every configuration is first checked against a reference on the same inputs (relative norm error:
MLA against the torch core, MoE against the shipped tiles' output) and a wrong one is reported,
not timed. Times are medians of triton.testing.do_bench (CUDA events, L2 flushed between runs).
Bytes and FLOPs are the analytic minimums of bench_kernels (each operand read once). Before the
timings, worker processes (--jobs) compile every configuration into Triton's cache on small inputs
of the same specialisation, so the sweep itself waits for no compiler.

    python -m benchmarks.kernels.tune_kernels --json tune.json              # on a GPU (~3 min)
    python -m benchmarks.kernels.tune_kernels --json tune.json --dry-run    # CPU interpreter, tiny shapes

On a GPU the files go to kernels/triton/configs/ unless --configs-dir names another folder (or
"none"); the dry run writes them only where --configs-dir says. A file replaces the one for the
same kernel, shape and GPU; then `python -m kernels.aot` checks the new tiles' budgets.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # must precede the first import of a Triton kernel module
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from benchmarks.kernels import tune_configs  # noqa: E402
from benchmarks.kernels.bench_kernels import fp8_experts  # noqa: E402
from benchmarks.part_runner import PartTimeout, error_record, time_limit, write_json  # noqa: E402
from kernels.mla import PagedKV, mla_decode_core  # noqa: E402
from kernels.triton import mla as tmla  # noqa: E402
from kernels.triton import moe as tmoe  # noqa: E402
from kernels.triton import tuned  # noqa: E402
from kernels.triton.split_kv import SplitKVTiles  # noqa: E402

# MLA tiles: (heads per program, tokens per step, warps, stages)
MLA_TILES = [
    (32, 64, 8, 3),
    (32, 64, 8, 2),
    (32, 64, 4, 3),
    (32, 32, 4, 3),
    (32, 32, 8, 4),
    (32, 128, 8, 2),
    (64, 64, 8, 2),
    (64, 64, 8, 3),
    (64, 32, 8, 3),
    (64, 32, 4, 3),
    (64, 64, 4, 2),
    (64, 128, 8, 1),
    (16, 64, 4, 3),
    (16, 128, 4, 3),
    (128, 32, 8, 2),
]
V2_TILES = [(16, 128, 8, 2), (16, 128, 4, 2), (16, 64, 8, 3), (16, 64, 4, 3), (16, 32, 4, 3), (16, 32, 4, 4)]
SPLITS = (1, 2, 4, 8, 16)
V3_MLA, V2_MLA = (128, 512, 64), (16, 512, 64)  # heads, latent C, rope R
MLA_PRIMARY = (64, 4096)
MLA_GRID = [(1, 1024), (1, 32768), (8, 4096), (8, 32768), (32, 8192), (64, 1024), (128, 4096), (256, 4096)]
# MoE tiles: (block_m, block_n, block_k, warps, stages); fp8 needs block_n 128 and block_k | 128
MOE_BF16 = [
    (16, 64, 64, 4, 3),
    (16, 128, 64, 4, 4),
    (16, 64, 128, 4, 4),
    (16, 128, 128, 4, 3),
    (32, 64, 64, 4, 4),
    (32, 128, 64, 4, 3),
    (64, 128, 64, 4, 4),
    (64, 128, 64, 8, 3),
    (64, 256, 64, 8, 3),
    (128, 128, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 256, 64, 8, 3),
    (128, 128, 128, 8, 3),
    (64, 64, 64, 4, 4),
    (64, 256, 64, 8, 4),
    (64, 256, 128, 8, 2),
    (128, 256, 64, 8, 2),
]
MOE_FP8 = [
    (16, 128, 128, 4, 3),
    (16, 128, 128, 4, 4),
    (16, 128, 128, 8, 3),
    (16, 128, 64, 4, 4),
    (32, 128, 128, 4, 3),
    (64, 128, 128, 4, 3),
    (64, 128, 128, 8, 3),
    (64, 128, 128, 4, 4),
    (128, 128, 128, 8, 3),
    (128, 128, 128, 8, 4),
    (128, 128, 64, 8, 4),
    (64, 128, 64, 4, 5),
    (64, 128, 128, 8, 4),
    (64, 128, 128, 8, 2),
    (32, 128, 128, 8, 3),
    (64, 128, 64, 8, 3),
]
V3_MOE = (256, 7168, 2048, 8)  # experts, hidden, intermediate, top-k
TOKENS_PER_EXPERT = (1, 4, 16, 64, 256, 512)
LIMITS_S = {"ceilings": 30, "mla": 120, "moe_bf16": 120, "moe_fp8": 100}
DRY = {  # tiny shapes for the CPU (Triton's interpreter): the mechanics, not the figures
    "mla": ((4, 32, 8), (2, 40), [(2, 100)], [(16, 16, 4, 2), (32, 32, 4, 3)], (1, 2)),
    "moe": ((8, 64, 32, 2), (1, 4), [(16, 64, 64, 4, 3), (32, 32, 32, 4, 3)], [(16, 128, 128, 4, 3)]),
}


# -- inputs and timing ---------------------------------------------------------------------------


def randn(shape, dtype, device, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, device=device, dtype=dtype).mul_(scale)


def mla_inputs(batch: int, context: int, dims: tuple, device, page: int = 64, dtype=torch.bfloat16):
    """q_latent [B, H, C], q_pe [B, H, R], cache rows in scattered pages, PagedKV (slots and bias too
    when the torch reference will read them)."""
    heads, C, R = dims
    pages_per_seq = -(-context // page)
    pages = torch.randperm(batch * pages_per_seq, device=device).view(batch, pages_per_seq)
    cache = randn((batch * pages_per_seq * page, C + R), dtype, device)
    kv_lens = torch.full((batch,), context, device=device)
    return randn((batch, heads, C), dtype, device), randn((batch, heads, R), dtype, device), cache, pages, kv_lens


def mla_reference(q_lat, q_pe, cache, pages, kv_lens, page: int, scale: float) -> torch.Tensor:
    pos = torch.arange(int(kv_lens.max()), device=cache.device)
    slots = pages.gather(1, (pos // page).expand(len(pages), -1)) * page + pos % page
    bias = torch.zeros(len(pages), 1, len(pos), device=cache.device)
    return mla_decode_core(q_lat, q_pe, cache, PagedKV(slots, bias, pages, kv_lens, page), scale)


def mla_fn(inputs, tiles: tuple, splits: int, page: int = 64):
    q_lat, q_pe, cache, pages, kv_lens = inputs
    kv = PagedKV(None, None, pages, kv_lens, page)
    scale = 1 / 192**0.5

    def run():
        out, launches = tmla.decode_launches(q_lat, q_pe, cache, kv, scale, splits, tiles=SplitKVTiles(*tiles))
        for launch in launches:
            launch()
        return out

    return run


def mla_cost(batch: int, context: int, dims: tuple) -> tuple[int, int]:
    """(bytes, FLOPs): the cache read once, queries read and outputs written; scores and values."""
    heads, C, R = dims
    return 2 * (batch * context * (C + R) + batch * heads * (2 * C + R)), 2 * batch * heads * context * (2 * C + R)


def moe_inputs(tokens_per_expert: int, dims: tuple, dtype, device, fp8: bool):
    """x, weights (bf16, or fp8 with their block scales), topk_ids, topk_weights: T = tpe * E / K
    tokens, each to K distinct experts (so every expert gets about tpe rows)."""
    E, H, I, K = dims
    T = max(1, tokens_per_expert * E // K)
    ids = torch.rand(T, E, device=device).argsort(dim=1)[:, :K]
    x, weights = randn((T, H), dtype, device), torch.rand(T, K, device=device)
    if fp8:
        return x, fp8_experts(E, H, I, device), ids, weights
    return x, (randn((E, 2 * I, H), dtype, device, H**-0.5), randn((E, H, I), dtype, device, I**-0.5)), ids, weights


def moe_fn(inputs, blocks: tuple, fp8: bool):
    x, experts, ids, weights = inputs
    mb = tmoe.MoEBlocks(*blocks)
    if fp8:
        return lambda: tmoe.fused_moe_fp8(x, *experts, ids, weights, mb)
    return lambda: tmoe.fused_moe(x, *experts, ids, weights, mb)


def moe_cost(inputs, dims: tuple, fp8: bool) -> tuple[int, int]:
    """(bytes, FLOPs): each active expert's weights once (at 1 token per expert about 63% of them
    are), the tokens in and out; 2 * pairs * 3 * H * I."""
    E, H, I, K = dims
    ids = inputs[2]
    T, active = ids.shape[0], int(ids.unique().numel())
    return active * 3 * H * I * (1 if fp8 else 2) + 4 * T * H, 2 * T * K * 3 * H * I


def rel_norm_err(out, ref) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))


def median_ms(fn, device) -> float:
    if device.type == "cuda":
        return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def row(ms: float, nbytes: int, flops: int, peaks: dict, flop_peak: str) -> dict:
    gb_s, tflop_s = nbytes / ms / 1e6, flops / ms / 1e9
    out = {"us": round(ms * 1e3, 2), "gb_s": round(gb_s, 1), "tflop_s": round(tflop_s, 2)}
    if peaks.get("copy_gb_s"):
        out["copy_fraction"] = round(gb_s / peaks["copy_gb_s"], 3)
    if peaks.get(flop_peak):
        out[f"{flop_peak}_fraction"] = round(tflop_s / peaks[flop_peak], 3)
    return out


# -- sections ------------------------------------------------------------------------------------


def ceilings(ns, device, report) -> dict:
    """Measured roofs: copy (bytes read + written), bf16 and fp8 matmul."""
    if device.type != "cuda":
        return {"skipped": "no GPU"}
    out = {}
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    out["copy_gb_s"] = round(2 * src.numel() / median_ms(lambda: dst.copy_(src), device) / 1e6, 1)
    n = 8192
    a, b = randn((n, n), torch.bfloat16, device), randn((n, n), torch.bfloat16, device)
    out["bf16_tflop_s"] = round(2 * n**3 / median_ms(lambda: a @ b, device) / 1e9, 1)
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
        one = torch.ones((), device=device)
        fp8 = lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
        out["fp8_tflop_s"] = round(2 * n**3 / median_ms(fp8, device) / 1e9, 1)
    except Exception as exc:  # noqa: BLE001 - the other roofs still stand
        out["fp8_error"] = f"{type(exc).__name__}: {exc}"[:500]
    return out


def sweep_mla(ns, device, report) -> dict:
    """Tiles x splits at the primary shape, then the best tiles over the grid; V2-Lite at 64 x 4096."""
    peaks = report["sections"].get("ceilings", {})
    if ns.dry_run:
        dims, primary, grid, tiles_list, splits_list = DRY["mla"]
        v2 = None
    else:
        dims, primary, grid, tiles_list, splits_list, v2 = V3_MLA, MLA_PRIMARY, MLA_GRID, MLA_TILES, SPLITS, V2_MLA
    rows, wrong, seen = [], [], set()

    def measure(shape, dims, tiles, splits, inputs, ref, model) -> dict | None:
        splits = min(splits, max(1, shape[1] // 256)) if not ns.dry_run else splits
        key = (model, *shape, *tiles, splits)
        if key in seen:
            return None  # this split count was clamped onto one already timed
        seen.add(key)
        entry = {"model": model, "batch": shape[0], "context": shape[1], "tiles": list(tiles), "splits": splits}
        fn = mla_fn(inputs, tiles, splits)
        try:
            if ref is not None:
                entry["rel_err"] = rel_norm_err(fn(), ref)
                if entry["rel_err"] > 2e-2:
                    wrong.append(entry)
                    return None
            entry |= row(median_ms(fn, device), *mla_cost(*shape, dims), peaks, "bf16_tflop_s")
        except PartTimeout:
            raise
        except Exception as exc:  # noqa: BLE001 - a tile that does not compile (shared memory) is a finding
            entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(entry)
        return entry

    inputs = mla_inputs(*primary, dims, device)
    ref = mla_reference(*inputs, 64, 1 / 192**0.5)
    for tiles in tiles_list:
        for splits in splits_list:
            measure(primary, dims, tiles, splits, inputs, ref if splits == splits_list[0] else None, "v3")
    timed = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    best_tiles = []
    for r in timed:
        if r["tiles"] not in best_tiles:
            best_tiles.append(r["tiles"])
    del inputs, ref
    for shape in grid:
        inputs = mla_inputs(*shape, dims, device)
        for tiles in best_tiles[:3] + ([] if list(tiles_list[0]) in best_tiles[:3] else [list(tiles_list[0])]):
            for splits in splits_list:
                measure(shape, dims, tuple(tiles), splits, inputs, None, "v3")
        del inputs
    if v2 is not None:
        inputs = mla_inputs(*primary, v2, device)
        ref = mla_reference(*inputs, 64, 1 / 192**0.5)
        for tiles in V2_TILES:
            for splits in splits_list:
                measure(primary, v2, tiles, splits, inputs, ref if splits == splits_list[0] else None, "v2_lite")
    shapes = {"v3": list(dims)} | ({"v2_lite": list(v2)} if v2 is not None else {})
    return {"rows": rows, "wrong": wrong, "best": best_per_shape(rows, ("model", "batch", "context")), "shapes": shapes}


def sweep_moe(ns, device, report, fp8: bool) -> dict:
    peaks = report["sections"].get("ceilings", {})
    flop_peak = "fp8_tflop_s" if fp8 else "bf16_tflop_s"
    if ns.dry_run:
        dims, tpes, bf16_list, fp8_list = DRY["moe"]
    else:
        dims, tpes, bf16_list, fp8_list = V3_MOE, TOKENS_PER_EXPERT, MOE_BF16, MOE_FP8
    blocks_list = fp8_list if fp8 else bf16_list
    rows, wrong = [], []
    # each configuration's output against the shipped tiles' at a small routing (same quantisation)
    shipped = tmoe.FP8_BLOCKS if fp8 else tmoe.MoEBlocks()
    shipped = (shipped.block_m, shipped.block_n, shipped.block_k, shipped.num_warps, shipped.num_stages)
    inputs = moe_inputs(tpes[min(1, len(tpes) - 1)], dims, torch.bfloat16, device, fp8)
    ref = moe_fn(inputs, shipped, fp8)()
    ok = []
    for blocks in blocks_list:
        try:
            err = rel_norm_err(moe_fn(inputs, blocks, fp8)(), ref)
        except PartTimeout:
            raise
        except Exception as exc:  # noqa: BLE001
            rows.append({"blocks": list(blocks), "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        (ok if err <= 1e-2 else wrong).append(blocks)
        if err > 1e-2:
            wrong[-1] = {"blocks": list(blocks), "rel_err": err}
    del inputs, ref
    for tpe in tpes:
        inputs = moe_inputs(tpe, dims, torch.bfloat16, device, fp8)
        for blocks in ok:
            if not ns.dry_run and (blocks[0] > 32 and tpe < 16 or blocks[0] < 32 and tpe > 64):
                continue  # big row blocks are padding at a few rows per expert; small ones re-read weights
            entry = {"tokens_per_expert": tpe, "blocks": list(blocks)}
            try:
                ms = median_ms(moe_fn(inputs, blocks, fp8), device)
                entry |= row(ms, *moe_cost(inputs, dims, fp8), peaks, flop_peak)
            except PartTimeout:
                raise
            except Exception as exc:  # noqa: BLE001
                entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(entry)
        del inputs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    best = best_per_shape(rows, ("tokens_per_expert",))
    return {"rows": rows, "wrong": wrong, "best": best, "shape": dict(zip(("E", "H", "I", "K"), dims))}


def best_per_shape(rows: list[dict], keys: tuple) -> list[dict]:
    best = {}
    for r in rows:
        if "us" in r:
            k = tuple(r[key] for key in keys)
            if k not in best or r["us"] < best[k]["us"]:
                best[k] = r
    return list(best.values())


SECTIONS = {
    "ceilings": ceilings,
    "mla": sweep_mla,
    "moe_bf16": lambda ns, d, r: sweep_moe(ns, d, r, fp8=False),
    "moe_fp8": lambda ns, d, r: sweep_moe(ns, d, r, fp8=True),
}


# -- compiling ahead in worker processes ---------------------------------------------------------


def compile_jobs(ns, device) -> list:
    """Every configuration a section will launch, as a zero-argument function on small inputs of the
    same specialisation (only unspecialised arguments differ: batch, pair counts, page-table width)."""
    jobs = []
    if ns.dry_run:
        return jobs
    for dims, tiles_list in ((V3_MLA, MLA_TILES), (V2_MLA, V2_TILES)):
        inputs = mla_inputs(2, 1024, dims, device)
        for tiles in tiles_list:
            for splits in SPLITS:  # the merge's BLOCK_S
                jobs.append(mla_fn(inputs, tiles, splits))
    E, H, I, K = V3_MOE
    for fp8, blocks_list in ((False, MOE_BF16), (True, MOE_FP8)):
        inputs = moe_inputs(4, (8, H, I, K), torch.bfloat16, device, fp8)
        jobs += [moe_fn(inputs, blocks, fp8) for blocks in blocks_list]
    return jobs


def compile_shard(ns, device) -> int:
    index, count = map(int, ns.compile_shard.split("/"))
    failed = 0
    for i, job in enumerate(compile_jobs(ns, device)):
        if i % count == index:
            try:
                job()
            except Exception:  # noqa: BLE001 - the sweep records it
                failed += 1
    torch.cuda.synchronize()
    print(f"shard {index}/{count}: done, {failed} failed")
    return 0


def precompile(ns) -> dict:
    start = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.kernels.tune_kernels", "--compile-shard", f"{i}/{ns.jobs}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(ns.jobs)
    ]
    tails = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=ns.compile_timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        tails.append(out.strip().splitlines()[-1:] if out else [])
    return {"workers": ns.jobs, "seconds": round(time.perf_counter() - start, 1), "tails": tails}


# -- main ----------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default="tune_kernels.json")
    p.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny shapes")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--jobs", type=int, default=None, help="compile workers (default: 8 on a GPU, 0 on a CPU)")
    p.add_argument("--compile-timeout-s", type=float, default=90)
    p.add_argument(
        "--configs-dir",
        default=None,
        help=f"write the chosen tiles as config files here (default on a GPU: {tuned.CONFIG_DIR}; 'none': nowhere)",
    )
    p.add_argument("--compile-shard", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def summary_lines(report: dict) -> list[str]:
    lines = [f"ceilings: {report['sections'].get('ceilings')}"]
    mla = report["sections"].get("mla", {})
    for r in sorted(mla.get("best", []), key=lambda r: (r["model"], r["batch"], r["context"])):
        lines.append(
            f"mla {r['model']:<8}B{r['batch']:<4}L{r['context']:<6} tiles {r['tiles']} splits {r['splits']:<3}"
            f"{r['us']:>9.1f} us {r['gb_s']:>7.0f} GB/s {r['tflop_s']:>6.1f} TF"
        )
    for name in ("moe_bf16", "moe_fp8"):
        for r in report["sections"].get(name, {}).get("best", []):
            lines.append(
                f"{name} tpe {r['tokens_per_expert']:<4} blocks {r['blocks']} {r['us']:>9.1f} us "
                f"{r['gb_s']:>7.0f} GB/s {r['tflop_s']:>6.1f} TF"
            )
    for name, sec in report["sections"].items():
        if isinstance(sec, dict) and (sec.get("error") or sec.get("wrong")):
            lines.append(f"{name}: error {sec.get('error', {}).get('message', '')[:200]} wrong {sec.get('wrong')}")
    return lines


def main(argv=None) -> int:
    ns = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    if ns.compile_shard:
        return compile_shard(ns, device)
    jobs = ns.jobs if ns.jobs is not None else (8 if device.type == "cuda" else 0)
    ns.jobs = jobs
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "dry_run": ns.dry_run,
        "sections": {},
    }
    path = Path(ns.json)
    if jobs and not ns.dry_run:
        report["precompile"] = precompile(ns)
        write_json(path, report)
    ok = True
    for name in ns.sections.split(","):
        start = time.perf_counter()
        try:
            with time_limit(LIMITS_S[name] * (10 if ns.dry_run else 1)):
                report["sections"][name] = SECTIONS[name](ns, device, report)
        except (Exception, PartTimeout) as exc:
            report["sections"][name] = {"error": error_record(exc)}
            ok = False
        report["sections"][name]["seconds"] = round(time.perf_counter() - start, 1)
        write_json(path, report)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    folder = ns.configs_dir or (None if ns.dry_run else str(tuned.CONFIG_DIR))
    if folder and folder != "none":
        report["config_files"] = [str(p) for p in tune_configs.write_configs(report, folder)]
        write_json(path, report)
    print("\n".join(summary_lines(report) + [f"wrote {p}" for p in report.get("config_files", [])]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
