"""Speculative decoding in single mode (runtime/spec_step.py): greedy outputs equal speculation off,
whatever the drafts; the MTP module's drafts equal the module recomputed from scratch over the kept
tokens (so its cache holds exactly the kept positions); seeded sampling stays reproducible; pages
and counters add up.

A tiny random MTP module almost never guesses right, so most tests feed the verifier "oracle"
drafts: the reference continuation with some tokens corrupted, which exercises acceptance, partial
acceptance, stop strings inside an accepted run and `max_tokens` alike. The module itself still runs
every step (its cache and chain are what the from-scratch test checks).
"""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from afd_engine import Engine, SamplingParams
from afd_engine.engine_args import EngineArgs
from afd_engine.errors import ConfigError
from afd_engine.models.forward_batch import ForwardBatch, SeqChunk
from afd_engine.runtime import spec_step
from afd_engine.runtime.kv_cache import KVPool
from afd_engine.tiny_model import make_tiny_model

MTP = {"num_nextn_predict_layers": 1}
FLAGS = dict(dtype="float32", num_threads=1, page_size=4, kv_cache_memory_mb=16)
PROMPTS = [[5, 9, 33, 12, 7], [4, 8, 15, 16, 23, 42, 17, 3], [11] * 20, [30, 41, 7], [8, 8, 2, 40, 11] * 7]


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("spec"), arch="deepseek_v3", seed=4, overrides=MTP))


@pytest.fixture(scope="module")
def sparse_mtp_model(tmp_path_factory) -> str:
    """DeepSeek-V3.2: the module is a decoder layer with its own indexer, whose keys share its cache
    layer; verify rows choose among the tokens up to their own positions."""
    return str(make_tiny_model(tmp_path_factory.mktemp("spec32"), arch="deepseek_v32", seed=6, overrides=MTP))


BOTH = pytest.mark.parametrize("model", ["mtp_model", "sparse_mtp_model"])


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_new_tokens=13, temperature=0.0, ignore_eos=True),  # lands inside accepted runs
        SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True),
        SamplingParams(max_new_tokens=17, temperature=0.0, ignore_eos=True, logprobs=0),
        SamplingParams(max_new_tokens=21, temperature=0.0, ignore_eos=True),
    ]


@pytest.fixture
def oracle(monkeypatch):
    """Replaces the module's drafts by the reference continuation (`oracle.want`: prompt -> tokens),
    each token kept with probability 0.7 (else off by one); records the module's own drafts."""

    class Oracle:
        want: dict[tuple[int, ...], list[int]] = {}
        perfect: set[tuple[int, ...]] = set()  # prompts whose drafts are never corrupted
        rng = random.Random(0)
        real: list[tuple[list[int], list[int]]] = []  # (known tokens after the step, the module's drafts)

    real_draft = spec_step.SpecStepper._draft

    def draft(self, prepared, hidden, accepted, emitted):
        drafts = real_draft(self, prepared, hidden, accepted, emitted)
        if accepted is None:
            return drafts
        out = []
        for r, a, e, mine in zip(prepared.inputs.samplers, accepted.tolist(), emitted.tolist(), drafts):
            known = r.prompt_ids + r.output_ids + r.draft_ids[:a] + [e]  # after the step
            Oracle.real.append((known, mine))
            cont = Oracle.want.get(tuple(r.prompt_ids))
            if cont is None or not mine:
                out.append(mine)
                continue
            n = len(known) - len(r.prompt_ids)
            keep = 1.0 if tuple(r.prompt_ids) in Oracle.perfect else 0.7
            out.append([t if Oracle.rng.random() < keep else (t + 1) % 500 for t in cont[n : n + self.num_steps]])
        return out

    monkeypatch.setattr(spec_step.SpecStepper, "_draft", draft)
    return Oracle


