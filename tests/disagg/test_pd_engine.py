"""Prefill-decode disaggregation between a prefill and a decode engine in this process: tokens,
prefix caches on both sides, sampling state, handshake refusals, timeouts and aborts, pages."""

from __future__ import annotations

import functools
import json
import time

import pytest

from afd_engine import Engine, SamplingParams
from afd_engine.disagg.transfer import mooncake_available
from tests.disagg.pd_helpers import COMMON, PDPair, idle_pages
from tests.engine_helpers import prefix_sharing_rounds, random_prompts, run_staggered, staggered_reference

MOONCAKE_MISSING = mooncake_available()


def pair(path: str, backend: str = "builtin", prefill: dict | None = None, decode: dict | None = None) -> PDPair:
    if backend == "mooncake" and MOONCAKE_MISSING:
        pytest.skip(f"the Mooncake Transfer Engine does not import on this machine: {MOONCAKE_MISSING}")
    common = {**COMMON, "model_path": path, "disaggregation_transfer_backend": backend}
    return PDPair(
        Engine(**common, disaggregation_mode="prefill", **(prefill or {})),
        Engine(**common, disaggregation_mode="decode", **(decode or {})),
    )


GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


@functools.cache
def references(path: str):
    """The single engine's staggered tokens (checked against transformers) and prefix-sharing
    rounds, once per checkpoint (both backends compare with them)."""
    staggered = staggered_reference(path, [5, 40, 17, 70, 33, 9], GREEDY, seed=11, low=5)
    with Engine(model_path=path, **COMMON) as single:
        vocab = single.config.vocab_size
        return staggered, (vocab, prefix_sharing_rounds(single, vocab, GREEDY))


@pytest.mark.parametrize(
    "model,backend",
    [
        ("v3-yarn-qlora", "builtin"),
        ("v3-yarn-qlora", "mooncake"),
        ("qwen3-gqa4", "builtin"),
        ("qwen3-gqa4", "mooncake"),
    ],
)
def test_greedy_tokens_equal_the_single_engine(tiny_model_factory, model, backend):
    """Chunked prefills, requests joining while others decode, prompts that hit the prefix cache
    of the prefill side, of the decode side (which then takes fewer pages), or both."""
    path = tiny_model_factory(model)
    (prompts, want), (vocab, ref_rounds) = references(path)
    params = GREEDY
    pd = pair(path, backend)
    try:
        assert run_staggered(pd, prompts, params, every=2) == want
        rounds = prefix_sharing_rounds(pd, vocab, params)
        assert [r[1] for r in rounds] == [r[1] for r in ref_rounds]
        assert [r[2] for r in rounds] == [r[2] for r in ref_rounds]  # cached_tokens: the prefill side's hits
        assert pd.prefill.scheduler.cache_hit_tokens > 0
        assert pd.decode.disagg.cached_pages > 0  # pages the decode side already held were not sent
        assert pd.decode.disagg.transfer_bytes == pd.prefill.disagg.transfer_bytes > 0
        assert idle_pages(pd.prefill) and idle_pages(pd.decode)
    finally:
        pd.close()


def test_short_prompts_prefilled_by_the_decode_instance_itself(tiny_model_factory):
    """Conditional disaggregation (`afd router --local-prefill-max-tokens 20`): the prompts of 5,
    17 and 9 tokens go to the decode instance alone and prefill in its batch, among requests whose
    pages come from the prefill instance; every request's tokens equal the single engine's."""
    path = tiny_model_factory("v3-yarn-qlora")
    (prompts, want), _ = references(path)
    pd = pair(path)
    pd.local_max_tokens = 20
    try:
        assert run_staggered(pd, prompts, GREEDY, every=2) == want
        assert sorted(len(o.prompt_token_ids) for o in pd.prefill_outputs.values()) == [33, 40, 70]
        assert pd.decode.disagg.transfer_bytes == pd.prefill.disagg.transfer_bytes > 0
        assert idle_pages(pd.prefill) and idle_pages(pd.decode)
    finally:
        pd.close()


