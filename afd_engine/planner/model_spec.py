"""The models the planner knows: a catalog of published shapes, and any Hugging Face `config.json`
of a family it can read (DeepSeek-V2/V3/V3.2 and Kimi-K2, GLM-4.5/4.6, MiniMax-M2, Qwen3-MoE,
Step-3). The arithmetic on a shape is in shapes.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from afd_engine.errors import ConfigError
from afd_engine.hf_config import SPELLINGS, pick
from afd_engine.planner.shapes import INDEX_DTYPES, Attention, ModelSpec

__all__ = ["INDEX_DTYPES", "MODELS", "Attention", "ModelSpec", "get_model", "model_from_hf_config"]

_V3_MLA = dict(heads=128, head_dim=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64)
# DeepSeek-V3's MoE: 3 dense layers, 256 routed experts top-8 and one shared expert, all 2048 wide
_V3_MOE = dict(
    dense_layers=3, dense_width=18432, experts=256, topk=8, expert_width=2048, shared_experts=1, shared_width=2048
)

MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec(
            "deepseek-v3",
            layers=61,
            hidden=7168,
            vocab=129280,
            attention=Attention("mla", **_V3_MLA),
            **_V3_MOE,
            default_attn_dtype="bf16",
        ),
        # DeepSeek-V3.2: V3's shape, plus the lightning indexer (64 heads of 128) in every layer and
        # MLA over the indexer's top 2048 cached tokens
        ModelSpec(
            "deepseek-v3.2",
            layers=61,
            hidden=7168,
            vocab=129280,
            attention=Attention("mla", **_V3_MLA, index_topk=2048, index_heads=64, index_head_dim=128),
            **_V3_MOE,
            default_attn_dtype="bf16",
        ),
        # Kimi-K2 (model_type kimi_k2): DeepSeek-V3's architecture with 64 heads, 384 experts in one
        # group and a single dense layer
        ModelSpec(
            "kimi-k2",
            layers=61,
            hidden=7168,
            vocab=163840,
            attention=Attention("mla", **{**_V3_MLA, "heads": 64}),
            **{**_V3_MOE, "dense_layers": 1, "experts": 384},
            default_attn_dtype="bf16",
        ),
        # GLM-4.5 and GLM-4.6 (glm4_moe, the same shape): GQA 96 query / 8 KV heads of 128 (rope over
        # half of each), DeepSeek-V3's MoE layout at 160 experts
        ModelSpec(
            "glm-4.6",
            layers=92,
            hidden=5120,
            vocab=151552,
            attention=Attention("gqa", heads=96, head_dim=128, kv_heads=8),
            dense_layers=3,
            dense_width=12288,
            experts=160,
            topk=8,
            expert_width=1536,
            shared_experts=1,
            shared_width=1536,
            default_attn_dtype="bf16",
        ),
        # MiniMax-M2: GQA 48 / 8 heads of 128, every layer MoE, 256 experts top-8, no shared expert
        ModelSpec(
            "minimax-m2",
            layers=62,
            hidden=3072,
            vocab=200064,
            attention=Attention("gqa", heads=48, head_dim=128, kv_heads=8),
            dense_layers=0,
            dense_width=0,
            experts=256,
            topk=8,
            expert_width=1536,
            shared_experts=0,
            shared_width=0,
            default_attn_dtype="bf16",
        ),
        # Step-3 text model: 48 routed experts top-3 + 1 shared (S = 4/49 = 0.08); dense FFN in the first
        # four layers and the last one.
        ModelSpec(
            "step3",
            layers=61,
            hidden=7168,
            vocab=128815,
            attention=Attention("mfa", heads=64, head_dim=256, q_lora_rank=2048),
            dense_layers=5,
            dense_width=18432,
            experts=48,
            topk=3,
            expert_width=5120,
            shared_experts=1,
            shared_width=5120,
            default_attn_dtype="fp8",
        ),
        ModelSpec(
            "qwen3-235b-a22b",
            layers=94,
            hidden=4096,
            vocab=151936,
            attention=Attention("gqa", heads=64, head_dim=128, kv_heads=4),
            dense_layers=0,
            dense_width=0,
            experts=128,
            topk=8,
            expert_width=1536,
            shared_experts=0,
            shared_width=0,
            default_attn_dtype="fp8",
        ),
    )
}


def get_model(name_or_path: str) -> ModelSpec:
    """A catalog name, a checkpoint directory, or a config.json path."""
    if name_or_path.lower() in MODELS:
        return MODELS[name_or_path.lower()]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"unknown model {name_or_path!r}: not one of {', '.join(MODELS)} and no config.json there")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    return model_from_hf_config(cfg, name=path.parent.name if path.name == "config.json" else path.stem)


# model_type -> the reader of its config.json
_DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2")
_SUPPORTED_TYPES = (*_DEEPSEEK_TYPES, "glm4_moe", "minimax_m2", "qwen3_moe", "step3")


def model_from_hf_config(cfg: dict, name: str) -> ModelSpec:
    """The shape of a Hugging Face config.json (a ConfigError naming what is missing or unknown)."""
    cfg = {**cfg.get("text_config", {}), **{k: v for k, v in cfg.items() if k != "text_config"}}
    model_type = cfg.get("model_type", "")
    try:
        if model_type in _DEEPSEEK_TYPES:
            return _deepseek(cfg, name, model_type)
        if model_type == "glm4_moe":
            return _glm4_moe(cfg, name)
        if model_type == "minimax_m2":
            return _minimax_m2(cfg, name)
        if model_type == "qwen3_moe":
            return _qwen3_moe(cfg, name)
        if model_type.startswith("step3") or "moe_num_experts" in cfg:
            return _step3(cfg, name)
    except KeyError as exc:
        raise ConfigError(f"model {name}: config.json lacks {exc.args[0]!r}") from None
    raise ConfigError(
        f"model {name}: model_type {model_type!r} is not supported by the planner ({', '.join(_SUPPORTED_TYPES)})"
    )


def _deepseek_moe(cfg: dict) -> dict:
    """DeepSeek's MoE layout (also GLM-4.5's): leading dense layers, routed and shared experts of
    moe_intermediate_size."""
    return dict(
        dense_layers=cfg.get("first_k_dense_replace", 0),
        dense_width=cfg["intermediate_size"],
        experts=_experts(cfg, SPELLINGS["deepseek_experts"]),
        topk=cfg["num_experts_per_tok"],
        expert_width=cfg["moe_intermediate_size"],
        shared_experts=cfg.get("n_shared_experts") or 0,
        shared_width=cfg["moe_intermediate_size"],
    )


def _deepseek(cfg: dict, name: str, model_type: str) -> ModelSpec:
    # DeepSeek-V3.2's indexer: every key is needed (the engine refuses the architecture without them)
    indexer = (
        dict(index_topk=cfg["index_topk"], index_heads=cfg["index_n_heads"], index_head_dim=cfg["index_head_dim"])
        if model_type == "deepseek_v32"
        else {}
    )
    attn = Attention(
        "mla",
        heads=cfg["num_attention_heads"],
        head_dim=cfg["v_head_dim"],
        q_lora_rank=cfg.get("q_lora_rank") or 0,
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_dim=cfg["qk_nope_head_dim"],
        qk_rope_dim=cfg["qk_rope_head_dim"],
        **indexer,
    )
    return ModelSpec(
        name,
        layers=cfg["num_hidden_layers"],
        hidden=cfg["hidden_size"],
        vocab=cfg["vocab_size"],
        attention=attn,
        **_deepseek_moe(cfg),
        default_attn_dtype="bf16",
    )


def _gqa(cfg: dict) -> Attention:
    """Grouped-query attention; partial rotary (GLM, MiniMax) changes no weight or cache size."""
    heads = cfg["num_attention_heads"]
    return Attention(
        "gqa",
        heads=heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        kv_heads=cfg["num_key_value_heads"],
    )


def _glm4_moe(cfg: dict, name: str) -> ModelSpec:
    return ModelSpec(
        name,
        layers=cfg["num_hidden_layers"],
        hidden=cfg["hidden_size"],
        vocab=cfg["vocab_size"],
        attention=_gqa(cfg),
        **_deepseek_moe(cfg),
        default_attn_dtype="bf16",
    )


def _minimax_m2(cfg: dict, name: str) -> ModelSpec:
    """MiniMax-M2: every layer MoE, experts `intermediate_size` wide; its MTP modules are not part
    of the served model. A lightning-attention layer (attn_type_list 0) is not modelled."""
    if any(kind != 1 for kind in cfg.get("attn_type_list") or ()):
        raise ConfigError(f"model {name}: lightning (linear) attention layers (attn_type_list 0) are not modelled")
    shared = cfg.get("shared_intermediate_size") or 0
    return ModelSpec(
        name,
        layers=cfg["num_hidden_layers"],
        hidden=cfg["hidden_size"],
        vocab=cfg["vocab_size"],
        attention=_gqa(cfg),
        dense_layers=0,
        dense_width=0,
        experts=_experts(cfg, ("num_local_experts", "num_experts")),
        topk=cfg["num_experts_per_tok"],
        expert_width=cfg["intermediate_size"],
        shared_experts=1 if shared else 0,
        shared_width=shared,
        default_attn_dtype="bf16",
    )


def _qwen3_moe(cfg: dict, name: str) -> ModelSpec:
    sparse_step = cfg.get("decoder_sparse_step", 1)
    dense = len(cfg.get("mlp_only_layers", [])) + (0 if sparse_step == 1 else cfg["num_hidden_layers"] // sparse_step)
    return ModelSpec(
        name,
        layers=cfg["num_hidden_layers"],
        hidden=cfg["hidden_size"],
        vocab=cfg["vocab_size"],
        attention=_gqa(cfg),
        dense_layers=dense,
        dense_width=cfg.get("intermediate_size", 0),
        experts=_experts(cfg, SPELLINGS["qwen3_experts"]),
        topk=cfg["num_experts_per_tok"],
        expert_width=cfg["moe_intermediate_size"],
        shared_experts=0,
        shared_width=0,
    )


def _experts(cfg: dict, names: tuple[str, ...]) -> int:
    """The routed expert count under any of its spellings (transformers 5.x: num_local_experts)."""
    count = pick(cfg, names)
    if count is None:
        raise KeyError(names[0])
    return count


def _step3(cfg: dict, name: str) -> ModelSpec:
    layers = cfg["num_hidden_layers"]
    moe_layers = cfg.get("moe_layers_enum")
    n_moe = len(str(moe_layers).split(",")) if moe_layers else layers
    attn = Attention(
        "mfa",
        heads=cfg["num_attention_heads"],
        head_dim=cfg["head_dim"],
        kv_heads=cfg.get("num_attention_groups", 1),
        q_lora_rank=cfg.get("share_q_dim", 0),
    )
    shared_width = cfg.get("share_expert_dim", 0)
    return ModelSpec(
        name,
        layers=layers,
        hidden=cfg["hidden_size"],
        vocab=cfg["vocab_size"],
        attention=attn,
        dense_layers=layers - n_moe,
        dense_width=cfg["intermediate_size"],
        experts=cfg["moe_num_experts"],
        topk=cfg["moe_top_k"],
        expert_width=cfg["moe_intermediate_size"],
        shared_experts=1 if shared_width else 0,
        shared_width=shared_width,
    )
