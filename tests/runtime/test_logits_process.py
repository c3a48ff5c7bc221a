"""Penalties, logit bias, min_p, min_tokens and grammars against plain reference implementations,
and in the engine: against transformers' model with the reference processing, and unconstrained
requests unaffected by constrained ones in the same batch."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from afd_engine.engine import Engine
from afd_engine.runtime.logits_process import LogitControls
from afd_engine.runtime.request import Request
from afd_engine.runtime.sampler import apply_min_p
from afd_engine.sampling_params import SamplingParams
from tests.hf_reference import hf_logits

V = 50


def reference_process(logits: list[float], prompt: list[int], output: list[int], p: SamplingParams, eos: set[int]):
    """One row, token by token, as vLLM documents the processing."""
    out = list(logits)
    for token, bias in p.logit_bias:
        out[token] += bias
    if len(output) < p.min_tokens:
        for token in (eos if not p.ignore_eos else set()) | set(p.stop_token_ids):
            out[token] = -math.inf
    for token in range(len(out)):
        count = output.count(token)
        if token in prompt or count:
            out[token] = out[token] / p.repetition_penalty if out[token] > 0 else out[token] * p.repetition_penalty
        out[token] -= p.frequency_penalty * count
        out[token] -= p.presence_penalty * (count > 0)
    return out


def _request(rid: str, prompt: list[int], output: list[int], params: SamplingParams) -> Request:
    req = Request(rid=rid, prompt_ids=prompt, params=params, seed=0)
    req.output_ids = list(output)
    return req


CASES = [
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=-0.7),
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(repetition_penalty=0.6, presence_penalty=0.3, frequency_penalty=0.4),
    SamplingParams(logit_bias={3: 5.0, 7: -100.0}),
    SamplingParams(min_tokens=9, stop_token_ids=[4]),
    SamplingParams(),  # untouched row between processed ones
    SamplingParams(min_tokens=2, ignore_eos=True, frequency_penalty=2.0),
]


def test_processing_matches_the_reference_row_by_row():
    gen = torch.Generator().manual_seed(0)
    reqs, offsets = [], []
    for i, p in enumerate(CASES):
        prompt = torch.randint(0, V, (6,), generator=gen).tolist()
        output = torch.randint(0, V, (i + 2,), generator=gen).tolist()
        reqs.append(_request(f"r{i}", prompt, output, p))
        offsets.append(len(output))
    logits = torch.randn(len(CASES), V, generator=gen) * 3
    controls = LogitControls.build(reqs, offsets, frozenset({1}), V, torch.device("cpu"))
    got = controls.apply(logits)
    for i, req in enumerate(reqs):
        want = reference_process(logits[i].tolist(), req.prompt_ids, req.output_ids, req.params, {1})
        assert got[i].tolist() == pytest.approx(want, rel=1e-6, abs=1e-5), f"row {i}: {req.params}"
    assert torch.isneginf(got[5, [1, 4]]).all() and not torch.isneginf(got[7, 1])  # min_tokens bans
    # the counts advance with the sampled tokens: a second step sees them
    tokens = torch.arange(len(CASES)) + 10
    controls.accept(tokens)
    for req, token in zip(reqs, tokens.tolist()):
        req.output_ids.append(token)
    again = controls.apply(logits)
    for i in (0, 1, 3, 7):
        want = reference_process(logits[i].tolist(), reqs[i].prompt_ids, reqs[i].output_ids, reqs[i].params, {1})
        assert again[i].tolist() == pytest.approx(want, rel=1e-6, abs=1e-5)


def test_nothing_to_process_builds_nothing():
    reqs = [_request("a", [1, 2], [3], SamplingParams(temperature=0.5, top_k=3))]
    assert LogitControls.build(reqs, [1], frozenset({1}), V, torch.device("cpu")) is None


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_probability():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, V, generator=gen) * 2
    min_ps = torch.tensor([0.0, 0.05, 0.3, 1.0])
    got = apply_min_p(logits, min_ps)
    probs = torch.softmax(logits, dim=-1)
    for row in range(4):
        keep = probs[row] >= min_ps[row] * probs[row].max()
        assert torch.equal(~torch.isneginf(got[row]), keep), row
        assert torch.equal(got[row][keep], logits[row][keep])
    assert int((~torch.isneginf(got[3])).sum()) == 1  # min_p 1: only the top token


@pytest.fixture(scope="module")
def engine(tiny_v3):
    with Engine(model_path=tiny_v3, dtype="float32", num_threads=1) as eng:
        yield eng


def _reference_greedy(path: str, prompt: list[int], p: SamplingParams, n: int, eos: set[int]) -> list[int]:
    """Greedy tokens of transformers' model with the reference processing, recomputed per token."""
    out: list[int] = []
    for _ in range(n):
        logits = hf_logits(path, prompt + out)[-1].tolist()
        processed = reference_process(logits, prompt, out, p, eos)
        out.append(max(range(len(processed)), key=processed.__getitem__))
    return out


