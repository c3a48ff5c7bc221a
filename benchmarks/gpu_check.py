#!/usr/bin/env python3
"""The first check of the engine on a GPU: one script, a few minutes, every finding in one JSON file.

Nothing here had run on a GPU before: the Triton kernels were checked only under Triton's
interpreter and `--device cuda` never ran. Each part runs on its own, under a time limit: its
failure is recorded (error type, message, the end of its traceback and of its cause's) and the
next part runs. On a GPU each part runs in a process of its own (--isolate), so a kernel that
breaks the CUDA context, a crash in a compiler or a hang ends with that part. The JSON file is
rewritten after every part, so a run cut short still leaves all it measured:
{"header": {device, driver, versions, SMs, memory...}, "parts": {name: {"ok", "seconds",
"headline", results..., "error"?}}, "ok", "finished"}.

    ceilings            device-to-device copy GB/s and bf16 8192^3 matmul TFLOP/s (CUDA events, median)
    kernels_correct     every Triton kernel the engine launches (MLA and GQA decode, fused MoE bf16/fp32
                        and fp8, fp8 quantize/dequantize) at DeepSeek-V3 and Qwen3-30B-A3B shapes against
                        the torch reference backend on the same random inputs: ||out - ref|| / ||ref||
    engine_single_fp32  tiny DeepSeek-V3 and Qwen3-MoE checkpoints, greedy, torch and triton backends,
                        against transformers on the same device: token-exact
    engine_single_bf16  the same in bf16: matching tokens and the largest logprob difference
    engine_afd_1a1f     1 attention + 1 FFN rank on one GPU (processes, shm/ZeroMQ): the single tokens
    engine_graphs       decode steps from CUDA graphs against eager ones, requests arriving two at a
                        time (buckets change, prefill mixes in): token-equal
    kernels_timing      bench_kernels.py's rows at DeepSeek-V3 shapes, MLA decode over batch x context,
                        fused MoE (bf16, fp8) over tokens per expert: time, GB/s, TFLOP/s, peak fractions
    decode_step_time    the single engine's decode step at batch 1, 8, 64: torch backend eager, triton
                        with CUDA graphs off and on (runtime/cuda_graph.py), and their ratio

Tolerances of kernels_correct: fp32 1e-3, bf16 2e-2, fp8 MoE 5e-2 (the kernel re-quantizes the
SwiGLU output to fp8, which the reference does not: about 2% of the norm on the CPU tests), fp8
quantize/dequantize 0 (bit-exact to comm/wire.py).

    python benchmarks/gpu_check.py --json gpu_check.json              # on a GPU (needs no venv; run from the root)
    python benchmarks/gpu_check.py --json check.json --dry-run        # the same on the CPU, tiny shapes (~1 min)
    python benchmarks/gpu_check.py --json check.json --parts ceilings,kernels_correct --quick

Exit status 0 when every part passed, 1 otherwise. The AFD part needs pyzmq (benchmarks/gpu_wheels.sh).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import bench_kernels as bk  # noqa: E402
from part_runner import (  # noqa: E402
    PartTimeout,
    died,
    error_record,
    run_cases,
    run_parts,
    summary,
    time_limit,
    write_json,
)

from kernels.registry import attention_backend, moe_backend  # noqa: E402

# part -> time limit in seconds (also capped by what --deadline-s leaves); the expected times on an
# H200 are well under these: most of a part's first seconds are Triton compiling its kernels
PART_LIMITS_S = {
    "ceilings": 30,
    "kernels_correct": 150,
    "engine_single_fp32": 60,
    "engine_single_bf16": 60,
    "engine_afd_1a1f": 75,
    "engine_graphs": 60,
    "kernels_timing": 100,
    "decode_step_time": 90,
}
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 2e-2, "fp8_moe": 5e-2, "fp8_bits": 0.0}
# bf16 engine runs: a sanity bound on |engine logprob - transformers logprob| of the same token in the
# same context, not a tolerance (bf16 logits of ~10 are 1/16 apart; a broken kernel is off by nats)
BF16_MAX_LOGPROB_DIFF = 0.5
ARCHS, BACKENDS = ("deepseek_v3", "qwen3_moe"), ("torch", "triton")
PROMPT_LENGTHS = (1, 7, 23, 50)
DRY_RUN_PROMPT_LENGTHS = (1, 23, 50)
V3_MLA = {"heads": 128, "C": 512, "R": 64, "Dn": 128, "Dv": 128}
TINY_MLA = {"heads": 4, "C": 32, "R": 8, "Dn": 16, "Dv": 16}


@dataclass
class Context:
    """What the parts share: where they run, how big, and what earlier parts found."""

    device: torch.device
    dry_run: bool
    quick: bool
    workdir: Path
    report: dict
    single_tokens: dict = field(default_factory=dict)  # (arch, dtype, backend) -> tokens per prompt
    graph_replays: dict = field(default_factory=dict)  # (arch, dtype, backend) -> CUDA graph decode steps
    checkpoints: dict = field(default_factory=dict)  # arch -> path
    earlier: dict = field(default_factory=dict)  # part -> record, of the run this process is one part of

    def part(self, name: str) -> dict:
        """The record of part `name` if it ran already, in this process or an earlier one; else {}."""
        return self.report["parts"].get(name) or self.earlier.get(name, {})

    def checkpoint(self, arch: str) -> str:
        """A tiny random checkpoint of `arch` (afd_engine.tiny_model), written once."""
        from afd_engine.tiny_model import make_tiny_model

        if arch not in self.checkpoints:
            self.checkpoints[arch] = str(make_tiny_model(self.workdir / arch, arch=arch))
        return self.checkpoints[arch]

    def prompts(self, count: int | None = None, length: int | None = None) -> list[list[int]]:
        """Fixed random prompts of token ids: PROMPT_LENGTHS, or `count` of `length` tokens."""
        from afd_engine.tiny_tokenizer import TINY_VOCAB_SIZE

        g = torch.Generator().manual_seed(3)
        if count is None:  # (the dry run runs kernels under Triton's interpreter: fewer prompts)
            lengths = DRY_RUN_PROMPT_LENGTHS if self.dry_run else PROMPT_LENGTHS
        else:
            lengths = [length] * count
        return [torch.randint(5, TINY_VOCAB_SIZE, (n,), generator=g).tolist() for n in lengths]


# -- running parts -------------------------------------------------------------------------------


def run_part(name: str, fn, limit_s: float, *, ctx: Context, fail_part: str | None) -> dict:
    """One part in this process under its time limit: {"ok", "seconds", "headline", its results or
    "error"}. `fail_part` NAME makes part NAME raise; NAME:exit makes this process exit (a crash)."""
    start, record = time.perf_counter(), {"ok": False, "headline": ""}
    try:
        with time_limit(limit_s):
            if fail_part in (name, f"{name}:exit"):
                if fail_part.endswith(":exit"):
                    os._exit(70)
                raise RuntimeError(f"injected failure (--fail-part {name})")
            if ctx.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(ctx.device)
            result = fn(ctx)
        record.update(result, ok=not result.get("failures"))
    except (Exception, PartTimeout) as exc:
        record["error"] = error_record(exc)
        record["headline"] = f"{type(exc).__name__}: {exc}"[:100]
    record["seconds"] = round(time.perf_counter() - start, 3)
    gc.collect()
    return record | gpu_memory(ctx.device)


def gpu_memory(device: torch.device) -> dict:
    """The part's peak GPU memory, its cache released; or the CUDA error that every call now raises
    (after an illegal address, say: the reason parts run in processes of their own on a GPU)."""
    if device.type != "cuda":
        return {}
    try:
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.empty_cache()
        return {"peak_gpu_memory_gb": round(peak, 2)}
    except Exception as exc:
        return {"cuda_error_after": f"{type(exc).__name__}: {exc}"[:2000]}


def run_isolated(name: str, fn, limit_s: float, *, ns: argparse.Namespace, workdir: Path) -> dict:
    """One part in a process of its own (this script with --parts NAME), in a new session: a crash,
    a hang in C code or a broken CUDA context ends with it. Killed, with its rank processes, 30 s
    past its limit; its output goes to a log whose end the record keeps when the part failed."""
    out, log = workdir / f"{name}.json", workdir / f"{name}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--json", str(out), "--parts", name, "--isolate", "off"]
    cmd += ["--deadline-s", str(limit_s), "--context", str(ns.json), *passed_flags(ns)]
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = proc.wait(timeout=limit_s + 30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            returncode = proc.wait()
    record = json.loads(out.read_text())["parts"].get(name) if out.exists() else None
    record = record or died(returncode, time.perf_counter() - start, limit_s + 30)
    record["process"] = {"returncode": returncode, "wall_s": round(time.perf_counter() - start, 3)}
    if not record["ok"]:
        record["log_tail"] = log.read_text(errors="replace").splitlines()[-40:]
        print(f"--- {name} failed; its log ends:", *record["log_tail"][-15:], sep="\n", file=sys.stderr)
    return record


def passed_flags(ns: argparse.Namespace) -> list[str]:
    """The flags a part's own process takes over from this run."""
    flags = ["--dry-run"] * ns.dry_run + ["--quick"] * ns.quick
    return flags + (["--fail-part", ns.fail_part] if ns.fail_part else [])


