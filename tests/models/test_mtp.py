"""DeepSeek's multi-token prediction module (afd_engine/models/mtp.py) against a reference written
from its equations: the glue (each input RMS-normed, concatenated, projected by `eh_proj`) in plain
torch from the checkpoint's tensors, the decoder block and the shared head by transformers (a
one-layer DeepSeek-V3 whose layer, final norm and head are the MTP module's, fed the glue's output
as its input embeddings). Loading: a checkpoint without the module is refused, naming what it lacks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from afd_engine.errors import ConfigError, ModelLoadError
from afd_engine.model_config import ModelConfig
from afd_engine.models import load_model
from afd_engine.models.forward_batch import ForwardBatch, SeqChunk
from afd_engine.runtime.kv_cache import KVPool
from afd_engine.tiny_model import make_tiny_model

MTP = {"num_nextn_predict_layers": 1}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("mtp"), arch="deepseek_v3", seed=4, overrides=MTP)


def tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def reference_block(checkpoint: Path, tmp: Path, n: int) -> torch.nn.Module:
    """transformers' DeepSeek-V3 of one MoE layer holding MTP layer n's block, norm and head."""
    weights = tensors(checkpoint)
    prefix = f"model.layers.{n}."
    out = {"model.embed_tokens.weight": weights["model.embed_tokens.weight"]}
    for name, t in weights.items():
        if name.startswith(prefix + "shared_head."):
            out[
                {"norm.weight": "model.norm.weight", "head.weight": "lm_head.weight"}[name.split("shared_head.")[1]]
            ] = t
        elif name.startswith(prefix) and name.split(prefix)[1].split(".")[0] in ("self_attn", "mlp"):
            out["model.layers.0." + name.split(prefix)[1]] = t
        elif name.startswith(prefix) and "layernorm" in name:
            out["model.layers.0." + name.split(prefix)[1]] = t
    config = json.loads((checkpoint / "config.json").read_text())
    config.update(num_hidden_layers=1, first_k_dense_replace=0, num_nextn_predict_layers=0)
    (tmp / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in out.items()}, str(tmp / "model.safetensors"))
    return AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32).eval()


def test_mtp_logits_follow_the_equations(checkpoint, tmp_path):
    cfg = ModelConfig.from_pretrained(checkpoint)
    model = load_model(cfg, checkpoint, torch.float32, mtp=True)
    mtp, n = model.mtp[0], cfg.num_layers
    g = torch.Generator().manual_seed(0)
    T = 7
    next_ids = torch.randint(3, cfg.vocab_size, (T,), generator=g)  # t_{i+1} at each position i
    hidden = torch.randn(T, cfg.hidden_size, generator=g)  # the main model's h_i
    pool = KVPool(cfg.num_layers + 1, cfg.kv_cache_dim, 8, 4, 2, 4, torch.float32)
    row = pool.open_row()
    assert pool.grow(row, T)
    fb = ForwardBatch.build([SeqChunk(row, 0, next_ids.tolist())], [], pool.page_table, 4)
    embeds = model.model.embed_tokens(next_ids)
    ours = mtp(embeds, hidden, fb, pool.cache, torch.arange(T))

    # the glue, from the checkpoint's tensors
    w = tensors(checkpoint)
    eps = cfg.rms_norm_eps

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    e = w["model.embed_tokens.weight"][next_ids]
    glue = torch.cat(
        (rms(e, w[f"model.layers.{n}.enorm.weight"]), rms(hidden, w[f"model.layers.{n}.hnorm.weight"])), -1
    )
    x = glue @ w[f"model.layers.{n}.eh_proj.weight"].T
    with torch.no_grad():
        ref = reference_block(checkpoint, tmp_path, n)(inputs_embeds=x[None]).logits[0].float()
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    # the main model's forward does not run the MTP layer, nor count its experts
    assert n not in model.routed_experts() and len(model.served_layers) == n


def test_a_checkpoint_without_an_mtp_module_is_refused(tmp_path, checkpoint):
    plain = make_tiny_model(tmp_path / "plain", arch="deepseek_v3", seed=4)
    with pytest.raises(ConfigError, match="num_nextn_predict_layers=0: it has no multi-token prediction module"):
        load_model(ModelConfig.from_pretrained(plain), plain, torch.float32, mtp=True)
    # one that declares the module but lacks its tensors: the loader names them
    config = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**config, **MTP}))
    with pytest.raises(ModelLoadError, match=r"lacks weights the model needs: model\.layers\.4\."):
        load_model(ModelConfig.from_pretrained(plain), plain, torch.float32, mtp=True)


def test_the_main_model_ignores_the_mtp_module_unless_asked(checkpoint):
    cfg = ModelConfig.from_pretrained(checkpoint)
    model = load_model(cfg, checkpoint, torch.float32)
    assert not hasattr(model, "mtp") and len(model.model.layers) == cfg.num_layers