@pytest.mark.parametrize(
    "params",
    [
        dict(frequency_penalty=1.0, presence_penalty=0.5),
        dict(repetition_penalty=1.5),
        dict(logit_bias={10: 4.0, 11: 4.0}),
    ],
    ids=["frequency+presence", "repetition", "logit_bias"],
)
def test_engine_greedy_with_processing_matches_transformers(engine, tiny_v3, params):
    prompt = [3, 3, 3, 3]  # (unprocessed, greedy repeats a token at its 7th)
    p = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, **params)
    out = engine.generate(prompt_token_ids=[prompt], sampling_params=p)[0].token_ids
    assert out == _reference_greedy(tiny_v3, prompt, p, 16, set())
    plain = engine.generate(
        prompt_token_ids=[prompt], sampling_params=SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    )
    assert plain[0].token_ids != out  # the processing changed the output


def test_min_tokens_holds_off_eos(engine):
    eos = engine.tokenizer.eos_token_id
    prompt = [5, 9, 12]
    forced = SamplingParams(max_new_tokens=10, temperature=0.0, logit_bias={eos: 100.0})
    assert engine.generate(prompt_token_ids=[prompt], sampling_params=forced)[0].token_ids == [eos]
    held = SamplingParams(max_new_tokens=10, temperature=0.0, logit_bias={eos: 100.0}, min_tokens=4)
    out = engine.generate(prompt_token_ids=[prompt], sampling_params=held)[0]
    assert len(out.token_ids) == 5 and out.token_ids[-1] == eos and eos not in out.token_ids[:4]
    assert out.finish_reason == "stop"


PLAIN = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_constrained_and_unconstrained_in_one_batch(tiny_v3, overlap):
    prompts = [[5, 9, 12, 9], [30, 41, 7], [8, 8, 2, 40, 11], [17, 3]]
    regex = SamplingParams(max_new_tokens=30, temperature=0.0, guide=("regex", "[a-z]{2,6}-[0-9]{3}"))
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
    }
    sampled = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, guide=("json_schema", json.dumps(schema)))
    with Engine(model_path=tiny_v3, dtype="float32", num_threads=1, disable_overlap_schedule=not overlap) as eng:
        alone = [eng.generate(prompt_token_ids=[p], sampling_params=PLAIN)[0].token_ids for p in prompts[:2]]
        outs = eng.generate(prompt_token_ids=prompts, sampling_params=[PLAIN, PLAIN, regex, sampled])
        again = eng.generate(prompt_token_ids=[prompts[3]], sampling_params=sampled)[0]
    assert [o.token_ids for o in outs[:2]] == alone
    assert re.fullmatch("[a-z]{2,6}-[0-9]{3}", outs[2].text) and outs[2].finish_reason == "stop"
    assert 0 <= json.loads(outs[3].text)["n"] <= 99 and outs[3].finish_reason == "stop"
    assert again.token_ids == outs[3].token_ids  # seeded and constrained: reproducible alone


def test_a_guide_that_does_not_compile_fails_its_request_only(engine):
    bad = SamplingParams(max_new_tokens=5, guide=("regex", "(unclosed"))
    outs = engine.generate(prompt_token_ids=[[5, 9], [5, 9]], sampling_params=[bad, PLAIN])
    assert outs[0].finish_reason == "error" and "grammar did not compile" in outs[0].error
    assert len(outs[1].token_ids) == 16


def test_grammars_and_penalties_survive_preemption_and_chunked_prefill(tiny_v3):
    """A small pool preempts (the output is kept, and with it the matcher and counts) and prefills
    in chunks; every request gets the tokens it gets in a pool that holds them all."""
    prompts = [[5 + i, 9, 12, 40 + i] * 5 for i in range(8)]
    params = [
        SamplingParams(max_new_tokens=40, temperature=0.0, guide=("regex", "[a-z]{8,24}")),
        SamplingParams(
            max_new_tokens=24, temperature=0.0, ignore_eos=True, frequency_penalty=1.5, repetition_penalty=1.3
        ),
    ] * 4
    runs = {}
    for small in (True, False):
        flags = dict(page_size=4, max_total_tokens=100, max_num_batched_tokens=16) if small else {}
        with Engine(model_path=tiny_v3, dtype="float32", num_threads=1, **flags) as eng:
            runs[small] = [o.token_ids for o in eng.generate(prompt_token_ids=prompts, sampling_params=params)]
            if small:
                assert eng.scheduler.num_preemptions > 0
                texts = [eng.tokenizer.decode(t, skip_special_tokens=True) for t in runs[small][::2]]
    assert runs[True] == runs[False]
    assert all(re.fullmatch("[a-z]{8,24}", t) for t in texts), texts
