"""Published checkpoints' config.json (tests/models/real_configs, whose README gives their source):
scaled-down copies served token-exact in both spellings, full sizes counted against transformers and
the model cards."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DeepseekV3Config
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from afd_engine import Engine, SamplingParams
from afd_engine.model_config import ModelConfig
from afd_engine.models.checkpoint import parameter_counts
from afd_engine.planner.model_spec import get_model
from afd_engine.tiny_tokenizer import QWEN_CHAT_TEMPLATE, write_tiny_tokenizer
from tests.engine_helpers import random_prompts
from tests.hf_reference import assert_greedy_matches, hf_greedy

REAL = Path(__file__).parent / "real_configs"
SERVED = ("qwen3-30B-A3B", "qwen3-235B-A22B")
# published totals as the model cards give them (billions, cut to the digits shown): total, activated
PUBLISHED = {"qwen3-30B-A3B": (30.5, 3.3), "qwen3-235B-A22B": (235, 22)}


def billions(count: int, digits: int) -> float:
    return math.floor(count / 10 ** (9 - digits)) / 10**digits


# only sizes change; every other key stays as published
SMALL = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 3,
    "max_window_layers": 3,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 512,
}
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)


def published(name: str) -> dict:
    return json.loads((REAL / f"{name}.json").read_text())


def random_model(config):
    """transformers' model of `config` with seeded random weights, spread enough that greedy steps
    are far from ties."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(
                1 + 0.1 * torch.randn_like(p) if "norm" in pname else torch.randn_like(p) * (0.1 + ("embed" in pname))
            )
    return model


def scaled_down_checkpoints(name: str, out: Path) -> tuple[Path, Path]:
    """The published config with small sizes: random weights saved by transformers (today's
    spellings), and the same weights beside the config exactly as published."""
    raw = published(name)
    tok = write_tiny_tokenizer(out / "resaved", QWEN_CHAT_TEMPLATE)
    small = {
        **raw,
        **SMALL,
        "vocab_size": tok.vocab_size,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
    }
    assert small.keys() == raw.keys()
    random_model(AutoConfig.for_model(**small)).save_pretrained(out / "resaved")
    as_published = out / "published"
    as_published.mkdir()
    for f in (out / "resaved").iterdir():
        (as_published / f.name).write_bytes(f.read_bytes())
    (as_published / "config.json").write_text(json.dumps(small))
    return out / "resaved", as_published


@pytest.mark.parametrize("name", SERVED)
def test_scaled_down_published_config_is_token_exact_in_both_spellings(name, tmp_path):
    resaved, as_published = scaled_down_checkpoints(name, tmp_path)
    new_keys = json.loads((resaved / "config.json").read_text())
    assert new_keys["num_local_experts"] == 8 and "num_experts" not in new_keys and "rope_theta" not in new_keys
    assert published(name)["num_experts"] == 128
    for path in (resaved, as_published):
        with Engine(model_path=str(path), num_threads=1) as eng:
            assert eng.config.n_routed_experts == 8 and eng.config.rope.theta == published(name)["rope_theta"]
            prompts = random_prompts(eng.config.vocab_size, (3, 17, 40), seed=2)
            outs = eng.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        for ids, out in zip(prompts, outs):
            ref, gaps = hf_greedy(str(path), ids, 16)
            assert assert_greedy_matches(out.token_ids, ref, gaps, f"{path.name} len {len(ids)}") == 16


@pytest.mark.parametrize("name", SERVED)
def test_full_size_published_config_counts_the_published_parameters(name, tmp_path):
    raw = published(name)
    saved = tmp_path / name
    AutoConfig.for_model(**raw).save_pretrained(saved)  # today's spellings of the same model
    with torch.device("meta"):
        hf_total = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw)).parameters())
    total_b, active_b = PUBLISHED[name]
    digits = 1 if isinstance(total_b, float) else 0
    for cfg in (raw, json.loads((saved / "config.json").read_text())):
        total, active = parameter_counts(ModelConfig.from_dict(cfg))
        assert total == hf_total
        assert (billions(total, digits), billions(active, digits)) == (total_b, active_b)
    for spec in (get_model(str(REAL / f"{name}.json")), get_model(str(saved))):
        assert (billions(spec.total_params(), digits), billions(spec.activated_params(), digits)) == (total_b, active_b)
        assert abs(spec.total_params() - hf_total) / hf_total < 1e-4  # the planner skips only the norms


