"""tune_kernels (benchmarks/kernels): the dry run sweeps every section's tiles on the CPU (Triton's
interpreter), checks each configuration against its reference before timing it, names the fastest
per shape, and writes them as config files that the kernels' lookup reads back (tune_configs)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from benchmarks.kernels import tune_configs
from kernels.triton import mla as mla_kernel
from kernels.triton import moe, tuned
from kernels.triton.split_kv import SplitKVTiles


def test_dry_run_sweeps_every_section(tmp_path):
    out = tmp_path / "tune.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernels.tune_kernels", "--dry-run", "--json", str(out)]
        + ["--configs-dir", str(tmp_path / "configs")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    sections = report["sections"]
    assert set(sections) == {"ceilings", "mla", "moe_bf16", "moe_fp8"}
    assert sections["ceilings"]["skipped"] == "no GPU"
    mla = sections["mla"]
    # 2 tiles x 2 split counts at the primary shape, then the same at the one grid shape
    assert len(mla["rows"]) == 8 and mla["wrong"] == []
    checked = [r for r in mla["rows"] if "rel_err" in r]
    assert len(checked) == 2 and all(r["rel_err"] < 1e-2 for r in checked)  # bf16 inputs
    assert {(b["batch"], b["context"]) for b in mla["best"]} == {(2, 40), (2, 100)}
    for name, tiles in (("moe_bf16", 2), ("moe_fp8", 1)):
        sec = sections[name]
        assert sec["wrong"] == [] and len(sec["rows"]) == 2 * tiles  # each tile at 1 and 4 rows per expert
        assert all(r["us"] > 0 and {"gb_s", "tflop_s"} <= r.keys() for r in sec["rows"])
        assert [b["tokens_per_expert"] for b in sec["best"]] == [1, 4]
    assert "mla v3" in proc.stdout and "moe_fp8 tpe 4" in proc.stdout
    # the fastest tiles as files for this device ("cpu"), read back by the kernels' lookup
    assert len(report["config_files"]) == 3 and "wrote " in proc.stdout
    for name, kind in (("moe_bf16", "bf16"), ("moe_fp8", "fp8")):
        for best in sections[name]["best"]:
            got = moe.moe_blocks(kind, best["tokens_per_expert"], 64, 32, "cpu", tmp_path / "configs")
            assert got == moe.MoEBlocks(*best["blocks"])
    chosen = tune_configs.fastest_mla_tiles(mla["rows"])
    tiles = mla_kernel.split_kv_tiles(4, torch.bfloat16, 32, 8, 2, "cpu", tmp_path / "configs")
    assert list(chosen) == [2] and tiles == SplitKVTiles(*chosen[2])


def mla_row(batch, context, tiles, splits, us):
    return {"model": "v3", "batch": batch, "context": context, "tiles": tiles, "splits": splits, "us": us}


def test_the_writer_keeps_each_size_fastest_tiles(tmp_path):
    """MLA: per batch, the tiles least in time summed over its contexts (each at its best split
    count), among tiles measured at all of them; MoE: the fastest tiles per rows per expert."""
    a, b, c = [64, 64, 8, 3], [32, 64, 8, 3], [16, 32, 4, 3]
    rows = [
        mla_row(1, 1024, a, 1, 30.0),
        mla_row(1, 1024, a, 2, 20.0),  # a: 20 + 50 = 70
        mla_row(1, 1024, b, 1, 25.0),  # b: 25 + 40 = 65, the fastest in sum
        mla_row(1, 8192, a, 1, 50.0),
        mla_row(1, 8192, b, 1, 40.0),
        mla_row(1, 8192, c, 1, 10.0),  # c: not measured at 1024
        mla_row(64, 4096, a, 1, 300.0),
        mla_row(64, 4096, b, 1, 500.0),
        {"model": "v3", "batch": 64, "context": 4096, "tiles": c, "splits": 1, "error": "shared memory"},
    ]
    moe_best = [
        {"tokens_per_expert": 1, "blocks": [16, 128, 128, 4, 3], "us": 1.0},
        {"tokens_per_expert": 64, "blocks": [64, 128, 128, 8, 3], "us": 2.0},
    ]
    report = {"device": "NVIDIA Test GPU", "date": "2026-11-27", "torch": "2", "triton": "3", "sections": {}}
    report["sections"]["mla"] = {"rows": rows, "shapes": {"v3": [128, 512, 64]}}
    report["sections"]["moe_fp8"] = {"best": moe_best, "shape": {"E": 256, "H": 7168, "I": 2048, "K": 8}}
    paths = tune_configs.write_configs(report, tmp_path)
    assert [p.name for p in paths] == [
        "mla_decode_dtype=bf16_heads=128_C=512_R=64_device=NVIDIA_Test_GPU.json",
        "fused_moe_dtype=fp8_H=7168_I=2048_device=NVIDIA_Test_GPU.json",
    ]
    gpu, bf16 = "NVIDIA Test GPU", torch.bfloat16
    assert mla_kernel.split_kv_tiles(128, bf16, 512, 64, 2, gpu, tmp_path) == SplitKVTiles(*b)
    assert mla_kernel.split_kv_tiles(128, bf16, 512, 64, 32, gpu, tmp_path) == SplitKVTiles(*a)
    assert moe.moe_blocks("fp8", 3, 7168, 2048, gpu, tmp_path) == moe.MoEBlocks(16, 128, 128, 4, 3)
    assert moe.moe_blocks("fp8", 20, 7168, 2048, gpu, tmp_path) == moe.MoEBlocks(64, 128, 128, 8, 3)
    stamp = json.loads(paths[0].read_text())["tuned"]
    assert stamp["date"] == "2026-11-27" and stamp["by"] == "python -m benchmarks.kernels.tune_kernels"
    assert tuned.lookup("mla_decode", mla_kernel.tuned_shape(128, 512, 64, bf16), gpu, 1, tmp_path) == dict(
        zip(tune_configs.MLA_FIELDS, b)
    )
