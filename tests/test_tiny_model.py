"""Tests of the tiny-model maker: real HF checkpoint layout, determinism, sharding, FP8, tokenizer."""

from __future__ import annotations

import hashlib
import json
import pathlib
import time

import pytest
import torch
import transformers  # noqa: E402  (a hard dependency: the test oracle)
from safetensors import safe_open

from afd_engine.errors import ConfigError
from afd_engine.models.loader import dequantize_fp8
from afd_engine.tiny_model import (
    FP8_BLOCK,
    SUPPORTED_ARCHS,
    main_make_tiny_model,
    make_tiny_model,
    quantize_fp8_block,
)
from afd_engine.tiny_tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, build_tiny_tokenizer, write_tiny_tokenizer


def _read_tensors(ckpt: pathlib.Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory, sharded or not."""
    tensors = {}
    for path in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def _file_digests(ckpt: pathlib.Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(ckpt.iterdir())}


def _load_hf(ckpt: pathlib.Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(ckpt), dtype=torch.float32, output_loading_info=True
    )
    return model.eval(), info


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, pathlib.Path]:
    """One default checkpoint per arch, shared by the read-only tests."""
    return {arch: make_tiny_model(tmp_path_factory.mktemp(arch), arch=arch) for arch in SUPPORTED_ARCHS}


@pytest.fixture(scope="module")
def hf_models(ckpts):
    return {arch: _load_hf(path) for arch, path in ckpts.items()}


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_hf_loads_without_missing_or_unexpected_keys(arch, ckpts, hf_models):
    model, info = hf_models[arch]
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["unexpected_keys"], info["unexpected_keys"]
    assert not info["mismatched_keys"], info["mismatched_keys"]
    expected_cls = {
        "deepseek_v3": "DeepseekV3ForCausalLM",
        "deepseek_v2": "DeepseekV2ForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "glm4_moe": "Glm4MoeForCausalLM",
        "minimax_m2": "MiniMaxM2ForCausalLM",
        "deepseek_v32": "DeepseekV32ForCausalLM",
    }[arch]
    assert type(model).__name__ == expected_cls
    if arch == "minimax_m2":
        return  # its own tensor names (block_sparse_moe, experts w1/w3/w2): tests/models/test_minimax_m2.py

    stored = _read_tensors(ckpts[arch])
    loaded = dict(model.named_parameters()) | dict(model.named_buffers())
    # transformers 5 fuses the per-expert tensors: gate_up_proj [E, 2*I, H] = cat(gate, up), down [E, H, I].
    layer = 1  # first MoE layer of every preset (layer 0 is dense in each)
    for e in (0, 7):
        p = f"model.layers.{layer}.mlp.experts.{e}."
        fused = torch.cat([stored[p + "gate_proj.weight"], stored[p + "up_proj.weight"]], dim=0)
        assert torch.equal(loaded[f"model.layers.{layer}.mlp.experts.gate_up_proj"][e], fused)
        assert torch.equal(loaded[f"model.layers.{layer}.mlp.experts.down_proj"][e], stored[p + "down_proj.weight"])
    # Unfused tensors arrive unchanged.
    per_arch = {
        "qwen3_moe": ["model.layers.0.self_attn.k_norm.weight", "model.layers.0.self_attn.v_proj.weight"],
        "glm4_moe": ["model.layers.0.self_attn.k_proj.bias", f"model.layers.{layer}.mlp.shared_experts.up_proj.weight"],
        "deepseek_v32": [f"model.layers.0.self_attn.indexer.{n}" for n in ("wq_b.weight", "k_norm.bias")],
    }.get(
        arch, ["model.layers.0.self_attn.kv_b_proj.weight", f"model.layers.{layer}.mlp.shared_experts.up_proj.weight"]
    )
    for name in ["model.embed_tokens.weight", "lm_head.weight", f"model.layers.{layer}.mlp.gate.weight", *per_arch]:
        assert torch.equal(loaded[name], stored[name]), name
    if arch in ("deepseek_v3", "glm4_moe", "deepseek_v32"):
        bias = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
        assert stored[bias].dtype == torch.float32
        assert stored[bias].abs().max() > 0  # the bias path is exercised
        assert torch.equal(loaded[bias], stored[bias])
        q = "q_proj" if arch == "glm4_moe" else "q_a_proj"
        assert f"model.layers.{layer}.self_attn.{q}.weight" in stored
    else:
        assert "model.layers.0.self_attn.q_proj.weight" in stored
        assert not any(k.endswith("e_score_correction_bias") for k in stored)


def test_config_fields(ckpts):
    v3 = json.loads((ckpts["deepseek_v3"] / "config.json").read_text())
    v2 = json.loads((ckpts["deepseek_v2"] / "config.json").read_text())
    assert v3["architectures"] == ["DeepseekV3ForCausalLM"] and v3["model_type"] == "deepseek_v3"
    assert v2["architectures"] == ["DeepseekV2ForCausalLM"] and v2["model_type"] == "deepseek_v2"
    assert v3["kv_lora_rank"] == v2["kv_lora_rank"] == 32
    assert v3["q_lora_rank"] == 48 and v2["q_lora_rank"] is None
    assert v3["rope_scaling"] == {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    assert v3["max_position_embeddings"] == v2["max_position_embeddings"] == 512
    assert not v2.get("rope_scaling")
    assert (v3["topk_method"], v3["scoring_func"], v3["norm_topk_prob"]) == ("noaux_tc", "sigmoid", True)
    assert (v2["topk_method"], v2["scoring_func"], v2["norm_topk_prob"]) == ("greedy", "softmax", False)
    assert (v3["n_group"], v3["topk_group"], v2["n_group"], v2["topk_group"]) == (4, 2, 1, 1)
    assert v3["tie_word_embeddings"] is False and v3["torch_dtype"] == "float32"
    assert "quantization_config" not in v3

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(ckpts["deepseek_v3"]))
    gen = json.loads((ckpts["deepseek_v3"] / "generation_config.json").read_text())
    for cfg in (v3, v2, gen):
        assert cfg["bos_token_id"] == tokenizer.bos_token_id == tokenizer.convert_tokens_to_ids(BOS_TOKEN)
        assert cfg["eos_token_id"] == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    assert gen["do_sample"] is False
    assert v3["vocab_size"] == v2["vocab_size"] == len(tokenizer)


def test_tokenizer_and_chat_template(ckpts):
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(ckpts["deepseek_v3"]))
    assert tokenizer.pad_token == PAD_TOKEN
    ids = tokenizer("Hello world").input_ids
    assert ids[0] == tokenizer.bos_token_id and tokenizer.eos_token_id not in ids

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        f"{BOS_TOKEN}Be brief.<｜User｜>Hi<｜Assistant｜>Hello.{EOS_TOKEN}<｜User｜>What is 2+2?<｜Assistant｜>"
    )
    no_prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=False)
    assert no_prompt == f"{BOS_TOKEN}Be brief.<｜User｜>Hi"
    # The role markers are single special tokens, and the template's bos is not doubled.
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert chat_ids[0] == tokenizer.bos_token_id and chat_ids[1] != tokenizer.bos_token_id
    assert tokenizer.convert_tokens_to_ids("<｜Assistant｜>") == chat_ids[-1]


def test_unicode_round_trip(ckpts):
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(ckpts["deepseek_v2"]))
    text = "Mixture of experts 混合专家模型 🚀🎉 naïve café — ¿qué? \t\n end"
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(ids[1:]) == text


def test_tokenizer_is_deterministic_and_fast(tmp_path):
    start = time.perf_counter()
    info_a = write_tiny_tokenizer(tmp_path / "a")
    assert time.perf_counter() - start < 2.0
    info_b = write_tiny_tokenizer(tmp_path / "b")
    assert info_a == info_b
    assert (info_a.bos_token_id, info_a.eos_token_id, info_a.pad_token_id) == (0, 1, 2)
    assert info_a.vocab_size == build_tiny_tokenizer().get_vocab_size() == 512
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = make_tiny_model(tmp_path / "a", seed=3)
    b = make_tiny_model(tmp_path / "b", seed=3)
    c = make_tiny_model(tmp_path / "c", seed=4)
    assert _file_digests(a) == _file_digests(b)
    wa, wc = _read_tensors(a), _read_tensors(c)
    assert wa.keys() == wc.keys()
    for name in ("model.embed_tokens.weight", "model.layers.2.mlp.experts.5.up_proj.weight", "lm_head.weight"):
        assert not torch.equal(wa[name], wc[name]), name


def test_shards_index_and_same_weights(tmp_path, ckpts, hf_models):
    sharded = make_tiny_model(tmp_path / "sharded", arch="deepseek_v3", shards=3)
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())

    in_files = {}
    for name in files:
        with safe_open(str(sharded / name), framework="pt") as f:
            in_files.update({key: name for key in f.keys()})
    assert index["weight_map"] == in_files  # covers every tensor, each in the file it names
    tensors = _read_tensors(sharded)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    single = _read_tensors(ckpts["deepseek_v3"])
    assert tensors.keys() == single.keys()
    assert all(torch.equal(tensors[k], single[k]) for k in single)

    model, info = _load_hf(sharded)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    reference = hf_models["deepseek_v3"][0].state_dict()
    loaded = model.state_dict()
    assert loaded.keys() == reference.keys()
    assert all(torch.equal(loaded[k], reference[k]) for k in reference)


def test_fp8_block_quantized_checkpoint(tmp_path):
    # intermediate_size 300 makes the dense MLP span several 128-blocks, one of them partial.
    overrides = {"intermediate_size": 300}
    fp8_dir = make_tiny_model(tmp_path / "fp8", seed=1, fp8=True, overrides=overrides)
    ref_dir = make_tiny_model(tmp_path / "ref", seed=1, fp8=False, overrides=overrides)
    config = json.loads((fp8_dir / "config.json").read_text())
    assert config["quantization_config"] == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    fp8, ref = _read_tensors(fp8_dir), _read_tensors(ref_dir)

    quantized = [k for k, t in fp8.items() if t.dtype == torch.float8_e4m3fn]
    assert "model.layers.0.self_attn.q_a_proj.weight" in quantized
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in quantized
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in quantized
    for kept in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.0.self_attn.kv_a_layernorm.weight",
    ):
        assert fp8[kept].dtype == torch.float32 and torch.equal(fp8[kept], ref[kept]), kept
        assert kept + "_scale_inv" not in fp8
    # Every 2-D projection of the attention and MLPs is quantized, nothing else.
    expected = {
        k for k, t in ref.items() if t.dim() == 2 and k.startswith("model.layers.") and ".mlp.gate.weight" not in k
    }
    assert set(quantized) == expected
    assert set(fp8) == set(ref) | {k + "_scale_inv" for k in quantized}

    assert tuple(fp8["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape) == (3, 1)  # [300, 64]
    assert tuple(fp8["model.layers.0.mlp.down_proj.weight_scale_inv"].shape) == (1, 3)  # [64, 300]
    for name in quantized:
        weight, scale_inv = fp8[name], fp8[name + "_scale_inv"]
        n, k = weight.shape
        assert scale_inv.dtype == torch.float32
        assert tuple(scale_inv.shape) == (-(-n // 128), -(-k // 128))
        _assert_within_e4m3_error(dequantize_fp8(weight, scale_inv, FP8_BLOCK), ref[name], scale_inv)


def _assert_within_e4m3_error(deq: torch.Tensor, orig: torch.Tensor, scale_inv: torch.Tensor) -> None:
    """e4m3 keeps 3 mantissa bits: relative error <= 1/16, plus the subnormal step near zero."""
    n, k = orig.shape
    scale = scale_inv.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]  # [N, K]
    bound = orig.abs() / 16 + scale * 2.0**-9
    assert deq.dtype == torch.float32
    assert ((deq - orig).abs() <= bound).all()
    # Each block's largest element is mapped onto 448 and comes back almost exactly.
    assert torch.allclose(deq.abs().max(), orig.abs().max(), rtol=1 / 16)


def test_quantize_dequantize_partial_blocks():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 200, generator=gen) * torch.logspace(-3, 1, 300)[:, None]  # [300, 200]
    weight[:128, :128] = 0.0  # an all-zero block must not divide by zero
    q, scale_inv = quantize_fp8_block(weight)
    assert q.dtype == torch.float8_e4m3fn and q.shape == weight.shape
    assert scale_inv.shape == (3, 2) and scale_inv[0, 0] == 1.0
    deq = dequantize_fp8(q, scale_inv, FP8_BLOCK)
    assert torch.equal(deq[:128, :128], torch.zeros(128, 128))
    _assert_within_e4m3_error(deq, weight, scale_inv)


def test_bfloat16_storage_keeps_bias_fp32(tmp_path, ckpts):
    bf16 = _read_tensors(make_tiny_model(tmp_path / "bf16", dtype="bfloat16"))
    fp32 = _read_tensors(ckpts["deepseek_v3"])
    for name, tensor in bf16.items():
        if name.endswith("e_score_correction_bias"):
            assert tensor.dtype == torch.float32 and torch.equal(tensor, fp32[name])
        else:
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, fp32[name].to(torch.bfloat16)), name
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_overrides(tmp_path):
    all_moe = make_tiny_model(tmp_path / "moe", overrides={"first_k_dense_replace": 0, "rope_scaling": None})
    config = json.loads((all_moe / "config.json").read_text())
    assert config["first_k_dense_replace"] == 0 and config["rope_scaling"] is None
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in _read_tensors(all_moe)
    _, info = _load_hf(all_moe)
    assert not info["missing_keys"] and not info["unexpected_keys"]

    rope = {"rope_type": "default", "rope_theta": 10000.0}
    new_style = make_tiny_model(tmp_path / "rope", arch="deepseek_v2", overrides={"rope_parameters": rope})
    config = json.loads((new_style / "config.json").read_text())
    assert config["rope_parameters"] == rope and "rope_scaling" not in config


def test_greedy_generation_is_not_degenerate(ckpts, hf_models):
    for arch in SUPPORTED_ARCHS:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(ckpts[arch]))
        model = hf_models[arch][0]
        continuations = set()
        for prompt in ("The cat", "Hello, how are", "In 1969 people", "def add(a, b):"):
            enc = tokenizer(prompt, return_tensors="pt")
            with torch.no_grad():
                out = model.generate(
                    **enc,
                    max_new_tokens=16,
                    do_sample=False,
                    output_scores=True,
                    return_dict_in_generate=True,
                    pad_token_id=tokenizer.pad_token_id,
                )
            new = out.sequences[0, enc.input_ids.shape[1] :].tolist()
            assert len(set(new)) > 1, (arch, prompt, new)  # not the same token forever
            # Clear argmax decisions, so that small numeric differences do not flip greedy tokens.
            gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
            assert sum(g > 1e-3 for g in gaps) >= 0.75 * len(gaps), (arch, prompt, gaps)
            continuations.add(tuple(new))
        assert len(continuations) >= 2, (arch, continuations)


def test_unknown_arch_and_cli(tmp_path, capsys):
    with pytest.raises(ConfigError, match="deepseek_v3.*deepseek_v2"):
        make_tiny_model(tmp_path / "bad", arch="llama")

    assert main_make_tiny_model([str(tmp_path / "bad"), "--arch", "llama"]) == 2
    err = capsys.readouterr().err
    assert "llama" in err and "deepseek_v3" in err and "deepseek_v2" in err and "Traceback" not in err

    out_dir = tmp_path / "cli"
    assert (
        main_make_tiny_model(
            [str(out_dir), "--arch", "deepseek_v2", "--seed", "5", "--shards", "2", "--dtype", "bfloat16"]
        )
        == 0
    )
    assert capsys.readouterr().out.strip() == str(out_dir)
    assert (out_dir / "model.safetensors.index.json").is_file() and not (out_dir / "model.safetensors").exists()
    assert main_make_tiny_model([str(out_dir), "--fp8"]) == 0
    assert (out_dir / "model.safetensors").is_file() and not (out_dir / "model.safetensors.index.json").exists()