def test_seeded_sampling_and_logprobs_travel_with_the_request(tiny_v3):
    params = [
        SamplingParams(max_new_tokens=6, temperature=0.9, top_p=0.9, seed=s, logprobs=3, ignore_eos=True)
        for s in (1, 2)
    ] + [
        SamplingParams(
            max_new_tokens=4, temperature=0.0, prompt_logprobs=2, prompt_logprobs_start=0, logprobs=1, ignore_eos=True
        )
    ]
    with Engine(model_path=tiny_v3, **COMMON) as single:
        prompts = random_prompts(single.config.vocab_size, [30, 12, 21], seed=5, low=5)
        want = single.generate(prompt_token_ids=prompts, sampling_params=params)
    pd = pair(tiny_v3)
    try:
        got = pd.generate(prompt_token_ids=prompts, sampling_params=params)
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids
            # (a decode step's batch differs between the two: the values agree to float rounding)
            assert_logprobs_close(g.logprobs, w.logprobs)
            assert_logprobs_close(g.prompt_logprobs, w.prompt_logprobs)
        assert got[2].prompt_logprobs is not None and len(got[2].prompt_logprobs) == 21
    finally:
        pd.close()


def assert_logprobs_close(got, want) -> None:
    assert (got is None) == (want is None) and len(got or []) == len(want or [])
    for g, w in zip(got or [], want or []):
        assert (g is None) == (w is None)
        if g is not None:
            assert g.top_ids == w.top_ids
            assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
            assert g.top_logprobs == pytest.approx(w.top_logprobs, abs=1e-5)


def test_a_full_decode_instance_holds_requests_back_instead_of_failing_them(tiny_v3):
    """Room for about two requests at a time on the decode side: the rest wait for pages."""
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    pd = pair(tiny_v3, decode={"max_total_tokens": 96, "disable_radix_cache": True})
    try:
        prompts = random_prompts(pd.prefill.config.vocab_size, [40] * 5, seed=8, low=5)
        with Engine(model_path=tiny_v3, **COMMON) as single:
            want = [o.token_ids for o in single.generate(prompt_token_ids=prompts, sampling_params=params)]
        outs = pd.generate(prompt_token_ids=prompts, sampling_params=params)
        assert [o.error for o in outs] == [None] * 5
        assert [o.token_ids for o in outs] == want
        assert idle_pages(pd.decode) and pd.decode.pool.used_pages == 0
    finally:
        pd.close()


def test_step_records_count_the_requests_joining_from_the_prefill_side(tiny_v3, tmp_path):
    """--record-steps on both sides: every request joins one decode step (`joins`, the step whose
    round took its KV and first token in); the prefill side has nothing joining, and counts the
    requests it handed on in its next step (`left`)."""
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    prefill, decode = tmp_path / "p.jsonl", tmp_path / "d.jsonl"
    pd = pair(tiny_v3, prefill={"record_steps": str(prefill)}, decode={"record_steps": str(decode)})
    try:
        prompts = random_prompts(pd.prefill.config.vocab_size, [20, 9, 30, 12, 25], seed=3, low=5)
        outs = pd.generate(prompt_token_ids=prompts, sampling_params=params)
        assert [o.error for o in outs] == [None] * 5
    finally:
        pd.close()
    d = [json.loads(line) for line in decode.read_text().splitlines()]
    p = [json.loads(line) for line in prefill.read_text().splitlines()]
    assert sum(r["joins"] for r in d) == 5
    assert all(r["seqs"] >= r["joins"] for r in d)  # those that joined decode in that step
    assert {r["joins"] for r in p} == {0}
    # a request decodes its tokens 2-4 in the step it joined and the two after it, and counts as
    # left in the step after those (the decode side's first three steps: none left yet)
    assert [r["left"] for r in d] == [0, 0, 0] + [r["joins"] for r in d[:-3]]
    assert sum(r["left"] for r in p) >= 1  # handed on before the prefill side's last step


