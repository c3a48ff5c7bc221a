#!/usr/bin/env python3
"""Kernel timings per backend: time, achieved GB/s and TFLOP/s, fraction of the device's peak.

Kernels (each through the backend objects the engine uses, kernels/registry.py):
- mla_decode: absorbed MLA decode over the paged latent cache (batch x context, page size 64)
- fused_moe: routed experts, top-k of E, bf16/fp32 weights
- fp8_quantize: per-128-group e4m3 quantization of activations (comm/wire.py's format)

Bytes and FLOPs are analytic minimums (each operand read once, each result written once): what
a kernel must move, so GB/s / peak says how close it is to the memory roofline. On a GPU the peak
comes from the planner's hardware catalog when the device name matches one of it (H100, H200...).
Every row also reports the largest relative error against the torch reference on the same inputs.

    python -m benchmarks.kernels.bench_kernels                           # DeepSeek-V3 shapes (needs a GPU)
    python -m benchmarks.kernels.bench_kernels --quick --json k.json     # tiny shapes; on a CPU the
                                                                         # triton rows run interpreted
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():  # must precede the first import of a Triton kernel module
    os.environ.setdefault("TRITON_INTERPRET", "1")

from afd_engine.planner.hardware import HARDWARE  # noqa: E402
from benchmarks.lib.results import write_json
from kernels.mla import PagedKV  # noqa: E402
from kernels.registry import attention_backend, moe_backend  # noqa: E402

# (batch, context, heads, latent C, rope R, nope Dn, value Dv)
MLA_FULL, MLA_QUICK = (64, 4096, 128, 512, 64, 128, 128), (2, 40, 4, 32, 8, 16, 16)
# (tokens, experts, hidden, intermediate, top-k): DeepSeek-V3's expert shape, 4K tokens
MOE_FULL, MOE_QUICK = (4096, 256, 7168, 2048, 8), (16, 8, 64, 32, 2)
FP8_FULL, FP8_QUICK = (4096, 7168), (16, 200)


def timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds of `fn()` over `reps` runs after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-12))


def mla_case(shape, dtype, device, page_size: int = 64):
    B, L, H, C, R, Dn, Dv = shape
    g = torch.Generator(device).manual_seed(0)
    pages_per_seq = -(-L // page_size)
    pages = torch.randperm(B * pages_per_seq, generator=g, device=device).view(B, pages_per_seq)  # scattered pages
    cache = randn(g, (B * pages_per_seq * page_size, C + R), dtype)
    pos = torch.arange(L, device=device)
    slots = pages.gather(1, (pos // page_size).expand(B, L)) * page_size + pos % page_size
    kv = PagedKV(slots, torch.zeros(B, 1, L, device=device), pages, torch.full((B,), L, device=device), page_size)
    q_nope, q_pe = randn(g, (B, H, Dn), dtype), randn(g, (B, H, R), dtype)
    w_uk, w_uv = randn(g, (H, Dn, C), dtype, C**-0.5), randn(g, (H, Dv, C), dtype, C**-0.5)
    args = [q_nope, q_pe, cache, kv, w_uk, w_uv, 1 / (Dn + R) ** 0.5]
    size = dtype.itemsize
    nbytes = (B * L * (C + R) + B * H * (Dn + R + Dv) + H * (Dn + Dv) * C) * size
    flops = 2 * B * H * L * (2 * C + R) + 2 * B * H * C * (Dn + Dv)
    return args, nbytes, flops


def moe_case(shape, dtype, device):
    T, E, H, I, K = shape
    g = torch.Generator(device).manual_seed(0)
    x = randn(g, (T, H), dtype)
    w13, w2 = randn(g, (E, 2 * I, H), dtype, H**-0.5), randn(g, (E, H, I), dtype, I**-0.5)
    ids = torch.rand(T, E, generator=g, device=device).argsort(dim=1)[:, :K]
    weights = torch.rand(T, K, generator=g, device=device)
    active = int(ids.unique().numel())
    nbytes = (active * 3 * H * I + 2 * T * H) * dtype.itemsize + T * K * 12
    flops = 2 * T * K * 3 * H * I
    return [x, w13, w2, ids, weights], nbytes, flops


def fp8_experts(E: int, H: int, I: int, device) -> tuple[torch.Tensor, ...]:
    """Random experts as a DeepSeek-V3 checkpoint stores them: (w13 [E, 2I, H], its scales
    [E, 2I/128, H/128], w2 [E, H, I], its scales), e4m3 values with one fp32 scale per 128x128 block."""

    def blocks(n: int, k: int):
        q = torch.randn(E, n, k, device=device, dtype=torch.bfloat16).mul_(48).clamp_(-448, 448)
        scale = torch.rand(E, -(-n // 128), -(-k // 128), device=device).add_(0.5).div_(48 * k**0.5)
        return q.to(torch.float8_e4m3fn), scale

    return (*blocks(2 * I, H), *blocks(H, I))


def routed_tokens(T: int, E: int, H: int, K: int, dtype, device) -> tuple[torch.Tensor, ...]:
    """x [T, H], topk_ids [T, K] (K distinct experts of E), topk_weights [T, K] fp32."""
    ids = torch.rand(T, E, device=device).argsort(dim=1)[:, :K]
    return torch.randn(T, H, device=device, dtype=dtype), ids, torch.rand(T, K, device=device)


def randn(g: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Normal values times `scale`, drawn in `dtype` on the generator's device: DeepSeek-V3's experts
    are 22 GB in bf16, too many to draw on the host or through an fp32 copy."""
    return torch.randn(shape, generator=g, device=g.device, dtype=dtype).mul_(scale)


