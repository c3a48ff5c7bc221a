"""Overlapped scheduling: step n+1 is planned while step n's forward runs, and the results are those
of the engine without overlap (--disable-overlap-schedule) and of transformers."""

from __future__ import annotations

import random
import threading

import pytest

from afd_engine import Engine, EngineArgs, SamplingParams
from tests.engine_helpers import random_prompts
from tests.hf_reference import hf_greedy

FLAGS = dict(num_threads=1, page_size=4, max_total_tokens=100, max_num_batched_tokens=40, max_running_requests=16)


def mixed_workload(engine: Engine, seed: int = 0) -> dict[str, tuple]:
    """Requests arrive over time with every way of ending: max_new_tokens, a stop token id met
    mid-generation, a stop string, the context length, an abort; some sample, some ask for
    logprobs; prompts share prefixes, and the small pool forces chunked prefill and preemption.
    Returns each request's (tokens, finish reason, text, logprob values); of an aborted one only
    the reason (how far it got depends on when the abort came)."""
    rng = random.Random(seed)
    vocab = engine.config.vocab_size
    shared = random_prompts(vocab, [17], seed, low=5)[0]
    results, added, step, to_abort = {}, 0, 0, {}  # to_abort: step -> request ids
    while added < 40 or engine.has_unfinished():
        step += 1
        for _ in range(rng.randrange(0, 5) if added < 40 else 0):
            prompt = (shared if rng.random() < 0.5 else []) + random_prompts(vocab, [rng.randrange(1, 30)], added, 5)[0]
            kind = added % 5
            params = SamplingParams(
                max_new_tokens=rng.randrange(1, 24) if added % 7 else 500,
                temperature=0.0 if kind != 4 else 0.8,
                seed=added,
                ignore_eos=True,
                stop_token_ids=[rng.randrange(5, vocab) for _ in range(40)] if kind == 1 else [],
                stop=["e", "a"] if kind == 2 else None,
                logprobs=2 if kind == 3 else None,
            )
            engine.add_request(prompt_token_ids=prompt, params=params, request_id=f"r{added}")
            if added % 7 == 0:  # will not end by itself before this
                to_abort.setdefault(step + 4, []).append(f"r{added}")
            added += 1
        for rid in to_abort.pop(step, []):
            results[rid] = (None, engine.abort(rid).finish_reason, None, None)
        for out in engine.step():
            assert out.error is None, out.error
            lps = [round(lp.logprob, 4) for lp in out.logprobs] if out.logprobs else None
            results[out.request_id] = (out.token_ids, out.finish_reason, out.text, lps)
    assert engine.pool.used_pages == engine.cache.num_pages  # nothing held by a finished request
    assert engine.cache.evictable_pages == engine.cache.num_pages
    return results


def test_overlap_gives_the_results_of_the_engine_without_it(tiny_v3):
    runs = {}
    for overlap in (True, False):
        with Engine(model_path=tiny_v3, overlap_schedule="on" if overlap else "off", **FLAGS) as engine:
            runs[overlap] = mixed_workload(engine)
            assert engine.scheduler.num_preemptions > 0
    assert runs[True] == runs[False]
    reasons = {r[1] for r in runs[True].values()}
    assert reasons == {"length", "stop", "abort"}


def test_overlap_is_token_exact_against_transformers_at_the_context_length(tiny_v3):
    prompts = random_prompts(512, [3, 9, 20, 5], seed=7, low=5)
    params = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    with Engine(model_path=tiny_v3, num_threads=1, context_length=26, overlap_schedule="on") as engine:
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
    for ids, out in zip(prompts, outs):
        assert out.finish_reason == "length" and len(ids) + len(out.token_ids) == 26
        assert out.token_ids == hf_greedy(tiny_v3, ids, 26 - len(ids))[0]


@pytest.mark.parametrize("overlap", [True, False])
def test_the_next_step_is_planned_while_the_forward_runs(tiny_v3, overlap):
    """The third forward waits until the scheduler has planned a fourth step: without overlap the
    scheduler would wait for that forward, and the forward times out."""
    with Engine(model_path=tiny_v3, overlap_schedule="on" if overlap else "off", num_threads=1) as engine:
        planned, forwards, waited = threading.Event(), [], []
        schedule, execute = engine.scheduler.schedule, engine.runner.execute

        def counting_schedule():
            if engine.scheduler.round == 3:  # (schedule() counts the rounds)
                planned.set()
            return schedule()

        def waiting_execute(step):
            forwards.append(step)
            if len(forwards) == 3:
                waited.append(planned.wait(timeout=2.0))
            return execute(step)

        engine.scheduler.schedule, engine.runner.execute = counting_schedule, waiting_execute
        params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
        out = engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params)[0]
        assert out.token_ids == hf_greedy(tiny_v3, [5, 6, 7], 6)[0]
        assert waited == [overlap]
        assert len(forwards) == 6  # no step for a token that max_new_tokens ends anyway


def test_a_request_that_stops_while_its_next_token_is_under_way(tiny_v3):
    """EOS-like stops are known only once the token is sampled: the step after it was already
    planned with the request in it. That extra token is dropped, the request's pages come back."""
    base = hf_greedy(tiny_v3, [11, 12, 13], 12)[0]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=[base[4]])
    with Engine(model_path=tiny_v3, num_threads=1, disable_radix_cache=True, overlap_schedule="on") as engine:
        updates = []
        rid = engine.add_request(prompt_token_ids=[11, 12, 13], params=params)
        while engine.has_unfinished():
            updates += [u for u in engine.step_updates() if u.request_id == rid]
        engine.stepper.drain()
        assert [t for u in updates for t in u.token_ids] == base[: base.index(base[4]) + 1]
        assert updates[-1].finish_reason == "stop" and all(u.finish_reason is None for u in updates[:-1])
        assert engine.pool.used_pages == 0 and engine.pool.free_rows == engine.args.max_running_requests


def test_the_flags():
    import argparse

    import torch

    from afd_engine.errors import ConfigError

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)

    def overlap(*flags: str, device: str = "cpu") -> bool:
        args = EngineArgs.from_cli(parser.parse_args(list(flags)))
        args.validate()
        return args.overlap_on(torch.device(device))

    assert not overlap() and overlap(device="cuda")  # auto: where the forward leaves the CPU free
    assert overlap("--overlap-schedule", "on") and not overlap("--overlap-schedule", "off", device="cuda")
    assert not overlap("--disable-overlap-schedule", device="cuda")
    with pytest.raises(ConfigError, match="--overlap-schedule='on': contradicts --disable-overlap-schedule"):
        overlap("--disable-overlap-schedule", "--overlap-schedule", "on")


@pytest.mark.parametrize("overlap", [True, False])
def test_prompt_logprobs_run_without_overlap_and_match(tiny_v3, overlap):
    params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    with Engine(
        model_path=tiny_v3, num_threads=1, max_num_batched_tokens=8, overlap_schedule="on" if overlap else "off"
    ) as e:
        rid = e.add_request(prompt_token_ids=list(range(5, 25)), params=params)
        other = e.add_request(prompt_token_ids=[7, 8], params=SamplingParams(max_new_tokens=5, temperature=0.0))
        outs = {}
        while e.has_unfinished():
            outs.update({o.request_id: o for o in e.step()})
    assert len(outs[rid].prompt_logprobs) == 20 and outs[rid].prompt_logprobs[0] is None
    assert outs[rid].token_ids == hf_greedy(tiny_v3, list(range(5, 25)), 3)[0]
    assert outs[other].token_ids == hf_greedy(tiny_v3, [7, 8], len(outs[other].token_ids))[0]
