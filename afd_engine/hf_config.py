"""Reading a Hugging Face `config.json` as published checkpoints and transformers 4.x/5.x write it.

One field can arrive under several names: transformers 5.x saves Qwen3-MoE's expert count as
`num_local_experts` (4.x and the published checkpoints: `num_experts`), folds `rope_theta` and
`rope_scaling` into `rope_parameters`, and names the rope kind `rope_type` where older files say
`type`. `pick` reads any spelling and refuses a file whose spellings disagree.

`check_supported` refuses, before any weight is read, a checkpoint of an architecture or with a
feature the engine does not serve, in one message naming the model type or the config key and
what is supported.
"""

from __future__ import annotations

from afd_engine.errors import ModelLoadError

# model_type -> the architecture served for it (a config saved without `architectures`)
SERVED = {
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",  # Kimi-K2: DeepSeek-V3's architecture under its own model_type
    "minimax_m2": "MiniMaxM2ForCausalLM",
}
SUPPORTED_ARCHITECTURES = tuple(dict.fromkeys(SERVED.values()))

# Architectures near the served ones that a user may try, and what the engine lacks for each.
NOT_SERVED = {
    "deepseek_v4": "DeepSeek-V4's compressed sparse attention and hyper-connections",
    "DeepseekV4ForCausalLM": "DeepSeek-V4's compressed sparse attention and hyper-connections",
    "qwen3_next": "Qwen3-Next's hybrid attention (Gated DeltaNet linear-attention layers among full-attention ones)",
    "Qwen3NextForCausalLM": "Qwen3-Next's hybrid attention (Gated DeltaNet linear-attention layers among "
    "full-attention ones)",
    "qwen3_5_moe": "Qwen3.5-MoE's hybrid linear attention and vision tower",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3.5-MoE's hybrid linear attention and vision tower",
    "Qwen3_5MoeForCausalLM": "Qwen3.5-MoE's hybrid linear attention",
    "qwen3_5_moe_text": "Qwen3.5-MoE's hybrid linear attention",
    "qwen3_5": "Qwen3.5's hybrid linear attention and vision tower",
    "Qwen3_5ForConditionalGeneration": "Qwen3.5's hybrid linear attention and vision tower",
    "qwen3_5_text": "Qwen3.5's hybrid linear attention",
    "Qwen3_5ForCausalLM": "Qwen3.5's hybrid linear attention",
    "gpt_oss": "gpt-oss's attention sinks, sliding-window layers and MXFP4 experts",
    "GptOssForCausalLM": "gpt-oss's attention sinks, sliding-window layers and MXFP4 experts",
    "minimax": "MiniMax-Text-01's lightning (linear) attention layers",
    "MiniMaxForCausalLM": "MiniMax-Text-01's lightning (linear) attention layers",
    "qwen3_vl_moe": "Qwen3-VL-MoE's vision tower",
    "Qwen3VLMoeForConditionalGeneration": "Qwen3-VL-MoE's vision tower",
}

# Keys whose presence means attention the engine does not compute (whatever the architecture says).
_SPARSE_ATTENTION_KEYS = ("index_topk", "index_n_heads", "index_head_dim")
_SERVED_QUANTIZATION = "fp8 with block scales (quant_method=fp8 and weight_block_size), as DeepSeek-V3 ships"

# Each field the engine reads, with every name it is saved under (first: the published name).
SPELLINGS = {
    "qwen3_experts": ("num_experts", "num_local_experts"),
    "deepseek_experts": ("n_routed_experts", "num_local_experts", "num_experts"),
    "mtp_layers": ("num_nextn_predict_layers", "num_mtp_layers"),
    "minimax_experts": ("num_local_experts", "num_experts"),
}


def pick(raw: dict, names: tuple[str, ...], default=None):
    """The value saved under any of `names`; an error when two of them disagree. A null counts as
    absent (transformers writes null for unset fields)."""
    found = {n: raw[n] for n in names if raw.get(n) is not None}
    if len(set(map(repr, found.values()))) > 1:
        both = ", ".join(f"{n}={v!r}" for n, v in found.items())
        raise ModelLoadError(f"config.json disagrees with itself: {both} (the same setting under different names)")
    return next(iter(found.values()), default)


def require(raw: dict, key: str):
    """A field the model cannot be built without; its absence is named, not a KeyError."""
    if raw.get(key) is None:
        raise ModelLoadError(f"config.json lacks {key!r}, which the {architecture_of(raw)} model needs")
    return raw[key]