# -- header --------------------------------------------------------------------------------------


def version_of(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def nvidia_driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def header(device: torch.device) -> dict:
    h = {
        "device": "cpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": version_of("triton"),
        "transformers": version_of("transformers"),
        "pyzmq": version_of("pyzmq"),
        "cpus": os.cpu_count(),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "dev_shm_free_gb": round(shutil.disk_usage("/dev/shm").free / 2**30, 2) if os.path.isdir("/dev/shm") else None,
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "fp32_matmul_allows_tf32": torch.backends.cuda.matmul.allow_tf32,
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        h.update(device=p.name, capability=f"{p.major}.{p.minor}", sm_count=p.multi_processor_count)
        h.update(gpu_memory_gb=round(p.total_memory / 2**30, 1), driver=nvidia_driver())
        h["cuda_driver_api"] = getattr(torch._C, "_cuda_getDriverVersion", lambda: None)()
    return h


def cuda_unavailable_reason() -> str:
    try:
        torch.cuda.init()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "torch.cuda.is_available() is False"


# -- a. ceilings ---------------------------------------------------------------------------------


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


def ceilings(ctx: Context) -> dict:
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


# -- b. kernels_correct --------------------------------------------------------------------------


def rel_norm_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))


def on_device(case: tuple, device: torch.device) -> list:
    """A tests/kernels/paged.py case (made on its DEVICE) moved to `device`; PagedKV field by field."""
    from kernels.mla import PagedKV

    def move(t):
        if isinstance(t, PagedKV):
            return PagedKV(*(x.to(device) for x in t[:4]), t.page_size)
        return t.to(device) if isinstance(t, torch.Tensor) else t

    return [move(t) for t in case]


