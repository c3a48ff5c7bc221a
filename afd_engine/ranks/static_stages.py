"""An attention rank's static decode: its stages on persistent buffers, replayed from CUDA graphs.

The operations of a step are arranged in stages (operations/strategy.py): in AFD a stage runs from
a MoE layer's combine to the next MoE layer's dispatch and shared expert. Between two messages
everything is device compute, so a stage of a static micro-batch is one CUDA graph per (stage,
micro-batch slot, bucket), with the messages at its edges done by the host:

    before the stage   receive the results of the dispatch the micro-batch sent after its previous
                       stage into its persistent combine buffer (rows past the real ones zero)
    the stage          its operations (or its graph's replay): combine returns the buffer, dispatch
                       routes every row through persistent tables with a device-held salt and
                       returns a `Deferred` (ranks/remote_experts.py)
    after the stage    send the real rows of what it routed, count them for the expert load

Without capture (--static-decode, a CPU) the stages run their operations on the same buffers in the
same order, so the CPU runs the host side of a replay exactly. Colocated ranks serve their peers'
experts inside a stage (a host wait between device compute), so their stages are never captured
and their combine receives in place; their experts replay from graphs (static_decode.ExpertGraphs).

Memory: each micro-batch slot captures into a pool of its own, buckets largest first; within a
step a slot replays one bucket's graphs in the order they were captured, so what one stage's graph
reuses of the pool was dead in the capture too. The state a stage leaves (its output tensors, its
Deferreds) is kept per graph: a replay restores it, which keeps every graph's outputs alive.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from afd_engine.eplb.expert_map import spread_over_copies
from afd_engine.graph_sizes import bucket_for
from afd_engine.models.forward_batch import ForwardBatch
from afd_engine.operations.stages import split_stages
from afd_engine.operations.state import MicroBatchState
from afd_engine.ranks.static_decode import AddressGuard, expert_addresses
from afd_engine.runtime.cuda_graph import StaticDecode, needs_slot_tables
from afd_engine.runtime.kv_cache import KVPool


class StaticMicroBatches:
    """The persistent decode batches of an attention rank, one per micro-batch slot."""

    def __init__(self, pool: KVPool, buckets: list[int], needs_slots: bool, num_micro_batches: int, hidden: int, dtype):
        self.pool = pool
        self.buckets = sorted(buckets)
        self.max_bs = self.buckets[-1]
        pad_page = pool.reserve_page()  # shared: padding rows only ever read their own padding token
        pages = pool.page_table.shape[1]
        self.batches = [
            StaticDecode(pool, self.max_bs, pages, pad_page, needs_slots, pool.device) for _ in range(num_micro_batches)
        ]
        self.combined = [torch.zeros(self.max_bs, hidden, dtype=dtype, device=pool.device) for _ in self.batches]
        self.salts = [torch.zeros((), dtype=torch.int64, device=pool.device) for _ in self.batches]
        self.bs: list[int | None] = [None] * num_micro_batches  # this step's bucket of each slot
        self.steps = 0  # micro-batches run statically

    def bucket_for(self, rows: int) -> int | None:
        """The smallest bucket holding `rows`; None above the largest."""
        return bucket_for(self.buckets, rows)

    def stage(self, micro: list[dict]) -> tuple[list[dict], list[int | None], list[torch.Tensor | None]]:
        """The step's micro-batches, each decode-only one that fits moved onto its persistent batch:
        (the batches to run, each one's real row count or None where it runs eagerly, each one's
        logit rows to keep or None)."""
        staged, real, keep = [], [], []
        self.bs = [None] * len(self.batches)
        for m, batch in enumerate(micro):
            fb: ForwardBatch = batch["fb"]
            static = self.batches[m] if m < len(self.batches) else None
            if static is None or not static.fits(fb):
                staged.append(batch)
                real.append(None)
                keep.append(None)
                continue
            bs = self.bs[m] = self.bucket_for(fb.num_tokens)
            static.load(fb, bs)
            staged.append(self.inputs(m, bs, batch))
            real.append(fb.num_tokens)
            keep.append(batch["rows"])
            self.steps += 1
        return staged, real, keep

    def inputs(self, m: int, bs: int, batch: dict | None = None) -> dict:
        """Slot m's micro-batch at bucket bs: its operations' initial state."""
        static = self.batches[m]
        return {**(batch or {"kv_cache": self.pool.cache}), "fb": static.batch(bs), "rows": static.rows[:bs]}

    def set_salts(self, step: int, sender: int) -> None:
        """Each slot's route salt this step (ExpertMap.to_physical's: step + micro-batch + sender)."""
        for m, salt in enumerate(self.salts):
            salt.fill_(step + m + sender)

    def addresses(self) -> list[int]:
        """Where every persistent tensor lives (graph inputs, combine buffers, salts)."""
        tensors = [t for s in self.batches for t in vars(s).values() if isinstance(t, torch.Tensor)]
        return [t.data_ptr() for t in tensors + self.combined + self.salts]


class RouteTables:
    """Every MoE layer's routing tables at fixed addresses, each placement copied in when it
    changes: [E, width] the slots of each expert's copies (width: the most copies an expert can
    have), [E] each expert's count."""

    def __init__(self, moe_layers, num_experts: int, width: int, device: torch.device) -> None:
        i64 = dict(dtype=torch.int64, device=device)
        self.width = width
        self.tables = {
            layer: (torch.zeros(num_experts, width, **i64), torch.ones(num_experts, **i64)) for layer in moe_layers
        }
        self.loaded = None  # the ExpertMap copied in last

    def load(self, expert_map) -> None:
        if expert_map is self.loaded:
            return
        for layer, (table, copies) in self.tables.items():
            src, counts = expert_map.tables(layer)
            w = src.shape[1]
            if w > self.width:
                raise RuntimeError(f"MoE layer {layer}: an expert has {w} copies, the route tables hold {self.width}")
            table[:, :w].copy_(src)
            table[:, w:].copy_(src[:, :1].expand(-1, self.width - w))  # never chosen: count bounds the pick
            copies.copy_(counts)
        self.loaded = expert_map

    def route(self, layer_id: int, topk_ids: torch.Tensor, salt: torch.Tensor) -> torch.Tensor:
        table, copies = self.tables[layer_id]
        if self.width == 1:  # no copies anywhere: one slot per expert
            return table[topk_ids, 0]
        return spread_over_copies(topk_ids, table, copies, salt)

    def addresses(self) -> list[int]:
        return [t.data_ptr() for pair in self.tables.values() for t in pair]


