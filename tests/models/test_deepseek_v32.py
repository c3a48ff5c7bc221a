"""DeepSeek-V3.2's config and what its sparse attention changes (the parity suite, tests/models/
test_parity.py, holds its tokens to transformers' in every runtime mode): the indexer's key rides
in the cache rows, the selection changes the output, a config it cannot serve is named."""

from __future__ import annotations

import json

import pytest
import torch

from afd_engine import Engine
from afd_engine.errors import ConfigError, ModelLoadError
from afd_engine.model_config import ModelConfig
from afd_engine.tiny_model import make_tiny_model
from tests.engine_helpers import engine_logits, random_prompts
from tests.hf_reference import hf_logits


def test_the_config_reads_as_sparse_mla(tiny_model_factory):
    cfg = ModelConfig.from_pretrained(tiny_model_factory("v32-sparse"))
    assert (cfg.architecture, cfg.attention, cfg.sparse_attention) == ("DeepseekV32ForCausalLM", "mla", True)
    assert (cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim) == (8, 16, 32)
    assert (cfg.mla_cache_dim, cfg.kv_cache_dim) == (32 + 8, 32 + 8 + 32)  # latent, rope key, index key
    assert (cfg.topk_method, cfg.scoring_func) == ("noaux_tc", "sigmoid")


def test_a_dense_v3_caches_no_index_key(tiny_v3):
    cfg = ModelConfig.from_pretrained(tiny_v3)
    assert not cfg.sparse_attention and cfg.kv_cache_dim == cfg.mla_cache_dim == 40


def test_the_selection_changes_the_logits(tmp_path):
    """The same weights with index_topk past every context attend densely: both equal transformers
    under their own config, and differ from each other once a prompt is longer than 8 tokens."""
    sparse = str(make_tiny_model(tmp_path / "sparse", arch="deepseek_v32", seed=4))
    dense = str(make_tiny_model(tmp_path / "dense", arch="deepseek_v32", seed=4, overrides={"index_topk": 4096}))
    prompt = random_prompts(ModelConfig.from_pretrained(sparse).vocab_size, (60,), seed=8, low=5)[0]
    logits = {}
    for path in (sparse, dense):
        with Engine(model_path=path, dtype="float32", num_threads=1) as eng:
            logits[path] = engine_logits(eng, prompt)
        assert (logits[path] - hf_logits(path, prompt)).abs().max() <= 1e-4
    diff = (logits[sparse] - logits[dense]).abs().amax(dim=-1)  # per position
    assert diff[:8].max() <= 1e-4  # eight tokens or fewer: all of them are chosen
    assert diff[20:].min() > 1e-2


@pytest.mark.parametrize(
    "change,message",
    [
        (
            {"index_head_dim": 8},
            "index_head_dim=8 must exceed qk_rope_head_dim=8 (the indexer rotates its first qk_rope_head_dim "
            "dimensions)",
        ),
        (
            {"q_lora_rank": None},
            "DeepseekV32ForCausalLM needs q_lora_rank: the indexer's queries start from q_a_proj",
        ),
        ({"index_topk": None}, "config.json lacks 'index_topk', which the DeepseekV32ForCausalLM model needs"),
    ],
)
def test_a_config_the_indexer_cannot_run_is_named(tiny_model_factory, change, message):
    with open(f"{tiny_model_factory('v32-sparse')}/config.json") as f:
        raw = json.load(f)
    raw.update(change)
    with pytest.raises(ModelLoadError) as err:
        ModelConfig.from_dict(raw)
    assert str(err.value) == message


@pytest.mark.parametrize("dtype,row", [("float32", 40 + 9), ("bfloat16", 40 + 18)])
def test_fp8_index_keys_take_bytes_and_a_scale_per_token(tiny_model_factory, dtype, row):
    """--index-cache-dtype fp8: 32 e4m3 bytes and a 4-byte scale instead of 32 values per token; a
    stored key reads back as its fp8 rounding, and the selection mostly agrees with full precision."""
    path = tiny_model_factory("v32-sparse")
    with Engine(model_path=path, dtype=dtype, num_threads=1, index_cache_dtype="fp8") as eng:
        assert (eng.config.kv_cache_dim, eng.pool.cache.shape[-1]) == (row, row)
        indexer = eng.model.model.layers[0].self_attn.indexer
        keys = torch.zeros(6, row, dtype=eng.pool.cache.dtype)[:, 40:]
        k = torch.randn(3, 32) * torch.tensor([[0.01], [1.0], [300.0]])
        indexer._store(keys, torch.tensor([4, 1, 2]), k)
        scale = k.abs().amax(-1, keepdim=True) / 448.0
        want = (k / scale).to(torch.float8_e4m3fn).float() * scale
        assert torch.equal(indexer._load(keys, torch.tensor([[4, 1, 2]]))[0], want)
        assert keys[[0, 3, 5]].abs().sum() == 0  # other rows untouched
    prompt = random_prompts(eng.config.vocab_size, (90,), seed=3, low=5)[0]
    chosen = {}
    for storage in ("auto", "fp8"):
        with Engine(model_path=path, dtype="float32", num_threads=1, index_cache_dtype=storage) as eng:
            eng.model.model.layers[0].self_attn.indexer.register_forward_hook(
                lambda m, i, o, storage=storage: chosen.setdefault(storage, o)
            )
            engine_logits(eng, prompt)
    same = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(chosen["auto"], chosen["fp8"]))
    assert 0.9 < same / chosen["auto"].ge(0).sum() < 1.0  # fp8 moves a few choices, not most


def test_fp8_index_keys_need_a_sparse_model(tiny_v3):
    with pytest.raises(ConfigError) as err:
        Engine(model_path=tiny_v3, index_cache_dtype="fp8")
    assert str(err.value) == (
        "--index-cache-dtype fp8 stores DeepSeek-V3.2's indexer keys; DeepseekV3ForCausalLM has no indexer"
    )
