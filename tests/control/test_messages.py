"""The control messages survive the wire exactly: the engine's outputs (msgpack), every field and
every kind, and a request to the engine (JSON) with every sampling field."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from afd_engine.control import messages as msgs
from afd_engine.runtime.request import TokenLogprob, TokenUpdate
from afd_engine.sampling_params import SamplingParams

UPDATES = [
    TokenUpdate("plain", [17], None, None, num_prompt_tokens=5, num_output_tokens=1),
    TokenUpdate(
        "with-logprobs",
        [3, 4],
        [TokenLogprob(-0.25, [3, 9], [-0.25, -1.5]), TokenLogprob(-2.0, [], [])],
        "stop",
        text_trim=-3,
        num_prompt_tokens=7,
        num_output_tokens=9,
        num_cached_tokens=4,
        prompt_logprobs=[None, TokenLogprob(-1.0, [8], [-0.5])],
    ),
    TokenUpdate("failed", [], None, "error", error="the engine could not take this request: \u2603"),
]


def test_a_step_output_round_trips_exactly():
    stats = msgs.EngineStats(3, 1, 40, 100, 12, 64, 200, 5, (10.5, 30.0))
    out = msgs.StepOutput(UPDATES, stats, rank=1)
    back = msgs.decode_output(msgs.encode_output(out))
    assert back == out
    assert isinstance(back.stats.expert_rank_load, tuple) and isinstance(back.updates[1].logprobs[0], TokenLogprob)


def test_the_other_outputs_round_trip_and_nothing_else_travels_that_way():
    rejected = msgs.Rejected("r1", "prompt too long", "prompt")
    report = msgs.ExpertLoadReport("load-1", 0, {"load": [[1, 2]], "placement": {"version": 2}})
    assert msgs.decode_output(msgs.encode_output(rejected)) == rejected
    assert msgs.decode_output(msgs.encode_output(report)) == report
    assert msgs.decode_output(msgs.encode_output(msgs.StepOutput())) == msgs.StepOutput()
    with pytest.raises(TypeError, match="AbortRequest does not travel from the engine"):
        msgs.encode_output(msgs.AbortRequest("r1"))
    with pytest.raises(ValueError, match="unknown engine output"):
        msgs.decode_output(msgpack.packb(["Mystery", 1]))


def test_updates_travel_as_arrays_not_maps():
    frame = msgpack.unpackb(msgs.encode_output(msgs.StepOutput(UPDATES[:1])))
    # (the last two: prompt logprobs and the disaggregated TTFT split, both absent)
    assert frame[0] == "StepOutput" and frame[3] == [["plain", [17], None, None, None, None, 5, 1, 0, None, None]]


def test_a_disaggregated_request_and_its_timeline_round_trip():
    sent = msgs.AddRequest("r-2", [5, 6], SamplingParams(), {"room": 7, "bootstrap": "10.0.0.1:8998"})
    assert msgs.decode(msgs.encode(sent)) == sent
    assert msgs.decode(msgs.encode(msgs.AddRequest("r-3", [5], SamplingParams()))).disaggregation is None
    update = TokenUpdate("d", [3], None, None, timeline={"queue_s": 0.5, "transfer_bytes": 1024.0})
    (got,) = msgs.decode_output(msgs.encode_output(msgs.StepOutput([update]))).updates
    assert got.timeline == {"queue_s": 0.5, "transfer_bytes": 1024.0}


def test_an_add_request_round_trips_with_every_sampling_field():
    params = SamplingParams(
        max_new_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=3,
        seed=11,
        stop=("a", "bc"),
        stop_token_ids=(4, 5),
        ignore_eos=True,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        logprobs=2,
        prompt_logprobs=1,
        prompt_logprobs_start=1,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.2,
        min_p=0.1,
        min_tokens=2,
        logit_bias={7: -3.5, 9: 1.0},
        guide=("json_schema", '{"type": "object"}'),
    )
    default = SamplingParams()
    unset = [f.name for f in dataclasses.fields(SamplingParams) if getattr(params, f.name) == getattr(default, f.name)]
    assert not unset, f"give these a value other than their default: {unset}"
    sent = msgs.AddRequest("r-1", [5, 6, 7], params)
    got = msgs.decode(msgs.encode(sent))
    assert got == sent
    assert [getattr(got.params, f.name) for f in dataclasses.fields(SamplingParams)] == [
        getattr(params, f.name) for f in dataclasses.fields(SamplingParams)
    ]
