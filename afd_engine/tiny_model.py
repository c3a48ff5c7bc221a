"""The tiny-model maker: writes small random DeepSeek-V3 / DeepSeek-V2 Hugging Face checkpoints.

A tiny checkpoint has exactly the layout of a real one (config.json field names, safetensors
tensor names with one tensor per expert, optional sharding with an index, optional DeepSeek-V3
FP8 block quantization, tokenizer files), so the engine's loader and transformers' reference
implementation both read it unchanged, and the two can be compared token for token on a CPU.

Weights are random but deterministic: each tensor is drawn from its own generator seeded by
(seed, tensor name), so the same seed always gives byte-identical files, and changing one tensor's
shape (an override) or the storage format (dtype, fp8, shards) leaves the values of the others
unchanged. The scales are chosen so that the model is not degenerate: different prompts give
different greedy continuations and the top logits are well separated.

Command line: ``python -m afd_engine.tiny_model OUT_DIR [--arch ...] [--seed N] [--shards N]
[--fp8] [--dtype float32|bfloat16]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import pathlib
import sys

import torch
from safetensors.torch import save_file

from afd_engine.arg_errors import ArgumentParser
from afd_engine.errors import ConfigError
from afd_engine.tiny_tokenizer import CHAT_TEMPLATE, QWEN_CHAT_TEMPLATE, TokenizerInfo, write_tiny_tokenizer
from configs import load_json

SUPPORTED_ARCHS = ("deepseek_v3", "deepseek_v2", "qwen3_moe", "glm4_moe", "deepseek_v32", "minimax_m2")
SUPPORTED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

FP8_BLOCK = (128, 128)
# Largest finite float8_e4m3fn value: a block's amax is mapped onto it.
FP8_E4M3_MAX = 448.0
FP8_QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": list(FP8_BLOCK),
}

# Standard deviations of the random init, per kind of tensor. Embeddings are large so that token
# identity dominates the first residual stream; projections are large enough (for fan-in 32..64)
# that every layer changes the hidden state; norms sit around 1 with some spread.
_INIT_STD = {
    "embed": 1.0,
    "linear": 0.1,
    "router": 0.1,
    "lm_head": 0.1,
    "norm": 0.1,  # around a mean of 1
    "bias": 0.05,  # e_score_correction_bias, big enough to change some expert choices
}


def make_tiny_model(
    out_dir,
    arch: str = "deepseek_v3",
    seed: int = 0,
    shards: int = 1,
    overrides: dict | None = None,
    fp8: bool = False,
    dtype: str = "float32",
) -> pathlib.Path:
    """Write a small random DeepSeek checkpoint directory and return its path.

    Args:
        out_dir: directory to write (created if missing). Previous weight files in it are removed.
        arch: "deepseek_v3" (MLA with q_lora, sigmoid noaux_tc routing, YaRN), "deepseek_v2"
            (V2-Lite-like: no q_lora, softmax greedy routing, no rope scaling), "qwen3_moe" (GQA
            with q/k norm, softmax top-k routing, no shared expert, layer 0 dense) or "glm4_moe"
            (GLM-4.5: GQA with q/k/v biases, q/k norm and rope over half of each head, DeepSeek-V3's
            routing and shared expert, layer 0 dense) or "deepseek_v32" (DeepSeek-V3 plus the sparse
            attention's indexer, 8 tokens chosen per query) or "minimax_m2" (MiniMax-M2: GQA with
            one q/k norm over all heads, rope over half of each head, every layer MoE with sigmoid
            routing and the correction bias, no shared expert; `block_sparse_moe` names, experts
            `w1`/`w3`/`w2`).
        seed: seed of the random weights; the same seed gives byte-identical safetensors files.
        shards: number of safetensors files; more than 1 also writes model.safetensors.index.json.
        overrides: config.json keys merged last into the preset (any key). A "rope_parameters"
            key replaces "rope_scaling".
        fp8: store the attention and MLP projections as DeepSeek-V3 FP8 with 128x128 block scales.
        dtype: "float32" or "bfloat16", storage dtype of the other weights (the router bias stays
            float32).
    """
    if arch not in SUPPORTED_ARCHS:
        raise ConfigError(f"unknown tiny model arch {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
    if dtype not in SUPPORTED_DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; supported: {', '.join(SUPPORTED_DTYPES)}")
    if shards < 1:
        raise ConfigError(f"shards must be at least 1, got {shards}")

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_info = write_tiny_tokenizer(
        out, QWEN_CHAT_TEMPLATE if arch in ("qwen3_moe", "glm4_moe") else CHAT_TEMPLATE
    )
    config = build_tiny_config(arch, tokenizer_info, overrides=overrides, fp8=fp8, dtype=dtype)

    weights = init_tiny_weights(config, seed)
    stored = _to_storage_format(weights, SUPPORTED_DTYPES[dtype], fp8)
    _remove_old_weight_files(out)
    _write_safetensors(stored, out, shards)

    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {
            "_from_model_config": True,
            "bos_token_id": config["bos_token_id"],
            "eos_token_id": config["eos_token_id"],
            "do_sample": False,
        },
    )
    return out


def build_tiny_config(
    arch: str, tokenizer_info: TokenizerInfo, overrides: dict | None = None, fp8: bool = False, dtype: str = "float32"
) -> dict:
    """Return the config.json dict of a tiny checkpoint: preset, tokenizer ids, then overrides."""
    presets = load_json("tiny_models.json")
    config = dict(presets[arch])
    config.update(
        vocab_size=tokenizer_info.vocab_size,
        bos_token_id=tokenizer_info.bos_token_id,
        eos_token_id=tokenizer_info.eos_token_id,
        torch_dtype=dtype,
    )
    if fp8:
        config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    config.update(overrides or {})
    # transformers 5 spells rope settings "rope_parameters"; a config carries one form only.
    if "rope_parameters" in (overrides or {}):
        config.pop("rope_scaling", None)

    if config["vocab_size"] < tokenizer_info.vocab_size:
        raise ConfigError(
            f"vocab_size {config['vocab_size']} is smaller than the tiny tokenizer's {tokenizer_info.vocab_size}"
        )
    if config.get("attention_bias") and config.get("model_type") != "glm4_moe":
        raise ConfigError(
            "the tiny model maker writes attention biases for glm4_moe only; attention_bias must be false"
        )
    return config


def tiny_weight_specs(config: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """List (name, shape, kind) of every tensor of the checkpoint described by `config`.

    Names are those of real DeepSeek checkpoints; kind selects the init ("embed", "norm",
    "linear", "router", "bias", "lm_head"). Linear shapes are [out_features, in_features].
    """
    if config.get("model_type") == "qwen3_moe":
        return _qwen3_specs(config)
    if config.get("model_type") == "glm4_moe":
        return _glm4_specs(config)
    if config.get("model_type") == "minimax_m2":
        return _minimax_m2_specs(config)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    specs: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (vocab, hidden), "embed")]
    for layer in range(config["num_hidden_layers"]):
        specs += _deepseek_layer_specs(config, layer)
    specs += [("model.norm.weight", (hidden,), "norm"), ("lm_head.weight", (vocab, hidden), "lm_head")]
    first_mtp = config["num_hidden_layers"]
    for layer in range(first_mtp, first_mtp + (config.get("num_nextn_predict_layers") or 0)):
        p = f"model.layers.{layer}."  # a multi-token prediction module: a decoder layer and its glue
        specs += [
            (p + "embed_tokens.weight", (vocab, hidden), "embed"),
            (p + "enorm.weight", (hidden,), "norm"),
            (p + "hnorm.weight", (hidden,), "norm"),
            (p + "eh_proj.weight", (hidden, 2 * hidden), "linear"),
            *_deepseek_layer_specs(config, layer),
            (p + "shared_head.norm.weight", (hidden,), "norm"),
            (p + "shared_head.head.weight", (vocab, hidden), "lm_head"),
        ]
    return specs


def _deepseek_layer_specs(config: dict, layer: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of one DeepSeek decoder layer's tensors."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    nope, rope, v_dim = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    q_lora, kv_lora = config.get("q_lora_rank"), config["kv_lora_rank"]
    specs: list[tuple[str, tuple[int, ...], str]] = []
    p = f"model.layers.{layer}."
    specs.append((p + "input_layernorm.weight", (hidden,), "norm"))
    if q_lora is not None:
        specs += [
            (p + "self_attn.q_a_proj.weight", (q_lora, hidden), "linear"),
            (p + "self_attn.q_a_layernorm.weight", (q_lora,), "norm"),
            (p + "self_attn.q_b_proj.weight", (heads * (nope + rope), q_lora), "linear"),
        ]
    else:
        specs.append((p + "self_attn.q_proj.weight", (heads * (nope + rope), hidden), "linear"))
    specs += [
        # Output = [compressed kv latent | shared rope key].
        (p + "self_attn.kv_a_proj_with_mqa.weight", (kv_lora + rope, hidden), "linear"),
        (p + "self_attn.kv_a_layernorm.weight", (kv_lora,), "norm"),
        # Output per head = [k_nope | v].
        (p + "self_attn.kv_b_proj.weight", (heads * (nope + v_dim), kv_lora), "linear"),
        (p + "self_attn.o_proj.weight", (hidden, heads * v_dim), "linear"),
        (p + "post_attention_layernorm.weight", (hidden,), "norm"),
    ]
    if config.get("index_topk"):  # DeepSeek-V3.2's lightning indexer (models/indexer.py)
        i_heads, i_dim, i = config["index_n_heads"], config["index_head_dim"], p + "self_attn.indexer."
        specs += [
            (i + "wq_b.weight", (i_heads * i_dim, q_lora), "linear"),
            (i + "wk.weight", (i_dim, hidden), "linear"),
            (i + "k_norm.weight", (i_dim,), "norm"),
            (i + "k_norm.bias", (i_dim,), "bias"),
            (i + "weights_proj.weight", (i_heads, hidden), "linear"),
        ]
    return specs + _deepseek_mlp_specs(config, layer, config.get("topk_method") == "noaux_tc")


def _deepseek_mlp_specs(config: dict, layer: int, correction_bias: bool) -> list[tuple[str, tuple[int, ...], str]]:
    """One layer's MLP as DeepSeek (and GLM-4.5) name it: a dense MLP, or router, experts and
    shared experts."""
    hidden, moe_inter, p = config["hidden_size"], config["moe_intermediate_size"], f"model.layers.{layer}."
    if not _is_moe_layer(config, layer):
        return _mlp_specs(p + "mlp.", hidden, config["intermediate_size"])
    n_experts = config["n_routed_experts"]
    specs = [(p + "mlp.gate.weight", (n_experts, hidden), "router")]
    if correction_bias:
        specs.append((p + "mlp.gate.e_score_correction_bias", (n_experts,), "bias"))
    for e in range(n_experts):
        specs += _mlp_specs(f"{p}mlp.experts.{e}.", hidden, moe_inter)
    if config.get("n_shared_experts"):
        specs += _mlp_specs(p + "mlp.shared_experts.", hidden, moe_inter * config["n_shared_experts"])
    return specs


def _glm4_specs(config: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """GLM-4.5-MoE's tensors: GQA with q/k/v biases and optional per-head q/k norms, then DeepSeek's
    MoE layout (router with its correction bias, experts one tensor each, shared experts)."""
    hidden, vocab, head_dim = config["hidden_size"], config["vocab_size"], config["head_dim"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    bias = "bias" if config.get("attention_bias") else None
    specs: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (vocab, hidden), "embed")]
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}.self_attn."
        specs += [(f"model.layers.{layer}.input_layernorm.weight", (hidden,), "norm")]
        for proj, rows in (("q_proj", heads), ("k_proj", kv_heads), ("v_proj", kv_heads)):
            specs.append((p + proj + ".weight", (rows * head_dim, hidden), "linear"))
            specs += [(p + proj + ".bias", (rows * head_dim,), bias)] if bias else []
        specs.append((p + "o_proj.weight", (hidden, heads * head_dim), "linear"))
        if config.get("use_qk_norm"):
            specs += [(p + "q_norm.weight", (head_dim,), "norm"), (p + "k_norm.weight", (head_dim,), "norm")]
        specs.append((f"model.layers.{layer}.post_attention_layernorm.weight", (hidden,), "norm"))
        specs += _deepseek_mlp_specs(config, layer, correction_bias=True)
    specs.append(("model.norm.weight", (hidden,), "norm"))
    if not config.get("tie_word_embeddings"):
        specs.append(("lm_head.weight", (vocab, hidden), "lm_head"))
    return specs


def _minimax_m2_specs(config: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """MiniMax-M2's tensors as its checkpoints name them: GQA with one q/k norm over all heads of a
    layer, then the `block_sparse_moe` block of every layer (router, the block's correction bias,
    experts `w1` gate, `w3` up, `w2` down, each `intermediate_size` wide)."""
    hidden, vocab, head_dim = config["hidden_size"], config["vocab_size"], config["head_dim"]
    heads, kv_heads, experts = config["num_attention_heads"], config["num_key_value_heads"], config["num_local_experts"]
    inter = config["intermediate_size"]
    specs: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (vocab, hidden), "embed")]
    for layer in range(config["num_hidden_layers"]):
        p, moe = f"model.layers.{layer}.", f"model.layers.{layer}.block_sparse_moe."
        specs += _gqa_layer_specs(p, hidden, heads, kv_heads, head_dim, per_head_norm=False)
        specs += [
            (moe + "gate.weight", (experts, hidden), "router"),
            (moe + "e_score_correction_bias", (experts,), "bias"),
        ]
        for e in range(experts):
            specs += [
                (f"{moe}experts.{e}.w1.weight", (inter, hidden), "linear"),
                (f"{moe}experts.{e}.w2.weight", (hidden, inter), "linear"),
                (f"{moe}experts.{e}.w3.weight", (inter, hidden), "linear"),
            ]
    specs.append(("model.norm.weight", (hidden,), "norm"))
    if not config.get("tie_word_embeddings"):
        specs.append(("lm_head.weight", (vocab, hidden), "lm_head"))
    return specs


def init_tiny_weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Draw every tensor of the checkpoint in float32, deterministically from (seed, name)."""
    weights = {}
    for name, shape, kind in tiny_weight_specs(config):
        gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        weights[name] = 1.0 + _INIT_STD[kind] * noise if kind == "norm" else _INIT_STD[kind] * noise
    return weights


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight to float8_e4m3fn with one scale per block, as DeepSeek-V3 stores it.

    weight [N, K] -> (fp8 [N, K], scale_inv float32 [ceil(N/bn), ceil(K/bk)]), where
    scale_inv = block amax / 448 so that dequantized = fp8.float() * scale_inv per block.
    """
    n, k = weight.shape
    bn, bk = block
    nb, kb = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.zeros(nb * bn, kb * bk, dtype=torch.float32)
    padded[:n, :k] = weight.float()
    blocks = padded.view(nb, bn, kb, bk)  # [nb, bn, kb, bk]
    amax = blocks.abs().amax(dim=(1, 3))  # [nb, kb]
    # An all-zero block keeps scale 1 rather than dividing by zero.
    scale_inv = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))  # [nb, kb]
    scaled = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = scaled.reshape(nb * bn, kb * bk)[:n, :k].contiguous().to(torch.float8_e4m3fn)  # [N, K]
    return q, scale_inv.contiguous()


def build_make_tiny_model_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="afd make-tiny-model", description="Write a small random DeepSeek Hugging Face checkpoint."
    )
    parser.add_argument("out_dir", metavar="OUT_DIR", help="directory to write the checkpoint into")
    parser.add_argument("--arch", default="deepseek_v3", help=f"one of: {', '.join(SUPPORTED_ARCHS)}")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--shards", type=int, default=1, help="number of safetensors files")
    parser.add_argument("--fp8", action="store_true", help="store projections as block-quantized FP8")
    parser.add_argument("--dtype", default="float32", help=f"one of: {', '.join(SUPPORTED_DTYPES)}")
    return parser


def main_make_tiny_model(argv: list[str]) -> int:
    """Command-line entry: parse OUT_DIR and options, write the checkpoint, print its path.

    Returns the exit code: 0 on success, 2 on a bad argument (with a message, no traceback).
    """
    try:
        args = build_make_tiny_model_parser().parse_args(argv)
    except SystemExit as exc:  # the parser has already printed the error (or the --help text)
        return int(exc.code or 0)
    try:
        path = make_tiny_model(
            args.out_dir, arch=args.arch, seed=args.seed, shards=args.shards, fp8=args.fp8, dtype=args.dtype
        )
    except ConfigError as exc:
        print(f"afd make-tiny-model: error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _qwen3_specs(config: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """Qwen3-MoE's tensors, named as its Hugging Face checkpoints name them (one tensor per expert)."""
    hidden, vocab, head_dim = config["hidden_size"], config["vocab_size"], config["head_dim"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    specs: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (vocab, hidden), "embed")]
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        specs += _gqa_layer_specs(p, hidden, heads, kv_heads, head_dim, per_head_norm=True)
        sparse = layer not in config.get("mlp_only_layers", []) and (layer + 1) % config["decoder_sparse_step"] == 0
        if sparse and config["num_experts"] > 0:
            specs.append((p + "mlp.gate.weight", (config["num_experts"], hidden), "router"))
            for e in range(config["num_experts"]):
                specs += _mlp_specs(f"{p}mlp.experts.{e}.", hidden, config["moe_intermediate_size"])
        else:
            specs += _mlp_specs(p + "mlp.", hidden, config["intermediate_size"])
    specs.append(("model.norm.weight", (hidden,), "norm"))
    if not config.get("tie_word_embeddings"):
        specs.append(("lm_head.weight", (vocab, hidden), "lm_head"))
    return specs


