"""bench_op_times: every layer operation of every process timed and counted, the spawned ranks' too
(the times are the benchmark's; the counts follow from the model and the tokens generated)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.process_helpers import bench_run

TOKENS = 6  # one prefill step and five decode steps


def test_each_process_of_single_and_afd_reports_all_its_operations(tmp_path, tiny_v3):
    config = json.loads((Path(tiny_v3) / "config.json").read_text())
    layers = config["num_hidden_layers"]
    moe_layers = layers - config["first_k_dense_replace"]
    out = tmp_path / "ops.json"
    res = bench_run(
        "bench_op_times.py",
        *("--model-path", tiny_v3, "--deployments", "single", "afd 1A+1F"),
        *("--max-new-tokens", str(TOKENS), "--json", str(out)),
    )
    data = json.loads(out.read_text())["deployments"]
    (single,) = data["single"]
    attention, experts = data["afd 1A+1F"]  # the attention rank, then the FFN rank
    for proc in (single, attention):
        calls = {op: v["calls"] for op, v in proc["ops"].items()}
        assert calls["embed"] == calls["logits"] == TOKENS
        assert calls["attention"] == layers * TOKENS
        assert calls["gate"] == calls["dispatch"] == calls["combine"] == moe_layers * TOKENS
    assert {op: v["calls"] for op, v in experts["ops"].items()} == {
        op: moe_layers * TOKENS for op in ("post_dispatch", "receive", "experts", "send_combine")
    }
    assert all(v["mean_us"] > 0 for p in (single, attention, experts) for v in p["ops"].values())
    assert "afd 1A+1F, experts process" in res.stdout and "single, attention process" in res.stdout
