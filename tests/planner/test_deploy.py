"""Stage times, the N-micro-batch pipeline and memory feasibility of one deployment."""

from __future__ import annotations

import dataclasses

import pytest

from afd_engine.errors import ConfigError
from afd_engine.planner.deploy import Deployment, estimate, max_seqs_by_memory
from afd_engine.planner.hardware import HARDWARE, Efficiency
from afd_engine.planner.model_spec import MODELS
from afd_engine.planner.search import SearchSpace, best_batch, search
from afd_engine.planner.stages import StageModel

H800 = HARDWARE["H800"]
V3 = StageModel(MODELS["deepseek-v3"], H800, H800, context=4096, attn_dtype="bf16")


def afd(n: int, seqs: int = 192, **kw) -> Deployment:
    return Deployment("afd", 32, 16, n, seqs, **kw)


def test_period_follows_the_pipeline_formula():
    for n in (1, 2, 3, 4):
        e = estimate(V3, afd(n))
        lat = H800.efficiency.comm_latency_us  # delays a micro-batch, does not occupy the link
        terms = [
            n * e.attention_us,
            n * (e.dispatch_us - lat),
            n * e.ffn_us,
            n * (e.combine_us - lat),
            e.attention_us + e.dispatch_us + e.ffn_us + e.combine_us,
        ]
        assert e.period_us == pytest.approx(max(terms))
    one = estimate(V3, afd(1))
    assert one.bound == "round trip" and one.attention_busy < 0.5  # one micro-batch: A waits on every round trip


def test_latency_bound_links_do_not_limit_back_to_back_micro_batches():
    slow_link = dataclasses.replace(H800, efficiency=dataclasses.replace(H800.efficiency, comm_latency_us=2000.0))
    sm = StageModel(MODELS["deepseek-v3"], slow_link, slow_link, 4096, "bf16")
    one, four = estimate(sm, afd(1, seqs=64)), estimate(sm, afd(4, seqs=64))
    assert one.bound == four.bound == "round trip"  # 4 ms of latency per round trip
    # 4 micro-batches share one latency-bound round trip per layer instead of queueing 4 latencies
    assert four.period_us == pytest.approx(one.period_us, rel=0.05) and four.period_us < 1.5 * 4000
    assert four.tokens_per_gpu_s == pytest.approx(one.tokens_per_gpu_s, rel=0.1)


def test_more_micro_batches_hide_the_round_trip_when_attention_dominates():
    busy = [estimate(V3, afd(n, seqs=384)).attention_busy for n in (1, 2, 3)]
    assert busy[0] < busy[1] < busy[2] == pytest.approx(1.0)
    assert estimate(V3, afd(3, seqs=384)).bound == "attention"


def test_colocated_serialises_attention_and_experts_on_one_gpu():
    e = estimate(V3, Deployment("colocated", 32, 0, 2, 128, "direct"))
    lat = H800.efficiency.comm_latency_us
    assert e.period_us == pytest.approx(
        max(
            2 * (e.attention_us + e.ffn_us),
            2 * (e.dispatch_us + e.combine_us - 2 * lat),
            e.attention_us + e.ffn_us + e.dispatch_us + e.combine_us,
        )
    )
    assert e.tokens_per_gpu_s == pytest.approx(128 * 32 / (e.tpot_ms / 1e3) / 32)


def test_memory_limits_the_batch():
    dep = afd(3, seqs=0)
    most = max_seqs_by_memory(V3, dep)
    assert estimate(V3, dataclasses.replace(dep, seqs_per_gpu=most)).fits
    assert not estimate(V3, dataclasses.replace(dep, seqs_per_gpu=most + 1)).fits
    # bf16 latent cache: 61 layers x 576 x 2 bytes per token
    assert V3.kv_bytes_per_seq() == 4096 * 61 * 576 * 2
    # all of DeepSeek-V3's experts do not fit on one FFN node of H800s
    assert max_seqs_by_memory(V3, Deployment("afd", 8, 8, 3, 0)) == 0


def test_best_batch_is_the_largest_meeting_the_slo():
    best = best_batch(V3, afd(3, seqs=0), 80)
    assert best.tpot_ms <= 80
    more = estimate(V3, dataclasses.replace(best.deployment, seqs_per_gpu=best.deployment.seqs_per_gpu + 1))
    assert more.tpot_ms > 80 or not more.fits
    assert best_batch(V3, afd(3, seqs=0), 5) is None  # no batch meets 5 ms


def test_search_respects_a_gpu_budget_and_pins():
    found = search(V3, "afd", 80, SearchSpace(total_gpus=48))
    assert found and all(e.deployment.gpus == 48 for e in found)
    assert found == sorted(found, key=lambda e: -e.tokens_per_gpu_s)
    pinned = search(
        V3, "afd", 80, SearchSpace(attn_gpus=(32,), ffn_gpus=(16,), micro_batches=(3,), shared_expert=("attention",))
    )
    assert [(e.deployment.attn_gpus, e.deployment.micro_batches, e.deployment.shared_expert) for e in pinned] == [
        (32, 3, "attention")
    ]
    with pytest.raises(ConfigError, match="no afd topology"):
        search(V3, "afd", 80, SearchSpace(total_gpus=3))


