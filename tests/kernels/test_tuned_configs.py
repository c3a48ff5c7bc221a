"""Tuned tiles as data (kernels/triton/tuned.py): a wrapper finds the file for its GPU and shape,
takes the entry of the nearest tuned size, and its default tiles when no file names them; what
`tuned.write` writes, `lookup` reads back. Files are written to a temporary folder here; the last
tests read the shipped ones (kernels/triton/configs/)."""

from __future__ import annotations

import json

import pytest
import torch

from kernels.triton import mla, moe, tuned
from kernels.triton.split_kv import SplitKVTiles

GPU = "NVIDIA Test GPU 80GB"
SHAPE = {"dtype": "bf16", "H": 64, "I": 32}
SMALL = {"block_m": 16, "block_n": 32, "block_k": 32, "num_warps": 4, "num_stages": 3}
MIDDLE = {"block_m": 32, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 4}
LARGE = {"block_m": 64, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 3}


@pytest.fixture
def folder(tmp_path):
    """A config folder with one fused-MoE file for GPU at SHAPE, tuned at 1, 16 and 256 rows per
    expert, written by hand (not by `tuned.write`, tested on its own below)."""
    body = {"kernel": "fused_moe", "device": GPU, "shape": SHAPE, "tuned": {}}
    body["configs"] = {"1": SMALL, "16": MIDDLE, "256": LARGE}
    (tmp_path / "fused_moe_dtype=bf16_H=64_I=32_device=NVIDIA_Test_GPU_80GB.json").write_text(json.dumps(body))
    return tmp_path


def test_the_file_is_named_by_kernel_shape_and_device():
    name = tuned.file_name("fused_moe", SHAPE, GPU)
    assert name == "fused_moe_dtype=bf16_H=64_I=32_device=NVIDIA_Test_GPU_80GB.json"
    assert tuned.device_name("cpu") == "cpu" and tuned.device_name(GPU) == GPU


def test_lookup_picks_the_entry_of_a_tuned_size(folder):
    for size, config in ((1, SMALL), (16, MIDDLE), (256, LARGE)):
        assert tuned.lookup("fused_moe", SHAPE, GPU, size, folder) == config


def test_between_tuned_sizes_the_nearest_by_ratio_serves(folder):
    def at(size):
        return tuned.lookup("fused_moe", SHAPE, GPU, size, folder)

    assert at(3) == SMALL and at(5) == MIDDLE  # 3 is 3x above 1 and 5.3x below 16; 5 is 5x above, 3.2x below
    assert at(4) == SMALL  # a tie (4 = 4 x 1 = 16 / 4) goes to the smaller size
    assert at(63) == MIDDLE and at(65) == LARGE  # around 64, the ratio midpoint of 16 and 256
    assert at(0) == at(0.25) == SMALL and at(10**6) == LARGE  # outside the tuned range, its ends
    assert [tuned.nearest((1.0, 16.0, 256.0), s) for s in (1, 4, 4.01, 64, 64.01)] == [0, 0, 1, 1, 2]


def test_no_file_for_the_device_or_shape_gives_none_and_the_default_tiles(folder):
    assert tuned.lookup("fused_moe", SHAPE, "NVIDIA Other GPU", 16, folder) is None
    assert tuned.lookup("fused_moe", {**SHAPE, "I": 48}, GPU, 16, folder) is None
    assert tuned.lookup("mla_decode", SHAPE, GPU, 16, folder) is None
    assert moe.moe_blocks("bf16", 16, 64, 32, "NVIDIA Other GPU", folder) == moe.DEFAULT_BLOCKS["bf16"]
    assert moe.moe_blocks("bf16", 16, 64, 48, GPU, folder) == moe.DEFAULT_BLOCKS["bf16"]
    assert moe.moe_blocks("fp8", 16, 64, 32, GPU, folder) == moe.FP8_BLOCKS  # no fp8 file
    assert moe.moe_blocks("bf16", 16, 64, 32, "cpu", folder) == moe.DEFAULT_BLOCKS["bf16"]
    assert mla.split_kv_tiles(4, torch.bfloat16, 32, 8, 2, GPU, folder) == mla.default_tiles(4, torch.bfloat16)


def test_the_moe_wrapper_takes_the_tuned_tiles_of_its_file(folder):
    assert moe.moe_blocks("bf16", 0.5, 64, 32, GPU, folder) == moe.MoEBlocks(**SMALL)
    assert moe.moe_blocks("bf16", 40, 64, 32, GPU, folder) == moe.MoEBlocks(**MIDDLE)
    assert moe.every_blocks("bf16", 64, 32, folder) == [moe.DEFAULT_BLOCKS["bf16"]] + [
        moe.MoEBlocks(**c) for c in (SMALL, MIDDLE, LARGE)
    ]


