"""config.json as users have it: every spelling read, disagreements and unserved features refused with
one message each, before any weight is read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoConfig, Qwen3MoeConfig

from afd_engine import Engine
from afd_engine.errors import ModelLoadError
from afd_engine.model_config import ModelConfig

SUPPORTED = (
    "supported architectures: DeepseekV3ForCausalLM, DeepseekV2ForCausalLM, Qwen3MoeForCausalLM, Glm4MoeForCausalLM"
)


def tiny_config(path: str) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def test_a_config_saved_without_architectures_is_read_by_model_type(tmp_path):
    # what `Qwen3MoeConfig(num_experts=12, ...).save_pretrained(...)` writes with transformers 5.x
    Qwen3MoeConfig(num_experts=12, hidden_size=64, num_hidden_layers=2, head_dim=16).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert "architectures" not in raw and raw["num_local_experts"] == 12
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.architecture, cfg.n_routed_experts, cfg.head_dim, cfg.rope.theta) == (
        "Qwen3MoeForCausalLM",
        12,
        16,
        10000.0,
    )


@pytest.mark.parametrize(
    "arch, changes, message",
    [
        (
            "qwen3_moe",
            {"num_experts": 16, "num_local_experts": 12},
            "config.json disagrees with itself: num_experts=16, num_local_experts=12 (the same setting under "
            "different names)",
        ),
        (
            "deepseek_v3",
            {"num_local_experts": 8},
            "config.json disagrees with itself: n_routed_experts=16, num_local_experts=8",
        ),
        (
            "deepseek_v3",
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0}},
            "config.json disagrees with itself on rope settings (rope_theta: 50000.0 in rope_parameters, 10000 "
            "in rope_scaling/rope_theta)",
        ),
        (
            "deepseek_v3",
            {"rope_parameters": {"rope_type": "linear", "factor": 4.0}},
            "config.json disagrees with itself on rope settings (rope_type: 'linear' in rope_parameters, 'yarn' "
            "in rope_scaling/rope_theta)",
        ),
    ],
)
def test_spellings_that_disagree_are_named(tiny_model_factory, arch, changes, message):
    raw = tiny_config(tiny_model_factory("qwen3-gqa4" if arch == "qwen3_moe" else "v3-yarn-qlora")) | changes
    with pytest.raises(ModelLoadError) as err:
        ModelConfig.from_dict(raw)
    assert str(err.value).startswith(message)


def test_spellings_that_agree_are_read(tiny_model_factory):
    raw = tiny_config(tiny_model_factory("v3-yarn-qlora"))
    both = raw | {"num_local_experts": raw["n_routed_experts"], "rope_parameters": {"rope_theta": raw["rope_theta"]}}
    assert ModelConfig.from_dict(both) == ModelConfig.from_dict(raw)
    qwen = tiny_config(tiny_model_factory("qwen3-gqa4"))
    renamed = {("num_local_experts" if k == "num_experts" else k): v for k, v in qwen.items()}
    renamed["rope_parameters"] = {"rope_theta": renamed.pop("rope_theta"), "rope_type": "default"}
    renamed.pop("rope_scaling")
    assert ModelConfig.from_dict(renamed) == ModelConfig.from_dict(qwen)


def served_as(raw: dict, model_type: str, arch: str) -> dict:
    return raw | {"model_type": model_type, "architectures": [arch]}


@pytest.mark.parametrize(
    "base, changes, message",
    [
        (
            "qwen3-gqa4",
            lambda raw: AutoConfig.for_model("qwen3_next").to_dict() | {"architectures": ["Qwen3NextForCausalLM"]},
            "Qwen3NextForCausalLM is not supported: the engine does not implement Qwen3-Next's hybrid attention "
            "(Gated DeltaNet linear-attention layers among full-attention ones); " + SUPPORTED,
        ),
        (
            "qwen3-gqa4",
            lambda raw: AutoConfig.for_model("qwen3_5_moe").to_dict(),
            "qwen3_5_moe is not supported: the engine does not implement Qwen3.5-MoE's hybrid linear attention "
            "and vision tower; " + SUPPORTED,
        ),
        (
            "v3-yarn-qlora",
            lambda raw: raw | {"architectures": ["LlamaForCausalLM"]},
            "unsupported architecture LlamaForCausalLM; " + SUPPORTED,
        ),
        (
            "v3-yarn-qlora",
            lambda raw: raw | {"index_topk": 2048, "index_n_heads": 64},
            "DeepseekV3ForCausalLM with a sparse-attention indexer (index_topk=2048) is not supported; supported: "
            "MLA with full causal attention, no biases, silu experts",
        ),
        (
            "v3-yarn-qlora",
            lambda raw: raw | {"attention_bias": True},
            "DeepseekV3ForCausalLM with attention biases (attention_bias=True) is not supported",
        ),
        (
            "v2-lite",
            lambda raw: raw | {"mlp_bias": True},
            "DeepseekV2ForCausalLM with MLP biases (mlp_bias=True) is not supported",
        ),
        (
            "qwen3-gqa4",
            lambda raw: raw | {"use_sliding_window": True, "sliding_window": 4096},
            "Qwen3MoeForCausalLM with sliding-window attention (use_sliding_window=True) is not supported; "
            "supported: full causal attention with grouped KV heads, no biases, silu experts",
        ),
        (
            "qwen3-gqa4",
            lambda raw: raw | {"layer_types": ["sliding_attention", "full_attention"]},
            "Qwen3MoeForCausalLM with sliding_attention layers (layer_types=['sliding_attention', "
            "'full_attention']) is not supported",
        ),
        (
            "qwen3-gqa4",
            lambda raw: raw | {"hidden_act": "gelu"},
            "Qwen3MoeForCausalLM with an activation other than silu (hidden_act='gelu') is not supported",
        ),
        (
            "qwen3-gqa4",
            lambda raw: raw | {"quantization_config": {"quant_method": "awq", "bits": 4}},
            "Qwen3MoeForCausalLM quantized with quant_method='awq' is not supported; quantization_config "
            "supported: fp8 with block scales (quant_method=fp8 and weight_block_size), as DeepSeek-V3 ships, or none",
        ),
        (
            "v3-yarn-qlora",
            lambda raw: raw | {"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}},
            "DeepseekV3ForCausalLM quantized with quant_method='fp8' without weight_block_size (per-tensor scales) "
            "is not supported",
        ),
        (
            "v3-yarn-qlora",
            lambda raw: {k: v for k, v in raw.items() if k != "kv_lora_rank"},
            "config.json lacks 'kv_lora_rank', which the DeepseekV3ForCausalLM model needs",
        ),
        (
            "v3-yarn-qlora",
            lambda raw: raw | {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
            "unsupported rope scaling type 'dynamic' (supported: default, yarn)",
        ),
    ],
)
def test_unserved_checkpoints_are_refused_before_any_weight(tiny_model_factory, tmp_path, base, changes, message):
    """The checkpoint keeps its weights but the config asks for what the engine lacks: one message
    naming it, never a KeyError or a missing-weight message."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_model_factory(base), ckpt)
    (ckpt / "config.json").write_text(json.dumps(changes(tiny_config(str(ckpt)))))
    (ckpt / "model.safetensors").write_bytes(b"not read")  # reading any weight would fail differently
    with pytest.raises(ModelLoadError) as err:
        Engine(model_path=str(ckpt), num_threads=1)
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"n_group": 3}, "n_routed_experts=16 is not divisible by n_group=3"),
        ({"num_experts_per_tok": 17}, "num_experts_per_tok=17 must be in [1, n_routed_experts]"),
        ({"topk_method": "sinkhorn"}, "unsupported topk_method 'sinkhorn'"),
        ({"scoring_func": "tanh"}, "unsupported scoring_func 'tanh'"),
    ],
)
def test_routing_settings_out_of_range_are_named(tiny_model_factory, changes, message):
    with pytest.raises(ModelLoadError) as err:
        ModelConfig.from_dict(tiny_config(tiny_model_factory("v3-yarn-qlora")) | changes)
    assert str(err.value) == message


def test_kv_heads_that_do_not_divide_the_heads_are_named(tiny_model_factory):
    raw = tiny_config(tiny_model_factory("qwen3-gqa4"))
    with pytest.raises(ModelLoadError) as err:
        ModelConfig.from_dict(raw | {"num_key_value_heads": 3})
    assert (
        str(err.value) == f"num_attention_heads={raw['num_attention_heads']} is not a multiple of num_key_value_heads=3"
    )


def test_a_config_without_weights_is_named(tiny_model_factory, tmp_path):
    shutil.copy(Path(tiny_model_factory("v3-yarn-qlora")) / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError) as err:
        Engine(model_path=str(tmp_path), num_threads=1)
    assert (
        str(err.value)
        == f"no safetensors weights in '{tmp_path}' (no *.safetensors file, no model.safetensors.index.json)"
    )
