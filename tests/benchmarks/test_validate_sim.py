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
    from benchmarks.serving_datasets import trace_requests

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
