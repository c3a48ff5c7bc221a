"""Decode steps replayed from CUDA graphs give the eager steps' tokens (fp32, triton backend), with
requests arriving two at a time (tests.engine_helpers.run_staggered): the batch moves across
buckets, prefill steps mix in, and with overlap each step's inputs hold the last step's
placeholders. On the CPU the same static, padded path runs eagerly (GraphRunner with capture off,
the torch backend in place of triton, which the interpreter would make slow)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu import engines

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v32"])  # V3.2: the indexer over padded decode tables
def test_graph_decode_steps_give_the_eager_tokens(checkpoint, device, tiny, record_property, arch):
    from afd_engine.runtime.cuda_graph import GraphRunner
    from afd_engine.sampling_params import SamplingParams
    from tests.engine_helpers import run_staggered

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (3, 17, 1, 9, 30, 5, 12, 2)]
    params = SamplingParams(max_new_tokens=4 if tiny else 20, temperature=0.0, ignore_eos=True)
    backend = "torch" if tiny else "triton"
    runs = {}
    for graphs in (False, True):
        settings = {"disable_cuda_graph": not graphs}
        with engines.make_engine(checkpoint(arch), device, "float32", backend, settings) as engine:
            if graphs and device.type != "cuda":
                engine.runner.graphs = GraphRunner(
                    engine.model, engine.pool, [1, 2, 4], True, engine.load_recorder, False
                )
            tokens = run_staggered(engine, prompts, params, every=2)
            runner = engine.runner.graphs
            runs[graphs] = (tokens, runner.replays if runner else 0)
    (eager, eager_replays), (graphed, replays) = runs[False], runs[True]
    record_property("graph_replays", replays)
    assert graphed == eager
    assert replays > 0 and eager_replays == 0  # the graph path ran, the eager one did not
