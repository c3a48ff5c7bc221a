"""bench_long_context: decode steps of a DeepSeek-V3.2-shaped model against the same model dense
over built contexts (the times are the benchmark's, not asserted; what was measured is: how many
tokens each model's MLA attended to, and that the two models agree where the indexer keeps all)."""

from __future__ import annotations

import json

import pytest

from benchmarks.lib.results import STAMP_KEYS
from tests.process_helpers import bench_run

CONTEXTS = (16, 64, 128)  # the quick mode's, around its index_topk of 32
TOPK = 32


@pytest.mark.timeout(240)
def test_quick_run_limits_the_sparse_models_attention_to_index_topk_tokens(tmp_path):
    out, png = tmp_path / "long_context.json", tmp_path / "long_context.png"
    res = bench_run("bench_long_context.py", "--quick", "--json", str(out), "--plot", str(png))
    data = json.loads(out.read_text())
    assert all(k in data for k in STAMP_KEYS) and data["torch"]
    assert (data["batch"], data["repeats"], data["threads"], data["model"]["index_topk"]) == (2, 1, 1, TOPK)
    assert list(data["backends"]) == ["cpu", "torch"]
    for backend, points in data["backends"].items():
        assert [p["context"] for p in points] == list(CONTEXTS)
        for p in points:
            ctx, dense, sparse = p["context"], p["dense"], p["sparse"]
            # every query's MLA: the sparse model's over its top index_topk, the dense one's over all
            assert sparse["attended_tokens"] == {"min": min(ctx + 1, TOPK), "max": min(ctx + 1, TOPK)}, backend
            assert dense["attended_tokens"] == {"min": ctx + 1, "max": ctx + 1}, backend
            # the indexer keeping every token leaves the dense model's logits; dropping some changes them
            if ctx + 1 <= TOPK:
                assert p["logits_max_abs_diff"] < 1e-4, (backend, ctx)
            else:
                assert p["logits_max_abs_diff"] > 1e-2, (backend, ctx)
            assert set(dense) == {"step_ms", "mla_ms", "attended_tokens", "samples"}
            assert set(sparse) == {"step_ms", "indexer_ms", "mla_ms", "attended_tokens", "samples"}
            for model in (dense, sparse):
                for key, samples in model["samples"].items():
                    assert len(samples) == 1 and model[key] == samples[0] > 0
                assert model["mla_ms"] < model["step_ms"]
    lines = res.stdout.splitlines()
    assert lines[0] == "attention backend cpu, median ms per decode step:"
    assert lines[1].split()[:3] == ["context", "dense", "step"]
    assert [line.split()[0] for line in lines[2:5]] == [str(c) for c in CONTEXTS]
    assert [line.split()[-1] for line in lines[2:5]] == ["17/17", "32/65", "32/129"]
    assert lines[5] == "attention backend torch, median ms per decode step:"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
