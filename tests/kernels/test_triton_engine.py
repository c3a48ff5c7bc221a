"""The whole engine on the triton backends (Triton's interpreter on a CPU): the same greedy tokens
as transformers, in single, colocated and AFD modes."""

from __future__ import annotations

import pytest

from afd_engine import SamplingParams, make_engine
from afd_engine.tiny_tokenizer import TINY_VOCAB_SIZE
from tests.engine_helpers import random_prompts, run_staggered
from tests.hf_reference import assert_greedy_matches, hf_greedy

NEW = 6
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
TRITON = dict(attention_backend="triton", moe_backend="triton", dtype="float32", num_threads=1, page_size=4)
MODES = {
    "single": dict(mode="single"),
    "colocated dp2 mb2": dict(mode="colocated", dp_size=2, micro_batches=2),
    "afd 1A 1x2 mb2": dict(mode="afd", dp_size=1, ffn_ranks_per_node=2, micro_batches=2),
}


@pytest.fixture(scope="module")
def reference(tiny_v3):
    batch = random_prompts(TINY_VOCAB_SIZE, (1, 6, 19), seed=3, low=5)
    return batch, [hf_greedy(tiny_v3, ids, NEW) for ids in batch]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", list(MODES))
def test_triton_backends_match_transformers(mode, tiny_v3, reference):
    batch, hf = reference
    with make_engine(model_path=tiny_v3, **TRITON, **MODES[mode]) as engine:
        outs = run_staggered(engine, batch, GREEDY, every=2)  # prefill (torch extend) beside triton decode
    for ids, out, (ref, gaps) in zip(batch, outs, hf):
        assert_greedy_matches(out, ref, gaps, f"{mode} prompt len {len(ids)}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["single", "afd 1A 1x2 mb2"])
def test_triton_backends_serve_qwen3_moe(mode, tiny_model_factory):
    path = tiny_model_factory("qwen3-gqa4")  # GQA decode through the triton attention backend
    batch = random_prompts(TINY_VOCAB_SIZE, (3, 14), seed=4, low=5)
    with make_engine(model_path=path, **TRITON, **MODES[mode]) as engine:
        outs = run_staggered(engine, batch, GREEDY, every=2)
    for ids, out in zip(batch, outs):
        assert_greedy_matches(out, *hf_greedy(path, ids, NEW), f"qwen3 {mode} prompt len {len(ids)}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["single", "afd 1A 1x2 mb2"])
def test_triton_backends_serve_deepseek_v32(mode, tiny_model_factory):
    """Prefill and decode tokens alike attend through the sparse MLA kernel (8 of up to 26 tokens)."""
    path = tiny_model_factory("v32-sparse")
    batch = random_prompts(TINY_VOCAB_SIZE, (5, 20), seed=4, low=5)
    with make_engine(model_path=path, **TRITON, **MODES[mode]) as engine:
        outs = run_staggered(engine, batch, GREEDY, every=2)
    for ids, out in zip(batch, outs):
        assert_greedy_matches(out, *hf_greedy(path, ids, NEW), f"v3.2 {mode} prompt len {len(ids)}")
