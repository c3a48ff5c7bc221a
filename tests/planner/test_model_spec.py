"""Model shapes: catalog sizes, config.json parsing, and parameter counts equal to a real checkpoint's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from afd_engine.errors import ConfigError
from afd_engine.planner.model_spec import MODELS, get_model, model_from_hf_config

DEEPSEEK_V3_CONFIG = {  # the fields of deepseek-ai/DeepSeek-V3's config.json the planner reads
    "model_type": "deepseek_v3",
    "num_hidden_layers": 61,
    "hidden_size": 7168,
    "vocab_size": 129280,
    "num_attention_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "first_k_dense_replace": 3,
    "intermediate_size": 18432,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048,
    "n_shared_experts": 1,
}


@pytest.mark.parametrize(
    "name,total_b,active_b", [("deepseek-v3", 671, 37), ("step3", 316, 38), ("qwen3-235b-a22b", 235, 22)]
)
def test_catalog_sizes_match_published_parameter_counts(name, total_b, active_b):
    m = MODELS[name]
    assert m.total_params() / 1e9 == pytest.approx(total_b, rel=0.02)
    assert m.activated_params() / 1e9 == pytest.approx(active_b, rel=0.05)


def test_attention_arithmetic_intensity_per_kv_byte():
    # Step-3 section 5.1 with 8-bit KV: MLA ~512, MFA 128, GQA (Qwen3) 32
    ratio = {n: m.attention.core_flops_per_position / m.attention.kv_elems_per_token for n, m in MODELS.items()}
    assert ratio["step3"] == 128 and ratio["qwen3-235b-a22b"] == 32
    assert ratio["deepseek-v3"] == pytest.approx(512, rel=0.1)


def test_sparsity_of_step3_and_deepseek():
    assert MODELS["step3"].sparsity == pytest.approx(0.08, abs=0.003)  # "about 0.08"
    assert MODELS["deepseek-v3"].sparsity == pytest.approx(9 / 257)


def test_hf_config_gives_the_catalog_model():
    parsed = model_from_hf_config(DEEPSEEK_V3_CONFIG, "DeepSeek-V3")
    assert parsed.total_params() == MODELS["deepseek-v3"].total_params()
    assert parsed.attention == MODELS["deepseek-v3"].attention


def test_step3_and_qwen3_configs():
    step3 = model_from_hf_config(
        {
            "model_type": "step3_vl",
            "text_config": {
                "num_hidden_layers": 61,
                "hidden_size": 7168,
                "vocab_size": 128815,
                "num_attention_heads": 64,
                "num_attention_groups": 1,
                "head_dim": 256,
                "share_q_dim": 2048,
                "intermediate_size": 18432,
                "moe_num_experts": 48,
                "moe_top_k": 3,
                "moe_intermediate_size": 5120,
                "share_expert_dim": 5120,
                "moe_layers_enum": ",".join(str(i) for i in range(4, 60)),
            },
        },
        "step3",
    )
    assert step3.total_params() == MODELS["step3"].total_params() and step3.dense_layers == 5
    qwen = model_from_hf_config(
        {
            "model_type": "qwen3_moe",
            "num_hidden_layers": 94,
            "hidden_size": 4096,
            "vocab_size": 151936,
            "num_attention_heads": 64,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 1536,
        },
        "qwen",
    )
    assert qwen.total_params() == MODELS["qwen3-235b-a22b"].total_params()


@pytest.mark.parametrize("config", ["v3-yarn-qlora", "qwen3-gqa4", "qwen3-mha-sparse2"])
def test_counts_equal_a_real_checkpoint(config, tiny_model_factory):
    """Every matrix in a real (tiny) DeepSeek-V3 or Qwen3-MoE checkpoint is counted once, and nothing
    else is; and the planner's KV bytes per token are what the engine's pool allocates per token."""
    from afd_engine.model_config import ModelConfig
    from afd_engine.runtime.kv_cache import KVPool

    tiny_v3 = tiny_model_factory(config)
    cfg = ModelConfig.from_pretrained(tiny_v3)
    model, tiny_v3 = get_model(tiny_v3), Path(tiny_v3)
    assert model.kv_bytes_per_token(4) == KVPool.bytes_per_page(cfg.num_layers, cfg.kv_cache_dim, 1, torch.float32)
    index = (
        json.loads((tiny_v3 / "model.safetensors.index.json").read_text())
        if (tiny_v3 / "model.safetensors.index.json").exists()
        else None
    )
    files = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
    matrices = 0
    for f in files:
        with safe_open(str(tiny_v3 / f), "pt") as st:
            for name in st.keys():
                shape = st.get_slice(name).get_shape()
                if len(shape) == 2:
                    matrices += shape[0] * shape[1]
    assert model.total_params() == matrices


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="unknown model 'nope'.*deepseek-v3"):
        get_model("nope")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="model_type 'llama' is not supported"):
        get_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "hidden_size": 8}))
    with pytest.raises(ConfigError, match="lacks 'num_attention_heads'"):
        get_model(str(tmp_path / "config.json"))