def mla_error(kv_lens, page_size, dims, dtype, *, device) -> float:
    """TritonMLA decode against TorchMLA on ragged sequences in scrambled, NaN-padded pages."""
    from tests.kernels.paged import make_mla_case

    q_nope, q_pe, cache, kv, w_kv_b, scale = on_device(make_mla_case(kv_lens, page_size, **dims, dtype=dtype), device)
    ref_mla, mla = attention_backend("torch", "mla"), attention_backend("triton", "mla")
    w_uk, w_uv = ref_mla.absorb(w_kv_b, dims["heads"], dims["Dn"], dims["Dv"])
    ref = ref_mla.decode(q_nope, q_pe, cache, kv, w_uk, w_uv, scale)
    return rel_norm_err(mla.decode(q_nope, q_pe, cache, kv._replace(slots=None, bias=None), w_uk, w_uv, scale), ref)


def gqa_error(kv_lens, page_size, heads, kv_heads, head_dim, dtype, *, device) -> float:
    """TritonGQA decode against TorchGQA, pages as in mla_error."""
    from tests.kernels.paged import make_gqa_case

    q, cache, kv, scale = on_device(make_gqa_case(kv_lens, page_size, heads, kv_heads, head_dim, dtype), device)
    ref = attention_backend("torch", "gqa").decode(q, cache, kv, kv_heads, scale)
    out = attention_backend("triton", "gqa").decode(q, cache, kv._replace(slots=None, bias=None), kv_heads, scale)
    return rel_norm_err(out, ref)


def moe_error(shape, dtype, remote: float = 0.0, *, device) -> float:
    """Triton fused MoE against the torch reference; `remote`: fraction of slots on other ranks (-1)."""
    (x, w13, w2, ids, weights), _, _ = bk.moe_case(shape, dtype, device)
    ids = ids.masked_fill(torch.rand(ids.shape, device=device) < remote, -1)
    ref = moe_backend("torch").fused_moe(x, w13, w2, ids, weights)
    return rel_norm_err(moe_backend("triton").fused_moe(x, w13, w2, ids, weights), ref)


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


