"""Graph-ready decode (afd_engine/runtime/cuda_graph.py), proven on the CPU.

- The static, padded decode step of a bucket gives the eager engine's tokens and expert load counts
  (padding rows change nothing), falls back to eager above the largest bucket and for prefill, and
  its buffers never move.
- The function a CUDA graph captures (the model's decode forward on a bucket's static batch) traces
  under torch._dynamo with fullgraph=True at two buckets, for single mode, an attention rank's
  static micro-batch (every piece between its messages, its real executor's route of every row and
  its combine into the persistent buffer, the messages stood in for), and an FFN rank's experts on a
  received batch padded into its persistent buffers (ranks/static_decode.py): no host read, no
  data-dependent shape. Seen red with a host read put back in the forward and in the route.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from afd_engine import Engine, SamplingParams
from afd_engine.engine_args import EngineArgs
from afd_engine.eplb.expert_map import ExpertLayout, ExpertMap
from afd_engine.errors import ConfigError
from afd_engine.graph_sizes import graph_buckets, parse_buckets
from afd_engine.models.forward_batch import ForwardBatch, SeqChunk
from afd_engine.operations import run_micro_batches
from afd_engine.operations.strategy import AFD_ATTENTION
from afd_engine.ranks.remote_experts import RemoteExpertExecutor
from afd_engine.ranks.static_decode import StaticReceived
from afd_engine.ranks.static_stages import RouteTables
from afd_engine.runtime.cuda_graph import GraphRunner
from afd_engine.tiny_model import make_tiny_model
from tests.engine_helpers import random_prompts

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["deepseek_v3", "qwen3_moe"])
def checkpoint(request, tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param))


def make_engine(path: str) -> Engine:
    return Engine(model_path=path, dtype="float32", kv_cache_memory_mb=8, page_size=4)


def with_graphs(engine: Engine, buckets: list[int]) -> GraphRunner:
    graphs = GraphRunner(engine.model, engine.pool, buckets, True, engine.load_recorder, capture=False)
    engine.runner.graphs = graphs
    return graphs


def generate(engine: Engine, prompts, lengths) -> list[list[int]]:
    """Each prompt with its own max_tokens, so the decode batch shrinks step by step."""
    ids = [
        engine.add_request(prompt_token_ids=p, params=SamplingParams(max_new_tokens=n, **GREEDY))
        for p, n in zip(prompts, lengths)
    ]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            done[out.request_id] = out.token_ids
    return [done[i] for i in ids]


def test_buckets_and_their_flags():
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_buckets(5) == [1, 2, 4, 5] and graph_buckets(1) == [1]
    assert parse_buckets("8, 1,2,2") == [1, 2, 8]
    assert EngineArgs(max_running_requests=12).graph_buckets() == [1, 2, 4, 8, 12]
    assert EngineArgs(cuda_graph_max_bs=200).graph_buckets()[-1] == 200
    assert EngineArgs(cuda_graph_bs="3,1").graph_buckets() == [1, 3]
    for bad, why in (("1,x", "not a comma-separated list"), ("0,4", "positive batch sizes"), (",", "positive")):
        with pytest.raises(ConfigError, match=f"--cuda-graph-bs='{bad}': .*{why}"):
            EngineArgs(cuda_graph_bs=bad).validate()
    with pytest.raises(ConfigError, match="--cuda-graph-max-bs=0: must be at least 1"):
        EngineArgs(cuda_graph_max_bs=0).validate()


def test_padded_static_steps_give_the_eager_tokens_and_loads(checkpoint):
    prompts = random_prompts(200, (3, 9, 5, 14, 2, 7), seed=1, low=5)
    lengths = (6, 2, 9, 4, 7, 3)  # the decode batch goes 6 -> 5 -> ... -> 1
    eager = make_engine(checkpoint)
    want = generate(eager, prompts, lengths)
    static = make_engine(checkpoint)
    pages = static.pool.num_pages
    graphs = with_graphs(static, [1, 2, 4])  # 3 and 5 sequences run padded; 6 runs eagerly
    assert static.pool.num_pages == pages - 1  # the padding page left the pool's count
    assert generate(static, prompts, lengths) == want
    assert graphs.replays >= 6  # every decode step of 4 or fewer sequences
    assert [len(t) for t in want] == list(lengths)
    # the padding rows' gate choices were weighed 0: the same expert loads as the eager run
    assert torch.equal(static.load_recorder.window(), eager.load_recorder.window())
    assert static.load_recorder.window().sum() > 0


def test_the_static_batch_is_views_of_buffers_that_never_move(checkpoint):
    engine = make_engine(checkpoint)
    graphs = with_graphs(engine, [2, 4])
    before = {b: [t.data_ptr() for t in _tensors(graphs.static.batch(b))] for b in (2, 4)}
    generate(engine, random_prompts(200, (4, 6, 3), seed=2, low=5), (3, 5, 2))
    assert graphs.replays > 0
    for b in (2, 4):
        fb = graphs.static.batch(b)
        assert [t.data_ptr() for t in _tensors(fb)] == before[b]
        assert fb.input_ids.data_ptr() == graphs.static.input_ids.data_ptr() and fb.num_tokens == b
    assert graphs.bucket_for(3) == 4 and graphs.bucket_for(1) == 2 and graphs.bucket_for(5) is None


def _tensors(fb: ForwardBatch) -> list[torch.Tensor]:
    return [fb.input_ids, fb.positions, fb.out_slots, fb.dec_slots, fb.dec_kv_lens, fb.dec_bias, fb.dec_pages]


# -- no host read, no data-dependent shape: the captured function under dynamo's fullgraph ------------


# what reads device values on the host (a sync on a GPU) or gives a shape that depends on them;
# dynamo records `.item()` in the graph as an unbacked value (checked by _assert_scalar) instead of
# breaking it, so fullgraph alone does not refuse a host read: the graph is searched for these too
HOST_READS = {"item", "tolist", "numpy", "cpu", "nonzero", "masked_select", "unique", "bincount"}
HOST_READS |= {"repeat_interleave", "_local_scalar_dense", "_assert_scalar", "argwhere", "unique_consecutive"}


def host_reads(gm: torch.fx.GraphModule) -> list[str]:
    found = []
    for node in gm.graph.nodes:
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
        if node.op in ("call_method", "call_function") and name.split(".")[0] in HOST_READS:
            found.append(f"{node.op} {name}")
    return found


def traced(fn, *args):
    """fn compiled with fullgraph=True (a graph break raises) and run: its result. Raises when the
    graph holds a host read (HOST_READS)."""
    reads = []

    def backend(gm, example_inputs):
        reads.extend(host_reads(gm))
        return gm.forward

    torch._dynamo.reset()
    with torch.inference_mode():
        out = torch.compile(fn, fullgraph=True, backend=backend, dynamic=False)(*args)
    if reads:
        raise AssertionError(f"host reads in the captured step: {reads}")
    return out


def loaded_runner(engine: Engine, batch: int, buckets) -> GraphRunner:
    """A GraphRunner whose static buffers hold a real decode step of `batch` sequences."""
    graphs = with_graphs(engine, buckets)
    pool = engine.pool
    rows = [pool.open_row() for _ in range(batch)]
    for i, row in enumerate(rows):
        assert pool.grow(row, 12 + i)
    fb = ForwardBatch.build([], [SeqChunk(r, 11 + i, [7 + i]) for i, r in enumerate(rows)], pool.page_table, 4)
    graphs.static.load(fb, graphs.bucket_for(batch))
    return graphs


@pytest.mark.parametrize("bs", [2, 4])
def test_the_single_mode_decode_forward_traces_as_one_graph(checkpoint, bs):
    engine = make_engine(checkpoint)
    graphs = loaded_runner(engine, bs - 1, [2, 4])  # one padding row
    with torch.inference_mode():
        eager = graphs._static_forward(bs)
    assert torch.equal(traced(graphs._static_forward, bs), eager)


class PieceExecutor(RemoteExpertExecutor):
    """An attention rank's real executor on a static micro-batch, its messages (which a graph leaves
    to the host, ranks/static_stages.py) left out: dispatch routes every row through the persistent
    tables, combine returns the persistent buffer the host would have filled."""

    def receive_into(self, d):
        d.received = True


def piece_executor(engine: Engine, bs: int, real: int) -> PieceExecutor:
    cfg = engine.config
    layout = ExpertLayout(cfg.n_routed_experts, 4, 1, 2, num_groups=cfg.n_group or 1)  # 4 copies: the sorting path
    expert_map = ExpertMap.initial(layout, cfg.moe_layers)
    executor = PieceExecutor(SimpleNamespace(sender=1), expert_map)
    tables = RouteTables(cfg.moe_layers, cfg.n_routed_experts, 5, torch.device("cpu"))
    tables.load(expert_map)
    executor.route_tables, executor.salts = tables, [torch.tensor(3)]
    executor.real_rows, executor.combined = [real], [torch.zeros(bs, cfg.hidden_size)]
    return executor


@pytest.mark.parametrize("bs", [2, 4])
def test_an_attention_ranks_static_micro_batch_traces_as_one_graph(checkpoint, bs):
    """Its pieces (from one combine to the next dispatch, the route of every row included) hold no
    host read: traced together, with the messages stood in for, they make one graph."""
    engine = make_engine(checkpoint)
    graphs = loaded_runner(engine, bs - 1, [2, 4])  # one padding row
    ops = AFD_ATTENTION.arrange(engine.model.operations(piece_executor(engine, bs, bs - 1)))

    def step(fb, cache, rows):
        return run_micro_batches(ops, [{"fb": fb, "kv_cache": cache, "rows": rows}])[0]

    args = (graphs.static.batch(bs), engine.pool.cache, graphs.static.rows[:bs])
    with torch.inference_mode():
        eager = step(*args)
    assert torch.equal(traced(step, *args), eager)


def test_a_host_read_in_the_route_breaks_an_attention_ranks_graph(checkpoint, monkeypatch):
    """Seen red: counting each expert's pairs with bincount (a host read: its output size is the
    largest id) where the route counts them with index_add."""
    engine = make_engine(checkpoint)
    graphs = loaded_runner(engine, 2, [2])
    ops = AFD_ATTENTION.arrange(engine.model.operations(piece_executor(engine, 2, 2)))
    real = RouteTables.route

    def host_read(self, layer, topk_ids, salt):
        torch.bincount(topk_ids.flatten())
        return real(self, layer, topk_ids, salt)

    monkeypatch.setattr(RouteTables, "route", host_read)

    def step(fb, cache, rows):
        return run_micro_batches(ops, [{"fb": fb, "kv_cache": cache, "rows": rows}])[0]

    with pytest.raises(AssertionError, match=r"host reads in the captured step: \['call_function bincount'"):
        traced(step, graphs.static.batch(2), engine.pool.cache, graphs.static.rows[:2])


@pytest.mark.parametrize("width", ["top-k (two-stage)", "one expert a row (direct)"])
@pytest.mark.parametrize("bs", [8, 16])
def test_an_ffn_ranks_experts_trace_on_a_padded_received_batch(checkpoint, bs, width):
    engine = make_engine(checkpoint)
    layer, experts = next(iter(engine.model.routed_experts().items()))
    cfg = engine.config
    k = cfg.num_experts_per_tok if width.startswith("top-k") else 1
    g = torch.Generator().manual_seed(bs)
    m = bs // 2 + 1  # received rows: the rest of the bucket is padding
    hidden = torch.randn(m, cfg.hidden_size, generator=g)
    ids = torch.randint(-1, cfg.n_routed_experts, (m, k), generator=g)  # -1: another rank's expert
    weights = torch.rand(m, k, generator=g)
    static = StaticReceived([8, 16], cfg.hidden_size, cfg.num_experts_per_tok, torch.float32, torch.device("cpu"))
    padded = static.load(hidden, experts.to_local(ids), weights)
    assert padded[0].shape[0] == bs and static.addresses() == static.addresses()
    assert (padded[1][m:] == -1).all() and not padded[2][m:].any()  # padding rows route nowhere, weigh 0
    with torch.inference_mode():
        eager = experts(*padded)
        alone = experts(hidden, experts.to_local(ids), weights)
    assert torch.equal(traced(experts, *padded), eager)
    assert torch.allclose(eager[:m], alone, atol=1e-6) and not eager[m:].any()  # padding rows get nothing


def test_a_host_read_in_the_decode_forward_breaks_the_graph(checkpoint, monkeypatch):
    """Seen red: the split-KV rule read from kv_lens instead of the page table's width (a host read
    and a data-dependent shape) is what the fullgraph trace must refuse."""
    engine = make_engine(checkpoint)
    graphs = loaded_runner(engine, 2, [2])
    real = ForwardBatch.paged_decode

    def host_read(fb):
        longest = int(fb.dec_kv_lens.max())  # a device-to-host copy on a GPU
        kv = real(fb)
        return kv._replace(pages=kv.pages[:, : -(-longest // fb.page_size)])

    monkeypatch.setattr(ForwardBatch, "paged_decode", host_read)
    with pytest.raises(AssertionError, match=r"host reads in the captured step: \['call_method item'"):
        traced(graphs._static_forward, 2)
