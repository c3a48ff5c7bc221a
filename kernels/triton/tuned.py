"""Tile configurations tuned on a GPU, kept as data: one JSON file per kernel, shape and device in
`configs/` beside this module, written by `python -m benchmarks.kernels.tune_kernels` and read by
the kernels' wrappers (fused MoE in moe.py, MLA decode in mla.py).

A file is named by what it was tuned for, the kernel, then its shape's fields in the wrapper's
order, then the device as torch names it (characters other than letters, digits, dots and dashes
as underscores):

    fused_moe_dtype=bf16_H=7168_I=2048_device=NVIDIA_H200.json

and holds {"kernel", "device", "shape", "tuned": {where, when, with what}, "configs": {size: {...}}}:
the configuration chosen at each tuned size (rows per expert for fused MoE, batch for MLA decode).
`lookup` answers with the configuration of the tuned size nearest to the one asked for, or None
when no file names this device and shape: the wrapper then takes its default tiles, which hold on
any GPU. Sizes are compared by ratio (a tuner measures them on a geometric grid: 1, 4, 16, 64...),
a tie going to the smaller size.

Files are read once per process (the wrappers ask on every launch); a file written meanwhile is
seen by the next process.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).resolve().with_name("configs")

Shape = tuple[tuple[str, object], ...]  # (field, value) pairs in the wrapper's order
Table = tuple[tuple[float, dict], ...]  # (tuned size, configuration), ascending


@functools.cache
def _cuda_name(index: int | None) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device | str) -> str:
    """The name a config file carries for `device`: torch's name of a CUDA GPU ("NVIDIA H200"),
    else the device type ("cpu", "meta"), for which no tuned file is kept. A string that names no
    torch device is taken as a GPU's name already (to ask what a GPU not at hand would take)."""
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError:
            return device
    return _cuda_name(device.index) if device.type == "cuda" else device.type


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as file names spell it: fp32, bf16, fp8 (float8_e4m3fn)."""
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8"}.get(dtype, str(dtype))


def file_name(kernel: str, shape: Mapping[str, object] | Shape, device: str) -> str:
    """`kernel`_field=value_..._device=NAME.json for a shape's fields, in their order."""
    items = shape.items() if isinstance(shape, Mapping) else shape
    fields = "_".join(f"{k}={v}" for k, v in items)
    return f"{kernel}_{fields}_device={re.sub(r'[^A-Za-z0-9.-]+', '_', device)}.json"


def nearest(sizes: list[float] | tuple[float, ...], size: float) -> int:
    """The index in ascending `sizes` of the one nearest to `size` by ratio (a tie: the smaller);
    below the first, the first; above the last, the last."""
    i = 0
    while i + 1 < len(sizes) and sizes[i + 1] <= size:
        i += 1
    if i + 1 < len(sizes) and size > sizes[i] and size * size > sizes[i] * sizes[i + 1]:
        i += 1  # size / low > high / size: nearer the higher one
    return i


@functools.lru_cache(maxsize=256)
def table(kernel: str, shape: Shape, device: str, folder: str | Path = CONFIG_DIR) -> Table | None:
    """Every (tuned size, configuration) of the file for `kernel`, `shape` and `device` in
    `folder`, ascending by size; None when there is no such file."""
    path = Path(folder) / file_name(kernel, shape, device)
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    try:
        return tuple(sorted((float(size), dict(config)) for size, config in data["configs"].items()))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: not a tuned config file ({type(exc).__name__}: {exc})") from exc


def lookup(
    kernel: str, shape: Mapping[str, object], device: str, size: float, folder: str | Path = CONFIG_DIR
) -> dict | None:
    """The configuration tuned for `kernel` at `shape` on `device` at the size nearest to `size`
    (see `nearest`), or None when no file in `folder` names this device and shape."""
    entries = table(kernel, tuple(shape.items()), device, folder)
    if not entries:
        return None
    return entries[nearest([s for s, _ in entries], size)][1]


def every_config(kernel: str, shape: Mapping[str, object], folder: str | Path = CONFIG_DIR) -> list[dict]:
    """The configurations of every device's file for `kernel` at `shape`, each once (what
    kernels.aot compiles: the GPU it targets is named, not known)."""
    prefix = file_name(kernel, shape, "").removesuffix(".json")
    found = []
    for path in sorted(Path(folder).glob("*.json")):
        if path.name.startswith(prefix):
            for config in json.loads(path.read_text())["configs"].values():
                if config not in found:
                    found.append(config)
    return found


def write(
    kernel: str,
    shape: Mapping[str, object],
    device: str,
    configs: Mapping[float, Mapping[str, object]],
    tuned: Mapping[str, object],
    folder: str | Path = CONFIG_DIR,
) -> Path:
    """Writes the file `lookup` reads for `kernel`, `shape` and `device`: `configs` maps each tuned
    size to its configuration; `tuned` says where, when and with what it was measured. Returns its
    path (replaced whole if it was there)."""
    path = Path(folder) / file_name(kernel, shape, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    head = json.dumps({"kernel": kernel, "device": device, "shape": dict(shape), "tuned": dict(tuned)}, indent=1)
    rows = [f"  {json.dumps(_size_key(s))}: {json.dumps(dict(c))}" for s, c in sorted(configs.items())]
    text = head.removesuffix("\n}") + ',\n "configs": {\n' + ",\n".join(rows) + "\n }\n}\n"  # a config a line
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def _size_key(size: float) -> str:
    return str(int(size)) if float(size).is_integer() else str(size)
