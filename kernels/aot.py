"""Every Triton kernel configuration the engine launches, compiled ahead of time for NVIDIA GPUs on a
machine without one, with the resources each uses and the budgets they must hold.

    python -m kernels.aot --target sm_90 sm_100 [--json PATH] [--only TEXT] [--num-warps N] [--dump DIR]

What is compiled, per model of MODELS (DeepSeek-V3, DeepSeek-V2-Lite, Qwen3-30B-A3B shapes):
attention decode (MLA or GQA split-KV and the merge of the splits) at page sizes 1/16/64 in fp32 and
bf16, for every merge tile (1..16 splits); routed experts (gate_up and down) in fp32 and bf16, and
with fp8 weights after the fp8 quantization of activations (and its inverse, dequantize); and per
model of SPARSE_MODELS (DeepSeek-V3.2), sparse MLA at every split count in fp32 and bf16. Where a
wrapper's tiles depend on the GPU (MLA decode, fused MoE: kernels/triton/configs/), every tile it
may take at the model's shape is compiled, its default and each tuned file's, named by its tile. The
launches come from the wrappers' own builders (`decode_launches`, `expert_launches`,
`quantize_launch`) called with meta-device tensors of the model's shapes, and are specialised by
Triton's own binder, so each compile is the one the wrapper would make on a GPU: the same
signature, constexprs, tile sizes, num_warps and num_stages. Values that vary per step (batch,
page-table width, split count) are passed unspecialised by the kernels, so one representative
step (DECODE_TOKENS tokens, MAX_CONTEXT tokens of page table) stands for all. Identical compiles
are done once; they run in parallel, one process per core, and land in Triton's cache
(~/.triton/cache), so a second run takes seconds.

Resources per configuration, read from the cubin with the cuobjdump that ships inside Triton:
    registers, stack_bytes         per thread: REG and STACK of `cuobjdump --dump-resource-usage`
    spill_store/load_bytes         per thread: bytes of the SASS's local stores and loads (STL, LDL);
                                   Triton kernels use local memory only for spills, so these are
                                   ptxas -v's "bytes spill stores / loads" (tests/kernels/test_aot.py
                                   checks them against ptxas -v)
    shared_bytes                   per block: the dynamic shared memory Triton's launch requests
Budgets (`violations`; exit status 1 when one is broken): shared memory within the target's
227 KB per block; no stack and no spill anywhere (the fp32 paths hold it too), but for the launches
SPILL_ALLOWANCE names, each with the GPU measurement that chose its spilling tile.

Needs no GPU and no CUDA driver: the target is named, never queried. TRITON_INTERPRET must be
unset (under the interpreter triton.jit makes no compilable kernels); this module drops it before
it imports a kernel, so run it as its own process.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from itertools import product
from pathlib import Path
from typing import NamedTuple

if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)  # before the first kernel import: compilable kernels

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler.compiler import make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from kernels.mla import PagedKV  # noqa: E402
from kernels.triton import fp8, gqa, mla, moe, sparse_mla  # noqa: E402
from kernels.triton.launch import Launch, is_interpreted  # noqa: E402

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
SHARED_LIMIT = {"sm_90": 227 * 1024, "sm_100": 227 * 1024}  # bytes per block (of 228 KB, 1 KB reserved)
# Launches allowed some local memory, by name pattern (fnmatch) -> bytes per thread (stack, spill
# stores, spill loads each): only tuned tiles (kernels/triton/configs/) that a GPU measured faster
# than every spill-free one tried, each named by its tile (the measurements: benchmarks/README.md,
# "Lab notes"). DeepSeek-V3's bf16 MLA decode at 64 heads a program and V2-Lite's at 128 tokens a
# step and 4 warps spill a little at sm_90 with Triton 3.9; the fp8 gate_up kernel at 64 rows spills
# a few bytes at sm_100 only, outside its inner loop. Default tiles never spill.
SPILL_ALLOWANCE = {
    "mla_split_kv/deepseek-v3/bf16/m64n64w8s3/*": 320,
    "mla_split_kv/deepseek-v2-lite/bf16/m16n128w4s2/*": 96,
    "moe_gate_up/*/fp8/m64n128k128w8s3": 8,
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PAGE_SIZES = (1, 16, 64)
SPLITS = tuple(2**i for i in range(mla.MAX_SPLITS.bit_length()))  # 1, 2, 4, 8, 16: every merge tile
DECODE_TOKENS = 64  # the representative step: tokens (sequences) per decode step...
MAX_CONTEXT = 4096  # ...and the page table's width in tokens


class MLAShape(NamedTuple):
    heads: int
    kv_lora_rank: int  # C: the latent cached per token
    rope_dim: int  # R: the rotated key part cached beside it


class GQAShape(NamedTuple):
    heads: int
    kv_heads: int
    head_dim: int


class MoEShape(NamedTuple):
    hidden: int
    intermediate: int  # moe_intermediate_size: one expert's gate (or up) rows
    experts: int
    top_k: int


# The published checkpoints' config.json values.
MODELS = {
    "deepseek-v3": (MLAShape(128, 512, 64), MoEShape(7168, 2048, 256, 8)),
    "deepseek-v2-lite": (MLAShape(16, 512, 64), MoEShape(2048, 1408, 64, 6)),
    "qwen3-30b-a3b": (GQAShape(32, 4, 128), MoEShape(2048, 768, 128, 8)),
}

# Sparse MLA models: (MLA shape, index_head_dim: the indexer key cached after each row's C + R,
# index_topk: the slots each query token attends to).
SPARSE_MODELS = {"deepseek-v3.2": (MLAShape(128, 512, 64), 128, 2048)}


class Case(NamedTuple):
    """One launch the engine makes: `name` is kernel/model/dtype[/tile][/page P][/splits S]; `path` is the
    dtype path it serves (fp32, bf16 or fp8)."""

    name: str
    path: str
    launch: Launch


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor with a shape and dtype and no storage (Triton sees a 16-byte aligned pointer)."""
    return torch.empty(shape, dtype=dtype, device="meta")