def fp8_moe_reference(x, w13, s13, w2, s2, ids, weights) -> torch.Tensor:
    """fp8-quantized activations through the torch reference with dequantized weights, one expert at
    a time (every expert dequantized at once would take 45 GB at DeepSeek-V3's size)."""
    from afd_engine.models.loader import dequantize_fp8
    from comm import wire

    xq = wire.dequantize_fp8(*wire.quantize_fp8(x), torch.float32)
    out = torch.zeros_like(xq)
    for e in ids.unique().tolist():
        w13_e, w2_e = dequantize_fp8(w13[e], s13[e], (128, 128)), dequantize_fp8(w2[e], s2[e], (128, 128))
        out += moe_backend("torch").fused_moe(xq, w13_e[None], w2_e[None], torch.where(ids == e, 0, -1), weights)
    return out


def moe_fp8_error(shape, dtype, *, device) -> float:
    T, E, H, I, K = shape
    experts, (x, ids, weights) = fp8_experts(E, H, I, device), routed_tokens(T, E, H, K, dtype, device)
    out = moe_backend("triton").fused_moe_fp8(x, *experts, ids, weights)
    return rel_norm_err(out, fp8_moe_reference(x, *experts, ids, weights))


def fp8_bits_error(T: int, H: int, dtype, *, device) -> float:
    """Fraction of fp8 bytes, scales and dequantized values of the Triton kernels that differ from
    comm/wire.py's (magnitudes over six decades, so some groups reach e4m3 subnormals)."""
    from comm import wire
    from kernels.triton.fp8 import dequantize_fp8, quantize_fp8

    x = (torch.randn(T, H, device=device) * torch.logspace(-3, 3, H, device=device)).to(dtype)
    (q, s), (q_ref, s_ref) = quantize_fp8(x), wire.quantize_fp8(x)
    back, back_ref = dequantize_fp8(q_ref, s_ref, dtype), wire.dequantize_fp8(q_ref, s_ref, dtype)
    wrong = (q.view(torch.uint8) != q_ref.view(torch.uint8)).sum() + (s != s_ref).sum() + (back != back_ref).sum()
    return float(wrong) / (2 * q.numel() + s.numel())


def correctness_cases(dry_run: bool, device) -> dict:
    """name -> (fn() -> relative error, tolerance). The dry run's shapes are tiny (interpreter)."""
    f32, bf16, fp8 = torch.float32, torch.bfloat16, "fp8_moe"
    mla, lens, long_lens = (TINY_MLA, [1, 5, 17, 100], [300, 3]) if dry_run else (V3_MLA, [1, 77, 600, 1500], [4000, 5])
    gqa = (8, 2, 16) if dry_run else (32, 4, 128)  # Qwen3-30B-A3B: 32 heads over 4 kv heads of 128
    moe = (8, 16, 64, 32, 4) if dry_run else (64, 256, 7168, 2048, 8)  # (tokens, E, H, I, top-k)
    moe_fp32 = moe if dry_run else (32, 16, 7168, 2048, 8)  # fp32 weights of 256 experts: 45 GB
    fp8_moe, fp8_x = ((4, 8, 256, 128, 2), (3, 300)) if dry_run else (moe, (64, 7168))
    cases = {}  # name -> (fn, args, tolerance key)
    for name, dtype, page in (("fp32", f32, 64), ("bf16", bf16, 64), ("bf16", bf16, 1), ("bf16", bf16, 16)):
        cases[f"mla_{name}_page{page}"] = (mla_error, (lens, page, mla, dtype), dtype)
    cases["mla_fp32_page16"] = (mla_error, (lens, 16, mla, f32), f32)
    cases["mla_bf16_page64_many_splits"] = (mla_error, (long_lens, 64, mla, bf16), bf16)
    for name, dtype, page in (("fp32", f32, 16), ("bf16", bf16, 64), ("bf16", bf16, 16)):
        cases[f"gqa_{name}_page{page}"] = (gqa_error, ([1, 50, 700], page, *gqa, dtype), dtype)
    cases["moe_bf16"] = (moe_error, (moe, bf16), bf16)
    cases["moe_bf16_other_rank_slots"] = (moe_error, (moe, bf16, 0.25), bf16)
    cases["moe_fp32"] = (moe_error, (moe_fp32, f32), f32)
    cases["moe_fp8_bf16_activations"] = (moe_fp8_error, (fp8_moe, bf16), fp8)
    cases["fp8_quantize_fp32"] = (fp8_bits_error, (*fp8_x, f32), "fp8_bits")
    cases["fp8_quantize_bf16"] = (fp8_bits_error, (*fp8_x, bf16), "fp8_bits")
    return {
        name: (functools.partial(fn, *args, device=device), TOLERANCE[tol]) for name, (fn, args, tol) in cases.items()
    }


