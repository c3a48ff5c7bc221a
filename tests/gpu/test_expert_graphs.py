"""The expert compute of a rank that serves experts, replayed from CUDA graphs
(afd_engine/ranks/static_decode.ExpertGraphs): received batches padded into the persistent inputs
give the eager compute's rows, across buckets and layers, and a graph output copied before the next
replay of its (layer, bucket) keeps its values. On the CPU nothing is captured and the same calls
compute eagerly (what the test then checks is itself)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_expert_graphs_replay_the_eager_compute(checkpoint, device, tiny, record_property):
    from afd_engine.ranks.static_decode import ExpertGraphs, StaticReceived
    from tests.gpu import engines

    backend = "torch" if tiny else "triton"
    with engines.make_engine(checkpoint("deepseek_v3"), device, "float32", backend, {}) as engine:
        experts = engine.model.routed_experts()
        cfg = engine.config
        k = cfg.num_experts_per_tok
        static = StaticReceived([8, 16, 32], cfg.hidden_size, k, torch.float32, device)
        graphs = ExpertGraphs(experts, static, k, capture=device.type == "cuda")
        seconds = graphs.capture_all()
        record_property("expert_graphs", len(graphs.graphs))
        record_property("capture_seconds", round(seconds, 3))
        g = torch.Generator().manual_seed(3)
        kept = []
        for m in (3, 8, 13, 30, 5):
            hidden = torch.randn(m, cfg.hidden_size, generator=g).to(device)
            ids = torch.randint(-1, cfg.n_routed_experts, (m, k), generator=g).to(device)
            weights = torch.rand(m, k, generator=g).to(device)
            for layer, layer_experts in experts.items():
                with torch.inference_mode():
                    eager = layer_experts(hidden, ids, weights)
                    padded = static.load(hidden, ids, weights)
                    out = graphs.run(layer, *padded)[:m].clone()
                torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
                kept.append((out, eager))
        for out, eager in kept:  # copies of graph outputs are not overwritten by later replays
            torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
        if device.type == "cuda":
            assert len(graphs.graphs) == 3 * len(experts) and graphs.owned
