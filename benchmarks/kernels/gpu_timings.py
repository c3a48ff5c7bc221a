"""The timed parts of the GPU check (benchmarks.kernels.gpu_check): what the device gives a trivial
kernel, the Triton kernels at DeepSeek-V3 shapes, the engine's decode step with CUDA graphs off
and on, and an MoE layer's payloads moved through the host or device to device. Each part takes
the check's Context (device, dry_run, quick, checkpoint(arch), part(name)) and returns its record;
the dry run runs them on the CPU at tiny shapes, where the times say nothing and the mechanics are
what is checked."""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.kernels import bench_kernels as bk
from benchmarks.part_runner import run_cases
from kernels.registry import attention_backend, moe_backend
from tests.gpu.engines import fixed_prompts, make_engine

BACKENDS = ("torch", "triton")
V3_MLA = {"heads": 128, "C": 512, "R": 64, "Dn": 128, "Dv": 128}
TINY_MLA = {"heads": 4, "C": 32, "R": 8, "Dn": 16, "Dv": 16}


def median_seconds(fn, device: torch.device, reps: int, warmup: int = 3) -> float:
    """Median seconds of fn() over `reps` runs after `warmup`: CUDA events on a GPU, else bench_kernels.timed."""
    if device.type != "cuda":
        return bk.timed(fn, device, reps)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def ceilings(ctx) -> dict:
    """What the device gives a trivial kernel: copy bandwidth (bytes read + written) and a bf16 GEMM."""
    copy_mb, n, reps = (16, 256, 3) if ctx.dry_run else (1024, 8192, 20)
    src = torch.empty(copy_mb * 2**20, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    copy_s = median_seconds(lambda: dst.copy_(src), ctx.device, reps)
    a, b = (torch.randn(n, n, device=ctx.device, dtype=torch.bfloat16) for _ in range(2))
    mm_s = median_seconds(lambda: a @ b, ctx.device, reps)
    _, bw, peak = bk.device_peak(ctx.device)
    out = {"copy_bytes": 2 * src.numel(), "copy_gb_s": 2 * src.numel() / copy_s / 1e9, "matmul_n": n}
    out.update(bf16_matmul_tflop_s=2 * n**3 / mm_s / 1e12, catalog_hbm_tb_s=bw, catalog_bf16_tflop_s=peak)
    out["headline"] = f"copy {out['copy_gb_s']:.0f} GB/s, bf16 matmul {out['bf16_matmul_tflop_s']:.1f} TFLOP/s"
    return out


# -- kernels ---------------------------------------------------------------------------------------


def mla_grid_rows(dims: dict, batches, contexts, dtype, device, reps: int) -> list[dict]:
    mla, rows = attention_backend("triton", "mla"), []
    for B in batches:
        for L in contexts:
            args, nbytes, flops = bk.mla_case((B, L, *dims.values()), dtype, device)
            seconds = bk.timed(lambda args=args: mla.decode(*args), device, reps)
            rows.append({"kernel": "mla_decode", "batch": B, "context": L, **bk.rates(seconds, nbytes, flops)})
    return rows


def moe_sweep_rows(shape, tokens_per_expert, dtype, device, reps: int) -> list[dict]:
    """bf16/fp32 fused MoE with T = tokens_per_expert * E / K tokens (bench_kernels.moe_case)."""
    _, E, H, I, K = shape
    moe, rows = moe_backend("triton"), []
    for tpe in tokens_per_expert:
        args, nbytes, flops = bk.moe_case((tpe * E // K, E, H, I, K), dtype, device)
        seconds = bk.timed(lambda args=args: moe.fused_moe(*args), device, reps)
        rows.append({"kernel": "fused_moe", "tokens_per_expert": tpe, **bk.rates(seconds, nbytes, flops)})
        del args  # the next case's weights are allocated before this one's would be released
    return rows


def moe_fp8_sweep_rows(shape, tokens_per_expert, device, reps: int) -> list[dict]:
    """fp8 fused MoE (bf16 activations), the same experts at each token count."""
    _, E, H, I, K = shape
    experts, moe, rows = bk.fp8_experts(E, H, I, device), moe_backend("triton"), []
    for tpe in tokens_per_expert:
        T = tpe * E // K
        x, ids, weights = bk.routed_tokens(T, E, H, K, torch.bfloat16, device)
        nbytes = int(ids.unique().numel()) * 3 * H * I + 4 * T * H + 12 * T * K
        seconds = bk.timed(lambda x=x, ids=ids, w=weights: moe.fused_moe_fp8(x, *experts, ids, w), device, reps)
        rows.append(
            {"kernel": "fused_moe_fp8", "tokens_per_expert": tpe, **bk.rates(seconds, nbytes, 6 * T * K * H * I)}
        )
    return rows


def timing_sections(ctx) -> dict:
    """name -> fn() -> rows: bench_kernels' own rows, then the sweeps (not with --quick on a GPU)."""
    dtype = torch.float32 if ctx.dry_run else torch.bfloat16
    reps = 2 if ctx.dry_run else (5 if ctx.quick else 20)
    dims, grid = (TINY_MLA, ((1, 2), (40, 80))) if ctx.dry_run else (V3_MLA, ((1, 8, 64), (1024, 4096)))
    moe, tpes = (bk.MOE_QUICK, (1, 4)) if ctx.dry_run else (bk.MOE_FULL, (1, 4, 16, 64))
    fp8 = (4, 8, 256, 128, 2) if ctx.dry_run else bk.MOE_FULL
    sections = {"bench_kernels": lambda: bk.run_rows(list(BACKENDS), ctx.dry_run, dtype, ctx.device, reps)}
    if ctx.dry_run or not ctx.quick:
        sections["mla_grid"] = lambda: mla_grid_rows(dims, *grid, dtype, ctx.device, reps)
        sections["moe_sweep"] = lambda: moe_sweep_rows(moe, tpes, dtype, ctx.device, reps)
        sections["moe_fp8_sweep"] = lambda: moe_fp8_sweep_rows(fp8, tpes, ctx.device, reps)
    return sections


def with_fractions(rows: list[dict], ctx) -> list[dict]:
    """Fractions of the catalog peaks (bench_kernels) and of this run's measured ceilings."""
    _, bw, peak = bk.device_peak(ctx.device)
    ceil = ctx.part("ceilings")
    for r in bk.add_peak_fractions(rows, bw, peak):
        r["measured_copy_fraction"] = r["gb_s"] / ceil["copy_gb_s"] if "copy_gb_s" in ceil else None
        matmul = ceil.get("bf16_matmul_tflop_s")
        r["measured_matmul_fraction"] = r["tflop_s"] / matmul if matmul else None
    return rows


def kernels_timing(ctx) -> dict:
    sections = timing_sections(ctx)
    records, failures = run_cases({name: lambda fn=fn: {"rows": fn()} for name, fn in sections.items()})
    for record in records.values():
        with_fractions(record.get("rows", []), ctx)
    rows = {r["kernel"]: r for r in records["bench_kernels"].get("rows", []) if r["backend"] == "triton"}
    headline = ", ".join(f"{k} {r['gb_s']:.0f} GB/s {r['tflop_s']:.1f} TFLOP/s" for k, r in rows.items())
    return {"sections": records, "failures": failures, "headline": headline[:100]}


# -- the engine's decode step ------------------------------------------------------------------------


def step_times(engine, prompts: list[list[int]], warmup: int, steps: int) -> dict:
    """Median wall time of `steps` decode steps of the batch `prompts`, after `warmup` steps
    (prefill, first decodes, Triton compiles); the requests then run out."""
    from afd_engine.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=warmup + steps + 2, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(prompt_token_ids=p, params=params)
    for _ in range(warmup):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    median = statistics.median(times)
    return {"batch": len(prompts), "step_ms": median * 1e3, "tokens_per_s": len(prompts) / median}


def decode_step_time(ctx) -> dict:
    """Step times of both backends, the triton one with CUDA graphs on and off (the dry run: torch
    only, eager; the interpreter is no speed figure and the CPU has no graphs)."""
    warmup, steps = (2, 3) if ctx.dry_run else (4, 20)
    runs = [("torch", False)] if ctx.dry_run else [("torch", False), ("triton", False), ("triton", True)]
    dtype = "float32" if ctx.dry_run else "bfloat16"
    rows = []
    for backend, graphs in runs:
        settings = {"disable_cuda_graph": not graphs}
        with make_engine(ctx.checkpoint("deepseek_v3"), ctx.device, dtype, backend, settings) as engine:
            runner = getattr(engine.runner, "graphs", None)
            if graphs and runner is None:
                raise RuntimeError("CUDA graphs were asked for and not captured")
            for batch in (1, 8, 64):
                before = runner.replays if runner is not None else 0
                row = step_times(engine, fixed_prompts(count=batch, length=16), warmup, steps)
                row["graph_replays"] = (runner.replays if runner is not None else 0) - before
                rows.append({"backend": backend, "cuda_graphs": graphs, **row})
            capture = engine.graph_capture_seconds
        if graphs:
            rows[-1]["capture_seconds"] = capture
    out = {"rows": rows}
    on = {r["batch"]: r["step_ms"] for r in rows if r["cuda_graphs"]}
    off = {r["batch"]: r["step_ms"] for r in rows if r["backend"] == rows[-1]["backend"] and not r["cuda_graphs"]}
    if on:
        out["graphs_over_eager"] = {b: on[b] / off[b] for b in on}
        times = ", ".join(f"B{b} {on[b]:.2f} vs {off[b]:.2f} ms" for b in on)
        out["headline"] = f"triton step, graphs vs eager: {times}"
    else:
        times = ", ".join(f"B{b} {ms:.1f} ms" for b, ms in off.items())
        out["headline"] = f"{rows[-1]['backend']} step {times} (eager: CUDA graphs need a GPU)"
    return out


# -- an MoE layer's payloads: through the host or device to device ----------------------------------

V3_HIDDEN, V3_TOP_K, V3_EXPERTS, V3_MOE_LAYERS = 7168, 8, 256, 58  # DeepSeek-V3: 61 layers, the first 3 dense


def layer_payloads(tokens: int, hidden: int, top_k: int, device: torch.device) -> list[torch.Tensor]:
    """What one MoE layer of `tokens` moves between the ranks: dispatch (hidden states bf16, top-k
    expert ids int64 and weights fp32) and combine (the experts' weighted sum, bf16)."""
    g = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g, device=device).bfloat16()
    ids = torch.randint(0, V3_EXPERTS, (tokens, top_k), generator=g, device=device)
    weights = torch.rand(tokens, top_k, generator=g, device=device)
    return [x, ids, weights, torch.randn(tokens, hidden, generator=g, device=device).bfloat16()]


def staging_paths(payloads: list[torch.Tensor], device: torch.device) -> dict:
    """name -> fn() moving every payload once: `host`, the current data path (`.cpu()` before the
    send, `.to(device)` after it); `device`, a device payload (a copy into a preallocated buffer
    of the receiver's); on a GPU also `pinned`, through preallocated pinned host buffers."""
    received = [torch.empty_like(t) for t in payloads]

    def host():
        for t in payloads:
            t.cpu().to(device)

    def device_copy():
        for dst, t in zip(received, payloads):
            dst.copy_(t, non_blocking=True)

    paths = {"host": host, "device": device_copy}
    if device.type == "cuda":
        staged = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in payloads]

        def pinned():
            for dst, stage, t in zip(received, staged, payloads):
                stage.copy_(t, non_blocking=True)
                dst.copy_(stage, non_blocking=True)

        paths["pinned"] = pinned
    return paths


def moe_layer_staging(ctx) -> dict:
    """Time per MoE layer of moving its payloads (layer_payloads) through the host as the data path
    does now, against device payloads, at 8, 64 and 512 tokens of DeepSeek-V3's width (CUDA events,
    median); per decode step that is V3_MOE_LAYERS of them. The dry run: hidden 64, top-2, CPU."""
    hidden, top_k = (64, 2) if ctx.dry_run else (V3_HIDDEN, V3_TOP_K)
    reps = 30 if ctx.dry_run else (10 if ctx.quick else 50)
    rows = []
    for tokens in (8, 64, 512):
        payloads = layer_payloads(tokens, hidden, top_k, ctx.device)
        nbytes = sum(t.numel() * t.element_size() for t in payloads)
        row = {"tokens": tokens, "hidden": hidden, "top_k": top_k, "bytes": nbytes}
        for name, fn in staging_paths(payloads, ctx.device).items():
            seconds = median_seconds(fn, ctx.device, reps)
            row[f"{name}_us"], row[f"{name}_gb_s"] = seconds * 1e6, nbytes / seconds / 1e9
        row["host_over_device"] = row["host_us"] / row["device_us"]
        row["v3_step_ms"] = {k[:-3]: v * V3_MOE_LAYERS / 1e3 for k, v in row.items() if k.endswith("_us")}
        rows.append(row)
    times = ", ".join(f"T{r['tokens']} {r['host_us']:.0f} vs {r['device_us']:.0f} us" for r in rows)
    return {"rows": rows, "moe_layers_per_step": V3_MOE_LAYERS, "headline": f"MoE layer, host vs device: {times}"}
