"""The GPU check's AFD parts (benchmarks/kernels/gpu_afd.py) and its MoE layer staging timings, in
this process on the CPU without a deployment: how tokens are compared, how TPOT is taken from
generation times, what is recorded about device payloads, and the NCCL stand-in on gloo (the
whole parts run in the dry run: tests/benchmarks/test_gpu_check.py)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from benchmarks.kernels import gpu_afd, gpu_timings
from benchmarks.kernels.gpu_check import Context


def test_agreement_counts_tokens_up_to_each_prompts_first_difference():
    ref = gpu_afd.Greedy([[1, 2, 3], [4, 5, 6]], [[-0.5, -1.0, -1.0], [-0.2, -1.0, -1.0]], {})
    run = gpu_afd.Greedy([[1, 2, 9], [7, 5, 6]], [[-0.25, -1.0, -3.0], [-0.3, -1.0, -1.0]], {})
    out = gpu_afd.agreement(ref, run)
    assert (out["tokens"], out["matched"], out["equal"]) == (6, 2, False)  # the second differs at once
    assert out["agreement"] == pytest.approx(2 / 6) and out["max_first_logprob_diff"] == pytest.approx(0.25)
    assert gpu_afd.agreement(ref, ref) | {"agreement": 1.0} == gpu_afd.agreement(ref, ref)
    assert gpu_afd.agreement(ref, ref)["equal"] is True


def test_static_check_wants_static_batches_exactly_when_asked():
    assert gpu_afd.static_check(True, "AFD", {"static_decode_batches": 4}) is None
    assert gpu_afd.static_check(False, "AFD", {"static_decode_batches": 0}) is None
    assert "no decode batch ran" in gpu_afd.static_check(True, "AFD", {"static_decode_batches": 0})
    assert "3 decode batches ran" in gpu_afd.static_check(False, "single", {"static_decode_batches": 3})
    assert gpu_afd.static_check(True, "AFD", {}) == "AFD: the engine does not report static_decode_batches"


def test_headline_leads_with_the_failed_cases():
    assert gpu_afd.headline("found", [], 4) == "found"
    failures = ["fp32_graphs_on: ImportError: " + "x" * 200, "bf16_graphs_on: Mismatch: y"]
    assert gpu_afd.headline("found", failures, 4) == f"2 of 4 cases failed ({failures[0][:100]}); found"


def test_graph_settings_turn_graphs_and_static_decode_on_and_off_together():
    assert gpu_afd.graph_settings(True) == {"disable_cuda_graph": False, "static_decode": True}
    assert gpu_afd.graph_settings(False) == {"disable_cuda_graph": True, "static_decode": False}


class FakeEngine:
    """generate() takes `step_s` per output token on top of `fixed_s`, as a clock says."""

    def __init__(self, clock, fixed_s: float, step_s: float) -> None:
        self.clock, self.fixed_s, self.step_s, self.calls = clock, fixed_s, step_s, []

    def generate(self, prompt_token_ids, sampling_params):
        n = sampling_params.max_new_tokens
        self.calls.append(n)
        self.clock.now += self.fixed_s + self.step_s * n
        return [SimpleNamespace(error=None, token_ids=[0] * n) for _ in prompt_token_ids]


def test_tpot_is_the_slope_of_generation_time_over_tokens(monkeypatch):
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(gpu_afd.time, "perf_counter", lambda: clock.now)
    engine = FakeEngine(clock, fixed_s=0.5, step_s=0.004)  # prefill and admission cancel out
    assert gpu_afd.tpot_seconds(engine, [[1, 2]], short=4, long=20, reps=2) == pytest.approx(0.004)
    assert engine.calls == [20, 4, 20, 4, 20]  # a warm-up, then short and long in turns


def test_a_timed_request_that_falls_short_is_an_error():
    engine = SimpleNamespace(generate=lambda **kw: [SimpleNamespace(error=None, token_ids=[1, 2])])
    with pytest.raises(RuntimeError, match="a timed request did not give 5 tokens: 2 tokens"):
        gpu_afd.generate_seconds(engine, [[1]], 5)


def test_device_payloads_as_the_ranks_report_them():
    cuda = SimpleNamespace(info={"payload_device": "cuda:0"})
    host = SimpleNamespace(info={"payload_device": None})
    assert gpu_afd.device_payloads(cuda) == {"device_payloads": True, "payload_device": "cuda:0"}
    assert gpu_afd.device_payloads(host) == {"device_payloads": False, "payload_device": None}


def test_static_batches_of_the_single_engine_and_of_a_deployment():
    assert gpu_afd.static_batches(SimpleNamespace(static_decode_batches=lambda: 7)) == 7
    assert gpu_afd.static_batches(SimpleNamespace(stats=SimpleNamespace(static_decode_batches=3))) == 3
    assert gpu_afd.static_batches(SimpleNamespace(stats=SimpleNamespace())) is None


@pytest.fixture
def ctx(tmp_path) -> Context:
    return Context(torch.device("cpu"), True, False, tmp_path, {"parts": {}})


def test_nccl_self_on_gloo_falls_back_to_all_gather_and_names_the_skipped_capture(ctx):
    out = gpu_afd.nccl_self(ctx)
    assert (out["backend"], out["world_size"], out["op"], out["graph"], out["replays"]) == (
        "gloo",
        1,
        "all_gather",
        False,
        3,
    )
    assert list(out["unusable"]) == ["send_recv"] and out["unusable"]["send_recv"].startswith("eager: RuntimeError")
    assert out["skipped"] == {"graph_capture": "CUDA graphs need a GPU: gloo on the CPU runs the ops eagerly"}
    assert out["headline"] == "gloo: all_gather eager 3x, values ok"
    assert not torch.distributed.is_initialized()


def test_self_traffic_that_moves_wrong_values_is_not_used(monkeypatch):
    copies = itertools.count()

    def make_op(op, src, dst):  # send/recv drops its data; all_gather copies all but the 2nd replay
        return lambda: None if op == "send_recv" else (dst.copy_(src) if next(copies) != 2 else None)

    monkeypatch.setattr(gpu_afd, "make_op", make_op)
    with pytest.raises(RuntimeError, match="4096 of 4096 values wrong after the run with value 2.0"):
        gpu_afd.self_traffic(torch.device("cpu"), 3, capture=False)
    monkeypatch.setattr(gpu_afd, "make_op", lambda op, src, dst: lambda: None)
    with pytest.raises(RuntimeError, match="neither send/recv to self nor all_gather could be used") as info:
        gpu_afd.self_traffic(torch.device("cpu"), 3, capture=False)
    assert "eager: RuntimeError: 4096 of 4096 values wrong after the run with value 0.0" in str(info.value)


def test_moe_layer_staging_moves_one_layers_dispatch_and_combine(ctx):
    out = gpu_timings.moe_layer_staging(ctx)
    rows = out["rows"]
    assert [r["tokens"] for r in rows] == [8, 64, 512] and out["moe_layers_per_step"] == 58
    for r in rows:  # bf16 hidden states both ways, top-2 int64 ids and fp32 weights
        assert r["bytes"] == r["tokens"] * (2 * 64 * 2 + 2 * 8 + 2 * 4) and (r["hidden"], r["top_k"]) == (64, 2)
        assert r["host_us"] > 0 and r["device_us"] > 0 and "pinned_us" not in r  # pinned memory needs CUDA
        assert r["v3_step_ms"]["host"] == pytest.approx(r["host_us"] * 58 / 1e3)
    assert out["headline"].startswith("MoE layer, host vs device: T8 ")


def test_layer_payloads_are_deepseek_v3s_at_full_width():
    x, ids, weights, combined = gpu_timings.layer_payloads(3, gpu_timings.V3_HIDDEN, 8, torch.device("cpu"))
    assert (x.shape, x.dtype, combined.shape, combined.dtype) == ((3, 7168), torch.bfloat16, (3, 7168), torch.bfloat16)
    assert (ids.shape, ids.dtype, weights.dtype) == ((3, 8), torch.int64, torch.float32)
    assert 0 <= int(ids.min()) and int(ids.max()) < 256
