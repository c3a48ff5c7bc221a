"""The tiles of the fused-MoE kernels (kernels/triton/moe.py): `MoEBlocks`, the defaults, and the
tuned ones for a GPU and the experts' shape (kernels/triton/tuned.py, by rows per expert)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from comm.wire import FP8_GROUP
from kernels.triton import tuned


@dataclass(frozen=True)
class MoEBlocks:
    """Tile sizes of both grouped GEMMs: rows (BLOCK_M, also the per-expert padding), output
    columns (BLOCK_N) and reduction (BLOCK_K), powers of two >= 16 (tl.dot's minimum); and both
    launches' warps and pipeline stages. The defaults are the bf16/fp32 tiles, FP8_BLOCKS the fp8
    ones, when no tuned file names the GPU and shape (`moe_blocks`)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name, v in (("block_m", self.block_m), ("block_n", self.block_n), ("block_k", self.block_k)):
            if v < 16 or v & (v - 1):
                raise ValueError(f"MoEBlocks.{name}={v}: use a power of two >= 16")

    def check_fp8(self) -> None:
        if FP8_GROUP % self.block_k or self.block_n != FP8_GROUP:
            raise ValueError(
                f"fp8 MoE needs block_k dividing {FP8_GROUP} (one scale per K tile) and "
                f"block_n == {FP8_GROUP} (act quantized per tile); got {self}"
            )


# The tiles when no tuned file (kernels/triton/tuned.py) names the device and the experts' shape:
# 16-row blocks, what a decode step wants (a few rows per expert, so every active expert's weights
# are read once and the kernels are bound by memory), within kernels.aot's budgets (no spill,
# shared memory) at sm_90 and sm_100 for every model it compiles. Prefill-sized batches run faster
# with wider row blocks, chosen per GPU by `python -m benchmarks.kernels.tune_kernels`. fp8 needs
# block_n 128 (its fused act quantization) and block_k dividing 128; fp32, the accuracy path, is
# never tuned.
FP8_BLOCKS = MoEBlocks(block_m=16, block_n=128, block_k=128)
DEFAULT_BLOCKS = {"fp32": MoEBlocks(), "bf16": MoEBlocks(), "fp8": FP8_BLOCKS}
KERNEL = "fused_moe"  # the kernel's name in tuned config files


def tuned_shape(kind: str, hidden: int, intermediate: int) -> dict:
    """The fields a tuned file of fused MoE is keyed by (besides the device): the weights' kind and
    one expert's shape. The expert count is not one: rows per expert, the size the file is tuned
    over, already divides the routed pairs by it."""
    return {"dtype": kind, "H": hidden, "I": intermediate}


def blocks_of(config: dict, kind: str) -> MoEBlocks:
    """A tuned configuration as MoEBlocks, checked as the kernel will use it."""
    blocks = MoEBlocks(**config)
    if kind == "fp8":
        blocks.check_fp8()
    return blocks


@functools.lru_cache(maxsize=64)
def _tuned(kind: str, hidden: int, intermediate: int, device: str, folder) -> tuple | None:
    """(tuned sizes, their MoEBlocks) from the file for this device and shape, or None."""
    entries = tuned.table(KERNEL, tuple(tuned_shape(kind, hidden, intermediate).items()), device, folder)
    if not entries:
        return None
    return tuple(size for size, _ in entries), tuple(blocks_of(config, kind) for _, config in entries)


def moe_blocks(
    kind: str,
    rows_per_expert: float,
    hidden: int,
    intermediate: int,
    device: torch.device | str = "cpu",
    folder=tuned.CONFIG_DIR,
) -> MoEBlocks:
    """The tiles for `kind` ("fp32", "bf16" or "fp8") weights of `hidden` x `intermediate` experts
    at `rows_per_expert` rows per local expert (T * K / E: an upper bound on a rank whose slots are
    partly other ranks' -1) on `device`: those tuned for the nearest rows per expert in the file
    for this device and shape in `folder`, else DEFAULT_BLOCKS[kind]. Shapes only, no host read."""
    found = _tuned(kind, hidden, intermediate, tuned.device_name(device), folder)
    if found is None:
        return DEFAULT_BLOCKS[kind]
    sizes, blocks = found
    return blocks[tuned.nearest(sizes, rows_per_expert)]


def every_blocks(kind: str, hidden: int, intermediate: int, folder=tuned.CONFIG_DIR) -> list[MoEBlocks]:
    """Every tile `moe_blocks` may give for this kind and shape on any GPU: the default, then each
    tuned file's (for kernels.aot, which names its target instead of asking a device)."""
    found = [DEFAULT_BLOCKS[kind]]
    for config in tuned.every_config(KERNEL, tuned_shape(kind, hidden, intermediate), folder):
        blocks = blocks_of(config, kind)
        if blocks not in found:
            found.append(blocks)
    return found
