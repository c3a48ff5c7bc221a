#!/usr/bin/env python3
"""The comm library's own cost per MoE layer at decode: one attention endpoint and one FFN endpoint
in this process exchange one layer's messages (dispatch, receive, send the results back, combine)
for a micro-batch of a few tokens, over the in-process and the shared-memory transports.

`--layout afd` (default): AFD 1A+1F, two-stage dispatch, every token whole to the one FFN rank.
`--layout colocated`: colocated dp2 with one rank holding tokens, as at concurrency 1: direct
dispatch of the copies routed to the peer's experts, the own share kept (`keep_own`), the peer's
results added to it at combine.

Both endpoints run in one thread, one after the other, so the figure is the library's CPU time
(routing, framing, copies, the rings and the wake-up bytes), without any process wake-up or
expert compute. The FFN side returns its tokens' activations as the "experts' output", so every
combine must give back exactly what was dispatched (checked, fp32 on the wire). Reported per
transport: the minimum and the median over `--chunks` chunks of `--layers` layers, in us per layer.

    python -m benchmarks.kernels.bench_comm_layer [--layout afd|colocated] [--tokens 1] [--hidden 192] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from benchmarks.lib.results import write_json
from comm import CommConfig, MsgKey, Topology, WireFormat, attention_endpoint, ffn_endpoint
from comm.transport.inproc import InProcessFabric
from comm.transport.shm_transport import ShmTransport, remove_namespace


def transports(kind: str, peer: int):
    """The sender's transport (endpoint 0) and the FFN rank's (endpoint `peer`)."""
    if kind == "inproc":
        fabric = InProcessFabric()
        return fabric.endpoint(0), fabric.endpoint(peer)
    ns = f"bench{os.getpid()}"
    return ShmTransport(0, [peer], namespace=ns), ShmTransport(peer, [0], namespace=ns)


def expected_output(layout: str, hidden: torch.Tensor, on_peer: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """What combine must give when the FFN side returns its rows as the experts' output: afd, the
    tokens themselves (the one node weighs nothing: its rank returns them as they came);
    colocated, the zero own share plus each peer copy weighted, added in token order."""
    if layout == "afd":
        return hidden
    out = torch.zeros_like(hidden)
    rows, slot = on_peer.nonzero(as_tuple=True)
    return out.index_add_(0, rows, hidden[rows] * weights[rows, slot][:, None])


def measure(kind: str, args: argparse.Namespace) -> dict:
    colocated = args.layout == "colocated"
    if colocated:  # rank 0 sends and keeps its own share; rank 1 serves the copies for its experts
        topo = Topology(num_senders=2, num_nodes=1, ranks_per_node=2, num_experts=args.experts, colocated=True)
        config = CommConfig("direct", WireFormat("fp32", "fp32"), timeout=10)
    else:
        topo = Topology(num_senders=1, num_nodes=1, ranks_per_node=1, num_experts=args.experts)
        config = CommConfig("two-stage", WireFormat("fp32", "fp32"), timeout=10)
    ffn_rank = 1 if colocated else 0  # the rank that serves sender 0's copies
    ta, tf = transports(kind, topo.ffn_endpoint(ffn_rank))
    a, f = attention_endpoint(topo, 0, ta, config), ffn_endpoint(topo, ffn_rank, tf, config)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=g)
    ids = torch.stack([torch.randperm(args.experts, generator=g)[: args.topk] for _ in range(args.tokens)])
    weights = torch.rand(args.tokens, args.topk, generator=g)
    own_share = torch.zeros(args.tokens, args.hidden)  # the kept share's output (experts not run here)
    step = iter(range(1 << 62))

    def layer() -> torch.Tensor:
        key = MsgKey(next(step), 1, 0)
        handle = a.dispatch(hidden, ids, weights, key, keep_own=colocated)
        batch = f.recv_dispatch(key, senders=[0] if colocated else None)
        f.send_combine(batch, batch.hidden)
        return a.combine(handle, own_share.clone() if colocated else None)

    try:
        want = expected_output(args.layout, hidden, topo.ffn_rank_of[ids] == ffn_rank, weights)
        if not torch.equal(layer(), want):
            raise RuntimeError(f"{kind}: combine did not return what was dispatched")
        for _ in range(args.layers):  # warm-up
            layer()
        per_layer = []
        for _ in range(args.chunks):
            start = time.perf_counter()
            for _ in range(args.layers):
                layer()
            per_layer.append((time.perf_counter() - start) / args.layers * 1e6)
    finally:
        ta.close(), tf.close()
        if kind == "shm":
            remove_namespace(f"bench{os.getpid()}")
    return {"min_us": min(per_layer), "median_us": statistics.median(per_layer), "chunks_us": per_layer}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", choices=("afd", "colocated"), default="afd", help="see the module docstring")
    p.add_argument("--tokens", type=int, default=1, help="tokens in the micro-batch")
    p.add_argument("--hidden", type=int, default=192, help="hidden size (the embedded model's)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--layers", type=int, default=300, help="layers per chunk")
    p.add_argument("--chunks", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = {kind: measure(kind, args) for kind in ("inproc", "shm")}
    print(f"{'transport':<10} {'min us/layer':>12} {'median us/layer':>15}")
    for kind, r in results.items():
        print(f"{kind:<10} {r['min_us']:>12.1f} {r['median_us']:>15.1f}")
    if args.json:
        write_json(args.json, {"args": vars(args), "transports": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
