"""The offline Engine API: shapes of inputs and outputs, sampling, stops, errors, lifecycle."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from afd_engine import Engine, EngineArgs, SamplingParams
from afd_engine.errors import ConfigError, InvalidRequestError, ModelLoadError
from tests.hf_reference import hf_greedy

GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_v3):
    with Engine(model_path=tiny_v3, dtype="float32", num_threads=1) as eng:
        yield eng


def test_generate_token_ids_shape_of_outputs(engine, tiny_v3):
    outs = engine.generate(prompt_token_ids=[[5, 6, 7], [9]], sampling_params=GREEDY)
    assert [len(o.token_ids) for o in outs] == [16, 16]
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert outs[0].token_ids == hf_greedy(tiny_v3, [5, 6, 7], 16)[0]
    assert outs[0].text == engine.tokenizer.decode(outs[0].token_ids, skip_special_tokens=True)
    assert outs[0].prompt_token_ids == [5, 6, 7]


def test_generate_text_prompts_with_per_request_params(engine):
    params = [GREEDY, SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)]
    outs = engine.generate(prompts=["Hello there", "The sea"], sampling_params=params)
    assert outs[0].prompt_token_ids == engine.tokenizer.encode("Hello there")
    assert [len(o.token_ids) for o in outs] == [16, 3]


def test_stop_token_id_and_stop_string(engine):
    base = engine.generate(prompt_token_ids=[[11, 12, 13, 14]], sampling_params=GREEDY)[0]
    stop_id = base.token_ids[4]
    first = base.token_ids.index(stop_id)
    out = engine.generate(
        prompt_token_ids=[[11, 12, 13, 14]],
        sampling_params=SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=[stop_id]),
    )[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[: first + 1]

    stop = base.text[len(base.text) // 2 : len(base.text) // 2 + 3]
    cut = base.text.index(stop)
    out = engine.generate(
        prompt_token_ids=[[11, 12, 13, 14]],
        sampling_params=SamplingParams(max_new_tokens=16, temperature=0.0, stop=[stop]),
    )[0]
    assert out.finish_reason == "stop"
    assert out.text == base.text[:cut]


def test_seeded_sampling_is_reproducible_in_any_batch(engine):
    sampled = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    alone = engine.generate(prompt_token_ids=[[20, 21, 22]], sampling_params=sampled)[0].token_ids
    crowd = engine.generate(
        prompt_token_ids=[[1, 2], [20, 21, 22], [30] * 40], sampling_params=[GREEDY, sampled, GREEDY]
    )[1].token_ids
    other = engine.generate(
        prompt_token_ids=[[20, 21, 22]], sampling_params=SamplingParams(max_new_tokens=12, temperature=1.0, seed=8)
    )[0].token_ids
    assert alone == crowd
    assert alone != other


def test_prompt_longer_than_context_fails_alone(tiny_v3):
    with Engine(model_path=tiny_v3, num_threads=1, context_length=64) as eng:
        outs = eng.generate(prompt_token_ids=[[5] * 10, [6] * 100, [7] * 20], sampling_params=GREEDY)
    assert outs[1].finish_reason == "error"
    assert "100 tokens" in outs[1].error and "context length is 64" in outs[1].error
    assert [len(outs[0].token_ids), len(outs[2].token_ids)] == [16, 16]


def test_generation_stops_at_the_context_length(tiny_v3):
    with Engine(model_path=tiny_v3, num_threads=1, context_length=24) as eng:
        out = eng.generate(prompt_token_ids=[[5] * 20], sampling_params=GREEDY)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"seed": -3}, "seed"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_sampling_params_name_the_parameter(kwargs, param):
    with pytest.raises(InvalidRequestError, match=f"invalid sampling parameter {param}=") as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


def test_invalid_prompts(engine):
    with pytest.raises(InvalidRequestError, match=r"integers in \[0, 512\)"):
        engine.add_request(prompt_token_ids=[1, 99999])
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        engine.add_request(prompt_token_ids=[])
    outs = engine.generate(prompt_token_ids=[[]], sampling_params=GREEDY)
    assert outs[0].finish_reason == "error"


def test_abort_frees_pages(engine):
    before = engine.cache.num_pages
    rid = engine.add_request(prompt_token_ids=[3] * 50, params=GREEDY)
    engine.step()
    assert engine.pool.used_pages > before
    out = engine.abort(rid)
    assert out.finish_reason == "abort"
    # the prefix cache keeps the 3 whole pages of prompt computed (16 tokens each); the rest is free
    assert engine.cache.num_pages == before + 3
    assert engine.pool.used_pages == engine.cache.num_pages and not engine.has_unfinished()


def test_missing_model_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        Engine(model_path=str(tmp_path / "nope"))


def test_unsupported_architecture_is_named(tmp_path, tiny_v3):
    bad = tmp_path / "llama"
    shutil.copytree(tiny_v3, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ModelLoadError,
        match="unsupported architecture LlamaForCausalLM; supported architectures: "
        "DeepseekV3ForCausalLM, DeepseekV2ForCausalLM",
    ):
        Engine(model_path=str(bad))


def test_bad_engine_settings_name_the_flag(tiny_v3):
    with pytest.raises(ConfigError, match="--page-size=0"):
        Engine(model_path=tiny_v3, page_size=0)
    with pytest.raises(ConfigError, match="unknown engine setting"):
        Engine(model_path=tiny_v3, pagesize=16)
    assert EngineArgs().page_size == 16


def test_logprobs_are_the_models_distribution(engine, tiny_v3):
    from tests.hf_reference import hf_logits

    params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2)
    out = engine.generate(prompt_token_ids=[[7, 8, 9]], sampling_params=params)[0]
    assert len(out.logprobs) == 3
    ref = torch.log_softmax(hf_logits(tiny_v3, [7, 8, 9])[-1], dim=-1)
    first = out.logprobs[0]
    assert first.top_ids[0] == out.token_ids[0] and len(first.top_ids) == 2
    assert abs(first.logprob - ref[out.token_ids[0]].item()) < 1e-4
    assert abs(first.top_logprobs[1] - ref.topk(2).values[1].item()) < 1e-4


def test_step_updates_stream_every_token_then_finish(engine):
    rid = engine.add_request(
        prompt_token_ids=[4, 5, 6], params=SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    )
    updates = []
    while engine.has_unfinished():
        updates += [u for u in engine.step_updates() if u.request_id == rid]
    assert [len(u.token_ids) for u in updates] == [1, 1, 1, 1]
    assert [u.finish_reason for u in updates] == [None, None, None, "length"]
    assert updates[-1].num_prompt_tokens == 3 and updates[-1].num_output_tokens == 4