def tile_tag(tiles) -> str:
    """A tile configuration (SplitKVTiles or MoEBlocks) as a name part: m64n128k128w8s3 for
    block_m 64, block_n 128, block_k 128, 8 warps, 3 stages."""
    fields = tiles._asdict() if hasattr(tiles, "_asdict") else dataclasses.asdict(tiles)
    return "".join(f"{_TAG[k]}{v}" for k, v in fields.items())


_TAG = {"block_m": "m", "block_n": "n", "block_k": "k", "num_warps": "w", "num_stages": "s"}


def attention_cases(model: str, shape, dtype: str, page_size: int, splits: int) -> list[Case]:
    """Split-KV and merge launches of one decode step: DECODE_TOKENS sequences, `splits` splits;
    for MLA, one split-KV launch per tile it may take (its default and each tuned file's)."""
    B, dt = DECODE_TOKENS, DTYPES[dtype]
    pages = meta(B, triton.cdiv(MAX_CONTEXT, page_size), dtype=torch.int64)  # [B, P]
    kv = PagedKV(None, None, pages, meta(B, dtype=torch.int64), page_size)
    slots = pages.numel() * page_size
    where = f"{model}/{dtype}"
    if isinstance(shape, MLAShape):
        H, C, R = shape
        q_latent, q_pe, cache = meta(B, H, C, dtype=dt), meta(B, H, R, dtype=dt), meta(slots, C + R, dtype=dt)
        cases = []
        for tiles in mla.every_tiles(H, C, R, dt):
            _, (split, merge) = mla.decode_launches(
                q_latent, q_pe, cache, kv, C**-0.5, splits, interpreted=False, tiles=tiles
            )
            cases.append(Case(f"mla_split_kv/{where}/{tile_tag(tiles)}/page{page_size}/splits{splits}", dtype, split))
        return [*cases, Case(f"mla_merge/{where}/splits{splits}", dtype, merge)]
    H, KVH, D = shape
    q, cache = meta(B, H, D, dtype=dt), meta(slots, 2 * KVH * D, dtype=dt)
    _, (split, merge) = gqa.decode_launches(q, cache, kv, KVH, D**-0.5, splits, interpreted=False)
    return [
        Case(f"gqa_split_kv/{where}/page{page_size}/splits{splits}", dtype, split),
        Case(f"gqa_merge/{where}/splits{splits}", dtype, merge),
    ]