def test_what_write_writes_lookup_reads_back(tmp_path):
    configs = {1: SMALL, 64: LARGE}
    path = tuned.write("fused_moe", SHAPE, GPU, configs, {"date": "2026-11-27"}, tmp_path)
    assert path.parent == tmp_path and path.name == tuned.file_name("fused_moe", SHAPE, GPU)
    assert json.loads(path.read_text())["tuned"] == {"date": "2026-11-27"}
    assert [tuned.lookup("fused_moe", SHAPE, GPU, s, tmp_path) for s in (1, 7, 9, 64)] == [SMALL, SMALL, LARGE, LARGE]
    assert moe.moe_blocks("bf16", 9, 64, 32, GPU, tmp_path) == moe.MoEBlocks(**LARGE)
    tiles = {"block_m": 16, "block_n": 64, "num_warps": 4, "num_stages": 2}
    tuned.write("mla_decode", mla.tuned_shape(4, 32, 8, torch.bfloat16), GPU, {8: tiles}, {}, tmp_path)
    assert mla.split_kv_tiles(4, torch.bfloat16, 32, 8, 2, GPU, tmp_path) == SplitKVTiles(**tiles)


def test_a_broken_file_is_refused_by_name(tmp_path):
    (tmp_path / tuned.file_name("fused_moe", SHAPE, GPU)).write_text(json.dumps({"kernel": "fused_moe"}))
    with pytest.raises(ValueError, match="not a tuned config file"):
        tuned.lookup("fused_moe", SHAPE, GPU, 1, tmp_path)
    bad_fp8 = {**SMALL, "block_n": 64}
    tuned.write("fused_moe", {**SHAPE, "dtype": "fp8"}, GPU, {1: bad_fp8}, {}, tmp_path)
    with pytest.raises(ValueError, match="fp8 MoE needs block_k dividing 128"):
        moe.moe_blocks("fp8", 1, 64, 32, GPU, tmp_path)


def test_the_shipped_h200_tiles_by_rows_per_expert():
    """The files shipped for an H200 at DeepSeek-V3's experts: 16-row blocks for decode, 64-row ones
    once the weights are re-read per block (bf16 from 9 rows per expert, fp8 from 33); fp32, another
    GPU, another shape and the CPU take the defaults."""
    h200 = "NVIDIA H200"
    assert [moe.moe_blocks("bf16", r, 7168, 2048, h200).block_m for r in (0.5, 8, 9, 512)] == [16, 16, 64, 64]
    assert [moe.moe_blocks("fp8", r, 7168, 2048, h200).block_m for r in (2, 16, 32, 33)] == [16, 16, 16, 64]
    assert {moe.moe_blocks("fp32", r, 7168, 2048, h200) for r in (1, 1000)} == {moe.MoEBlocks()}
    assert moe.moe_blocks("bf16", 512, 7168, 2048, "NVIDIA H100 80GB HBM3") == moe.MoEBlocks()
    assert moe.moe_blocks("bf16", 512, 2048, 768, h200) == moe.MoEBlocks()
    assert moe.moe_blocks("fp8", 512, 7168, 2048, "cpu") == moe.FP8_BLOCKS
    for blocks in moe.every_blocks("fp8", 7168, 2048):
        blocks.check_fp8()


def test_the_shipped_h200_mla_tiles():
    h200, bf16 = "NVIDIA H200", torch.bfloat16
    assert mla.split_kv_tiles(128, bf16, 512, 64, 1, h200) == SplitKVTiles(64, 64, 8, 3)
    assert mla.split_kv_tiles(16, bf16, 512, 64, 256, h200) == SplitKVTiles(16, 128, 4, 2)
    assert mla.split_kv_tiles(64, bf16, 512, 64, 64, h200) == mla.default_tiles(64, bf16)  # not tuned
    assert mla.split_kv_tiles(128, torch.float32, 512, 64, 64, h200) == SplitKVTiles(16, 16, 8, 2)
    assert mla.split_kv_tiles(128, bf16, 512, 64, 64, "cpu") == SplitKVTiles(32, 64, 8, 3)


def test_the_triton_moe_backend_asks_for_its_call_shape_and_device(monkeypatch):
    asked = []
    monkeypatch.setattr(moe, "moe_blocks", lambda *a: asked.append(a) or moe.MoEBlocks())
    x, w13, w2 = torch.randn(6, 64), torch.randn(8, 64, 64), torch.randn(8, 64, 32)
    ids, weights = torch.randint(0, 8, (6, 2)), torch.rand(6, 2)
    moe.TritonMoE().fused_moe(x, w13, w2, ids, weights)
    assert asked == [("fp32", 6 * 2 / 8, 64, 32, x.device)]