# The model cards' figures (billions): total, activated. They round (GLM-4.6's 355B is 352.8B,
# MiniMax-M2's 230B is 228.7B, Kimi-K2's 1.04T is 1.026T) and count the activated parameters without
# the input embedding table (a lookup, not a matmul); the exact check is transformers' own count.
CARDS = {
    "glm-4.6": (355, 32),
    "kimi-k2-instruct": (1040, 32),
    "deepseek_v3.2": (671, 37),
    "minimax-m2": (230, 10),
}


def hf_config(raw: dict):
    """transformers' config of a published file. Kimi-K2 is DeepSeek-V3 under model_type kimi_k2,
    which transformers knows only through the checkpoint's remote code (its `auto_map`)."""
    if raw["model_type"] == "kimi_k2" and "kimi_k2" not in CONFIG_MAPPING:
        return DeepseekV3Config(**{k: v for k, v in raw.items() if k not in ("model_type", "auto_map")})
    return AutoConfig.for_model(**raw)


@pytest.mark.parametrize("name", sorted(CARDS))
def test_full_size_config_counts_the_tensors_transformers_builds(name, tmp_path):
    raw = published(name)
    config = hf_config(raw)
    config.save_pretrained(tmp_path)  # today's spellings of the same model
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # a checkpoint's tensors: parameters and persistent buffers (the routers' correction bias)
    hf_total = sum(t.numel() for t in model.state_dict().values())
    total_b, active_b = CARDS[name]
    for cfg in (raw, json.loads((tmp_path / "config.json").read_text())):
        mc = ModelConfig.from_dict(cfg)
        total, active = parameter_counts(mc)
        assert total == hf_total
        assert math.isclose(total / 1e9, total_b, rel_tol=0.03), total
        assert math.isclose((active - mc.vocab_size * mc.hidden_size) / 1e9, active_b, rel_tol=0.05), active


def test_kimi_k2_is_served_as_deepseek_v3_with_its_own_routing():
    raw = published("kimi-k2-instruct")
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.architecture, cfg.attention, cfg.num_layers, cfg.num_heads) == ("DeepseekV3ForCausalLM", "mla", 61, 64)
    routing = (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.n_shared_experts)
    assert routing == (384, 8, 1, 1, 1)
    assert (cfg.topk_method, cfg.scoring_func, cfg.routed_scaling_factor) == ("noaux_tc", "sigmoid", 2.827)
    assert cfg.fp8_block == (128, 128)
    assert (cfg.rope.kind, cfg.rope.theta, cfg.rope.factor, cfg.mtp_layers) == ("yarn", 50000.0, 32.0, 0)
    # a copy saved without `architectures` names the same model by its model_type alone
    assert ModelConfig.from_dict({k: v for k, v in raw.items() if k != "architectures"}) == cfg


# Kimi-K2's published config with only the sizes small (MLA, 8 experts in one group, top-2)
KIMI_SMALL = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "num_hidden_layers": 3,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 512,
}


def test_scaled_down_kimi_k2_checkpoint_is_token_exact(tmp_path):
    """A checkpoint whose config.json is Kimi-K2's (model_type kimi_k2, auto_map to remote code) is
    served; the reference is transformers' DeepSeek-V3 on the same weights. The random weights are
    stored unquantized, so the small config drops the published quantization_config."""
    raw = published("kimi-k2-instruct")
    tok = write_tiny_tokenizer(tmp_path / "deepseek_v3", QWEN_CHAT_TEMPLATE)
    special = {"vocab_size": tok.vocab_size, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    small = {k: v for k, v in raw.items() if k != "quantization_config"} | KIMI_SMALL | special
    assert small.keys() == raw.keys() - {"quantization_config"}
    random_model(hf_config(small)).save_pretrained(tmp_path / "deepseek_v3")
    kimi = tmp_path / "kimi"
    kimi.mkdir()
    for f in (tmp_path / "deepseek_v3").iterdir():
        (kimi / f.name).write_bytes(f.read_bytes())
    (kimi / "config.json").write_text(json.dumps(small))
    with Engine(model_path=str(kimi), num_threads=1) as eng:
        assert (eng.config.architecture, eng.config.n_routed_experts) == ("DeepseekV3ForCausalLM", 8)
        prompts = random_prompts(eng.config.vocab_size, (3, 17, 40), seed=2)
        outs = eng.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    for ids, out in zip(prompts, outs):
        ref, gaps = hf_greedy(str(tmp_path / "deepseek_v3"), ids, 16)
        assert assert_greedy_matches(out.token_ids, ref, gaps, f"kimi len {len(ids)}") == 16