def sparse_cases(model: str, shape: MLAShape, index_dim: int, topk: int, dtype: str, splits: int) -> list[Case]:
    """Sparse MLA launches of DECODE_TOKENS query tokens, `topk` slots each, `splits` splits (one:
    the kernel writes the output itself, as a prefill chunk does; more: then the merge), over the
    MLA share of cache rows that also hold the indexer's key."""
    T, dt = DECODE_TOKENS, DTYPES[dtype]
    H, C, R = shape
    q_latent, q_pe = meta(T, H, C, dtype=dt), meta(T, H, R, dtype=dt)
    cache = meta(T * MAX_CONTEXT, C + R + index_dim, dtype=dt)[:, : C + R]
    indices = meta(T, topk, dtype=torch.int64)
    tiles = sparse_mla.default_tiles(H, dt)
    _, launches = sparse_mla.sparse_launches(q_latent, q_pe, cache, indices, C**-0.5, splits, False, tiles)
    where = f"{model}/{dtype}"
    cases = [Case(f"sparse_mla/{where}/{tile_tag(tiles)}/splits{splits}", dtype, launches[0])]
    return cases + [Case(f"sparse_mla_merge/{where}/splits{splits}", dtype, merge) for merge in launches[1:]]


def expert_cases(model: str, shape: MoEShape, dtype: str) -> list[Case]:
    """gate_up and down launches of one step's routed experts for each tile `moe.moe_blocks` may
    give at this shape (named by its tile): `dtype` fp32 or bf16 (weights and activations), or fp8
    (fp8 weights and quantized activations; the quantization is in fp8_cases)."""
    H, I, E, K = shape
    T, dt = DECODE_TOKENS, DTYPES.get(dtype, torch.bfloat16)
    x = meta(T, H, dtype=dt)
    if dtype == "fp8":
        a, a_scale, _ = fp8.quantize_launch(x)
        w13, w2 = meta(E, 2 * I, H, dtype=torch.float8_e4m3fn), meta(E, H, I, dtype=torch.float8_e4m3fn)
        w13_scale = meta(E, triton.cdiv(2 * I, 128), triton.cdiv(H, 128))
        w2_scale = meta(E, triton.cdiv(H, 128), triton.cdiv(I, 128))
    else:
        a, a_scale, w13_scale, w2_scale = x, None, None, None
        w13, w2 = meta(E, 2 * I, H, dtype=dt), meta(E, H, I, dtype=dt)
    cases = []
    for blocks in moe.every_blocks(dtype, H, I):
        rows = triton.cdiv(T * K + E * (blocks.block_m - 1), blocks.block_m) * blocks.block_m  # every expert's padding
        aligned = moe.ExpertBlocks(meta(rows, dtype=torch.int32), meta(rows // blocks.block_m, dtype=torch.int32))
        _, launches = moe.expert_launches(
            a, a_scale, w13, w13_scale, w2, w2_scale, aligned, meta(T, K), blocks, interpreted=False
        )
        where = f"{model}/{dtype}/{tile_tag(blocks)}"
        cases += [Case(f"moe_{part}/{where}", dtype, launch) for part, launch in zip(("gate_up", "down"), launches)]
    return cases


def fp8_cases(model: str, shape: MoEShape, dtype: str) -> list[Case]:
    """Quantization of one step's activations before the fp8 experts, and its inverse."""
    x = meta(DECODE_TOKENS, shape.hidden, dtype=DTYPES[dtype])
    q, scales, quantize = fp8.quantize_launch(x)
    _, dequantize = fp8.dequantize_launch(q, scales, DTYPES[dtype])
    return [
        Case(f"fp8_quantize/{model}/{dtype}", "fp8", quantize),
        Case(f"fp8_dequantize/{model}/{dtype}", "fp8", dequantize),
    ]


def all_cases() -> list[Case]:
    """Every launch of every model, dtype, page size and split count, each name once (the merge,
    the same at every page size, included once)."""
    cases = []
    for model, (attention, experts) in MODELS.items():
        for dtype in DTYPES:
            for page_size in PAGE_SIZES:
                for splits in SPLITS:
                    cases += attention_cases(model, attention, dtype, page_size, splits)
            cases += expert_cases(model, experts, dtype) + fp8_cases(model, experts, dtype)
        cases += expert_cases(model, experts, "fp8")
    for (model, (attention, index_dim, topk)), dtype, splits in product(SPARSE_MODELS.items(), DTYPES, SPLITS):
        cases += sparse_cases(model, attention, index_dim, topk, dtype, splits)
    return list({case.name: case for case in cases}.values())


class Job(NamedTuple):
    """One compile, specialised as Triton's launcher would and picklable for a worker process."""

    kernel: str  # "module:name"
    target: str  # sm_90, sm_100
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict

    @property
    def key(self) -> str:
        return repr(self)


def arch(target: str) -> int:
    return int(target.removeprefix("sm_"))


def specialise(launch: Launch, target: str) -> Job:
    """The compile `launch()` would trigger on a `target` GPU: Triton's binder specialises each
    argument (dtype, 16-divisibility, ints equal to 1) exactly as at launch time."""
    kernel, backend = launch.kernel, make_backend(GPUTarget("cuda", arch(target), 32))
    if is_interpreted(kernel):
        raise RuntimeError("kernels.aot needs compilable kernels: run it as its own process without TRITON_INTERPRET")
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    knobs = triton.knobs
    options = dict(  # what JITFunction.run adds to a launch's options
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        debug=kernel.debug or knobs.runtime.debug,
        instrumentation_mode=knobs.compilation.instrumentation_mode,
        fpsan_homomorphic_casts=knobs.compilation.fpsan_homomorphic_casts,
    )
    bound, specialization, options = binder(*launch.args, **launch.constexprs, **options)
    options, signature, constexprs, attrs = kernel._pack_args(backend, options, bound, specialization, options)
    name = f"{kernel.fn.__module__}:{kernel.fn.__name__}"
    return Job(name, target, signature, constexprs, attrs, options.__dict__)


def compile_job(job: Job, dump: str | None = None) -> dict:
    """Compile one job (in a worker process) -> its resources (see `resources`)."""
    module, name = job.kernel.split(":")
    kernel = getattr(importlib.import_module(module), name)
    src = ASTSource(fn=kernel, signature=job.signature, constexprs=job.constexprs, attrs=job.attrs)
    start = time.perf_counter()
    compiled = triton.compile(src, target=GPUTarget("cuda", arch(job.target), 32), options=job.options)
    seconds = time.perf_counter() - start  # ~0 when Triton's cache held it
    if dump:
        stem = Path(dump) / f"{job.target}-{name}-{compiled.hash[:12]}"
        stem.with_suffix(".ptx").write_text(compiled.asm["ptx"])
        stem.with_suffix(".cubin").write_bytes(compiled.asm["cubin"])
    return {**resources(compiled.asm["cubin"], compiled.metadata), "compile_seconds": round(seconds, 2)}


def resources(cubin: bytes, metadata) -> dict:
    """Registers, stack and spills per thread, shared memory per block, warps and stages. Spills
    live in the stack frame, so the SASS (slow to disassemble) is read only when there is one."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = _cuobjdump("--dump-resource-usage", f.name)
        reg, stack = (int(re.search(rf"\b{k}:(\d+)", usage).group(1)) for k in ("REG", "STACK"))
        sass = _cuobjdump("-sass", f.name) if stack else ""
    return {
        "registers": reg,
        "stack_bytes": stack,
        "spill_store_bytes": local_bytes(sass, "STL"),
        "spill_load_bytes": local_bytes(sass, "LDL"),
        "shared_bytes": metadata.shared,
        "num_warps": metadata.num_warps,
        "num_stages": metadata.num_stages,
    }


_WIDTH = {"64": 8, "128": 16, "U8": 1, "S8": 1, "U16": 2, "S16": 2}


def local_bytes(sass: str, op: str) -> int:
    """Bytes moved by the SASS's local-memory instructions `op` (STL or LDL): 4 per plain one,
    8 for .64, 16 for .128, 1 or 2 for the byte and short forms."""
    total = 0
    for mods in re.findall(rf"\b{op}((?:\.[A-Z0-9]+)*)\s", sass):
        widths = [_WIDTH[m] for m in mods.split(".") if m in _WIDTH]
        total += widths[0] if widths else 4
    return total


def _cuobjdump(*args: str) -> str:
    return subprocess.run([str(TOOLS / "cuobjdump"), *args], check=True, capture_output=True, text=True).stdout


def spill_allowance(uses: list[str]) -> int:
    """The local memory per thread every use of one compile is allowed (SPILL_ALLOWANCE; 0 if any
    use has none)."""
    return min(next((b for p, b in SPILL_ALLOWANCE.items() if fnmatch.fnmatchcase(u, p)), 0) for u in uses)


def violations(entry: dict) -> list[str]:
    """The budgets one report entry breaks, as sentences naming the configuration."""
    out = []
    where = f"{entry['target']} {entry['kernel']} ({entry['uses'][0]})"
    limit = SHARED_LIMIT[entry["target"]]
    if entry["shared_bytes"] > limit:
        out.append(f"{where}: {entry['shared_bytes']} bytes of shared memory, over the {limit} a block may use")
    spilled = {k: entry[k] for k in ("stack_bytes", "spill_store_bytes", "spill_load_bytes") if entry[k]}
    if spilled and max(spilled.values()) <= spill_allowance(entry["uses"]):
        spilled = {}
    if spilled:
        out.append(f"{where}: local memory per thread {spilled} with {entry['registers']} registers")
    return out


def build_report(cases: list[Case], targets: list[str], workers: int, dump: str | None = None) -> list[dict]:
    """One entry per distinct compile: kernel, target, constexprs, the cases using it, resources."""
    jobs: dict[str, tuple[Job, list[Case]]] = {}
    for target in targets:
        for case in cases:
            job = specialise(case.launch, target)
            jobs.setdefault(job.key, (job, []))[1].append(case)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = {key: pool.submit(compile_job, job, dump) for key, (job, _) in jobs.items()}
        return [_entry(job, uses, futures[key].result()) for key, (job, uses) in jobs.items()]


def _entry(job: Job, uses: list[Case], res: dict) -> dict:
    kernel = uses[0].name.split("/")[0]
    launch = uses[0].launch
    return {
        "kernel": kernel,
        "target": job.target,
        "function": job.kernel,
        "paths": sorted({c.path for c in uses}),
        "constexprs": {k: str(v) for k, v in launch.constexprs.items()},
        **res,
        "uses": [c.name for c in uses],
    }


_COLUMNS = (
    "target  kernel          first use (of n uses)                                w/s  regs stack spill st/ld   smem"
)


def format_table(report: list[dict]) -> str:
    """One line per configuration: target, kernel, first use, warps/stages and resources."""
    lines = [_COLUMNS]
    for e in report:
        use = f"{e['uses'][0].split('/', 1)[1]} ({len(e['uses'])})"
        spill = f"{e['spill_store_bytes']}/{e['spill_load_bytes']}"
        lines.append(
            f"{e['target']:7} {e['kernel']:15} {use:52} {e['num_warps']}/{e['num_stages']:<2} {e['registers']:>4} "
            f"{e['stack_bytes']:>5} {spill:>11} {e['shared_bytes']:>6}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.aot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", nargs="+", default=["sm_90", "sm_100"], choices=sorted(SHARED_LIMIT))
    parser.add_argument("--json", help="write the report (one entry per configuration) to this path")
    parser.add_argument("--only", default="", help="compile only launches whose name contains this text")
    parser.add_argument("--num-warps", type=int, help="override every launch's num_warps (to try a tile)")
    parser.add_argument("--dump", help="write each configuration's PTX and cubin into this directory")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    cases = [c for c in all_cases() if args.only in c.name]
    if args.num_warps:
        cases = [c._replace(launch=c.launch._replace(num_warps=args.num_warps)) for c in cases]
    if args.dump:
        Path(args.dump).mkdir(parents=True, exist_ok=True)
    report = build_report(cases, args.target, args.workers, args.dump)
    print(format_table(report))
    if args.json:
        summary = {"triton": triton.__version__, "targets": args.target, "configs": report}
        Path(args.json).write_text(json.dumps(summary, indent=1))
    broken = [v for entry in report for v in violations(entry)]
    print("\n".join(broken) if broken else f"{len(report)} configurations within budget", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
