"""Decode steps replayed from CUDA graphs: a static, padded decode batch per batch-size bucket.

A decode step's forward is hundreds of small kernel launches; at small batches their launch cost
is the step (a tiny model's eager step took 8-11 ms on an H200, all of it launches). A CUDA graph
records the launches once and replays them with one call, but only if every replay has the same
shapes and addresses and the forward never waits on the host. So a decode-only step runs as:

    bucket      the smallest captured batch size >= the step's B sequences (--cuda-graph-bs, or 1,
                2, 4, 8 and every 8 up to --cuda-graph-max-bs); a larger step runs eagerly
    buffers     persistent tensors sized for the largest bucket: token ids, positions, the slots
                the new latents go to, page table [max_bs, P] and kv lengths (and, for backends
                that read them, slot table and mask bias [max_bs, P * page]); a bucket's batch is
                their first rows, so a graph's inputs never move
    padding     rows B..bucket: token 0 at position 0, writing its latent to a reserved padding
                page and reading one token of it; their logits are dropped and the expert load
                recorder weighs them 0 (rows_weight), so they change nothing a request sees
    forward     the model's own forward on that batch (`ModelRunner`'s), with no host read and no
                data-dependent shape: the MoE alignment is sized by an upper bound, the split-KV
                count by the page table's width (tests/runtime/test_cuda_graph.py traces it with
                torch._dynamo fullgraph=True at two buckets)

`GraphRunner` captures one graph per bucket (largest first, one memory pool) when its device is a
GPU; elsewhere (`capture=False`, the CPU and the tests) the same static path runs eagerly, so the
padding and buffer logic is checked without a GPU. Steps with prefill chunks, or wider than the
largest bucket, or longer than the page table the buffers hold, run eagerly as before.

Deployments capture pieces of their steps instead (ranks/static_stages.py for attention ranks,
ranks/static_decode.py for the experts), on the same `StaticDecode` buffers.
"""

from __future__ import annotations

import time

import torch

from afd_engine.graph_sizes import bucket_for
from afd_engine.models.forward_batch import ForwardBatch
from afd_engine.runtime.kv_cache import KVPool


class StaticDecode:
    """The persistent, padded decode batch of every bucket (see the module docstring)."""

    def __init__(
        self, pool: KVPool, max_bs: int, max_pages: int, pad_page: int, needs_slots: bool, device: torch.device
    ) -> None:
        self.max_bs, self.max_pages, self.page_size = max_bs, max_pages, pool.page_size
        self.pad_slot = pad_page * pool.page_size
        self.pad_page, self.needs_slots = pad_page, needs_slots
        L = max_pages * pool.page_size if needs_slots else 1
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_bs, **i64)
        self.positions = torch.zeros(max_bs, **i64)
        self.out_slots = torch.full((max_bs,), self.pad_slot, **i64)
        self.kv_lens = torch.ones(max_bs, **i64)
        self.pages = torch.full((max_bs, max_pages), pad_page, **i64)
        self.slots = torch.full((max_bs, L), self.pad_slot, **i64)
        self.bias = torch.full((max_bs, 1, L), float("-inf"), dtype=torch.float32, device=device)
        self.bias[:, :, 0] = 0.0  # a padding row reads one token: its own padding slot
        self.rows = torch.arange(max_bs, **i64)  # every row's logits; the step picks its own
        self.rows_weight = torch.zeros(max_bs, **i64)  # 1 for a step's real rows (expert load counts)
        empty = torch.zeros(0, 0, **i64)
        self._extend = dict(
            ext_valid=empty.bool(),
            ext_positions=empty,
            ext_slots=empty,
            ext_kv_lens=torch.zeros(0, **i64),
        )

    def batch(self, bs: int) -> ForwardBatch:
        """The bucket's ForwardBatch: views of the first `bs` rows of the buffers (fixed addresses)."""
        return ForwardBatch(
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_slots=self.out_slots[:bs],
            num_extend_tokens=0,
            dec_slots=self.slots[:bs],
            dec_kv_lens=self.kv_lens[:bs],
            dec_bias=self.bias[:bs],
            dec_pages=self.pages[:bs],
            page_size=self.page_size,
            **self._extend,
        )

    def fits(self, fb: ForwardBatch) -> bool:
        """Whether `fb` is a decode-only step these buffers can hold."""
        B = fb.num_tokens
        return (
            fb.num_extend_tokens == 0
            and 0 < B <= self.max_bs
            and fb.dec_pages.shape[1] <= self.max_pages
            and (not self.needs_slots or fb.dec_slots.shape[1] <= self.slots.shape[1])
        )

    def load(self, fb: ForwardBatch, bs: int) -> None:
        """Copies decode-only step `fb` (B <= bs rows) into rows [0, B) and pads rows [B, bs)."""
        B, P = fb.num_tokens, fb.dec_pages.shape[1]
        self.input_ids[:B].copy_(fb.input_ids, non_blocking=True)
        self.positions[:B].copy_(fb.positions, non_blocking=True)
        self.out_slots[:B].copy_(fb.out_slots, non_blocking=True)
        self.kv_lens[:B].copy_(fb.dec_kv_lens, non_blocking=True)
        self.pages[:B, :P].copy_(fb.dec_pages, non_blocking=True)  # columns past P are never read
        self.rows_weight[:B].fill_(1)
        if self.needs_slots:
            L = fb.dec_slots.shape[1]
            self.slots[:B, :L].copy_(fb.dec_slots, non_blocking=True)
            self.bias[:B, :, :L].copy_(fb.dec_bias, non_blocking=True)
            self.bias[:B, :, L:].fill_(float("-inf"))
        self.pad(B, bs)

    def pad(self, start: int, bs: int) -> None:
        """Rows [start, bs) become padding rows: token 0 at position 0, one token of the padding page."""
        B = start
        if bs > B:
            self.input_ids[B:bs].zero_()
            self.positions[B:bs].zero_()
            self.out_slots[B:bs].fill_(self.pad_slot)
            self.kv_lens[B:bs].fill_(1)
            self.pages[B:bs, 0].fill_(self.pad_page)
            self.rows_weight[B:bs].zero_()
            if self.needs_slots:
                self.slots[B:bs, 0].fill_(self.pad_slot)
                self.bias[B:bs, :, 0].fill_(0.0)
                self.bias[B:bs, :, 1:].fill_(float("-inf"))


