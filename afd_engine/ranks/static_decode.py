"""Static decode on the ranks of a deployment: what piecewise CUDA graphs replay, runnable anywhere.

A CUDA graph replays fixed shapes at fixed addresses and never waits on the host. An attention
rank's step is cut by its messages (dispatch, combine), so what a graph can hold is each piece of
compute between them, per micro-batch and batch bucket; an FFN rank's is the expert compute of a
received batch. `--static-decode` runs every decode step of every role through exactly the
padded, persistent-buffer path those pieces replay, without capturing, so that a CPU proves what a
GPU will replay (tokens, expert loads, addresses):

    attention rank   micro-batch m of B decode sequences -> the smallest bucket bs >= B of
                     --cuda-graph-bs; its batch tensors are the first bs rows of m's own persistent
                     buffers (runtime/cuda_graph.StaticDecode; padding rows read and write one
                     reserved page). Every piece computes bs rows; dispatch sends the first B
                     (ranks/remote_experts.py) and combine writes their results into m's persistent
                     [max_bs, H] buffer, padding rows zero; the logits of the real rows are kept.
    FFN rank         the M token copies received for (layer, micro-batch) -> the smallest bucket
                     >= M of --ffn-cuda-graph-bs; they are copied into one set of persistent
                     buffers (padding rows route nowhere: local ids -1, weights 0), the experts
                     compute the bucket, the first M rows go back. One set serves every layer and
                     micro-batch: a rank runs its expert computes one at a time, in stream order.

A micro-batch with prefill, an empty one, or one past the largest bucket runs eagerly, as before.
Expert weights stay where they were loaded: a rebalance's switch and an FFN recovery copy the new
experts into that storage (models/routed_experts.RoutedExperts.adopt), so the addresses a graph
holds never move; `addresses()` lists them, for the check that they did not.
"""

from __future__ import annotations

import time

import torch

from afd_engine.graph_sizes import bucket_for
from afd_engine.runtime.cuda_graph import graph_safe_moe