def rope_settings(raw: dict) -> dict:
    """The rope dictionary with `rope_type` and `rope_theta` filled in, from `rope_parameters`
    (transformers 5.x) or `rope_scaling` + `rope_theta` (published checkpoints, transformers 4.x);
    an error where both are given and differ on a key."""
    new, old = dict(raw.get("rope_parameters") or {}), dict(raw.get("rope_scaling") or {})
    if raw.get("rope_theta") is not None:
        old.setdefault("rope_theta", raw["rope_theta"])
    for d in (new, old):
        kind = pick(d, ("rope_type", "type"))
        d.pop("type", None)
        if kind is not None:
            d["rope_type"] = kind
    if new and old:
        clash = {k: (new[k], old[k]) for k in new.keys() & old.keys() if new[k] != old[k]}
        if clash:
            shown = ", ".join(
                f"{k}: {a!r} in rope_parameters, {b!r} in rope_scaling/rope_theta" for k, (a, b) in clash.items()
            )
            raise ModelLoadError(f"config.json disagrees with itself on rope settings ({shown})")
    merged = {**old, **new}
    merged.setdefault("rope_type", "default")
    return merged


def architecture_of(raw: dict) -> str:
    """The architecture name: the first of `architectures`, else the one `model_type` implies."""
    archs = raw.get("architectures") or []
    served = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
    if served:
        return served[0]
    if archs:
        return archs[0]
    return SERVED.get(raw.get("model_type"), f"model_type={raw.get('model_type')!r}")


def check_supported(raw: dict) -> str:
    """The served architecture of this config, or a ModelLoadError naming what is not served."""
    arch = architecture_of(raw)
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    model_type = raw.get("model_type")
    for name in (*(raw.get("architectures") or []), model_type):
        if name in NOT_SERVED:
            raise ModelLoadError(
                f"{name} is not supported: the engine does not implement {NOT_SERVED[name]}; "
                f"supported architectures: {supported}"
            )
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {arch}; supported architectures: {supported}")
    _check_features(raw, arch)
    return arch


def _check_features(raw: dict, arch: str) -> None:
    """Config keys of a served architecture that ask for something the engine does not compute."""

    def refuse(key: str, what: str) -> None:
        raise ModelLoadError(f"{arch} with {what} ({key}={raw.get(key)!r}) is not supported; {_supported_shape(arch)}")

    for key in _SPARSE_ATTENTION_KEYS:
        if raw.get(key) is not None and arch != "DeepseekV32ForCausalLM":
            refuse(key, "a sparse-attention indexer")
    for key, what in (("attention_bias", "attention biases"), ("mlp_bias", "MLP biases")):
        if raw.get(key) and not (key == "attention_bias" and arch == "Glm4MoeForCausalLM"):  # (GLM's are served)
            refuse(key, what)
    if raw.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "an activation other than silu")
    if raw.get("use_sliding_window"):
        refuse("use_sliding_window", "sliding-window attention")
    layer_types = set(raw.get("layer_types") or ()) - {"full_attention", "indexed_attention"}
    if layer_types:
        refuse("layer_types", f"{', '.join(sorted(layer_types))} layers")
    if arch == "MiniMaxM2ForCausalLM":
        _check_minimax_m2(raw, refuse)
    quant = raw.get("quantization_config") or {}
    if quant:
        method = quant.get("quant_method")
        if method != "fp8" or not quant.get("weight_block_size"):
            raise ModelLoadError(
                f"{arch} quantized with quant_method={method!r}"
                + ("" if method != "fp8" else " without weight_block_size (per-tensor scales)")
                + f" is not supported; quantization_config supported: {_SERVED_QUANTIZATION}, or none"
            )


def _check_minimax_m2(raw: dict, refuse) -> None:
    """MiniMax-M2's own keys, as its published config spells them: what transformers' implementation
    computes (full attention everywhere, per-layer q/k norm, sigmoid routing with the correction
    bias, no shared expert) is served; a config asking for anything else is refused."""
    if any(kind != 1 for kind in raw.get("attn_type_list") or ()):  # 0: a lightning attention layer
        refuse("attn_type_list", "lightning (linear) attention layers")
    if raw.get("use_qk_norm") is False:
        refuse("use_qk_norm", "queries and keys not normed")
    if raw.get("qk_norm_type", "per_layer") != "per_layer":
        refuse("qk_norm_type", "a q/k norm other than per layer")
    if raw.get("scoring_func", "sigmoid") != "sigmoid":
        refuse("scoring_func", "routing scores other than sigmoid")
    if raw.get("use_routing_bias") is False:
        refuse("use_routing_bias", "routing without the correction bias")
    if raw.get("shared_intermediate_size"):
        refuse("shared_intermediate_size", "a shared expert")


def _supported_shape(arch: str) -> str:
    if arch == "MiniMaxM2ForCausalLM":
        return (
            "supported: full causal attention with grouped KV heads and a per-layer q/k norm, sigmoid routing "
            "with the correction bias, silu experts"
        )
    if arch == "Glm4MoeForCausalLM":
        return "supported: full causal attention with grouped KV heads and q/k/v biases, silu experts"
    if arch == "Qwen3MoeForCausalLM":
        return "supported: full causal attention with grouped KV heads, no biases, silu experts"
    return "supported: MLA with full causal attention, no biases, silu experts"