@dataclass
class _StageGraph:
    graph: torch.cuda.CUDAGraph
    after: dict  # the state the stage leaves (its outputs: the graph's tensors)
    produced: list  # the Deferred dispatches it routes


class StaticStages:
    """Runs the stages of static micro-batches (module doc) as `run_micro_batches`' stage runner.
    `prefetch`: receive a stage's combine before it (AFD; what a graph needs), else in its combine
    (colocated, where the rank serves its experts first)."""

    def __init__(self, executor, micro: StaticMicroBatches, prefetch: bool) -> None:
        self.executor, self.micro, self.prefetch = executor, micro, prefetch
        self.pending: list[list] = [[] for _ in micro.batches]  # per slot: sent, not yet combined
        self.graphs: dict[tuple[int, int, int], _StageGraph] = {}

    def begin_step(self) -> None:
        self.pending = [[] for _ in self.micro.batches]

    def run(self, index: int, state: MicroBatchState, run_ops) -> None:
        m, ex = state.micro_batch, self.executor
        if not ex._static(m):
            run_ops()
            return
        if self.prefetch:
            for d in self.pending[m]:
                ex.receive_into(d)
        self.pending[m] = []
        captured = self.graphs.get((index, m, self.micro.bs[m]))
        if captured is not None:
            captured.graph.replay()
            state.restore(captured.after)
            produced = captured.produced
        else:
            ex.produced = []
            run_ops()
            produced, ex.produced = ex.produced, []
        for d in produced:
            ex.send_deferred(d)
        self.pending[m] = produced

    @torch.inference_mode()
    def capture_all(self, stages: list) -> float:
        """Captures every (stage, slot, bucket) of an all-padding micro-batch, per slot into its own
        pool, buckets largest first, each slot and bucket run twice eagerly first (Triton compiles,
        lazy tables) on a side stream. Nothing is sent. Returns the seconds it took."""
        start, ex, device = time.perf_counter(), self.executor, self.micro.pool.device
        ex.real_rows = [0] * len(self.micro.batches)  # static, nothing real: routed, never sent
        stream = torch.cuda.Stream(device)
        for m in range(len(self.micro.batches)):
            pool = torch.cuda.graph_pool_handle()
            for bs in reversed(self.micro.buckets):
                self.micro.batches[m].pad(0, bs)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        self._run_alone(stages, m, bs, None)
                torch.cuda.current_stream(device).wait_stream(stream)
                self._run_alone(stages, m, bs, pool)
        torch.cuda.synchronize(device)
        ex.real_rows = []
        return time.perf_counter() - start

    def _run_alone(self, stages: list, m: int, bs: int, pool) -> None:
        """Slot m's micro-batch at bucket bs through every stage, without messages; with `pool`,
        each stage captured into a graph of that pool."""
        ex, state = self.executor, MicroBatchState(m, self.micro.inputs(m, bs))
        for index, stage in enumerate(stages):
            ex.produced = []
            graph = torch.cuda.CUDAGraph() if pool is not None else None
            with torch.cuda.graph(graph, pool=pool) if graph is not None else nullcontext():
                for op in stage:
                    op(state)
            for d in ex.produced:
                d.received = True  # its combine reads the (zero) buffer
            if graph is not None:
                self.graphs[index, m, bs] = _StageGraph(graph, state.snapshot(), ex.produced)
            ex.produced = []
        state.take_output()