class StaticReceived:
    """An FFN rank's persistent expert inputs: received token copies padded to a bucket (module doc)."""

    def __init__(self, buckets: list[int], hidden: int, top_k: int, dtype, device: torch.device) -> None:
        self.buckets = sorted(buckets)
        rows = self.buckets[-1]
        self.hidden = torch.zeros(rows, hidden, dtype=dtype, device=device)
        # per row width: K choices (two-stage dispatch), or one (direct dispatch sends a row per expert)
        self.routes = {
            k: (
                torch.full((rows, k), -1, dtype=torch.int64, device=device),
                torch.zeros(rows, k, dtype=torch.float32, device=device),
            )
            for k in sorted({1, top_k})
        }
        self.batches = 0  # received batches computed statically

    def fits(self, rows: int) -> bool:
        return 0 < rows <= self.buckets[-1]

    def bucket_for(self, rows: int) -> int | None:
        """The smallest bucket holding `rows`; None above the largest."""
        return bucket_for(self.buckets, rows)

    def load(
        self, hidden: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copies M received rows into the buffers, pads to the bucket; the bucket's views."""
        m = hidden.shape[0]
        bs = self.bucket_for(m)
        ids, w = self.routes[local_ids.shape[1]]
        self.hidden[:m].copy_(hidden, non_blocking=True)
        ids[:m].copy_(local_ids, non_blocking=True)
        w[:m].copy_(weights, non_blocking=True)
        self.hidden[m:bs].zero_()
        ids[m:bs].fill_(-1)
        w[m:bs].zero_()
        self.batches += 1
        return self.hidden[:bs], ids[:bs], w[:bs]

    def addresses(self) -> list[int]:
        return [t.data_ptr() for t in (self.hidden, *(t for pair in self.routes.values() for t in pair))]


class AddressGuard:
    """Fails a step whose persistent tensors moved: a replayed graph would read freed memory (an
    expert switch that rebinds instead of copying, a buffer reallocated). `addresses()` lists them;
    checked before every static step, which costs a few pointer reads."""

    def __init__(self, addresses, who: str) -> None:
        self.addresses, self.who = addresses, who
        self.expected = addresses()
        self.checks = 0

    def check(self) -> None:
        now = self.addresses()
        if now != self.expected:
            moved = [i for i, (a, b) in enumerate(zip(now, self.expected)) if a != b]
            raise RuntimeError(
                f"{self.who}: persistent tensors {moved} of {len(self.expected)} (now {len(now)}) that "
                "static decode runs on moved (an expert "
                "switch or recovery must copy into the weights' storage); a graph replay would read stale memory"
            )
        self.checks += 1


def expert_addresses(experts: dict) -> list[int]:
    """Where every routed-expert weight tensor held here lives (layer id -> RoutedExperts)."""
    return [t.data_ptr() for layer in sorted(experts) for t in experts[layer].state_dict().values()]


class ExpertGraphs:
    """The expert compute of a rank that serves experts, replayed from CUDA graphs: one per (MoE
    layer, received-token bucket) at the row width its dispatch mode sends, all reading the same
    persistent inputs (StaticReceived). The expert server computes through `run`: a batch in the
    persistent inputs replays its graph, anything else computes eagerly. A
    graph's output is overwritten by the next replay of the same (layer, bucket), a step later, so
    what is sent from it is copied first (`owned`)."""

    def __init__(self, experts: dict, static: StaticReceived, width: int, capture: bool) -> None:
        self.experts, self.static, self.width, self.capture = experts, static, width, capture
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}

    @torch.inference_mode()
    def capture_all(self) -> float:
        """Captures every (layer, bucket), largest bucket first, into one memory pool; the seconds
        it took (0 without capture). Each runs twice eagerly first (Triton compiles) on a side stream."""
        if not self.capture:
            return 0.0
        start = time.perf_counter()
        device = self.static.hidden.device
        ids, weights = self.static.routes[self.width]
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)
        for bs in reversed(self.static.buckets):
            args = (self.static.hidden[:bs], ids[:bs], weights[:bs])
            for layer, experts in self.experts.items():
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        experts(*args)
                torch.cuda.current_stream(device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[layer, bs] = experts(*args)
                self.graphs[layer, bs] = graph
        torch.cuda.synchronize(device)
        return time.perf_counter() - start

    def run(self, layer: int, x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s experts on a received batch: its graph's replay where the batch is a
        bucket of the persistent inputs at the captured width, else the eager compute."""
        key = (layer, x.shape[0])
        graph = self.graphs.get(key) if x.data_ptr() == self.static.hidden.data_ptr() else None
        if graph is None or local_ids.shape[1] != self.width:
            return self.experts[layer](x, local_ids, weights)
        graph.replay()
        return self.outputs[key]

    @property
    def owned(self) -> bool:
        """Whether results must be copied before they are sent (graph outputs are reused)."""
        return bool(self.graphs)


def graphs_on(args, device: torch.device) -> bool:
    """Whether a rank captures CUDA graphs: on a GPU unless --disable-cuda-graph, with a MoE backend
    that decodes without host reads."""
    return device.type == "cuda" and not args.disable_cuda_graph and graph_safe_moe(args.moe_backend)


def static_received(args, cfg, device: torch.device) -> StaticReceived | None:
    """The persistent expert inputs of a rank that serves experts, where it decodes statically
    (--static-decode, or where its expert graphs replay)."""
    if not (args.static_decode or graphs_on(args, device)):
        return None
    return StaticReceived(args.ffn_graph_buckets(), cfg.hidden_size, cfg.num_experts_per_tok, args.torch_dtype, device)


def expert_graphs(args, cfg, experts: dict, static: StaticReceived | None, device: torch.device) -> ExpertGraphs | None:
    """The expert graphs of a rank serving `experts` on `static` inputs: rows of one expert each in
    direct dispatch, of the top-k choices in two-stage."""
    if static is None:
        return None
    width = 1 if args.dispatch_mode == "direct" else cfg.num_experts_per_tok
    return ExpertGraphs(experts, static, width, graphs_on(args, device))