def test_heterogeneous_f_side_uses_its_own_hardware():
    h20 = StageModel(MODELS["step3"], H800, HARDWARE["H20"], 4096, "fp8")
    h800 = StageModel(MODELS["step3"], H800, H800, 4096, "fp8")
    dep = Deployment("afd", 16, 16, 3, 384)
    assert estimate(h20, dep).ffn_us > estimate(h800, dep).ffn_us  # H20: 1/7 of the fp8 FLOPs
    assert estimate(h20, dep).attention_us == estimate(h800, dep).attention_us


def test_efficiency_factors_scale_stage_times():
    slow = dataclasses.replace(H800, efficiency=Efficiency(attn_memory=0.35, attn_compute=0.225))
    fast_core = V3.attention_core_us(64)
    slow_core = StageModel(V3.model, slow, slow, 4096, "bf16").attention_core_us(64)
    assert slow_core == pytest.approx(2 * fast_core)


def test_invalid_inputs():
    with pytest.raises(ConfigError, match="--attn-dtype 'int4'"):
        StageModel(MODELS["step3"], H800, H800, 4096, "int4")
    with pytest.raises(ConfigError, match="--context must be >= 1"):
        StageModel(MODELS["step3"], H800, H800, 0)
    with pytest.raises(ConfigError, match="needs at least one FFN GPU"):
        estimate(V3, Deployment("afd", 8, 0, 3, 16))
    with pytest.raises(ConfigError, match="'ffn' must be 'attention' or"):
        estimate(V3, Deployment("colocated", 8, 0, 2, 16, "direct", "ffn"))
    with pytest.raises(ConfigError, match="--tpot-slo-ms must be > 0"):
        search(V3, "afd", 0)


def test_bf16_weights_double_weight_memory_and_streaming():
    fp8 = StageModel(MODELS["deepseek-v3"], H800, H800, 4096, "bf16")
    bf16 = StageModel(MODELS["deepseek-v3"], H800, H800, 4096, "bf16", weight_dtype="bf16")
    assert bf16.expert_weight_bytes(16) == 2 * fp8.expert_weight_bytes(16)
    # 16 experts' weights stream from HBM per micro-batch when the batch is small (memory-bound)
    overhead = H800.efficiency.layer_overhead_us
    assert bf16.experts_us(64, 16) - overhead == pytest.approx(2 * (fp8.experts_us(64, 16) - overhead))
    with pytest.raises(ConfigError, match="--weight-dtype 'int2'"):
        StageModel(MODELS["step3"], H800, H800, 4096, weight_dtype="int2")


def test_speculation_multiplies_rows_and_divides_tpot_by_the_accepted_length():
    """MTP with N drafts: a step runs 1 + N rows per request through every layer plus the module's
    passes, so with nothing accepted it only costs; each accepted token divides TPOT."""
    sm = StageModel(MODELS["deepseek-v3"], HARDWARE["H800"], HARDWARE["H800"], 4096)
    base = Deployment("afd", 32, 16, 3, 96)
    off = estimate(sm, base)
    wasted = estimate(sm, dataclasses.replace(base, mtp_steps=1, accept_length=1.0))
    kept = estimate(sm, dataclasses.replace(base, mtp_steps=1, accept_length=1.8))
    assert wasted.ffn_tokens_per_layer == 2 * off.ffn_tokens_per_layer == 2 * 32 * 96
    assert wasted.step_ms > off.step_ms and wasted.tpot_ms == wasted.step_ms
    assert kept.step_ms == wasted.step_ms and kept.tpot_ms == pytest.approx(kept.step_ms / 1.8)
    assert kept.tokens_per_s == pytest.approx(1.8 * wasted.tokens_per_s)
    chained = estimate(sm, dataclasses.replace(base, mtp_steps=2, accept_length=1.8))
    assert chained.step_ms > kept.step_ms and chained.ffn_tokens_per_layer == 3 * off.ffn_tokens_per_layer
    with pytest.raises(ConfigError, match=r"accepted length 2.5 must be between 1 and drafts \+ 1 \(2\)"):
        estimate(sm, dataclasses.replace(base, mtp_steps=1, accept_length=2.5))
    # under a tight SLO, speculation serves far more per GPU
    space = SearchSpace(attn_gpus=(32,), ffn_gpus=(16,), micro_batches=(3,))
    plain = search(sm, "afd", 50, space)
    spec = search(sm, "afd", 50, dataclasses.replace(space, mtp_steps=1, accept_length=1.81))
    assert spec and spec[0].tokens_per_gpu_s > 2 * (plain[0].tokens_per_gpu_s if plain else 0.0) > 0