@BOTH
@pytest.mark.parametrize("steps", [1, 3])
def test_greedy_tokens_equal_speculation_off(model, oracle, steps, request):
    """Mixed lengths, logprobs, a stop string taken from the reference output (so it lands inside
    accepted runs), chunked prefill and preemption in a small pool: the same tokens, text, finish
    reasons and logprobs as without speculation."""
    mtp_model = request.getfixturevalue(model)
    with Engine(model_path=mtp_model, **FLAGS) as off:
        params = _params()
        ref = off.generate(prompt_token_ids=PROMPTS, sampling_params=params)
        ref2_full = ref[2].token_ids  # (the oracle drafts past the stop string too)
        # tokens 8 and 9: with perfect drafts, token 9 is inside a verify's run at 1 and 3 steps
        stop_text = off.tokenizer.decode(ref[2].token_ids[8:10])
        params[2] = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop_text])
        ref[2] = off.generate(prompt_token_ids=[PROMPTS[2]], sampling_params=params[2])[0]
    assert ref[2].finish_reason == "stop" and len(ref[2].token_ids) == 10
    oracle.want = {tuple(p): o.token_ids for p, o in zip(PROMPTS, ref)}
    oracle.perfect = {tuple(PROMPTS[2])}
    oracle.want[tuple(PROMPTS[2])] = ref2_full
    small = dict(FLAGS, max_total_tokens=56, max_num_batched_tokens=16)
    with Engine(model_path=mtp_model, speculative_algorithm="NEXTN", speculative_num_steps=steps, **small) as eng:
        _check_cached_after_every_step(eng)
        outs = eng.generate(prompt_token_ids=PROMPTS, sampling_params=params)
        counters = eng.stepper.counters
        preemptions = eng.scheduler.num_preemptions
        pool, cache = eng.pool, eng.cache
        assert pool.used_pages == cache.num_pages  # every page of the requests went back (or to the cache)
    for got, want in zip(outs, ref):
        assert got.token_ids == want.token_ids
        assert got.text == want.text and got.finish_reason == want.finish_reason
        assert (got.logprobs is None) == (want.logprobs is None)
        for a, b in zip(got.logprobs or [], want.logprobs or []):
            assert a.top_ids == b.top_ids and a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert [len(o.token_ids) for o in outs[:2]] == [24, 13]
    assert counters.accepted > 0 and counters.verifies > 0
    assert counters.histogram[steps] > 0 and counters.histogram[0] > 0  # whole runs kept, and none
    assert preemptions > 0


def _check_cached_after_every_step(eng: Engine) -> None:
    """After each step every live request that sampled has all its tokens but the newest cached:
    a verify's kept drafts count as computed (they are never prefilled again)."""
    finish = eng.stepper._finish

    def checked(step, result):
        out = finish(step, result)
        for req in step.prepared.inputs.samplers:
            if req.finish_reason is None and req.row is not None:
                assert req.num_cached == req.total_len - 1, (req.rid, req.num_cached, req.total_len)
        return out

    eng.stepper._finish = checked


@BOTH
def test_drafts_equal_the_module_recomputed_from_scratch(model, oracle, request):
    """After every step, each request's drafts (the module's own) equal what the module gives over
    a fresh cache: the main model over the kept tokens, the module over every kept position, then
    its chain. Oracle drafts make steps keep several tokens, whose positions the module rewrites."""
    mtp_model = request.getfixturevalue(model)
    with Engine(model_path=mtp_model, **FLAGS) as off:
        ref = off.generate(
            prompt_token_ids=PROMPTS[:3], sampling_params=SamplingParams(max_new_tokens=16, ignore_eos=True)
        )
    oracle.want = {tuple(p): o.token_ids for p, o in zip(PROMPTS, ref)}
    with Engine(model_path=mtp_model, speculative_algorithm="NEXTN", speculative_num_steps=3, **FLAGS) as eng:
        eng.generate(prompt_token_ids=PROMPTS[:3], sampling_params=SamplingParams(max_new_tokens=16, ignore_eos=True))
        checked = 0
        for known, drafts in oracle.real[::3]:
            assert drafts == _scratch_drafts(eng, known, len(drafts)), (known, drafts)
            checked += len(drafts) > 1
    assert checked >= 5


def _scratch_drafts(eng: Engine, known: list[int], n: int) -> list[int]:
    """The module's chain of `n` drafts after `known` (whose last token is not cached), in a fresh pool."""
    model, cfg = eng.model, eng.config
    m = len(known)
    pool = KVPool(cfg.num_layers + 1, cfg.kv_cache_dim, 64, 4, 1, 16, torch.float32)
    row = pool.open_row()
    assert pool.grow(row, m + n)
    fb = ForwardBatch.build([SeqChunk(row, 0, known[:-1])], [], pool.page_table, 4)
    _, hidden = model(fb, pool.cache, torch.arange(0), hidden=True)
    tokens, drafts = list(known[1:]), []
    for k in range(n):
        fb = ForwardBatch.build([SeqChunk(row, 0, [0] * (m - 1 + k))], [], pool.page_table, 4)  # (ids unread)
        embeds = model.model.embed_tokens(torch.tensor(tokens))
        logits, out = model.mtp[0](embeds, hidden, fb, pool.cache, torch.tensor([m - 2 + k]), with_hidden=True)
        drafts.append(int(logits.argmax(-1)))
        tokens.append(drafts[-1])
        hidden = torch.cat((hidden, out))
    return drafts


