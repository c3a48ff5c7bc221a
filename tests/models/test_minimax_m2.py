"""MiniMax-M2 (`MiniMaxM2ForCausalLM`) against transformers' own implementation on the same tiny
weights: GQA with one q/k RMSNorm over all heads of a layer, rope over half of each head, every
layer MoE with sigmoid routing and the block's correction bias, experts named `w1`/`w3`/`w2` under
`block_sparse_moe`. Read as published (`rotary_dim`, MTP keys the engine does not serve) and as
transformers saves it; greedy tokens equal in one process and in every deployment (colocated, AFD,
PD)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from afd_engine import Engine, SamplingParams, make_engine
from afd_engine.errors import ConfigError, ModelLoadError
from afd_engine.model_config import ModelConfig
from afd_engine.models.checkpoint import expected_tensors, inspect_checkpoint
from afd_engine.tiny_model import make_tiny_model
from tests.conftest import resave_with_transformers
from tests.disagg.pd_helpers import COMMON, PDPair, idle_pages
from tests.engine_helpers import engine_logits, random_prompts, run_staggered, staggered_reference
from tests.hf_reference import assert_greedy_matches, hf_greedy, hf_logits
from tests.models.test_loading import dequantized_copy

NEW = 12
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)


@functools.cache
def written(root: Path) -> str:
    """The tiny checkpoint as published checkpoints spell it (`rotary_dim`, `rope_theta`)."""
    return str(make_tiny_model(root / "written", arch="minimax_m2", seed=3))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("minimax-m2")


@pytest.fixture(scope="module", params=["written", "resaved"])
def minimax(request, root) -> str:
    """The tiny checkpoint, and the same loaded and saved again by transformers (which adds
    rope_parameters with partial_rotary_factor beside rotary_dim)."""
    if request.param == "written":
        return written(root)
    return resave_with_transformers(written(root), root / "resaved")


def test_the_config_reads_as_minimax(minimax):
    cfg = ModelConfig.from_pretrained(minimax)
    assert cfg.raw["use_mtp"] and cfg.raw["num_mtp_modules"] == 3  # declared, and not served
    assert (cfg.architecture, cfg.attention, cfg.num_kv_heads, cfg.head_dim) == ("MiniMaxM2ForCausalLM", "gqa", 2, 16)
    assert (cfg.qk_norm, cfg.qk_norm_per_layer, cfg.attention_bias, cfg.rope_dim) == (True, True, False, 8)
    assert not cfg.rope.interleave and cfg.rope.theta == 10000.0
    assert (cfg.topk_method, cfg.scoring_func, cfg.n_group, cfg.norm_topk_prob) == ("noaux_tc", "sigmoid", 1, True)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (16, 4, 32)
    assert cfg.moe_layers == (0, 1, 2, 3) and cfg.n_shared_experts == 0 and cfg.mtp_layers == 0


def test_logits_and_greedy_tokens_equal_transformers(minimax):
    with Engine(model_path=minimax, dtype="float32", num_threads=1) as eng:
        prompts = random_prompts(eng.config.vocab_size, (1, 6, 23, 40), seed=5, low=5)
        for ids in prompts:
            assert (engine_logits(eng, ids) - hf_logits(minimax, ids)).abs().max().item() < 1e-4
        ours = [o.token_ids for o in eng.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    for ids, got in zip(prompts, ours):
        ref, gaps = hf_greedy(minimax, ids, NEW)
        assert assert_greedy_matches(got, ref, gaps, f"prompt of {len(ids)}") == NEW


def test_transformers_reads_the_tiny_checkpoint_as_written(root):
    """Every tensor under the name transformers converts from, experts fused as it fuses them."""
    path = written(root)
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    stored = load_file(str(Path(path) / "model.safetensors"))
    loaded = dict(model.named_parameters()) | dict(model.named_buffers())
    moe, mlp = "model.layers.2.block_sparse_moe.", "model.layers.2.mlp."
    for e in (0, 11):
        gate_up = torch.cat([stored[f"{moe}experts.{e}.w1.weight"], stored[f"{moe}experts.{e}.w3.weight"]])
        assert torch.equal(loaded[mlp + "experts.gate_up_proj"][e], gate_up)
        assert torch.equal(loaded[mlp + "experts.down_proj"][e], stored[f"{moe}experts.{e}.w2.weight"])
    assert torch.equal(loaded[mlp + "gate.weight"], stored[moe + "gate.weight"])
    bias = stored[moe + "e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.abs().max() > 0  # the correction changes choices
    assert torch.equal(loaded[mlp + "e_score_correction_bias"], bias)
    assert loaded["model.layers.2.self_attn.q_norm.weight"].shape == (8 * 16,)


def test_the_checkpoint_is_checked_under_its_own_names(root, tmp_path):
    path = written(root)
    cfg = inspect_checkpoint(path)
    names = expected_tensors(cfg)
    assert names["model.layers.1.block_sparse_moe.experts.5.w3.weight"] == (32, 64)
    assert names["model.layers.1.block_sparse_moe.e_score_correction_bias"] == (16,)
    assert names["model.layers.1.self_attn.q_norm.weight"] == (8 * 16,)
    assert names["model.layers.1.self_attn.k_norm.weight"] == (2 * 16,)
    assert not any(".mlp." in name for name in names)
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in Path(path).iterdir():
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(Path(path) / "model.safetensors"))
    del tensors["model.layers.2.block_sparse_moe.experts.7.w3.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"lacks weights the model needs: model\.layers\.2\.block_sparse_moe"):
        inspect_checkpoint(broken)


def test_an_fp8_checkpoint_reads_its_experts_scales_under_their_own_names(tmp_path):
    """As MiniMax-M2 ships: block-quantized projections, each `w1`/`w3`/`w2` beside its
    `_scale_inv`; the tokens equal transformers' on the weights dequantized independently."""
    fp8 = make_tiny_model(tmp_path / "fp8", arch="minimax_m2", fp8=True, overrides={"intermediate_size": 160})
    name = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    with safe_open(str(fp8 / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor(name).dtype == torch.float8_e4m3fn and name + "_scale_inv" in f.keys()
        assert f.get_tensor("model.layers.1.block_sparse_moe.gate.weight").dtype != torch.float8_e4m3fn  # the router
    ref = str(dequantized_copy(fp8, tmp_path / "deq"))
    with Engine(model_path=str(fp8), num_threads=1) as eng:
        prompts = random_prompts(eng.config.vocab_size, (3, 30), seed=2, low=5)
        outs = eng.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    for ids, out in zip(prompts, outs):
        assert assert_greedy_matches(out.token_ids, *hf_greedy(ref, ids, NEW), f"fp8 prompt of {len(ids)}") == NEW


UNSERVED = {
    "a lightning attention layer": (
        {"attn_type_list": [1, 0, 1, 1]},
        "MiniMaxM2ForCausalLM with lightning (linear) attention layers (attn_type_list=[1, 0, 1, 1]) is not "
        "supported; supported: full causal attention with grouped KV heads and a per-layer q/k norm, sigmoid "
        "routing with the correction bias, silu experts",
    ),
    "per-head q/k norm": ({"qk_norm_type": "per_head"}, "a q/k norm other than per layer (qk_norm_type='per_head')"),
    "no q/k norm": ({"use_qk_norm": False}, "queries and keys not normed (use_qk_norm=False)"),
    "softmax scores": ({"scoring_func": "softmax"}, "routing scores other than sigmoid (scoring_func='softmax')"),
    "no routing bias": (
        {"use_routing_bias": False},
        "routing without the correction bias (use_routing_bias=False)",
    ),
    "a shared expert": ({"shared_intermediate_size": 64}, "a shared expert (shared_intermediate_size=64)"),
    "rotary_dim against partial_rotary_factor": (
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}},
        "config.json disagrees with itself: rotary_dim=8 (of head_dim=16), partial_rotary_factor=0.25",
    ),
    "two expert counts": ({"num_experts": 8}, "config.json disagrees with itself: num_local_experts=16, num_experts=8"),
}