class StaticAttention:
    """Everything static decode adds to an attention rank (attention_runner.PipelineRunner): its
    persistent batches, route tables, stage runner, graphs where they are captured, and the check
    that none of the tensors they hold has moved."""

    def __init__(self, args, model, pool: KVPool, executor, layout, num_micro_batches: int, colocated: bool) -> None:
        cfg = model.config
        self.micro = StaticMicroBatches(
            pool, args.graph_buckets(), needs_slot_tables(args.attention_backend), num_micro_batches,
            cfg.hidden_size, args.torch_dtype,
        )  # fmt: skip
        self.tables = RouteTables(cfg.moe_layers, layout.num_experts, layout.num_redundant + 1, pool.device)
        executor.combined, executor.salts, executor.route_tables = self.micro.combined, self.micro.salts, self.tables
        self.executor = executor
        self.stages = StaticStages(executor, self.micro, prefetch=not colocated)
        experts = model.routed_experts()  # colocated: this rank's; AFD: none
        self.guard = AddressGuard(
            lambda: self.micro.addresses() + self.tables.addresses() + expert_addresses(experts),
            f"attention rank {executor.endpoint.sender}",
        )

    @property
    def steps(self) -> int:
        return self.micro.steps

    def capture(self, ops, expert_map) -> float:
        """Captures the stages of `ops` (arranged, with YieldOperation markers); the seconds it took."""
        self.tables.load(expert_map)
        seconds = self.stages.capture_all(split_stages(list(ops)))
        self.guard.expected = self.guard.addresses()  # capture made the tables' device copies
        return seconds

    def begin_step(self, micro: list[dict], step: int, expert_map) -> tuple[list[dict], list]:
        """The step's micro-batches on their persistent batches (StaticMicroBatches.stage), the
        tables and salts of this step set; returns (micro-batches, logit rows to keep)."""
        self.guard.check()
        self.tables.load(expert_map)
        self.micro.set_salts(step, self.executor.endpoint.sender)
        micro, self.executor.real_rows, keep = self.micro.stage(micro)
        self.stages.begin_step()
        return micro, keep

    @staticmethod
    def finish(outs: list, keep: list) -> list:
        """The real rows' logits of each static micro-batch."""
        return [out if rows is None else out[rows] for out, rows in zip(outs, keep)]
