"""Loads Hugging Face safetensors checkpoints (sharded, FP8 block-quantized) into the model.

Names are the checkpoint's own (MiniMax-M2's MoE names read as DeepSeek's: models/weight_names.py);
the mapping table below only covers what the serving layout stores differently (stacked routed
experts). Each process loads only the tensors its modules
own, so an expert-parallel rank reads only its experts. FP8 weights are dequantized here, except
routed experts whose module keeps them FP8 (`w13_q`/`w2_q` with their block scales).

Routed experts held at `fp8` (--ffn-weight-dtype) from a checkpoint whose experts are not FP8 are
block-quantized here, one checkpoint tensor at a time on the host (models/quant.py): kept as FP8
bytes and scales where the module keeps FP8, else stored as the quantized weights' values.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open

from afd_engine.errors import ModelLoadError
from afd_engine.models.quant import FP8_BLOCK, dequantize_fp8, fp8_round_trip, quantize_fp8_blocks
from afd_engine.models.weight_names import checkpoint_name, module_name

# checkpoint name -> (parameter name, which stacked slot); group(1) layer, group(2) expert.
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACK_SLOT = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None)}
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def checkpoint_files(model_path: Path) -> list[Path]:
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_path / f for f in weight_map.values()})
    else:
        files = sorted(model_path.glob("*.safetensors"))
    missing = [f.name for f in files if not f.is_file()]
    if not files or missing:
        raise ModelLoadError(
            f"no safetensors weights in {str(model_path)!r}" + (f" (missing {missing})" if missing else "")
        )
    return files


def load_weights(model: torch.nn.Module, model_path: str | Path) -> None:
    """Fills every parameter and buffer of `model` from the checkpoint; errors name what is missing.
    Only tensors the model holds are read."""
    model_path = Path(model_path)
    cfg = model.config
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    experts = _routed_experts(model)
    slots = {layer: _slots_of(module) for layer, module in experts.items()}
    filled: Counter[str] = Counter()
    # the layers past these are MTP modules not held (an FFN rank's shard may hold an MTP layer's experts)
    held = max(cfg.num_layers + len(getattr(model, "mtp", ())), max(experts, default=-1) + 1)
    for file in checkpoint_files(model_path):
        with safe_open(str(file), framework="pt") as f:
            names = set(f.keys())
            for name in names:
                if name.endswith("_scale_inv") or _skip_layer(name, held):
                    continue
                key = module_name(cfg.architecture, name)  # the module's name where the checkpoint's differs
                m = _EXPERT.match(key)
                if m is None:
                    if key in params:
                        _copy(params[key].data, _read(f, name, names, cfg.fp8_block), name)
                        filled[key] += 1
                    continue
                layer, expert, proj = int(m.group(1)), int(m.group(2)), m.group(3)
                rows = slots.get(layer, {}).get(expert)
                if not rows:
                    continue
                prefix = f"model.layers.{layer}.mlp.experts.{_STACK_SLOT[proj][0]}"
                if prefix + "_q" in params:
                    dests = _place_fp8_expert(_read_fp8(f, name, names), name, proj, rows, prefix, params)
                else:
                    tensor = _read(f, name, names, cfg.fp8_block)
                    if experts[layer].precision == "fp8" and name + "_scale_inv" not in names:
                        tensor = fp8_round_trip(tensor)  # the checkpoint's FP8 is taken as it is
                    dests = [prefix] * _place_expert(tensor, name, proj, rows, params[prefix])
                filled.update(dests)
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()  # prepare() ties it to the embedding
    missing = sorted(
        checkpoint_name(cfg.architecture, n) for n, p in params.items() if filled[n] != _pieces(n, p) and n not in tied
    )
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ModelLoadError(f"checkpoint {str(model_path)!r} lacks weights the model needs: {shown}")
    model.prepare()


def _routed_experts(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """layer -> its routed-experts module (the modules with a `slot_expert`)."""
    return {
        int(_LAYER.match(name + ".").group(1)): module
        for name, module in model.named_modules()
        if hasattr(module, "slot_expert")
    }


def _slots_of(module: torch.nn.Module) -> dict[int, list[int]]:
    """logical expert -> the slots holding it (a rank may hold two copies of one expert)."""
    rows: dict[int, list[int]] = {}
    for slot, expert in enumerate(module.slot_expert):
        rows.setdefault(expert, []).append(slot)
    return rows


def _pieces(name: str, param: torch.Tensor) -> int:
    """How many checkpoint tensors make up one parameter (stacked experts: one or two per expert)."""
    if name.endswith(("experts.w13", "experts.w13_q", "experts.w13_scale")):
        return 2 * param.shape[0]
    return param.shape[0] if name.endswith(("experts.w2", "experts.w2_q", "experts.w2_scale")) else 1


def _skip_layer(name: str, num_layers: int) -> bool:
    """Layers past num_hidden_layers are multi-token-prediction modules: read only where held."""
    m = _LAYER.match(name)
    return m is not None and int(m.group(1)) >= num_layers


def _read(f, name: str, names: set[str], fp8_block) -> torch.Tensor:
    tensor = f.get_tensor(name)
    scale_name = name + "_scale_inv"
    if scale_name in names:
        if fp8_block is None:
            raise ModelLoadError(f"{name} has a scale_inv but config.json declares no fp8 quantization_config")
        return dequantize_fp8(tensor, f.get_tensor(scale_name), fp8_block)
    return tensor


def _place_expert(tensor: torch.Tensor, name: str, proj: str, rows: list[int], stacked: torch.Tensor) -> int:
    """Copies one expert projection into each of its slots (gate/up: a half of w13); returns how
    many pieces it filled."""
    half = _STACK_SLOT[proj][1]
    for row in rows:
        param = stacked.data[row]
        if half is not None:
            param = param[half * (param.shape[0] // 2) : (half + 1) * (param.shape[0] // 2)]
        _copy(param, tensor, name)
    return len(rows)


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ModelLoadError(f"weight {name} has shape {tuple(src.shape)}, the config implies {tuple(dst.shape)}")
    dst.copy_(src)


def _read_fp8(f, name: str, names: set[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert projection as FP8 bytes and fp32 128x128 block scales: the checkpoint's, or the
    checkpoint's bf16/fp32 weight block-quantized here."""
    weight = f.get_tensor(name)
    if name + "_scale_inv" not in names:
        weight, scale = quantize_fp8_blocks(weight, FP8_BLOCK)
        return weight.view(torch.uint8), scale
    if weight.dtype != torch.float8_e4m3fn:
        raise ModelLoadError(f"{name} has a scale_inv but is {weight.dtype}, not float8_e4m3fn")
    return weight.view(torch.uint8), f.get_tensor(name + "_scale_inv").float()


def _place_fp8_expert(fp8, name: str, proj: str, rows: list[int], prefix: str, params: dict) -> list[str]:
    """Copies an expert's FP8 weight bytes and its 128x128 block scales (`fp8`) into the stacked
    buffers of each of its slots: gate rows then up rows of w13 (and of w13_scale, whole blocks
    since I % 128 == 0), or w2."""
    half = _STACK_SLOT[proj][1]
    weight, scale = fp8
    for row in rows:
        q, s = params[prefix + "_q"].data[row], params[prefix + "_scale"].data[row]
        if half is not None:
            q = q[half * (q.shape[0] // 2) : (half + 1) * (q.shape[0] // 2)]
            s = s[half * (s.shape[0] // 2) : (half + 1) * (s.shape[0] // 2)]
        _copy(q, weight, name)
        _copy(s, scale, name + "_scale_inv")
    return [prefix + "_q", prefix + "_scale"] * len(rows)