def checked(fn, tolerance: float) -> dict:
    error = fn()
    return {"ok": error <= tolerance, "rel_err": error, "tolerance": tolerance}


def kernels_correct(ctx: Context) -> dict:
    cases = correctness_cases(ctx.dry_run, ctx.device)
    records, failures = run_cases({name: functools.partial(checked, *case) for name, case in cases.items()})
    measured = [(r["rel_err"] / max(r["tolerance"], 1e-30), n) for n, r in records.items() if "rel_err" in r]
    worst = max(measured, default=(0.0, "-"))
    headline = f"{len(cases) - len(failures)}/{len(cases)} within tolerance; worst {worst[1]} at {worst[0]:.2g}x"
    return {"cases": records, "failures": failures, "headline": headline}


# -- c. kernels_timing ---------------------------------------------------------------------------


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
    experts, moe, rows = fp8_experts(E, H, I, device), moe_backend("triton"), []
    for tpe in tokens_per_expert:
        T = tpe * E // K
        x, ids, weights = routed_tokens(T, E, H, K, torch.bfloat16, device)
        nbytes = int(ids.unique().numel()) * 3 * H * I + 4 * T * H + 12 * T * K
        seconds = bk.timed(lambda x=x, ids=ids, w=weights: moe.fused_moe_fp8(x, *experts, ids, w), device, reps)
        rows.append(
            {"kernel": "fused_moe_fp8", "tokens_per_expert": tpe, **bk.rates(seconds, nbytes, 6 * T * K * H * I)}
        )
    return rows


def timing_sections(ctx: Context) -> dict:
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


def with_fractions(rows: list[dict], ctx: Context) -> list[dict]:
    """Fractions of the catalog peaks (bench_kernels) and of this run's measured ceilings."""
    _, bw, peak = bk.device_peak(ctx.device)
    ceil = ctx.part("ceilings")
    for r in bk.add_peak_fractions(rows, bw, peak):
        r["measured_copy_fraction"] = r["gb_s"] / ceil["copy_gb_s"] if "copy_gb_s" in ceil else None
        matmul = ceil.get("bf16_matmul_tflop_s")
        r["measured_matmul_fraction"] = r["tflop_s"] / matmul if matmul else None
    return rows


def kernels_timing(ctx: Context) -> dict:
    sections = timing_sections(ctx)
    records, failures = run_cases({name: lambda fn=fn: {"rows": fn()} for name, fn in sections.items()})
    for record in records.values():
        with_fractions(record.get("rows", []), ctx)
    rows = {r["kernel"]: r for r in records["bench_kernels"].get("rows", []) if r["backend"] == "triton"}
    headline = ", ".join(f"{k} {r['gb_s']:.0f} GB/s {r['tflop_s']:.1f} TFLOP/s" for k, r in rows.items())
    return {"sections": records, "failures": failures, "headline": headline[:100]}


# -- d., e., f. the engine -----------------------------------------------------------------------


def make_engine(ctx: Context, arch: str, dtype: str, backend: str, settings: dict | None = None, **deployment):
    """The single-process engine (no ZeroMQ import), or with `deployment` a multi-process one;
    `settings`: more EngineArgs fields (--disable-cuda-graph)."""
    kwargs = dict(model_path=ctx.checkpoint(arch), device=ctx.device.type, dtype=dtype, kv_cache_memory_mb=64)
    kwargs.update(attention_backend=backend, moe_backend=backend, **(settings or {}))
    if not deployment:
        from afd_engine.engine import Engine
        from afd_engine.engine_args import EngineArgs

        return Engine(EngineArgs(**kwargs))
    from afd_engine.factory import make_engine as make_deployment  # imports zmq

    return make_deployment(**kwargs, **deployment)


def greedy(ctx: Context, arch: str, dtype: str, backend: str, **deployment) -> tuple[list, list]:
    """(tokens, their logprobs) per prompt of ctx.prompts(), greedy, EOS ignored."""
    from afd_engine.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=3 if ctx.dry_run else 16, temperature=0.0, ignore_eos=True, logprobs=0)
    with make_engine(ctx, arch, dtype, backend, **deployment) as engine:
        outs = engine.generate(prompt_token_ids=ctx.prompts(), sampling_params=params)
        graphs = getattr(getattr(engine, "runner", None), "graphs", None)
        ctx.graph_replays[(arch, dtype, backend)] = graphs.replays if graphs is not None else 0
    if any(o.error for o in outs):
        raise RuntimeError(f"engine request failed: {next(o.error for o in outs if o.error)}")
    return [o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs]


