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
    timelines.append({"queue_s": 0.0, "prefill_s": 0.01})  # a request the decode instance prefilled itself
    out = bench.transfer_figures(timelines)
    assert out["transfer_mb_per_s"] == pytest.approx(2.0)
    assert out["transfer_ms_per_request"] == pytest.approx(1000.0)
    assert out["transfer_kb_per_request"] == pytest.approx(2048.0)
    assert out["ttft_split_ms_mean"]["prefill_s"] == pytest.approx(300.0)
    assert bench.transfer_figures([]) == {}


def test_model_choice(tmp_path):
    bench = load_bench("bench_pd.py")
    from afd_engine.default_model import default_model_path

    assert bench.model_path("embedded", str(tmp_path)) == str(default_model_path())
    path = bench.model_path("dsv3-4k", str(tmp_path))
    import json

    config = json.load(open(f"{path}/config.json"))
    assert (config["max_position_embeddings"], config["kv_lora_rank"], config["qk_rope_head_dim"]) == (4096, 512, 64)
    assert bench.model_path("dsv3-4k", str(tmp_path)) == path  # written once
