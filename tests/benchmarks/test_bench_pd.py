"""bench_pd.py's arithmetic (the deployments themselves run in tests/disagg)."""

from __future__ import annotations

import pytest

from tests.process_helpers import load_bench


def test_percentiles_and_transfer_figures():
    bench = load_bench("bench_pd.py")
    assert bench.pct([3.0, 1.0, 2.0, 4.0, 5.0], 50) == 3.0
    assert bench.pct([float(i) for i in range(101)], 99) == 99.0
    timelines = [
        {
            "transfer_bytes": 2**20,
            "transfer_s": 0.5,
            "queue_s": 0.1,
            "prefill_s": 0.2,
            "kv_wait_s": 0.3,
            "first_decode_step_s": 0.01,
        },
        {
            "transfer_bytes": 3 * 2**20,
            "transfer_s": 1.5,
            "queue_s": 0.3,
            "prefill_s": 0.4,
            "kv_wait_s": 0.5,
            "first_decode_step_s": 0.03,
        },
        {
            "transfer_bytes": 0,
            "transfer_s": 0.0,
            "queue_s": 0,
            "prefill_s": 0,
            "kv_wait_s": 0,
            "first_decode_step_s": 0,
        },
    ]
    out = bench.transfer_figures(timelines)
    assert out["transfer_mb_per_s"] == pytest.approx(2.0)
    assert out["transfer_ms_per_request"] == pytest.approx(1000.0)
    assert out["transfer_kb_per_request"] == pytest.approx(2048.0)
    assert out["ttft_split_ms_mean"]["prefill_s"] == pytest.approx(300.0)
    assert bench.transfer_figures([]) == {}
