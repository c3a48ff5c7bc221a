"""Speculative decoding in deployments of processes: colocated DP attention (the MTP module's MoE
through the same expert executor) and AFD (its routed experts on the FFN ranks, its passes steps of
their own there). Greedy outputs equal the single engine's without speculation, with 1 and 3 draft
steps, for requests with stop strings, `max_tokens` and logprobs; the ranks verify, draft and accept
exactly what the single engine does. The checkpoint's MTP module is a "copy" drafter
(tests/spec_helpers.py), so drafts are accepted in runs of repeated tokens."""

from __future__ import annotations

import json

import pytest

from afd_engine import Engine, SamplingParams, make_engine
from tests.spec_helpers import PROMPTS, make_copy_drafter

pytestmark = pytest.mark.slow

DEPLOYMENTS = {
    "colocated dp2": dict(mode="colocated", dp_size=2),
    "afd 2A 2x2 mb3": dict(mode="afd", dp_size=2, ffn_nodes=2, ffn_ranks_per_node=2, micro_batches=3),
}


@pytest.fixture(scope="module")
def copy_drafter(tmp_path_factory) -> str:
    return make_copy_drafter(tmp_path_factory.mktemp("copy-mtp"))


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"]}


def _params(stop: str) -> list[SamplingParams]:
    return [
        SamplingParams(max_new_tokens=23, temperature=0.0, ignore_eos=True, logprobs=1),
        SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop]),
        SamplingParams(max_new_tokens=19, temperature=0.0, ignore_eos=True),
        SamplingParams(max_new_tokens=30, temperature=0.0, guide=("json_schema", json.dumps(SCHEMA))),
    ]


@pytest.fixture(scope="module")
def reference(copy_drafter):
    """Speculation off, single engine: the outputs, a stop string (two tokens of request 1's
    output), and the single engine's speculation counters at 1 and 3 steps."""
    with Engine(model_path=copy_drafter, dtype="float32", num_threads=1) as off:
        plain = off.generate(prompt_token_ids=PROMPTS[1:2], sampling_params=_params("\x00")[1])[0]
        stop = off.tokenizer.decode(plain.token_ids[6:8])
        ref = off.generate(prompt_token_ids=PROMPTS, sampling_params=_params(stop))
    assert ref[1].finish_reason == "stop" and 0 <= json.loads(ref[3].text)["n"] <= 99
    counters = {}
    for steps in (1, 3):
        with Engine(
            model_path=copy_drafter, dtype="float32", num_threads=1, speculative_algorithm="NEXTN",
            speculative_num_steps=steps,
        ) as single:  # fmt: skip
            outs = single.generate(prompt_token_ids=PROMPTS, sampling_params=_params(stop))
            assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
            counters[steps] = single.stepper.counters
            assert counters[steps].accepted > 0
    return stop, ref, counters


@pytest.mark.timeout(300)
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("name", list(DEPLOYMENTS))
def test_deployment_speculates_exactly(copy_drafter, reference, name, steps):
    stop, ref, counters = reference
    with make_engine(
        model_path=copy_drafter, comm_timeout=30, dispatch_dtype="fp32", speculative_algorithm="NEXTN",
        speculative_num_steps=steps, **DEPLOYMENTS[name],
    ) as engine:  # fmt: skip
        outs = engine.generate(prompt_token_ids=PROMPTS, sampling_params=_params(stop))
        stats = engine.stats
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in ref]
    assert [a.top_ids for a in outs[0].logprobs] == [b.top_ids for b in ref[0].logprobs]
    # the ranks' drafts were the single engine's: the same verifications, drafts and acceptances
    # (split over the attention ranks, summed in the stats)
    single = counters[steps]
    assert (stats.spec_verifies, stats.spec_drafts, stats.spec_accepted) == (
        single.verifies,
        single.drafts,
        single.accepted,
    )
    assert list(stats.spec_accepted_histogram) == single.histogram


def test_the_copy_drafter_proposes_the_last_token(copy_drafter):
    """The fixture's premise: its drafts repeat the last token (so acceptance follows repetition)."""
    with Engine(
        model_path=copy_drafter, dtype="float32", num_threads=1, speculative_algorithm="NEXTN", speculative_num_steps=2
    ) as eng:
        rid = eng.add_request(prompt_token_ids=PROMPTS[1], params=SamplingParams(max_new_tokens=6, ignore_eos=True))
        seen = 0
        while eng.has_unfinished():
            eng.step()
            req = eng._requests.get(rid)
            if req is not None and req.draft_ids:
                assert req.draft_ids == [req.output_ids[-1]] * len(req.draft_ids)
                seen += 1
    assert seen > 0


@pytest.mark.timeout(300)
def test_the_trained_head_drafts_on_the_ffn_ranks_what_it_drafts_in_one_process():
    """The embedded model's trained MTP head (its block's experts on the FFN ranks): the AFD
    deployment accepts exactly the drafts the single engine accepts, so its draft passes computed
    the same module (a wrong expert result would change drafts and acceptances)."""
    from afd_engine.default_model import default_model_path

    path = str(default_model_path())
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    spec = dict(model_path=path, dtype="float32", speculative_algorithm="NEXTN", speculative_num_steps=2)
    with Engine(num_threads=1, **spec) as single:
        prompts = [single.tokenizer.encode(t) for t in ("Tell me about lists.", "The for statement", "Explain yield.")]
        ref = [o.token_ids for o in single.generate(prompt_token_ids=prompts, sampling_params=params)]
        counters = single.stepper.counters
    assert counters.accepted > counters.verifies // 4  # the head's drafts are often right
    with make_engine(comm_timeout=30, dispatch_dtype="fp32", **DEPLOYMENTS["afd 2A 2x2 mb3"], **spec) as engine:
        outs = [o.token_ids for o in engine.generate(prompt_token_ids=prompts, sampling_params=params)]
        stats = engine.stats
    assert outs == ref
    assert (stats.spec_verifies, stats.spec_accepted) == (counters.verifies, counters.accepted)
    assert list(stats.spec_accepted_histogram) == counters.histogram