@torch.inference_mode()
def reference_logprobs(ctx: Context, arch: str, dtype: str, tokens: list[list[int]]) -> list[torch.Tensor]:
    """transformers' log-distribution [n, V] of each engine token given the prompt and the engine's
    tokens before it (one forward per prompt): its argmax is transformers' greedy choice there."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ctx.checkpoint(arch), dtype=getattr(torch, dtype))
    model = model.to(ctx.device).eval()
    out = []
    for prompt, toks in zip(ctx.prompts(), tokens):
        ids = torch.tensor([prompt + toks[:-1]], device=ctx.device)
        out.append(model(ids).logits[0, len(prompt) - 1 :].float().log_softmax(-1).cpu())
    return out


def prompt_agreement(logp: torch.Tensor, toks: list[int], lps: list[float]) -> dict:
    """One prompt's engine tokens against transformers' distributions: tokens before the first that
    is not transformers' argmax, argmax hits in all, the largest logprob difference, and the first
    difference with transformers' top-2 gap there (a near-tie explains a difference)."""
    t = torch.tensor(toks)
    hits = (logp.argmax(-1) == t).tolist()
    prefix = hits.index(False) if False in hits else len(hits)
    diff = float((logp[torch.arange(len(toks)), t] - torch.tensor(lps)).abs().max())
    out = {"tokens": len(toks), "matched": prefix, "argmax_agree": sum(hits), "max_logprob_diff": diff}
    if prefix < len(toks):
        top2 = logp[prefix].topk(2)
        out["first_difference"] = {"position": prefix, "engine": toks[prefix], "transformers": int(top2.indices[0])}
        out["first_difference"]["top2_gap"] = float(top2.values[0] - top2.values[1])
    return out


def agreement(ref: list[torch.Tensor], tokens: list[list[int]], logprobs: list[list[float]]) -> dict:
    prompts = [prompt_agreement(*one) for one in zip(ref, tokens, logprobs)]
    total = {key: sum(p[key] for p in prompts) for key in ("tokens", "matched", "argmax_agree")}
    return {**total, "max_logprob_diff": max(p["max_logprob_diff"] for p in prompts), "prompts": prompts}


def single_case(ctx: Context, arch: str, dtype: str, backend: str) -> dict:
    tokens, logprobs = greedy(ctx, arch, dtype, backend)
    ctx.single_tokens[(arch, dtype, backend)] = tokens
    result = agreement(reference_logprobs(ctx, arch, dtype, tokens), tokens, logprobs)
    exact = result["matched"] == result["tokens"]
    ok = exact if dtype == "float32" else result["max_logprob_diff"] <= BF16_MAX_LOGPROB_DIFF
    # decode steps replayed from CUDA graphs (0: eager, e.g. the torch MoE backend reads the host)
    return {"ok": ok, "exact": exact, "graph_replays": ctx.graph_replays.get((arch, dtype, backend), 0), **result}


def engine_single(ctx: Context, dtype: str) -> dict:
    """Both tiny architectures on both backends against transformers, on the device."""
    cases = {f"{a}/{b}": functools.partial(single_case, ctx, a, dtype, b) for a in ARCHS for b in BACKENDS}
    records, failures = run_cases(cases)
    done = [r for r in records.values() if "tokens" in r]
    matched, total = sum(r["matched"] for r in done), sum(r["tokens"] for r in done)
    diff = max((r["max_logprob_diff"] for r in done), default=float("nan"))
    exact = sum(r["exact"] for r in done)
    headline = f"{exact}/{len(cases)} runs exact, {matched}/{total} tokens, max dlogp {diff:.2g}"
    return {"runs": records, "failures": failures, "headline": headline, "device": str(ctx.device)}


