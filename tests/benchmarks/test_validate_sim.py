"""benchmarks/validate_sim.py: the pieces that tie a served run to its simulation (no server here)."""

from __future__ import annotations

import argparse
import json

import pytest

from tests.process_helpers import load_bench

vs = load_bench("validate_sim.py")


def test_kv_pages_from_the_startup_log():
    log = (
        "2026 afd.engine INFO rank 0 ready: /tmp/val/emb4k, 13107 KV pages of 16 tokens\n"
        "2026 afd.engine INFO rank 1 ready: /tmp/val/emb4k, 12000 KV pages of 16 tokens\n"
    )
    assert vs.kv_pages(log) == [13107, 12000]


def test_the_simulated_slice_is_the_one_bench_serving_sends(tmp_path):
    from benchmarks.lib.datasets import trace_requests

    path = tmp_path / "t.jsonl"
    recs = [
        {"timestamp": 1000 * i, "input_length": 512 * (1 + i % 3), "output_length": 64, "hash_ids": [i]}
        for i in range(20)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    args = argparse.Namespace(trace=path, rate_scale=2.0, length_scale=1 / 32)
    trace, dropped = vs.trace_slice(args, 3.0, 4.0)
    bench = argparse.Namespace(
        trace=str(path),
        trace_rate_scale=2.0,
        trace_length_scale=1 / 32,
        trace_start=3.0,
        trace_duration=4.0,
        random_vocab_size=2048,
    )
    sent = trace_requests(bench)
    assert dropped == 0 and len(trace.requests) == len(sent) == 8
    assert [(r.arrival_s, r.input_len, r.output_len) for r in trace.requests] == [
        (s.arrival_s, s.prompt_len, s.output_len) for s in sent
    ]
    assert trace.block_tokens == 16


def test_mean_abs_error():
    engine = dict.fromkeys((k for k, _ in vs.METRICS), 100.0)
    sim = {**engine, "ttft_p50_ms": 110.0, "tpot_p90_ms": 70.0}
    assert vs.mean_abs_error(sim, engine) == pytest.approx((10 + 30) / 5)


def _records(path, rows) -> None:
    """--record-steps lines: (tokens, seqs, kv, seconds) per step, back to back."""
    t, lines = 0.0, []
    for i, (tokens, seqs, kv, secs) in enumerate(rows):
        lines.append(
            json.dumps({"step": i, "tokens": tokens, "seqs": seqs, "kv": kv, "pairs": 0, "t0": t, "t1": t + secs})
        )
        t += secs + 1.0  # idle between steps: only the forward counts
    path.write_text("\n".join(lines) + "\n")


def test_pd_fits_each_instance_on_its_own_steps_and_simulates_both(tmp_path, monkeypatch):
    """PD: the prefill instance's steps fit the prefill step time, the decode instance's the decode
    one, and the simulation runs the decode steps with the decode fit (a slower decode instance
    gives a longer TPOT, the same prefill a TTFT no shorter)."""
    assert vs.step_files("pd", "r", 1) == [["r.p"], ["r.d"]]
    assert vs.step_files("single", "r", 1) == [["r"]] and vs.step_files("dp2", "r", 2) == [["r.a0.jsonl", "r.a1.jsonl"]]
    _records(tmp_path / "r.p", [(n, 1, 0, 0.001 + 1e-5 * n) for n in (16, 64, 256, 512, 100, 32)])
    _records(tmp_path / "r.d", [(s, s, 40 * s, 0.002 + 1e-4 * s) for s in (1, 2, 4, 8, 3, 6)])
    prefill, decode = vs.fit_calibration("pd", vs.step_files("pd", str(tmp_path / "r"), 1), "test", 0.0)
    assert prefill.seconds((512, 1, 0, 0)) == pytest.approx(0.001 + 512e-5, rel=1e-6)
    assert decode.seconds((4, 4, 160, 0)) == pytest.approx(0.002 + 4e-4, rel=1e-6)
    assert vs.fit_calibration("single", [[str(tmp_path / "r.p")]], "test", 0.0).coef == prefill.coef

    monkeypatch.setattr(vs, "kv_bytes_per_token", lambda model: 1024.0)
    monkeypatch.setattr(vs, "model_dir", lambda workdir: tmp_path)
    from afd_engine.planner.traces import Trace, TraceRequest

    trace = Trace(
        [TraceRequest(0.05 * i, 64, 16, (4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3)) for i in range(20)], 16, "test"
    )
    args = argparse.Namespace(max_num_batched_tokens=2048, workdir=tmp_path)
    fast = vs.sim_metrics(trace, 1, 1000, (prefill, decode), ("gpu",), args)
    slow_decode = vs.StepCalibration(tuple(3 * c for c in decode.coef))
    slow = vs.sim_metrics(trace, 1, 1000, (prefill, slow_decode), ("gpu",), args)
    assert slow["tpot_p50_ms"] > 2 * fast["tpot_p50_ms"] and slow["ttft_p50_ms"] >= fast["ttft_p50_ms"]
    alone = vs.sim_metrics(trace, 1, 1000, prefill, ("gpu",), args)  # one instance, no PD
    assert alone["tpot_p50_ms"] != fast["tpot_p50_ms"]