def _gqa_layer_specs(
    p: str, hidden: int, heads: int, kv_heads: int, head_dim: int, per_head_norm: bool
) -> list[tuple[str, tuple[int, ...], str]]:
    """A bias-free GQA layer's norms and projections with q/k RMSNorm: per head (Qwen3-MoE) or over
    all heads of the layer (MiniMax-M2)."""
    q_norm, k_norm = (head_dim, head_dim) if per_head_norm else (heads * head_dim, kv_heads * head_dim)
    return [
        (p + "input_layernorm.weight", (hidden,), "norm"),
        (p + "self_attn.q_proj.weight", (heads * head_dim, hidden), "linear"),
        (p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden), "linear"),
        (p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden), "linear"),
        (p + "self_attn.o_proj.weight", (hidden, heads * head_dim), "linear"),
        (p + "self_attn.q_norm.weight", (q_norm,), "norm"),
        (p + "self_attn.k_norm.weight", (k_norm,), "norm"),
        (p + "post_attention_layernorm.weight", (hidden,), "norm"),
    ]


def _is_moe_layer(config: dict, layer: int) -> bool:
    # Same rule as DeepSeek's reference code: MoE after the first k dense layers, every freq-th.
    return (
        config.get("n_routed_experts") is not None
        and layer >= config.get("first_k_dense_replace", 0)
        and layer % config.get("moe_layer_freq", 1) == 0
    )


