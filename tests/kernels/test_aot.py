"""Every Triton kernel configuration the engine launches, compiled for Hopper (sm_90) and Blackwell
(sm_100) on this CPU-only machine by `python -m kernels.aot`, holds the budgets: shared memory within
227 KB a block, no local stack and no spill (bf16, fp8 and fp32 paths alike).

The compile runs as its own process: this one runs Triton's interpreter (tests/conftest.py), under
which triton.jit makes no compilable kernels. It compiles once per test run (xdist workers share
its report) in about a minute on 2 cores with an empty Triton cache, seconds with a warm one.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
from itertools import product
from pathlib import Path

import pytest
import torch
import triton

from kernels import aot
from kernels.triton import gqa, mla, moe, sparse_mla

ROOT = Path(__file__).resolve().parents[2]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell"
PTXAS_FLAGS = ("-v", "-lineinfo", "--regAllocOptLevel=2")  # Triton 3.9's own (nvidia/compiler.py, make_cubin)
TARGETS = ("sm_90", "sm_100")
SHARED_LIMIT = 227 * 1024  # bytes a block may use on both targets
MODELS = {"deepseek-v3": "mla", "deepseek-v2-lite": "mla", "qwen3-30b-a3b": "gqa"}


def run_aot(out: Path, *args: str) -> tuple[int, dict, str]:
    """(exit status, JSON report, stderr) of `python -m kernels.aot --json out *args`."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "kernels.aot", "--json", str(out), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    return proc.returncode, json.loads(out.read_text()) if out.exists() else {}, proc.stderr


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """The report of every configuration for both targets, compiled once per run: under xdist the
    first worker compiles and the others wait for its file (the compile uses every core anyway)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    root = tmp_path_factory.getbasetemp().parent if worker else tmp_path_factory.getbasetemp()
    path = root / "aot_report.json"
    with open(root / "aot_report.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():  # the tool writes its report even when a budget breaks (exit status 1)
            _, _, err = run_aot(path, "--target", *TARGETS)
            assert path.exists(), err[-4000:]
    return json.loads(path.read_text())


def budget_breaches(entry: dict) -> list[str]:
    """The budgets an entry breaks: shared memory over the limit, any stack frame or spill beyond
    the allowance of the launches kernels.aot.SPILL_ALLOWANCE names (GPU-measured tiles only)."""
    local = {k: entry[k] for k in ("stack_bytes", "spill_store_bytes", "spill_load_bytes") if entry[k]}
    allowed = aot.spill_allowance(entry["uses"])
    breaches = [f"local memory {local} (allowed {allowed})"] if local and max(local.values()) > allowed else []
    if entry["shared_bytes"] > SHARED_LIMIT:
        breaches.append(f"{entry['shared_bytes']} B of shared memory")
    return breaches


SHAPES = {  # model -> (attention (heads, C, R) of MLA, experts (H, I)): the published configs'
    "deepseek-v3": ((128, 512, 64), (7168, 2048)),
    "deepseek-v2-lite": ((16, 512, 64), (2048, 1408)),
    "qwen3-30b-a3b": (None, (2048, 768)),
}


def expected_uses() -> set[str]:
    """Every launch name the engine makes at the three models' shapes (see kernels.aot): MLA and
    MoE once per tile they may take (the default and each tuned file's), named by it."""
    names = set()
    for (model, kind), dtype in product(MODELS.items(), ("fp32", "bf16")):
        mla_shape = SHAPES[model][0]
        tags = [aot.tile_tag(t) + "/" for t in mla.every_tiles(*mla_shape, aot.DTYPES[dtype])] if mla_shape else [""]
        for page, splits in product((1, 16, 64), (1, 2, 4, 8, 16)):
            names |= {f"{kind}_split_kv/{model}/{dtype}/{tag}page{page}/splits{splits}" for tag in tags}
            names.add(f"{kind}_merge/{model}/{dtype}/splits{splits}")
        names |= {f"fp8_quantize/{model}/{dtype}", f"fp8_dequantize/{model}/{dtype}"}
    for model, dtype, part in product(MODELS, ("fp32", "bf16", "fp8"), ("gate_up", "down")):
        tiles = moe.every_blocks(dtype, *SHAPES[model][1])
        names |= {f"moe_{part}/{model}/{dtype}/{aot.tile_tag(blocks)}" for blocks in tiles}
    return names | expected_sparse_uses()


def expected_sparse_uses() -> set[str]:
    """The sparse launches kernels.aot compiles at DeepSeek-V3.2's shape: the kernel at each split
    count (named by its default tile) and the merge wherever there is more than one split."""
    names = set()
    for dtype, splits in product(("fp32", "bf16"), (1, 2, 4, 8, 16)):
        tag = aot.tile_tag(sparse_mla.default_tiles(128, aot.DTYPES[dtype]))
        names.add(f"sparse_mla/deepseek-v3.2/{dtype}/{tag}/splits{splits}")
        if splits > 1:
            names.add(f"sparse_mla_merge/deepseek-v3.2/{dtype}/splits{splits}")
    return names


def test_tuned_tiles_are_compiled_beside_the_defaults():
    """The H200 files add V3's and V2-Lite's tuned MLA tiles and V3's wider MoE tiles; the other
    shapes compile their defaults alone."""
    v3 = expected_uses()
    assert "mla_split_kv/deepseek-v3/bf16/m64n64w8s3/page64/splits1" in v3
    assert "mla_split_kv/deepseek-v3/bf16/m32n64w8s3/page64/splits1" in v3  # the default
    assert "mla_split_kv/deepseek-v2-lite/bf16/m16n128w4s2/page1/splits1" in v3
    assert "moe_gate_up/deepseek-v3/fp8/m64n128k128w8s3" in v3
    assert not [u for u in v3 if u.startswith("moe_gate_up/qwen3-30b-a3b/bf16/") and "m16n64k64w4s3" not in u]


def entry_for(report: dict, target: str, use: str) -> dict:
    [entry] = [e for e in report["configs"] if e["target"] == target and use in e["uses"]]
    return entry


def test_every_configuration_within_budget(report):
    breaches = [f"{e['target']} {e['uses'][0]}: {b}" for e in report["configs"] for b in budget_breaches(e)]
    assert breaches == []


def test_report_lists_every_launch_for_both_targets(report):
    for target in TARGETS:
        entries = [e for e in report["configs"] if e["target"] == target]
        uses = [u for e in entries for u in e["uses"]]
        assert sorted(uses) == sorted(expected_uses())  # each launch once, none missing
        for e in entries:
            assert e["registers"] > 0 and e["num_warps"] >= 1 and e["num_stages"] >= 1
            assert {"stack_bytes", "spill_store_bytes", "spill_load_bytes", "shared_bytes"} <= e.keys()


def test_compiled_tiles_are_the_wrappers(report):
    """The AOT compile used the launch configuration the wrappers choose (no copy of the table):
    on the GPU the tuned files name, and on any other."""
    h200, bf16, fp32 = "NVIDIA H200", torch.bfloat16, torch.float32
    cases = [
        ("deepseek-v3/bf16/{}/page64/splits4", mla.split_kv_tiles(128, bf16, 512, 64, 64, "cpu"), "BLOCK_H"),
        ("deepseek-v3/bf16/{}/page64/splits4", mla.split_kv_tiles(128, bf16, 512, 64, 64, h200), "BLOCK_H"),
        ("deepseek-v2-lite/bf16/{}/page1/splits1", mla.split_kv_tiles(16, bf16, 512, 64, 8, h200), "BLOCK_H"),
        ("deepseek-v2-lite/bf16/{}/page1/splits1", mla.split_kv_tiles(16, bf16, 512, 64, 8, "cpu"), "BLOCK_H"),
        ("deepseek-v3/fp32/{}/page16/splits2", mla.split_kv_tiles(128, fp32, 512, 64, 64, h200), "BLOCK_H"),
    ]
    for use, tiles, block_m in cases:
        e = entry_for(report, "sm_90", "mla_split_kv/" + use.format(aot.tile_tag(tiles)))
        assert (e["num_warps"], e["num_stages"]) == (tiles.num_warps, tiles.num_stages), use
        assert (e["constexprs"][block_m], e["constexprs"]["BLOCK_N"]) == (str(tiles.block_m), str(tiles.block_n))
        assert e["constexprs"]["UPCAST"] == "False"  # the interpreter's fp32 upcast stays off the GPU
    for use, tiles in (
        ("gqa_split_kv/qwen3-30b-a3b/bf16/page16/splits8", gqa.split_kv_tiles(8, bf16)),
        ("gqa_split_kv/qwen3-30b-a3b/fp32/page64/splits16", gqa.split_kv_tiles(8, fp32)),
    ):
        e = entry_for(report, "sm_90", use)
        assert (e["num_warps"], e["num_stages"]) == (tiles.num_warps, tiles.num_stages), use
        assert (e["constexprs"]["BLOCK_G"], e["constexprs"]["BLOCK_N"]) == (str(tiles.block_m), str(tiles.block_n))
    for dtype, rows, device in product(("bf16", "fp8"), (1, 512), (h200, "cpu")):  # decode and prefill rows
        blocks = moe.moe_blocks(dtype, rows, 7168, 2048, device)
        e = entry_for(report, "sm_100", f"moe_gate_up/deepseek-v3/{dtype}/{aot.tile_tag(blocks)}")
        tiles = [str(v) for v in (blocks.block_m, blocks.block_n, blocks.block_k)]
        assert [e["constexprs"][k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "FP8")] == [*tiles, str(dtype == "fp8")]
        assert (e["num_warps"], e["num_stages"]) == (blocks.num_warps, blocks.num_stages)


def test_split_count_and_batch_compile_once(report):
    """The split count and the batch are runtime values: one split-KV kernel per (model, dtype, page)
    serves all of them, and one merge per split tile."""
    name = "mla_split_kv/deepseek-v3/bf16/m64n64w8s3/page64/splits{}"
    split = entry_for(report, "sm_90", name.format(1))
    assert sorted(split["uses"]) == sorted(name.format(s) for s in (1, 2, 4, 8, 16))


def test_a_spilling_configuration_is_caught(tmp_path):
    """Seen red: V3's bf16 split-KV kernel at 2 warps instead of 8 holds its [32, 512] fp32
    accumulator in 64 threads (256 registers each, before the query): it spills. The tool exits 1
    naming it, the budget check breaks, and the spill bytes it reads from the SASS are ptxas -v's."""
    use = f"mla_split_kv/deepseek-v3/bf16/{aot.tile_tag(mla.default_tiles(128, torch.bfloat16))}/page64/splits4"
    code, report, err = run_aot(
        tmp_path / "r.json", "--target", "sm_90", "--only", use, "--num-warps", "2", "--dump", str(tmp_path)
    )
    assert code == 1 and f"sm_90 mla_split_kv ({use}): local memory per thread" in err
    [entry] = report["configs"]
    assert budget_breaches(entry) and entry["spill_store_bytes"] > 1000
    [ptx] = tmp_path.glob("*.ptx")
    cmd = [str(PTXAS), *PTXAS_FLAGS, "--gpu-name=sm_90a", str(ptx), "-o", str(tmp_path / "again.cubin")]
    log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    registers = re.search(r"Used (\d+) registers", log)
    fields = ("stack_bytes", "spill_store_bytes", "spill_load_bytes", "registers")
    assert [int(g) for g in (*frame.groups(), registers.group(1))] == [entry[k] for k in fields]
