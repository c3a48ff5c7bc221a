"""Published checkpoints' config.json (tests/models/real_configs, whose README gives their source):
scaled-down copies served token-exact in both spellings, full sizes counted, the unserved refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from afd_engine import Engine, SamplingParams
from afd_engine.errors import ConfigError, ModelLoadError
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
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**small), dtype=torch.float32)
    with torch.no_grad():  # spread enough that greedy steps are far from ties
        for pname, p in model.named_parameters():
            p.copy_(
                1 + 0.1 * torch.randn_like(p) if "norm" in pname else torch.randn_like(p) * (0.1 + ("embed" in pname))
            )
    model.save_pretrained(out / "resaved")
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


def test_deepseek_v32_is_refused_before_any_weight_is_read(tmp_path):
    (tmp_path / "config.json").write_text((REAL / "deepseek_v3.2.json").read_text())  # no weights at all
    message = (
        "DeepseekV32ForCausalLM is not supported: the engine does not implement DeepSeek-V3.2's sparse "
        "attention (a lightning indexer picks index_topk keys per query); supported architectures: "
        "DeepseekV3ForCausalLM, DeepseekV2ForCausalLM, Qwen3MoeForCausalLM, Glm4MoeForCausalLM"
    )
    with pytest.raises(ModelLoadError) as err:
        Engine(model_path=str(tmp_path))
    assert str(err.value) == message


def test_deepseek_v32_is_refused_by_the_planner_too():
    with pytest.raises(ConfigError) as err:
        get_model(str(REAL / "deepseek_v3.2.json"))
    assert str(err.value) == (
        "model deepseek_v3.2: model_type 'deepseek_v32' is not supported by the planner "
        "(deepseek_v2, deepseek_v3, qwen3_moe, step3)"
    )