def rates(seconds: float, nbytes: int, flops: int) -> dict:
    """A timing as microseconds, achieved GB/s and TFLOP/s."""
    return {"us": seconds * 1e6, "gb_s": nbytes / seconds / 1e9, "tflop_s": flops / seconds / 1e12}


def run_rows(backends: list[str], quick: bool, dtype: torch.dtype, device: torch.device, reps: int) -> list[dict]:
    from comm.wire import quantize_fp8

    rows = []
    mla_args, mla_bytes, mla_flops = mla_case(MLA_QUICK if quick else MLA_FULL, dtype, device)
    moe_args, moe_bytes, moe_flops = moe_case(MOE_QUICK if quick else MOE_FULL, dtype, device)
    fp8_shape = FP8_QUICK if quick else FP8_FULL
    x8 = torch.randn(*fp8_shape, generator=torch.Generator().manual_seed(0)).to(dtype).to(device)
    refs = {
        "mla_decode": attention_backend("torch").decode(*mla_args),
        "fused_moe": moe_backend("torch").fused_moe(*moe_args),
        "fp8_quantize": quantize_fp8(x8)[0],
    }
    for backend in backends:
        mla, moe = attention_backend(backend), moe_backend(backend)
        quant = quantize_fp8
        if backend == "triton":
            from kernels.triton.fp8 import quantize_fp8 as quant
        cases = {
            "mla_decode": (lambda mla=mla: mla.decode(*mla_args), mla_bytes, mla_flops),
            "fused_moe": (lambda moe=moe: moe.fused_moe(*moe_args), moe_bytes, moe_flops),
            "fp8_quantize": (
                lambda quant=quant: quant(x8)[0],
                x8.numel() * (x8.element_size() + 1) + x8.numel() // 32,
                4 * x8.numel(),
            ),
        }
        for name, (fn, nbytes, flops) in cases.items():
            seconds = timed(fn, device, reps)
            out = fn()
            err = rel_err(
                out.view(torch.uint8).float() if name == "fp8_quantize" else out,
                refs[name].view(torch.uint8).float() if name == "fp8_quantize" else refs[name],
            )
            rows.append(
                {"kernel": name, "backend": backend, **rates(seconds, nbytes, flops), "max_rel_err_vs_torch": err}
            )
    return rows


def device_peak(device: torch.device):
    """(name, HBM TB/s, bf16 TFLOP/s) of a known GPU, else (name, None, None)."""
    if device.type != "cuda":
        return "cpu", None, None
    name = torch.cuda.get_device_name(device)
    hw = next((h for key, h in HARDWARE.items() if key in name), None)
    return name, (hw.mem_bw_tbs if hw else None), (hw.bf16_tflops if hw else None)


def add_peak_fractions(rows: list[dict], bw: float | None, peak: float | None) -> list[dict]:
    """Adds each row's fraction of the HBM bandwidth `bw` (TB/s) and bf16 `peak` (TFLOP/s); None
    where the peak is unknown."""
    for r in rows:
        r["hbm_fraction"] = r["gb_s"] / (bw * 1000) if bw else None
        r["bf16_peak_fraction"] = r["tflop_s"] / peak if peak else None
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU, tests)")
    parser.add_argument("--backends", default="torch,triton", help="comma-separated backend names")
    parser.add_argument(
        "--dtype", default=None, choices=("float32", "bfloat16"), help="default: bfloat16 on a GPU, float32 on the CPU"
    )
    parser.add_argument("--reps", type=int, default=None, help="timed runs per kernel (default 20; quick: 2)")
    parser.add_argument("--json", default=None, help="write the rows here")
    ns = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, ns.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if device.type == "cpu" and not ns.quick:
        print("full DeepSeek-V3 shapes need a GPU; use --quick on a CPU", file=sys.stderr)
        return 2
    name, bw, peak = device_peak(device)
    rows = add_peak_fractions(
        run_rows(ns.backends.split(","), ns.quick, dtype, device, ns.reps or (2 if ns.quick else 20)), bw, peak
    )
    print(
        f"device: {name}, dtype {dtype}, {'quick' if ns.quick else 'DeepSeek-V3'} shapes"
        + (" (triton rows run under the interpreter: not a speed figure)" if device.type == "cpu" else "")
    )
    print(f"{'kernel':<14}{'backend':<8}{'us':>12}{'GB/s':>10}{'TFLOP/s':>10}{'HBM %':>8}{'peak %':>8}{'rel err':>10}")
    for r in rows:
        pct = [f"{100 * r[k]:.0f}" if r[k] is not None else "-" for k in ("hbm_fraction", "bf16_peak_fraction")]
        print(
            f"{r['kernel']:<14}{r['backend']:<8}{r['us']:>12.1f}{r['gb_s']:>10.2f}{r['tflop_s']:>10.3f}"
            f"{pct[0]:>8}{pct[1]:>8}{r['max_rel_err_vs_torch']:>10.1e}"
        )
    if ns.json:
        write_json(ns.json, {"dtype": str(dtype), "quick": ns.quick, "rows": rows})  # the stamp names the device
    return 0


if __name__ == "__main__":
    sys.exit(main())