def test_a_decode_that_outgrows_pages_reserved_for_others_waits_for_them(tiny_v3):
    """160 tokens of pages on the decode side (16-token pages): a request decodes alone while
    another's 7 pages wait for a prefill that never comes. When the first needs a page there is
    none; it is preempted (not ended for `length`), and once the reservation times out it resumes
    and gives the single engine's tokens."""
    params = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
    pd = pair(tiny_v3, decode={"max_total_tokens": 160, "page_size": 16, "disaggregation_timeout": 1.0})
    try:
        (prompt,) = random_prompts(pd.prefill.config.vocab_size, [20], seed=9, low=5)
        with Engine(model_path=tiny_v3, **COMMON) as single:
            (want,) = single.generate(prompt_token_ids=[prompt], sampling_params=params)
        rid = pd.add_request(prompt_token_ids=prompt, params=params)
        pd.run_until(lambda: len(pd.decode._requests[rid].output_ids) >= 2)
        held = pd.add_request(prompt_token_ids=[7] * 100, params=params, to_prefill=False)
        pd.run_until(lambda: pd.decode._requests[held].disagg_room in pd.decode.disagg.reserved)
        outs = {o.request_id: o for o in pd.run_until(lambda: not pd.decode.has_unfinished())}
        assert outs[held].error == "the prefill instance sent no KV cache within 1 s (--disaggregation-timeout)"
        assert outs[rid].finish_reason == "length" and outs[rid].error is None
        assert outs[rid].token_ids == want.token_ids and pd.decode.scheduler.num_preemptions >= 1
        assert idle_pages(pd.decode)
    finally:
        pd.close()


def test_mismatched_instances_are_refused_at_the_handshake(tiny_v3):
    pd = pair(tiny_v3, decode={"page_size": 8})
    try:
        rid = pd.add_request(prompt_token_ids=[5] * 20, params=SamplingParams(max_new_tokens=3))
        (out,) = pd.run_until(lambda: not pd.decode.has_unfinished())
        assert out.request_id == rid and out.finish_reason == "error"
        assert out.error == "the prefill and decode instances do not match: page size: prefill 16, decode 8"
        assert pd.decode.pool.used_pages == 0  # refused before reserving anything
    finally:
        pd.close()


