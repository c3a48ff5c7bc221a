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


def test_every_other_request_kind_round_trips_and_outputs_do_not_travel_that_way():
    for msg in (msgs.AbortRequest("r-9"), msgs.Shutdown(), msgs.Wake(), msgs.DumpExpertLoad("load-3")):
        assert msgs.decode(msgs.encode(msg)) == msg
    with pytest.raises(TypeError, match="Rejected does not travel to the engine"):
        msgs.encode(msgs.Rejected("r1", "no"))


def test_a_rank_failure_round_trips():
    failed = msgs.RankFailed(2, "RuntimeError: lost FFN rank 1 \u2603")
    assert msgs.decode_output(msgs.encode_output(failed)) == failed


def test_an_add_request_the_engine_cannot_take_is_answered_by_its_id():
    params = msgpack.unpackb(msgs.encode(msgs.AddRequest("r", [5], SamplingParams())))[3]

    def add(rid, prompt_ids, **changes) -> bytes:
        return msgpack.packb(["AddRequest", rid, prompt_ids, {**params, **changes}, None])

    bad_param = msgs.decode(add("r-1", [5], top_k=-7))
    assert bad_param == msgs.InvalidAddRequest("r-1", bad_param.message, "top_k") and "top_k" in bad_param.message
    unknown = msgs.decode(add("r-2", [5], bogus=1))
    assert isinstance(unknown, msgs.InvalidAddRequest) and unknown.rid == "r-2" and "bogus" in unknown.message
    wrong_type = msgs.decode(add("r-3", "abc"))
    assert isinstance(wrong_type, msgs.InvalidAddRequest) and wrong_type.rid == "r-3"
    with pytest.raises(ValueError):  # no request id to answer: the frame is dropped by the caller
        msgs.decode(msgpack.packb(["AbortRequest", 7]))
    with pytest.raises(ValueError):
        msgs.decode(b"not msgpack at all")


def test_a_lone_surrogate_cannot_go_on_the_wire():
    # msgpack strings are UTF-8: the API server rejects such text before it would reach `encode`
    with pytest.raises(UnicodeEncodeError):
        msgs.encode(msgs.AbortRequest("\ud800"))


def test_update_rows_follow_token_update_fields():
    from afd_engine.control.messages import _UpdateRow

    assert _UpdateRow.__struct_fields__ == tuple(f.name for f in dataclasses.fields(TokenUpdate))


def test_engine_stats_total_sums_counters_and_takes_the_deployments_ffn_figures():
    a = msgs.EngineStats(1, 2, expert_rank_load=(1.0, 2.0), ffn_ranks_alive=4, ffn_recoveries=1)
    b = msgs.EngineStats(3, 0, expert_rank_load=(), ffn_ranks_alive=3, ffn_recoveries=2, kv_transfer_seconds=0.5)
    total = msgs.EngineStats.total([a, b])
    assert total == msgs.EngineStats(
        4, 2, expert_rank_load=(1.0, 2.0), ffn_ranks_alive=3, ffn_recoveries=2, kv_transfer_seconds=0.5
    )
    assert msgs.EngineStats.total([]) == msgs.EngineStats()
