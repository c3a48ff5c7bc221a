"""DeepSeek-V3.2's config and what its sparse attention changes (the parity suite, tests/models/
test_parity.py, holds its tokens to transformers' in every runtime mode): the indexer's key rides
in the cache rows, the selection changes the output, a config it cannot serve is named."""

from __future__ import annotations

import json

import pytest

from afd_engine import Engine
from afd_engine.errors import ModelLoadError
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