@pytest.mark.parametrize("what", list(UNSERVED))
def test_a_config_the_engine_does_not_serve_is_named(root, what):
    change, message = UNSERVED[what]
    raw = {**json.loads((Path(written(root)) / "config.json").read_text()), **change}
    with pytest.raises(ModelLoadError) as err:
        ModelConfig.from_dict(raw)
    assert message in str(err.value)


def test_minimax_text_01_is_named_as_not_served():
    with pytest.raises(ModelLoadError, match="MiniMaxForCausalLM is not supported: the engine does not implement"):
        ModelConfig.from_dict({"architectures": ["MiniMaxForCausalLM"], "model_type": "minimax"})


# Deployments: requests join while others decode, the longer prompts prefill in pieces.
LENGTHS = [5, 40, 17, 70, 33, 9]
CHUNKED = dict(max_num_batched_tokens=32)
DEPLOYMENTS = {
    "colocated dp2 mb2": dict(mode="colocated", dp_size=2, micro_batches=2),
    "afd 2A 2x2 mb3 two-stage": dict(
        mode="afd", dp_size=2, ffn_nodes=2, ffn_ranks_per_node=2, micro_batches=3, dispatch="two-stage"
    ),
}


@functools.cache
def reference(path: str):
    """(prompts, the single engine's staggered tokens), held to transformers' greedy tokens."""
    return staggered_reference(path, LENGTHS, GREEDY, seed=11, low=5)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("deployment", list(DEPLOYMENTS))
def test_a_deployment_gives_the_single_engines_tokens(deployment, root):
    path = written(root)
    prompts, want = reference(path)
    flags = {**DEPLOYMENTS[deployment], **CHUNKED}
    with make_engine(model_path=path, comm_timeout=30, dispatch_dtype="fp32", **flags) as engine:
        assert run_staggered(engine, prompts, GREEDY, every=2) == want


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_prefill_decode_disaggregation_gives_the_single_engines_tokens(root):
    path = written(root)
    prompts, want = reference(path)
    common = {**COMMON, "model_path": path, "disaggregation_transfer_backend": "builtin"}
    pd = PDPair(Engine(**common, disaggregation_mode="prefill"), Engine(**common, disaggregation_mode="decode"))
    try:
        assert run_staggered(pd, prompts, GREEDY, every=2) == want
        assert pd.decode.disagg.transfer_bytes == pd.prefill.disagg.transfer_bytes > 0
        assert idle_pages(pd.prefill) and idle_pages(pd.decode)
    finally:
        pd.close()


def test_speculative_decoding_is_refused_naming_the_unread_module(root):
    """MiniMax-M2 ships MTP modules of its own layout, which the engine does not read."""
    with pytest.raises(ConfigError) as err:
        Engine(model_path=written(root), speculative_algorithm="NEXTN")
    assert str(err.value) == (
        "speculative decoding drafts with DeepSeek's multi-token prediction module; MiniMaxM2ForCausalLM's is "
        "not read (--speculative-algorithm needs a DeepSeek-V3-architecture checkpoint)"
    )