@contextlib.contextmanager
def stderr_to(path: Path):
    """File descriptor 2 of this process, and of the processes it starts meanwhile, into `path`."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def with_rank_log(fn, log: Path):
    """fn() with the ranks' stderr in `log`, echoed afterwards; a failure's message ends with it."""
    try:
        with stderr_to(log):
            return fn()
    except Exception as exc:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"{type(exc).__name__}: {exc}; the ranks' stderr ends:\n{tail}") from exc
    finally:
        sys.stderr.write(log.read_text(errors="replace"))


def engine_afd(ctx: Context) -> dict:
    """1 attention + 1 FFN rank, triton backends, fp32, over each data plane (auto: shared memory
    through the host, both ranks on one GPU; torch: NCCL with a GPU per rank, skipped on a machine
    of one GPU, which NCCL refuses to share between ranks; gloo on the CPU): the single engine's
    tokens."""
    try:
        import zmq  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"pyzmq is missing ({exc}): deployments need it; see benchmarks/gpu_wheels.sh") from exc
    arch, dtype, backend = "deepseek_v3", "float32", "triton"
    key = (arch, dtype, backend)
    single = ctx.single_tokens[key] if key in ctx.single_tokens else greedy(ctx, *key)[0]
    total = sum(len(t) for t in single)
    runs, failures = {}, []
    for transport in ("auto", "torch"):
        # auto: both ranks on the base GPU (--gpu-id-step 0); NCCL needs a GPU per rank
        step = 1 if transport == "torch" else 0
        if step and ctx.device.type == "cuda" and torch.cuda.device_count() < 2:
            runs[transport] = {"skipped": "NCCL refuses two ranks on one GPU; this machine has one"}
            continue
        deployment = dict(
            mode="afd", dp_size=1, ffn_nodes=1, ffn_ranks_per_node=1, gpu_id_step=step, transport=transport
        )
        try:
            log = ctx.workdir / f"ranks-{transport}.log"
            afd, _ = with_rank_log(functools.partial(greedy, ctx, arch, dtype, backend, **deployment), log)
        except Exception as exc:  # noqa: BLE001 - one transport failing must not hide the other's result
            runs[transport] = {"error": f"{type(exc).__name__}: {exc}"[-2000:]}
            failures.append(f"transport {transport}: {type(exc).__name__}")
            continue
        equal = sum(a == s for ours, ref in zip(afd, single) for a, s in zip(ours, ref))
        runs[transport] = {"tokens_equal": equal, "tokens": total, "afd_tokens": afd}
        if afd != single:
            failures.append(f"transport {transport}: {total - equal} of {total} tokens differ from single mode")
    headline = ", ".join(
        f"{t} {r['tokens_equal']}/{total}" if "tokens" in r else f"{t} {'failed' if 'error' in r else 'skipped'}"
        for t, r in runs.items()
    )
    return {
        "failures": failures,
        "headline": f"tokens equal to single mode: {headline}",
        "runs": runs,
        "single_tokens": single,
    }


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


def decode_step_time(ctx: Context) -> dict:
    """Step times of both backends, the triton one with CUDA graphs on and off (the dry run: torch
    only, eager; the interpreter is no speed figure and the CPU has no graphs)."""
    warmup, steps = (2, 3) if ctx.dry_run else (4, 20)
    runs = [("torch", False)] if ctx.dry_run else [("torch", False), ("triton", False), ("triton", True)]
    rows = []
    for backend, graphs in runs:
        settings = {"disable_cuda_graph": not graphs}
        with make_engine(ctx, "deepseek_v3", "float32" if ctx.dry_run else "bfloat16", backend, settings) as engine:
            runner = getattr(engine.runner, "graphs", None)
            if graphs and runner is None:
                raise RuntimeError("CUDA graphs were asked for and not captured")
            for batch in (1, 8, 64):
                before = runner.replays if runner is not None else 0
                row = step_times(engine, ctx.prompts(batch, 16), warmup, steps)
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


# correctness first: should the time run out, what is left undone is speed
def engine_graphs(ctx: Context) -> dict:
    """Decode steps replayed from CUDA graphs against eager ones, fp32, with requests arriving two at
    a time (tests.engine_helpers.run_staggered): the batch moves across buckets, prefill steps mix
    in, and with overlap each step's inputs hold the last step's placeholders: token-equal. On the
    CPU the same static, padded path runs eagerly (GraphRunner with capture off, triton replaced by
    the torch backend that the interpreter would make slow)."""
    from afd_engine.runtime.cuda_graph import GraphRunner
    from afd_engine.sampling_params import SamplingParams
    from tests.engine_helpers import run_staggered

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (3, 17, 1, 9, 30, 5, 12, 2)]
    params = SamplingParams(max_new_tokens=4 if ctx.dry_run else 20, temperature=0.0, ignore_eos=True)
    backend = "torch" if ctx.dry_run else "triton"
    runs = {}
    for graphs in (False, True):
        with make_engine(ctx, "deepseek_v3", "float32", backend, {"disable_cuda_graph": not graphs}) as engine:
            if graphs and ctx.device.type != "cuda":
                pool = engine.pool
                engine.runner.graphs = GraphRunner(engine.model, pool, [1, 2, 4], True, engine.load_recorder, False)
            tokens = run_staggered(engine, prompts, params, every=2)
            runner = engine.runner.graphs
            runs["graphs" if graphs else "eager"] = {"tokens": tokens, "replays": runner.replays if runner else 0}
    equal = sum(a == b for x, y in zip(runs["graphs"]["tokens"], runs["eager"]["tokens"]) for a, b in zip(x, y))
    total = sum(len(t) for t in runs["eager"]["tokens"])
    failures = [] if equal == total else [f"{total - equal} of {total} tokens differ between graphs and eager"]
    if not runs["graphs"]["replays"]:
        failures.append("no decode step was replayed from a graph")
    headline = f"graphs vs eager: {equal}/{total} tokens equal, {runs['graphs']['replays']} steps replayed"
    return {"failures": failures, "headline": headline, "runs": runs}


PARTS = {
    "ceilings": ceilings,
    "kernels_correct": kernels_correct,
    "engine_single_fp32": functools.partial(engine_single, dtype="float32"),
    "engine_single_bf16": functools.partial(engine_single, dtype="bfloat16"),
    "engine_afd_1a1f": engine_afd,
    "engine_graphs": engine_graphs,
    "kernels_timing": kernels_timing,
    "decode_step_time": decode_step_time,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", required=True, type=Path, help="write the report here (after every part)")
    parser.add_argument("--dry-run", action="store_true", help="everything on the CPU at tiny shapes")
    parser.add_argument("--quick", action="store_true", help="fewer timed repetitions, no timing sweeps")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of: {', '.join(PARTS)}")
    parser.add_argument("--deadline-s", type=float, default=360.0, help="parts not started by then are not run")
    parser.add_argument(
        "--isolate",
        default="auto",
        choices=("auto", "on", "off"),
        help="each part in a process of its own (auto: on a GPU, where a kernel can break the CUDA context)",
    )
    parser.add_argument("--context", type=Path, default=None, help=argparse.SUPPRESS)  # the whole run's report
    parser.add_argument("--fail-part", default=None, help=argparse.SUPPRESS)  # tests: NAME raises, NAME:exit exits
    ns = parser.parse_args(argv)
    unknown = sorted(set(ns.parts.split(",")) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; known: {', '.join(PARTS)}")
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    if ns.dry_run or not torch.cuda.is_available():  # before the first Triton kernel module is imported
        os.environ["TRITON_INTERPRET"] = "1"
    torch.manual_seed(0)
    device = torch.device("cpu" if ns.dry_run else "cuda")
    report = {"header": header(device if torch.cuda.is_available() else torch.device("cpu"))}
    report.update(args={k: str(v) for k, v in vars(ns).items()}, parts={}, finished=False)
    if device.type == "cuda" and not torch.cuda.is_available():
        report["error"] = f"no usable GPU ({cuda_unavailable_reason()}); --dry-run runs the checks on the CPU"
        write_json(ns.json, report)
        print(report["error"], file=sys.stderr)
        return 1
    workdir = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    try:
        parts = {p: PARTS[p] for p in ns.parts.split(",")}
        ok = run_parts(parts, report, ns.json, ns.deadline_s, runner(ns, report, workdir), PART_LIMITS_S)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"device: {report['header']['device']}; report: {ns.json}\n{summary(report)}")
    return 0 if ok else 1


def runner(ns: argparse.Namespace, report: dict, workdir: Path):
    """How each part runs: in a process of its own (--isolate), or in this one."""
    if ns.isolate == "on" or (ns.isolate == "auto" and not ns.dry_run):
        return functools.partial(run_isolated, ns=ns, workdir=workdir)
    earlier = json.loads(ns.context.read_text())["parts"] if ns.context and ns.context.exists() else {}
    device = torch.device("cpu" if ns.dry_run else "cuda")
    ctx = Context(device, ns.dry_run, ns.quick, workdir, report, earlier=earlier)
    return functools.partial(run_part, ctx=ctx, fail_part=ns.fail_part)


if __name__ == "__main__":
    sys.exit(main())