def _mlp_specs(prefix: str, hidden: int, inter: int) -> list[tuple[str, tuple[int, ...], str]]:
    return [
        (prefix + "gate_proj.weight", (inter, hidden), "linear"),
        (prefix + "up_proj.weight", (inter, hidden), "linear"),
        (prefix + "down_proj.weight", (hidden, inter), "linear"),
    ]


def _tensor_seed(seed: int, name: str) -> int:
    # A stable hash (unlike hash(), which is salted per process) of the seed and the tensor name.
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _is_fp8_quantized(name: str, tensor: torch.Tensor) -> bool:
    # DeepSeek-V3 quantizes the attention projections and all MLP/expert Linears; the embeddings,
    # lm_head, norms, router weight and router bias stay in high precision.
    return (
        tensor.dim() == 2
        and name.startswith("model.layers.")
        and (".self_attn." in name or ".mlp." in name or ".block_sparse_moe." in name)
        and ".mlp.gate.weight" not in name
        and ".block_sparse_moe.gate.weight" not in name  # MiniMax-M2's router
        and ".indexer.weights_proj." not in name  # DeepSeek-V3.2 keeps the indexer's head weights unquantized
        and "layernorm" not in name
    )


def _to_storage_format(weights: dict[str, torch.Tensor], dtype: torch.dtype, fp8: bool) -> dict[str, torch.Tensor]:
    stored = {}
    for name, tensor in weights.items():
        if name.endswith("e_score_correction_bias"):
            stored[name] = tensor.float()  # real checkpoints keep the router bias in float32
        elif fp8 and _is_fp8_quantized(name, tensor):
            stored[name], stored[name + "_scale_inv"] = quantize_fp8_block(tensor)
        else:
            stored[name] = tensor.to(dtype)
    return stored