class GraphRunner:
    """Decode steps of one model replayed from CUDA graphs, one per bucket (see the module docstring).

    `forward(fb, kv_cache, rows) -> logits` is the model's step function; `recorder` the expert load
    recorder it writes to (padding rows are weighed 0). With `capture` false nothing is captured
    and `run` calls the forward on the static batch (the CPU, tests)."""

    def __init__(
        self,
        forward,
        pool: KVPool,
        buckets: list[int],
        needs_slots: bool,
        recorder=None,
        capture: bool | None = None,
    ) -> None:
        self.forward, self.pool, self.recorder = forward, pool, recorder
        self.buckets = sorted(buckets)
        self.device = pool.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        pad_page = pool.reserve_page()
        self.static = StaticDecode(pool, self.buckets[-1], pool.page_table.shape[1], pad_page, needs_slots, self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # steps served by this runner (graph replays, or static eager runs)

    @property
    def max_bs(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, rows: int) -> int | None:
        """The smallest bucket holding `rows`; None above the largest."""
        return bucket_for(self.buckets, rows)

    def can_run(self, fb: ForwardBatch) -> bool:
        return self.static.fits(fb)

    def _static_forward(self, bs: int) -> torch.Tensor:
        """The forward of bucket `bs` on the static buffers: what a graph records."""
        if self.recorder is not None:
            self.recorder.rows_weight = self.static.rows_weight[:bs]
        try:
            return self.forward(self.static.batch(bs), self.pool.cache, self.static.rows[:bs])
        finally:
            if self.recorder is not None:
                self.recorder.rows_weight = None

    @torch.inference_mode()
    def capture_all(self) -> float:
        """Captures every bucket, largest first, into one memory pool; returns the seconds it took.
        Each bucket runs twice eagerly first (Triton compiles, library handles), on a side stream."""
        if not self.capture:
            return 0.0
        start = time.perf_counter()
        if self.recorder is not None:
            self.recorder.to(self.device)  # its tensors must live where the graphs write them
        mempool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for bs in reversed(self.buckets):
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._static_forward(bs)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                self.outputs[bs] = self._static_forward(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def run(self, fb: ForwardBatch, rows: torch.Tensor) -> torch.Tensor:
        """Logits [len(rows), V] of decode-only step `fb` (can_run), from its bucket's graph."""
        bs = self.bucket_for(fb.num_tokens)
        self.static.load(fb, bs)
        self.replays += 1
        if bs in self.graphs:
            self.graphs[bs].replay()
            out = self.outputs[bs]
        else:
            out = self._static_forward(bs)
        return out[rows]  # a new tensor: the next replay may overwrite the graph's output


def graph_safe_moe(moe_backend: str) -> bool:
    """Whether the named MoE backend decodes without host reads on a GPU (every attention backend
    does): the torch MoE reference sizes its blocks by host reads (kernels/moe.py), so it runs eagerly."""
    return moe_backend != "torch"


def needs_slot_tables(attention_backend: str) -> bool:
    """Whether the attention backend reads the slot table and mask bias (the torch reference and the
    cpu backend do; the Triton kernels read the page table only)."""
    return attention_backend != "triton"