def test_fp8_index_keys_travel_in_the_rows_and_must_match(tiny_model_factory):
    """DeepSeek-V3.2 with --index-cache-dtype fp8 on both sides: the single engine's tokens (its
    packed keys cross as they are); on one side only: refused naming the row size."""
    path = tiny_model_factory("v32-sparse")
    fp8 = {"index_cache_dtype": "fp8"}
    prompts = random_prompts(512, (40, 9, 70), seed=4, low=5)
    with Engine(model_path=path, **COMMON, **fp8) as single:
        want = [o.token_ids for o in single.generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    pd = pair(path, prefill=fp8, decode=fp8)
    try:
        assert [o.token_ids for o in pd.generate(prompt_token_ids=prompts, sampling_params=GREEDY)] == want
    finally:
        pd.close()
    pd = pair(path, prefill=fp8)
    try:
        pd.add_request(prompt_token_ids=prompts[0], params=GREEDY)
        (out,) = pd.run_until(lambda: not pd.decode.has_unfinished())
        assert out.error == (
            "the prefill and decode instances do not match: KV cache row size (with sparse attention, "
            "--index-cache-dtype changes it): prefill 49, decode 72"
        )
    finally:
        pd.close()


def test_a_prefill_side_that_never_gets_the_request_times_out_on_the_decode_side(tiny_v3):
    pd = pair(tiny_v3, decode={"disaggregation_timeout": 0.5})
    try:
        pd.add_request(prompt_token_ids=[7] * 30, params=SamplingParams(max_new_tokens=3), to_prefill=False)
        (out,) = pd.run_until(lambda: not pd.decode.has_unfinished())
        assert out.finish_reason == "error"
        assert out.error == "the prefill instance sent no KV cache within 0.5 s (--disaggregation-timeout)"
        assert pd.decode.pool.used_pages == 0
        # the instance goes on serving
        (ok,) = pd.generate(prompt_token_ids=[[7] * 30], sampling_params=SamplingParams(max_new_tokens=3))
        assert ok.error is None and len(ok.token_ids) == 3
        assert idle_pages(pd.prefill) and idle_pages(pd.decode)
    finally:
        pd.close()


def test_a_request_no_decode_instance_reserves_times_out_on_the_prefill_side(tiny_v3):
    pd = pair(tiny_v3, prefill={"disaggregation_timeout": 0.5})
    try:
        pd.prefill.add_request(prompt_token_ids=[9] * 12, request_id="lonely", disaggregation={"room": 3})
        pd.run_until(lambda: not pd.prefill.has_unfinished())
        out = pd.prefill_outputs["lonely"]
        assert out.finish_reason == "error"
        assert out.error == "no decode instance reserved pages for this request within 0.5 s (--disaggregation-timeout)"
        assert pd.prefill.pool.used_pages == 0
    finally:
        pd.close()


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_an_abort_on_either_side_reaches_the_other(tiny_v3, side):
    pd = pair(tiny_v3)
    try:
        # 200 tokens in chunks of 32: the abort lands while the prefill side is still at it
        prompt = random_prompts(512, [200], seed=2, low=5)[0]
        rid = pd.add_request(prompt_token_ids=prompt, params=SamplingParams(max_new_tokens=50))
        pd.run_until(lambda: bool(pd.prefill.scheduler.running))  # reserved on D, prefilling on P
        if side == "decode":
            pd.decode.abort(rid)
        else:
            pd.prefill.abort(f"p-{rid}")
        time.sleep(0.1)  # (the other side's message is on its way: it must not race the prefill)
        outs = pd.run_until(lambda: not pd.has_unfinished())
        if side == "decode":  # the prefill side fails its request
            failed = pd.prefill_outputs[f"p-{rid}"]
            assert (failed.finish_reason, failed.error) == (
                "error",
                "the decode instance failed this request: aborted on the decode side",
            )
        else:  # the decode side fails its request
            assert [(o.request_id, o.finish_reason, o.error) for o in outs] == [
                (rid, "error", "aborted on the prefill side")
            ]
        assert idle_pages(pd.prefill) and idle_pages(pd.decode)
        assert pd.decode.disagg.reserved_pages == 0
    finally:
        pd.close()


def test_instances_refuse_requests_that_do_not_fit_their_role(tiny_v3):
    from afd_engine.errors import InvalidRequestError

    with Engine(model_path=tiny_v3, **COMMON, disaggregation_mode="prefill") as prefill:
        with pytest.raises(InvalidRequestError, match="requests come through `afd router`"):
            prefill.add_request(prompt_token_ids=[1, 2, 3])
    with Engine(model_path=tiny_v3, **COMMON, disaggregation_mode="decode") as decode:
        with pytest.raises(InvalidRequestError, match="requests come through `afd router`"):
            decode.add_request(prompt_token_ids=[1, 2, 3], disaggregation="room 1")
        with pytest.raises(InvalidRequestError, match="needs the prefill instance's bootstrap_host"):
            decode.add_request(prompt_token_ids=[1, 2, 3], disaggregation={"room": 1})
        decode.add_request(prompt_token_ids=[1, 2, 3], disaggregation={"room": 2, "bootstrap": "127.0.0.1:1"})
        with pytest.raises(InvalidRequestError, match="bootstrap_room 2 is in use by another request"):
            decode.add_request(prompt_token_ids=[1, 2, 3], disaggregation={"room": 2, "bootstrap": "127.0.0.1:1"})
    with Engine(model_path=tiny_v3, **COMMON) as plain:
        with pytest.raises(InvalidRequestError, match="not disaggregated"):
            plain.add_request(prompt_token_ids=[1, 2, 3], disaggregation={"room": 1})
