"""Decode-time shape of a MoE model: per-layer parameter counts, attention-core FLOPs and KV bytes.

Built from a name in the catalog (`deepseek-v3`, `qwen3-235b-a22b`, `step3`) or from a Hugging
Face `config.json` (DeepSeek-V2/V3, Qwen3-MoE, Step-3). Counts are in parameters and elements;
byte sizes depend on the precision the planner is asked about.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from afd_engine.errors import ConfigError
from afd_engine.hf_config import SPELLINGS, pick


@dataclass(frozen=True)
class Attention:
    """One attention layer. kind: mla (latent cache, absorbed decode), gqa, or mfa (Step-3: all
    query heads share one K and one V head, queries through a low-rank bottleneck)."""

    kind: str
    heads: int
    head_dim: int = 128  # gqa/mfa; mla: v_head_dim
    kv_heads: int = 1  # gqa
    q_lora_rank: int = 0  # mla q_lora_rank / mfa query rank; 0: full-rank queries
    kv_lora_rank: int = 0  # mla
    qk_nope_dim: int = 0  # mla
    qk_rope_dim: int = 0  # mla

    def linear_params(self, hidden: int) -> int:
        """Weights touched per token outside the attention core (projections in and out)."""
        h = hidden
        if self.kind == "mla":
            qk = self.qk_nope_dim + self.qk_rope_dim
            q = h * self.q_lora_rank + self.q_lora_rank * self.heads * qk if self.q_lora_rank else h * self.heads * qk
            kv_a = h * (self.kv_lora_rank + self.qk_rope_dim)
            absorbed = self.heads * self.kv_lora_rank * (self.qk_nope_dim + self.head_dim)  # kv_b, absorbed
            return q + kv_a + absorbed + self.heads * self.head_dim * h
        q_dim = self.heads * self.head_dim
        q = h * self.q_lora_rank + self.q_lora_rank * q_dim if self.q_lora_rank else h * q_dim
        kv = 2 * h * self.kv_heads * self.head_dim
        return q + kv + q_dim * h

    @property
    def kv_elems_per_token(self) -> int:
        """Cached elements per token and layer."""
        if self.kind == "mla":
            return self.kv_lora_rank + self.qk_rope_dim
        return 2 * self.kv_heads * self.head_dim

    @property
    def core_flops_per_position(self) -> int:
        """FLOPs of one query token against one cached position (scores + weighted sum)."""
        if self.kind == "mla":  # absorbed: scores over rope+latent, values over the latent
            return 2 * self.heads * (2 * self.kv_lora_rank + self.qk_rope_dim)
        return 2 * self.heads * 2 * self.head_dim


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    vocab: int
    attention: Attention
    dense_layers: int  # layers with a dense FFN instead of MoE
    dense_width: int
    experts: int
    topk: int
    expert_width: int
    shared_experts: int
    shared_width: int
    default_attn_dtype: str = "fp8"  # precision of the attention core and KV cache it is usually served in

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.expert_width  # gate, up, down

    @property
    def shared_params(self) -> int:
        return self.shared_experts * 3 * self.hidden * self.shared_width

    @property
    def dense_params(self) -> int:
        return 3 * self.hidden * self.dense_width

    @property
    def gate_params(self) -> int:
        return self.hidden * self.experts

    @property
    def sparsity(self) -> float:
        """Step-3's S: activated over total experts, the shared ones counted as experts of the same width."""
        shared = self.shared_params / self.expert_params
        return (self.topk + shared) / (self.experts + shared)

    def kv_bytes_per_token(self, kv_bytes: int) -> int:
        """KV cache bytes of one token over all layers."""
        return self.layers * self.attention.kv_elems_per_token * kv_bytes

    def total_params(self) -> int:
        a = self.attention.linear_params(self.hidden)
        moe = self.moe_layers * (self.experts * self.expert_params + self.shared_params + self.gate_params)
        return self.layers * a + self.dense_layers * self.dense_params + moe + 2 * self.vocab * self.hidden

    def activated_params(self) -> int:
        a = self.attention.linear_params(self.hidden)
        moe = self.moe_layers * (self.topk * self.expert_params + self.shared_params + self.gate_params)
        return self.layers * a + self.dense_layers * self.dense_params + moe + 2 * self.vocab * self.hidden


MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec(
            "deepseek-v3",
            layers=61,
            hidden=7168,
            vocab=129280,
            attention=Attention(
                "mla", heads=128, head_dim=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64
            ),
            dense_layers=3,
            dense_width=18432,
            experts=256,
            topk=8,
            expert_width=2048,
            shared_experts=1,
            shared_width=2048,
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


def model_from_hf_config(cfg: dict, name: str) -> ModelSpec:
    cfg = {**cfg.get("text_config", {}), **{k: v for k, v in cfg.items() if k != "text_config"}}
    model_type = cfg.get("model_type", "")
    try:
        if model_type in ("deepseek_v3", "deepseek_v2"):
            return _deepseek(cfg, name)
        if model_type == "qwen3_moe":
            return _qwen3_moe(cfg, name)
        if model_type.startswith("step3") or "moe_num_experts" in cfg:
            return _step3(cfg, name)
    except KeyError as exc:
        raise ConfigError(f"model {name}: config.json lacks {exc.args[0]!r}") from None
    raise ConfigError(
        f"model {name}: model_type {model_type!r} is not supported by the planner "
        "(deepseek_v2, deepseek_v3, qwen3_moe, step3)"
    )


def _deepseek(cfg: dict, name: str) -> ModelSpec:
    attn = Attention(
        "mla",
        heads=cfg["num_attention_heads"],
        head_dim=cfg["v_head_dim"],
        q_lora_rank=cfg.get("q_lora_rank") or 0,
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_dim=cfg["qk_nope_head_dim"],
        qk_rope_dim=cfg["qk_rope_head_dim"],
    )
    return ModelSpec(
        name,
        layers=cfg["num_hidden_layers"],
        hidden=cfg["hidden_size"],
        vocab=cfg["vocab_size"],
        attention=attn,
        dense_layers=cfg.get("first_k_dense_replace", 0),
        dense_width=cfg["intermediate_size"],
        experts=_experts(cfg, "deepseek_experts"),
        topk=cfg["num_experts_per_tok"],
        expert_width=cfg["moe_intermediate_size"],
        shared_experts=cfg.get("n_shared_experts") or 0,
        shared_width=cfg["moe_intermediate_size"],
        default_attn_dtype="bf16",
    )


def _qwen3_moe(cfg: dict, name: str) -> ModelSpec:
    heads = cfg["num_attention_heads"]
    attn = Attention(
        "gqa",
        heads=heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        kv_heads=cfg["num_key_value_heads"],
    )
    sparse_step = cfg.get("decoder_sparse_step", 1)
    dense = len(cfg.get("mlp_only_layers", [])) + (0 if sparse_step == 1 else cfg["num_hidden_layers"] // sparse_step)
    return ModelSpec(
        name,
        layers=cfg["num_hidden_layers"],
        hidden=cfg["hidden_size"],
        vocab=cfg["vocab_size"],
        attention=attn,
        dense_layers=dense,
        dense_width=cfg.get("intermediate_size", 0),
        experts=_experts(cfg, "qwen3_experts"),
        topk=cfg["num_experts_per_tok"],
        expert_width=cfg["moe_intermediate_size"],
        shared_experts=0,
        shared_width=0,
    )


def _experts(cfg: dict, field: str) -> int:
    """The routed expert count under any of its spellings (transformers 5.x: num_local_experts)."""
    count = pick(cfg, SPELLINGS[field])
    if count is None:
        raise KeyError(SPELLINGS[field][0])
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
