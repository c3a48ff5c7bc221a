"""The model's shape, read from a Hugging Face `config.json` into one frozen object."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from afd_engine.errors import ConfigError, ModelLoadError
from afd_engine.hf_config import SPELLINGS, check_supported, pick, require, rope_settings


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings; `kind` is "default" or "yarn"."""

    kind: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True
    interleave: bool = True


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model code needs from the checkpoint's config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    topk_method: str
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    moe_layer_freq: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    tie_word_embeddings: bool = False
    fp8_block: tuple[int, int] | None = None
    # attention kind: "mla" (DeepSeek: a latent per token) or "gqa" (Qwen3-MoE: K and V per KV head)
    attention: str = "mla"
    num_kv_heads: int = 0  # gqa
    head_dim: int = 0  # gqa
    attention_bias: bool = False  # gqa (GLM-4.5): biases on the q, k and v projections
    qk_norm: bool = True  # gqa: per-head RMSNorm of queries and keys (Qwen3-MoE always; GLM-4.5 optional)
    partial_rotary_factor: float = 1.0  # gqa (GLM-4.5): rope over this share of each head, the rest unrotated
    # gqa (MiniMax-M2): the q/k RMSNorm spans the layer's whole query (heads * head_dim) and key
    # (kv_heads * head_dim) vectors, all heads at once, rather than each head
    qk_norm_per_layer: bool = False
    mlp_only_layers: tuple[int, ...] = ()  # Qwen3-MoE: layers with a dense MLP among sparse ones
    decoder_sparse_step: int = 1  # Qwen3-MoE: every step-th layer is sparse
    mtp_layers: int = 0  # DeepSeek: multi-token prediction modules stored after the last layer
    # DeepSeek-V3.2's sparse attention: a lightning indexer of `index_n_heads` heads of
    # `index_head_dim` scores the cached tokens and MLA attends to the top `index_topk` (0: dense)
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    # the index key's share of a cached row when it is stored as fp8 bytes and a scale (the engine
    # sets it from --index-cache-dtype: with_index_cache); 0: index_head_dim values of the cache dtype
    index_cache_width: int = 0
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values cached per token per layer: MLA's latent plus the shared rope key (and, with sparse
        attention, the indexer's key after them: same pages, same prefix-cache entries, same PD
        transfer), or GQA's keys and values of every KV head."""
        if self.attention == "gqa":
            return 2 * self.num_kv_heads * self.head_dim
        return self.mla_cache_dim + (self.index_cache_width or self.index_head_dim)

    @property
    def mla_cache_dim(self) -> int:
        """MLA's share of a cached row: the latent and the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def index_cache_fp8(self) -> bool:
        """The indexer's keys are cached as e4m3 bytes and one fp32 scale per token."""
        return self.index_cache_width > 0

    def with_index_cache(self, dtype: str, element_size: int) -> ModelConfig:
        """This config with the indexer keys stored as `dtype` (--index-cache-dtype: "auto", the KV
        cache's own dtype, or "fp8") in a cache of `element_size`-byte values."""
        if dtype == "auto":
            return self
        if not self.sparse_attention:
            raise ConfigError(
                f"--index-cache-dtype {dtype} stores DeepSeek-V3.2's indexer keys; {self.architecture} has no indexer"
            )
        return dataclasses.replace(self, index_cache_width=-(-(self.index_head_dim + 4) // element_size))

    @property
    def sparse_attention(self) -> bool:
        """DeepSeek-V3.2: attention over the indexer's top `index_topk` tokens per query."""
        return self.index_topk > 0

    @property
    def rope_dim(self) -> int:
        """Dimensions rope rotates per head: MLA's rope part, or GQA's head (its first
        `partial_rotary_factor` share)."""
        return int(self.head_dim * self.partial_rotary_factor) if self.attention == "gqa" else self.qk_rope_head_dim

    @property
    def uses_bias_correction(self) -> bool:
        return self.topk_method == "noaux_tc"

    def is_moe_layer(self, layer_id: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer_id >= self.first_k_dense_replace
            and layer_id % self.moe_layer_freq == 0
            and layer_id not in self.mlp_only_layers
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @staticmethod
    def from_pretrained(model_path: str | Path) -> ModelConfig:
        path = Path(model_path)
        if not path.is_dir():
            raise ModelLoadError(
                f"model directory {str(path)!r} does not exist (pass --model-path to a local checkpoint)"
            )
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelLoadError(f"{str(path)!r} has no config.json; is it a Hugging Face checkpoint directory?")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{cfg_file} is not valid JSON: {exc}") from exc
        return ModelConfig.from_dict(raw)

    @staticmethod
    def from_dict(raw: dict) -> ModelConfig:
        arch = check_supported(raw)
        if arch == "Qwen3MoeForCausalLM":
            return _qwen3_moe(raw)
        if arch == "Glm4MoeForCausalLM":
            return _glm4_moe(raw)
        if arch == "MiniMaxM2ForCausalLM":
            return _minimax_m2(raw)
        is_v3 = arch in ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")
        n_group = raw.get("n_group") or 1
        topk_method = raw.get("topk_method") or ("noaux_tc" if is_v3 else "greedy")
        quant = raw.get("quantization_config") or {}
        fp8_block = tuple(quant.get("weight_block_size", (128, 128))) if quant.get("quant_method") == "fp8" else None
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        cfg = ModelConfig(
            architecture=arch,
            vocab_size=require(raw, "vocab_size"),
            hidden_size=require(raw, "hidden_size"),
            intermediate_size=require(raw, "intermediate_size"),
            moe_intermediate_size=raw.get("moe_intermediate_size", 0),
            num_layers=require(raw, "num_hidden_layers"),
            num_heads=require(raw, "num_attention_heads"),
            q_lora_rank=raw.get("q_lora_rank"),
            kv_lora_rank=require(raw, "kv_lora_rank"),
            qk_nope_head_dim=require(raw, "qk_nope_head_dim"),
            qk_rope_head_dim=require(raw, "qk_rope_head_dim"),
            v_head_dim=require(raw, "v_head_dim"),
            n_routed_experts=pick(raw, SPELLINGS["deepseek_experts"], 0),
            n_shared_experts=raw.get("n_shared_experts") or 0,
            num_experts_per_tok=raw.get("num_experts_per_tok") or 0,
            n_group=n_group,
            topk_group=raw.get("topk_group") or n_group,
            topk_method=topk_method,
            scoring_func=raw.get("scoring_func") or ("sigmoid" if is_v3 else "softmax"),
            norm_topk_prob=bool(raw.get("norm_topk_prob", is_v3)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=raw.get("first_k_dense_replace") or 0,
            moe_layer_freq=raw.get("moe_layer_freq") or 1,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            rope=_rope(raw),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            fp8_block=fp8_block,
            mtp_layers=raw.get("num_nextn_predict_layers") or 0,
            **_indexer(raw, arch),
            raw=raw,
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.n_routed_experts:
            if self.n_routed_experts % self.n_group:
                raise ModelLoadError(
                    f"n_routed_experts={self.n_routed_experts} is not divisible by n_group={self.n_group}"
                )
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
                raise ModelLoadError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, n_routed_experts]")
            if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
                raise ModelLoadError(f"unsupported topk_method {self.topk_method!r}")
            if self.scoring_func not in ("softmax", "sigmoid"):
                raise ModelLoadError(f"unsupported scoring_func {self.scoring_func!r}")
        if self.rope.kind not in ("default", "yarn"):
            raise ModelLoadError(f"unsupported rope scaling type {self.rope.kind!r} (supported: default, yarn)")


def _indexer(raw: dict, arch: str) -> dict:
    """DeepSeek-V3.2's indexer fields (none for the dense architectures)."""
    if arch != "DeepseekV32ForCausalLM":
        return {}
    fields = {k: int(require(raw, k)) for k in ("index_topk", "index_n_heads", "index_head_dim")}
    if not raw.get("q_lora_rank"):
        raise ModelLoadError("DeepseekV32ForCausalLM needs q_lora_rank: the indexer's queries start from q_a_proj")
    if fields["index_head_dim"] <= raw.get("qk_rope_head_dim", 0):
        raise ModelLoadError(
            f"index_head_dim={fields['index_head_dim']} must exceed qk_rope_head_dim={raw.get('qk_rope_head_dim')}"
            " (the indexer rotates its first qk_rope_head_dim dimensions)"
        )
    return fields


def _rope(raw: dict) -> RopeConfig:
    """Rope settings from `rope_scaling` + `rope_theta` (published checkpoints, transformers 4.x) or
    `rope_parameters` (transformers 5.x)."""
    params = rope_settings(raw)
    kind = params["rope_type"]
    theta = float(params.get("rope_theta") or 10000.0)
    interleave = bool(raw.get("rope_interleave", True))
    if kind == "default":
        return RopeConfig(theta=theta, interleave=interleave)
    max_pos = raw.get("max_position_embeddings", 4096)
    original = params.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings") or max_pos
    factor = params.get("factor")
    return RopeConfig(
        kind=kind,
        theta=theta,
        factor=float(factor) if factor is not None else max_pos / original,
        original_max_position=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
        interleave=interleave,
    )


def _gqa(raw: dict, architecture: str, **routing) -> ModelConfig:
    """A GQA model's config (Qwen3-MoE, GLM-4.5, MiniMax-M2): the fields they share read alike, its
    routing and family fields given as `routing` (the experts' width too, where it is not
    `moe_intermediate_size`)."""
    routing.setdefault("moe_intermediate_size", raw.get("moe_intermediate_size", 0))
    heads = require(raw, "num_attention_heads")
    kv_heads = raw.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ModelLoadError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    quant = raw.get("quantization_config") or {}
    eos = raw.get("eos_token_id")
    cfg = ModelConfig(
        architecture=architecture,
        vocab_size=require(raw, "vocab_size"),
        hidden_size=require(raw, "hidden_size"),
        intermediate_size=require(raw, "intermediate_size"),
        num_layers=require(raw, "num_hidden_layers"),
        num_heads=heads,
        q_lora_rank=None,
        kv_lora_rank=0,
        qk_nope_head_dim=0,
        qk_rope_head_dim=0,
        v_head_dim=0,
        num_experts_per_tok=raw.get("num_experts_per_tok") or 0,
        moe_layer_freq=1,
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        rope=dataclasses.replace(_rope(raw), interleave=False),  # both rotate halves, not pairs
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        bos_token_id=raw.get("bos_token_id"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        fp8_block=tuple(quant.get("weight_block_size", (128, 128))) if quant.get("quant_method") == "fp8" else None,
        attention="gqa",
        num_kv_heads=kv_heads,
        head_dim=raw.get("head_dim") or require(raw, "hidden_size") // heads,
        raw=raw,
        **routing,
    )
    cfg.validate()
    return cfg


def _glm4_moe(raw: dict) -> ModelConfig:
    """GLM-4.5/4.6-MoE: GQA with q/k/v biases, optional per-head q/k norm and rope over part of each
    head (non-interleaved), DeepSeek-V3's routing (sigmoid, correction bias, groups, scaling) and
    shared expert, leading dense layers."""
    n_group = raw.get("n_group") or 1
    partial = rope_settings(raw).get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    return _gqa(
        raw,
        "Glm4MoeForCausalLM",
        n_routed_experts=raw.get("n_routed_experts") or 0,
        n_shared_experts=raw.get("n_shared_experts") or 0,
        n_group=n_group,
        topk_group=raw.get("topk_group") or n_group,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        first_k_dense_replace=raw.get("first_k_dense_replace") or 0,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        attention_bias=bool(raw.get("attention_bias", False)),
        qk_norm=bool(raw.get("use_qk_norm", False)),
        partial_rotary_factor=float(partial),
    )


def _minimax_m2(raw: dict) -> ModelConfig:
    """MiniMax-M2: GQA without biases, one RMSNorm over each layer's whole query vector and one over
    its whole key vector (all heads at once), rope over the first `rotary_dim` dims of each head
    (non-interleaved); every layer MoE: sigmoid scores, the correction bias in the choice only,
    normalized top-k weights, experts `intermediate_size` wide, no groups, no shared expert. The
    multi-token prediction modules its config declares (`use_mtp`, `num_mtp_modules`,
    `mtp_transformer_layers`) are not read: the model is served without them."""
    head_dim = raw.get("head_dim") or require(raw, "hidden_size") // require(raw, "num_attention_heads")
    partial = rope_settings(raw).get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    rotary_dim = raw.get("rotary_dim")  # the published spelling; transformers 5 adds partial_rotary_factor
    if rotary_dim is not None:
        if partial is not None and partial != rotary_dim / head_dim:
            raise ModelLoadError(
                f"config.json disagrees with itself: rotary_dim={rotary_dim} (of head_dim={head_dim}), "
                f"partial_rotary_factor={partial}"
            )
        partial = rotary_dim / head_dim
    return _gqa(
        raw,
        "MiniMaxM2ForCausalLM",
        moe_intermediate_size=require(raw, "intermediate_size"),
        n_routed_experts=pick(raw, SPELLINGS["minimax_experts"], 0),
        n_shared_experts=0,
        n_group=1,
        topk_group=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        first_k_dense_replace=0,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        qk_norm=True,
        qk_norm_per_layer=True,
        partial_rotary_factor=float(1.0 if partial is None else partial),
    )


def _qwen3_moe(raw: dict) -> ModelConfig:
    """Qwen3-MoE: GQA with per-head q/k norm, softmax top-k routing, no shared expert."""
    return _gqa(
        raw,
        "Qwen3MoeForCausalLM",
        n_routed_experts=pick(raw, SPELLINGS["qwen3_experts"], 0),
        n_shared_experts=0,
        n_group=1,
        topk_group=1,
        topk_method="greedy",
        scoring_func="softmax",
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        routed_scaling_factor=1.0,
        first_k_dense_replace=0,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
        decoder_sparse_step=raw.get("decoder_sparse_step") or 1,
    )