def _remove_old_weight_files(out: pathlib.Path) -> None:
    # A stale index or shard from an earlier call with other arguments would confuse loaders.
    for path in list(out.glob("model*.safetensors")) + [out / "model.safetensors.index.json"]:
        if path.is_file():
            path.unlink()


def _write_safetensors(tensors: dict[str, torch.Tensor], out: pathlib.Path, shards: int) -> None:
    metadata = {"format": "pt"}  # transformers expects this marker in the header
    if shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata=metadata)
        return
    names = list(tensors)
    if shards > len(names):
        raise ConfigError(f"shards={shards} is more than the {len(names)} tensors of the checkpoint")
    sizes = [tensors[n].numel() * tensors[n].element_size() for n in names]
    weight_map = {}
    for index, group in enumerate(_split_contiguous(sizes, shards)):
        filename = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        save_file({names[i]: tensors[names[i]] for i in group}, str(out / filename), metadata=metadata)
        weight_map.update({names[i]: filename for i in group})
    _write_json(
        out / "model.safetensors.index.json",
        {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map},
    )


def _split_contiguous(sizes: list[int], parts: int) -> list[range]:
    """Split indices 0..len(sizes)-1 into `parts` non-empty runs of roughly equal total size."""
    total = sum(sizes)
    groups, start, acc = [], 0, 0
    for i, size in enumerate(sizes):
        acc += size
        remaining_parts = parts - len(groups) - 1
        remaining_items = len(sizes) - i - 1
        # Close the run once it reaches its share, or when the later runs need every item left.
        if remaining_parts > 0 and (acc >= total * (len(groups) + 1) / parts or remaining_items == remaining_parts):
            groups.append(range(start, i + 1))
            start = i + 1
    groups.append(range(start, len(sizes)))
    return groups


def _write_json(path: pathlib.Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main_make_tiny_model(sys.argv[1:]))
