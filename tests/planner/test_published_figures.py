"""The planner against the figures published with the designs it models (Step-3, Baidu's AFD,
DeepSeek's profile, DeepEP), with one set of efficiency factors per hardware type (the catalog's),
no per-case constants.

Each test name says `fitted` (the figure, or the assumption behind it, was used to set an H800
efficiency factor, so matching it checks consistency only) or `predicted` (nothing was set from it).
afd_engine/planner/README.md lists which factor each fitted figure set."""

from __future__ import annotations

import pytest

from afd_engine.planner.hardware import HARDWARE, get_hardware
from afd_engine.planner.model_spec import get_model
from afd_engine.planner.network import CommCase, comm_time
from afd_engine.planner.reference import baidu_ratios
from afd_engine.planner.search import SearchSpace, search
from afd_engine.planner.sparsity import min_sparsity, stage_budget_us
from afd_engine.planner.stages import StageModel

H800 = HARDWARE["H800"]


@pytest.mark.parametrize("hw,expected", [("H800", 0.058), ("H20", 0.007), ("A800", 0.031), ("910B", 0.034)])
def test_predicted_step3_minimum_sparsity_table(hw, expected):
    # Step-3 section 5.4: H = 7168, L = 61, 50 ms over 3 stages; 8 x 400 Gb/s (H800, H20), 8 x 200 (A800, 910B)
    bound = min_sparsity(get_hardware(hw), hidden=7168, layers=61)
    assert bound.min_sparsity == pytest.approx(expected, abs=0.002)


def test_predicted_rooflines_match_step3_table_4():
    assert {n: round(HARDWARE[n].roofline) for n in ("H800", "H20", "A800", "910B")} == {
        "H800": 591,
        "H20": 74,
        "A800": 156,
        "910B": 175,
    }


def test_predicted_per_layer_stage_budget():
    # 50 ms TPOT, 3 stages (A / F / network), 61 layers: the paper's 272 us truncates 50/3 ms to 16.6 ms
    assert stage_budget_us(50, 3, 61) == pytest.approx(272, abs=1.5)
    assert stage_budget_us(50, 3, 61) == pytest.approx(16.6 * 1000 / 61, abs=1.5)


def baidu_case(mode: str) -> CommCase:
    # 32 DP attention ranks, 128-token micro-batch each, to EP16 (2 FFN nodes of 8); fp8 out, bf16 back
    return CommCase(tokens=128, hidden=7168, topk=8, experts=256, senders=32, receivers=16, mode=mode)


def test_fitted_baidu_direct_dispatch_plus_combine_about_550us():
    direct = comm_time(baidu_case("direct"), H800)
    # Baidu's "at least ~550 us" is one attention GPU's NIC at 80% of 400 Gb/s (8 NICs per node):
    # 128 tokens x 8 experts x 7168 x (1 + 2) bytes out and back
    assert direct.sender_nic_us == pytest.approx(550, rel=0.15)
    # the 16 F GPUs' NICs take twice that (32 senders / 16 receivers), so the model's full time is
    # receiver-bound: the 550 us is a lower bound, as the source says
    assert direct.receiver_nic_us == pytest.approx(2 * direct.sender_nic_us)
    assert direct.total_us > 1000  # far over the ~400 us per-layer budget Baidu quotes for a 50 ms SLO


def test_predicted_baidu_two_stage_cuts_between_node_volume_4_to_8x():
    direct, two = comm_time(baidu_case("direct"), H800), comm_time(baidu_case("two-stage"), H800)
    ratio = direct.inter_node_bytes / two.inter_node_bytes
    assert 4 <= ratio <= 8  # two FFN nodes: top-8 copies become <= 2 node copies
    assert two.total_us < direct.total_us / 3
    one_node = CommCase(tokens=128, hidden=7168, topk=8, experts=256, senders=32, receivers=8, mode="two-stage")
    direct_one = CommCase(**{**one_node.__dict__, "mode": "direct"})
    assert comm_time(direct_one, H800).inter_node_bytes / comm_time(one_node, H800).inter_node_bytes == pytest.approx(
        8, rel=1e-3
    )


@pytest.mark.parametrize("ep,dispatch_us,combine_us", [(8, 77, 114), (16, 118, 195), (32, 155, 273)])
def test_fitted_deepep_low_latency_table(ep, dispatch_us, combine_us):
    # H800 + CX7 400 Gb/s, 128 tokens, hidden 7168, top-8 of 256, fp8 dispatch, bf16 combine
    t = comm_time(
        CommCase(tokens=128, hidden=7168, topk=8, experts=256, senders=ep, receivers=ep, mode="direct", symmetric=True),
        H800,
    )
    assert t.dispatch_us == pytest.approx(dispatch_us, rel=0.30)
    assert t.combine_us == pytest.approx(combine_us, rel=0.30)


def test_fitted_step3_2a2f_throughput_at_50ms_4k():
    # Step-3 Table 8: 2 attention + 2 FFN instances of 8 H800 each, 3 micro-batches, fp8, 4K context
    sm = StageModel(get_model("step3"), H800, H800, context=4096, attn_dtype="fp8")
    best = search(sm, "afd", 50, SearchSpace(attn_gpus=(16,), ffn_gpus=(16,), micro_batches=(3,)))[0]
    assert best.tokens_per_gpu_s == pytest.approx(4039, rel=0.15)
    assert best.tpot_ms <= 50 and best.fits
    assert best.deployment.seqs_per_gpu * 16 == pytest.approx(6144, rel=0.15)  # their batch: 3 x 2048


def test_fitted_deepseek_v3_colocated_ep_throughput_at_50ms_4k():
    # DeepSeek's profile as Step-3 quotes it: 2,324 tokens/GPU/s, EP decode, bf16 attention, 4K
    sm = StageModel(get_model("deepseek-v3"), H800, H800, context=4096, attn_dtype="bf16")
    best = search(sm, "colocated", 50)[0]
    assert best.tokens_per_gpu_s == pytest.approx(2324, rel=0.15)
    assert best.deployment.attn_gpus >= 64  # large EP wins, as in DeepSeek's deployment


def test_fitted_step3_beats_deepseek_v3_by_about_three_quarters():
    s3 = StageModel(get_model("step3"), H800, H800, 4096, "fp8")
    ds = StageModel(get_model("deepseek-v3"), H800, H800, 4096, "bf16")
    a = search(s3, "afd", 50, SearchSpace(attn_gpus=(16,), ffn_gpus=(16,), micro_batches=(3,)))[0]
    c = search(ds, "colocated", 50)[0]
    assert 1.5 <= a.tokens_per_gpu_s / c.tokens_per_gpu_s <= 2.0  # paper: 4,039 / 2,324 = 1.74


def test_predicted_baidu_afd_vs_baseline_per_gpu():
    # AFD DP32 + EP16 over DP32 + EP32, DeepSeek-V3 on H800, bf16 attention, 4K context
    tight, loose = baidu_ratios(50), baidu_ratios(100)
    tight_gpu, tight_dep = tight["per_gpu"], tight["per_deployment"]
    loose_gpu, loose_dep = loose["per_gpu"], loose["per_deployment"]
    # per GPU (48 AFD GPUs against 32) reproduces it: about equal at 50 ms, better at 100 ms by up
    # to about a fifth (Baidu: +19%)
    assert 0.85 <= tight_gpu <= 1.15
    assert 1.05 <= loose_gpu <= 1.25
    assert loose_gpu > tight_gpu
    # per deployment does not: AFD's extra 16 GPUs put it far ahead at every SLO
    assert tight_dep > 1.3 and loose_dep > 1.3
