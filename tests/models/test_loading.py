"""Checkpoint variants: FP8 block-quantized, sharded, bfloat16, incomplete."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from afd_engine import Engine, SamplingParams
from afd_engine.errors import ModelLoadError
from afd_engine.tiny_model import make_tiny_model
from tests.engine_helpers import engine_logits
from tests.hf_reference import assert_greedy_matches, hf_greedy, hf_logits

PROMPTS = [[5, 6, 7], [40] * 30, list(range(100, 190))]
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


def dequantized_copy(src: Path, dst: Path) -> Path:
    """An fp32 checkpoint of the FP8 one, dequantized here independently of the engine's loader."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors*"))
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            if name.endswith("_scale_inv"):
                continue
            t = f.get_tensor(name)
            if t.dtype == torch.float8_e4m3fn:
                scale = f.get_tensor(name + "_scale_inv")
                out = torch.empty(t.shape)
                for i in range(scale.shape[0]):  # block by block, the plain definition
                    for j in range(scale.shape[1]):
                        blk = (slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128))
                        out[blk] = t[blk].float() * scale[i, j]
                t = out
            tensors[name] = t.float() if t.dtype != torch.float32 else t
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize(
    "arch, quantized",
    [("deepseek_v3", "model.layers.0.mlp.up_proj.weight"), ("qwen3_moe", "model.layers.1.self_attn.k_proj.weight")],
)
def test_fp8_checkpoint_matches_reference_on_dequantized_weights(tmp_path, arch, quantized):
    # an intermediate size of 300 gives several and partial 128-blocks per weight
    fp8 = make_tiny_model(tmp_path / "fp8", arch=arch, fp8=True, overrides={"intermediate_size": 300})
    ref = dequantized_copy(fp8, tmp_path / "deq")
    with safe_open(str(fp8 / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor(quantized).dtype == torch.float8_e4m3fn
    with Engine(model_path=str(fp8), num_threads=1) as eng:
        outs = eng.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    for ids, out in zip(PROMPTS, outs):
        assert_greedy_matches(out.token_ids, *hf_greedy(str(ref), ids, 24), f"{arch} fp8 prompt len {len(ids)}")


def test_sharded_checkpoint_generates_like_a_single_file(tmp_path, tiny_v3):
    sharded = make_tiny_model(tmp_path / "sharded", shards=3)
    assert (sharded / "model.safetensors.index.json").is_file()
    with Engine(model_path=str(sharded), num_threads=1) as a, Engine(model_path=tiny_v3, num_threads=1) as b:
        assert [o.token_ids for o in a.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)] == [
            o.token_ids for o in b.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
        ]


def test_bfloat16_runs_close_to_the_fp32_reference(tiny_v3):
    ids = list(range(10, 90))
    with Engine(model_path=tiny_v3, dtype="bfloat16", num_threads=1) as eng:
        assert eng.pool.cache.dtype == torch.bfloat16
        assert eng.model.lm_head.weight.dtype == torch.bfloat16
        gate = eng.model.model.layers[1].mlp.gate
        assert gate.e_score_correction_bias.dtype == torch.float32
        ours = engine_logits(eng, ids)
    ref = hf_logits(tiny_v3, ids)
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"bf16 top-1 agrees with fp32 on only {agree:.0%} of positions"
    # bf16 rounding can flip an expert choice at a few positions; the bulk stays close
    assert (ours - ref).abs().median() < 0.02


def checkpoint_without(src: str, dst: Path, dropped: str) -> str:
    shutil.copytree(src, dst)
    with safe_open(str(dst / "model.safetensors"), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys() if n != dropped}
    save_file(tensors, str(dst / "model.safetensors"))
    return str(dst)


def test_missing_weight_is_named(tmp_path, tiny_v3):
    broken = checkpoint_without(tiny_v3, tmp_path / "broken", "model.layers.2.self_attn.kv_b_proj.weight")
    with pytest.raises(ModelLoadError, match=r"lacks weights the model needs: model\.layers\.2\.self_attn\.kv_b_proj"):
        Engine(model_path=broken)


def test_missing_expert_is_detected(tmp_path, tiny_v3):
    broken = checkpoint_without(tiny_v3, tmp_path / "broken", "model.layers.3.mlp.experts.5.up_proj.weight")
    with pytest.raises(
        ModelLoadError, match=r"lacks weights the model needs: model\.layers\.3\.mlp\.experts\.5\.up_proj"
    ):
        Engine(model_path=broken)


def test_block_scales_beside_weights_that_are_not_fp8_are_named(tmp_path, tiny_v3):
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    ckpt = Path(shutil.copytree(tiny_v3, tmp_path / "scaled"))
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    tensors[name + "_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(ModelLoadError) as err:
        Engine(model_path=str(ckpt), num_threads=1)
    assert str(err.value) == f"{name} has a scale_inv but config.json declares no fp8 quantization_config"


def test_an_fp8_expert_stored_in_another_dtype_is_named(tmp_path):
    # experts kept fp8 at load: whole 128-row blocks and a backend that computes on fp8 weights
    ckpt = make_tiny_model(tmp_path / "fp8", fp8=True, overrides={"moe_intermediate_size": 128})
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    tensors[name] = tensors[name].float()
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(ModelLoadError) as err:
        Engine(model_path=str(ckpt), num_threads=1, moe_backend="triton")
    assert str(err.value) == f"{name} has a scale_inv but is torch.float32, not float8_e4m3fn"
