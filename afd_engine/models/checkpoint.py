"""A checkpoint checked before any weight is read: config, index, shards and every tensor's header.

`inspect_checkpoint` reads `config.json` (refusing what the engine does not serve), the safetensors
index and the header of each shard (a few kilobytes each, even for a 700 GB checkpoint), and checks
every tensor the model needs against the shape the config implies and a dtype the loader takes. So
`afd serve` on a broken directory stops with one line naming the file and the tensor, before it
binds a port or starts a rank.

The expected tensors come from the model itself, built on the meta device (no memory), with its
stacked routed experts unstacked into the checkpoint's one tensor per expert projection, under
the checkpoint's names (models/weight_names.py): the layout cannot drift from what the loader fills.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

from afd_engine.checkpoint_tokenizer import check_tokenizer
from afd_engine.errors import ModelLoadError
from afd_engine.model_config import ModelConfig
from afd_engine.models.weight_names import checkpoint_name

INDEX = "model.safetensors.index.json"
FLOAT_DTYPES = ("F32", "BF16", "F16")  # the loader converts any of these to the model's dtype
FP8_DTYPE = "F8_E4M3"  # with a `<name>_scale_inv` of block scales, in fp8 checkpoints
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(w13|w2)(_q)?$")


def expected_tensors(cfg: ModelConfig, mtp: bool = False) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor a complete checkpoint holds for the served layers (multi-token
    prediction layers only with `mtp`, where speculative decoding drafts with the first; block
    scales never). With `mtp`, a config without such a layer raises ConfigError."""
    from afd_engine.models import MODEL_REGISTRY, Kernels
    from afd_engine.models.meta import on_meta

    with on_meta():
        kernels = Kernels.named(attention_kind=cfg.attention)
        model = MODEL_REGISTRY[cfg.architecture](cfg, None, kernels)
        if mtp:
            from afd_engine.models.mtp import attach_mtp

            attach_mtp(model, cfg, kernels)
    out: dict[str, tuple[int, ...]] = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        m = _STACKED.match(name)
        if m is None:
            if not name.endswith("_scale"):
                out[name] = tuple(tensor.shape)
            continue
        slots, rows, cols = tensor.shape  # [experts, 2I, H] for w13, [experts, H, I] for w2
        projs = {"gate_proj": (rows // 2, cols), "up_proj": (rows // 2, cols)} if m.group(2) == "w13" else None
        for expert in range(slots):
            for proj, shape in (projs or {"down_proj": (rows, cols)}).items():
                out[f"{m.group(1)}.{expert}.{proj}.weight"] = shape
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return {checkpoint_name(cfg.architecture, name): shape for name, shape in out.items()}


def parameter_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(total, activated per token) parameters of the served layers: activated counts top-k of the
    routed experts of each MoE layer and everything else in full."""
    total = routed = 0
    for name, shape in expected_tensors(cfg).items():
        n = math.prod(shape)
        total += n
        routed += n if ".experts." in name else 0  # mlp.experts (block_sparse_moe.experts in MiniMax-M2)
    active = routed * cfg.num_experts_per_tok // cfg.n_routed_experts if cfg.n_routed_experts else 0
    return total, total - routed + active


def inspect_checkpoint(model_path: str | Path, mtp: bool = False) -> ModelConfig:
    """The checkpoint's config, once config, index, shards and tensor headers have been checked;
    a ModelLoadError naming the file and the tensor otherwise. `mtp`: the multi-token prediction
    module speculative decoding drafts with is checked too (a ConfigError where there is none)."""
    path = Path(model_path)
    cfg = ModelConfig.from_pretrained(path)
    check_tokenizer(path)  # now, not once the weights are loaded and transformers fails on it
    headers = read_headers(path)
    missing = []
    for name, shape in expected_tensors(cfg, mtp).items():
        if name not in headers:
            missing.append(name)
            continue
        _check_tensor(name, shape, headers, cfg)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ModelLoadError(f"checkpoint {str(path)!r} lacks weights the model needs: {shown}")
    return cfg


def read_headers(path: Path) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """tensor name -> (file, safetensors dtype, shape), from the index (when there is one) and each
    shard's header."""
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index} is not a safetensors index (JSON with a weight_map): {exc!r}") from None
        files = sorted({path / f for f in weight_map.values()})
    else:
        weight_map, files = {}, sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no safetensors weights in {str(path)!r} (no *.safetensors file, no {INDEX})")
    headers: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
    for file in files:
        if not file.is_file():
            held = next(n for n, f in weight_map.items() if path / f == file)
            raise ModelLoadError(f"{file} is missing: {INDEX} places tensors there (e.g. {held})")
        headers.update({n: (file, dtype, shape) for n, (dtype, shape) in _shard_header(file).items()})
    for name, f in weight_map.items():
        if name not in headers or headers[name][0] != path / f:
            raise ModelLoadError(f"{path / f}: lacks tensor {name}, which {INDEX} places there")
    return headers


def _shard_header(file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) from one safetensors file's header; an error for a file that is not
    safetensors or is shorter than its header says."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        try:
            if not 0 < n <= size - 8:
                raise ValueError(f"header length {n} in a file of {size} bytes")
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{file} is not a safetensors file ({exc})") from None
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        end = info["data_offsets"][1]
        if 8 + n + end > size:
            raise ModelLoadError(f"{file} is truncated: tensor {name} ends at byte {8 + n + end}, the file at {size}")
        out[name] = (info["dtype"], tuple(info["shape"]))
    return out


def _check_tensor(name: str, shape: tuple[int, ...], headers: dict, cfg: ModelConfig) -> None:
    file, dtype, found = headers[name]
    if found != shape:
        raise ModelLoadError(f"{file}: tensor {name} has shape {list(found)}, the config implies {list(shape)}")
    if dtype in FLOAT_DTYPES:
        return
    if dtype == FP8_DTYPE and cfg.fp8_block is not None:
        block = cfg.fp8_block
        scale = (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])) if len(shape) == 2 else None
        entry = headers.get(name + "_scale_inv")
        if entry is None or entry[2] != scale:
            got = "none" if entry is None else f"shape {list(entry[2])}"
            raise ModelLoadError(
                f"{file}: fp8 tensor {name} needs {name}_scale_inv of shape {list(scale or ())} ({got} found)"
            )
        return
    fp8 = " (F8_E4M3 only in a checkpoint whose quantization_config is fp8)" if dtype == FP8_DTYPE else ""
    raise ModelLoadError(f"{file}: tensor {name} is {dtype}; weights must be {', '.join(FLOAT_DTYPES)}{fp8}")