def test_seeded_sampling_is_reproducible_alone_or_batched(mtp_model):
    sampled = [SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=s, ignore_eos=True) for s in (1, 2)]
    with Engine(model_path=mtp_model, speculative_algorithm="EAGLE", speculative_num_steps=2, **FLAGS) as eng:
        both = eng.generate(prompt_token_ids=PROMPTS[:2], sampling_params=sampled)
        alone = eng.generate(prompt_token_ids=PROMPTS[1:2], sampling_params=sampled[1:])
    assert both[1].token_ids == alone[0].token_ids and len(both[0].token_ids) == 12


@pytest.mark.parametrize("steps", [1, 3])
def test_constrained_requests_speculate_within_their_grammar(mtp_model, oracle, steps):
    """A JSON-schema request drafts too: the grammar's mask at every draft position, the matcher
    rolled back past rejected drafts (the oracle corrupts some into tokens the grammar refuses). Its
    output equals the one without speculation; a penalized request beside it drafts nothing and
    equals too; a sampled regex request stays within its regex."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
    }
    params = [
        SamplingParams(max_new_tokens=40, temperature=0.0, guide=("json_schema", json.dumps(schema)), logprobs=1),
        SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True, frequency_penalty=1.0),
        SamplingParams(max_new_tokens=30, temperature=1.0, seed=5, guide=("regex", "[a-z]{3,8}-[0-9]{2,5}")),
    ]
    with Engine(model_path=mtp_model, **FLAGS) as off:
        ref = off.generate(prompt_token_ids=PROMPTS[:3], sampling_params=params)
    oracle.want = {tuple(p): o.token_ids for p, o in zip(PROMPTS[:2], ref)}
    with Engine(model_path=mtp_model, speculative_algorithm="NEXTN", speculative_num_steps=steps, **FLAGS) as eng:
        alone = eng.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params[:1])[0]
        assert eng.stepper.counters.accepted > 0  # the constrained request kept drafts
        outs = eng.generate(prompt_token_ids=PROMPTS[:3], sampling_params=params)
    assert alone.token_ids == ref[0].token_ids
    assert [o.token_ids for o in outs[:2]] == [o.token_ids for o in ref[:2]]
    assert [a.top_ids for a in outs[0].logprobs] == [b.top_ids for b in ref[0].logprobs]
    assert 0 <= json.loads(outs[0].text)["n"] <= 99 and outs[0].finish_reason == "stop"
    assert re.fullmatch("[a-z]{3,8}-[0-9]{2,5}", outs[2].text) and outs[2].finish_reason == "stop"


def test_streamed_updates_carry_every_kept_token(mtp_model, oracle):
    p = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    with Engine(model_path=mtp_model, **FLAGS) as off:
        ref = off.generate(prompt_token_ids=PROMPTS[:1], sampling_params=p)[0].token_ids
    oracle.want = {tuple(PROMPTS[0]): ref}
    with Engine(model_path=mtp_model, speculative_algorithm="NEXTN", speculative_num_steps=3, **FLAGS) as eng:
        rid = eng.add_request(prompt_token_ids=PROMPTS[0], params=p)
        chunks = []
        while eng.has_unfinished():
            chunks += [u.token_ids for u in eng.step_updates() if u.request_id == rid]
    assert [t for c in chunks for t in c] == ref
    assert max(len(c) for c in chunks) > 1


def test_checkpoint_without_mtp_is_refused(tiny_v3):
    with pytest.raises(ConfigError, match="num_nextn_predict_layers=0: it has no multi-token prediction module"):
        Engine(model_path=tiny_v3, speculative_algorithm="NEXTN", **FLAGS)


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(speculative_num_steps=2), "--speculative-num-steps=2: needs --speculative-algorithm NEXTN"),
        (
            dict(speculative_algorithm="NEXTN", speculative_num_steps=2, speculative_num_draft_tokens=4),
            "--speculative-num-draft-tokens=4: with --speculative-num-steps=2 and a chain of drafts it is 3",
        ),
        (dict(speculative_algorithm="NEXTN", speculative_eagle_topk=4), "--speculative-eagle-topk=4: only 1"),
        (dict(speculative_algorithm="NEXTN", speculative_num_steps=0), "draft steps must be between 1 and 8"),
        (
            dict(speculative_algorithm="NEXTN", mode="afd", enable_eplb=True),
            "--enable-eplb=True: is not supported with --speculative-algorithm NEXTN yet",
        ),
        (dict(speculative_algorithm="NEXTN", static_decode=True), "--static-decode=True: is not supported"),
        (dict(speculative_algorithm="NEXTN", overlap_schedule="on"), "--overlap-schedule='on': is not supported"),
    ],
)
def test_unsupported_combinations_are_refused_naming_both_flags(flags, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        EngineArgs.from_kwargs(**flags).validate()


@pytest.mark.parametrize("steps", [1, 3])
def test_prefill_decode_instances_both_speculating(mtp_model, oracle, steps):
    """PD (builtin transfer): the prefill instance computes the module's cache of the prompt too
    and sends it with the pages; the decode instance speculates from its first step. An instance
    pair where only one speculates is refused at the handshake, naming the difference."""
    from tests.disagg.pd_helpers import PDPair

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}}
    params = [SamplingParams(max_new_tokens=14, temperature=0.0, ignore_eos=True, logprobs=1)] * 4 + [
        SamplingParams(max_new_tokens=30, temperature=0.0, guide=("json_schema", json.dumps(schema)), logprobs=1)
    ]
    with Engine(model_path=mtp_model, **FLAGS) as off:
        ref = off.generate(prompt_token_ids=PROMPTS, sampling_params=params)
        full = ref[1].token_ids
        stop = off.tokenizer.decode(full[3:5])  # token 4: inside a run of perfect drafts at 1 and 3 steps
        params[1] = SamplingParams(max_new_tokens=14, temperature=0.0, ignore_eos=True, stop=[stop], logprobs=1)
        ref[1] = off.generate(prompt_token_ids=[PROMPTS[1]], sampling_params=params[1])[0]
    assert ref[1].finish_reason == "stop" and len(ref[1].token_ids) == 5 and json.loads(ref[4].text)
    oracle.want = {tuple(p): o.token_ids for p, o in zip(PROMPTS, ref)}
    oracle.want[tuple(PROMPTS[1])] = full
    oracle.perfect = {tuple(PROMPTS[1])}
    spec = dict(FLAGS, model_path=mtp_model, speculative_algorithm="NEXTN", speculative_num_steps=steps)
    pd = PDPair(Engine(**spec, disaggregation_mode="prefill"), Engine(**spec, disaggregation_mode="decode"))
    try:
        outs = pd.generate(prompt_token_ids=PROMPTS, sampling_params=params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
        assert [o.finish_reason for o in outs] == [o.finish_reason for o in ref]
        for got, want in zip(outs, ref):
            assert [a.top_ids for a in got.logprobs] == [b.top_ids for b in want.logprobs]
        assert pd.decode.stepper.counters.accepted > 0
    finally:
        pd.close()
    plain = dict(FLAGS, model_path=mtp_model)
    pd = PDPair(Engine(**plain, disaggregation_mode="prefill"), Engine(**spec, disaggregation_mode="decode"))
    try:
        pd.add_request(prompt_token_ids=PROMPTS[0], params=params[0])
        (out,) = pd.run_until(lambda: not pd.decode.has_unfinished())
        assert out.finish_reason == "error" and "KV cache layers" in out.error and "prefill 4, decode 5" in out.error
    finally:
        pd.close()


@pytest.mark.parametrize("declared", [False, True], ids=["no module", "module declared, tensors missing"])
def test_afd_serve_refuses_a_checkpoint_without_the_module_in_one_line(tmp_path, declared):
    """Exit 2, one line, no traceback, before any process or port is taken."""
    from tests.process_helpers import afd_run

    plain = make_tiny_model(tmp_path / "plain", arch="deepseek_v3", seed=4)
    if declared:
        config = json.loads((plain / "config.json").read_text())
        (plain / "config.json").write_text(json.dumps({**config, **MTP}))
    res = afd_run("serve", "--model-path", str(plain), "--speculative-algorithm", "NEXTN", "--port", "1")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    if declared:
        assert "lacks weights the model needs: model.layers.4.self_attn" in lines[0]
    else:
        assert "num_nextn_predict_layers=0: it has no multi-token prediction module to draft with" in lines[0]


@pytest.mark.parametrize("steps", [1, 3])
def test_the_context_length_ends_a_speculating_request_where_it_ends_a_plain_one(mtp_model, oracle, steps):
    p = SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True)
    with Engine(model_path=mtp_model, context_length=41, **FLAGS) as off:
        ref = off.generate(prompt_token_ids=PROMPTS[4:5], sampling_params=p)[0]
    assert ref.finish_reason == "length" and len(PROMPTS[4]) + len(ref.token_ids) == 41
    oracle.want, oracle.perfect = {tuple(PROMPTS[4]): ref.token_ids + [7] * 8}, {tuple(PROMPTS[4])}
    with Engine(
        model_path=mtp_model, context_length=41, speculative_algorithm="NEXTN", speculative_num_steps=steps, **FLAGS
    ) as eng:
        out = eng.generate(prompt_token_ids=PROMPTS[4:5], sampling_params=p)[0]
        assert eng.stepper.counters.accepted > 0
    assert (out.token_ids, out.finish_reason) == (ref.token_ids, "length")
