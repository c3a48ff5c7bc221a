#!/usr/bin/env python3
"""Dispatch + combine volume (and in-process latency) through the real comm library.

DeepSeek-V3 routing by default: top-8 of 256 experts, hidden 7168, fp8 dispatch, bf16 combine,
uniform random routing. Every A rank and FFN rank is a logical endpoint (a thread with the
in-process transport), so volumes are counted exactly even for 32 A ranks x 2 FFN nodes x 8 ranks
on a small machine. Beside each measured volume: the analytic value for this routing (exact)
and the expectation under uniform routing. Latency is the wall time of one whole exchange on
this machine (Python threads, no network): a smoke figure, not a network measurement.

    python -m benchmarks.kernels.bench_comm         # the default sweep
    python -m benchmarks.kernels.bench_comm --a-ranks 32 --ffn-nodes 2 --ffn-ranks-per-node 8 --tokens 128 --json o.json
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import torch

from benchmarks.lib.results import write_json
from comm import volume
from comm.attention_side import attention_endpoint
from comm.endpoint import CommConfig
from comm.ffn_side import ffn_endpoint
from comm.messages import MsgKey
from comm.stats import CommStats
from comm.topology import INTER_NODE, Topology
from comm.transport.inproc import InProcessFabric
from comm.wire import WireFormat

DEFAULT_SWEEP = ((4, 1, 2), (8, 2, 4), (32, 2, 8))
KEY = MsgKey(0, 0, 0)


def routing(topo: Topology, tokens: int, topk: int, hidden: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(tokens, hidden, generator=g) for _ in range(topo.num_senders)]
    ids = [torch.rand(tokens, topo.num_experts, generator=g).argsort(dim=1)[:, :topk] for _ in xs]
    ws = [torch.rand(tokens, topk, generator=g) for _ in xs]
    return xs, ids, ws


def exchange(
    topo: Topology, config: CommConfig, xs, ids, ws, copies: list[int] | None = None
) -> tuple[float, list[torch.Tensor], CommStats]:
    """One dispatch + combine for every sender; experts are identities. Returns (seconds, outputs,
    stats); `copies`, if given, gets each FFN rank's received (token, expert) pairs."""
    fabric = InProcessFabric()
    eps = [fabric.endpoint(e) for e in range(topo.num_endpoints)]
    senders = [attention_endpoint(topo, i, eps[topo.sender_endpoint(i)], config) for i in range(topo.num_senders)]
    ffn_ranks = [ffn_endpoint(topo, r, eps[topo.ffn_endpoint(r)], config) for r in range(topo.num_ffn_ranks)]
    outs: list = [None] * topo.num_senders

    def send(i):
        outs[i] = senders[i].combine(senders[i].dispatch(xs[i], ids[i], ws[i], KEY))

    def serve(ffn):
        batch = ffn.recv_dispatch(KEY)
        if copies is not None:
            copies[ffn.rank] = int((batch.local_ids >= 0).sum())
        ffn.send_combine(batch, batch.hidden.float() * batch.weights.sum(-1, keepdim=True))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(topo.num_senders)]
    threads += [threading.Thread(target=serve, args=(o,)) for o in ffn_ranks]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    for o in ffn_ranks:
        o.close()
    return elapsed, outs, CommStats.total([e.stats for e in senders + ffn_ranks])


def measure(a: int, nodes: int, per_node: int, args) -> dict:
    topo = Topology(a, nodes, per_node, args.experts)
    xs, ids, ws = routing(topo, args.tokens, args.topk, args.hidden, args.seed)
    wire = WireFormat(dispatch=args.dispatch_dtype, combine=args.combine_dtype)
    row = {"a_ranks": a, "ffn_nodes": nodes, "ffn_ranks_per_node": per_node, "tokens_per_rank": args.tokens}
    for mode in ("two-stage", "direct"):
        seconds, outs, stats = exchange(topo, CommConfig(mode, wire, timeout=600), xs, ids, ws)
        ref = [x * w.sum(-1, keepdim=True) for x, w in zip(xs, ws)]
        err = max(((o.float() - r).norm() / r.norm()).item() for o, r in zip(outs, ref) if r.numel())
        copies = volume.copies(topo, ids, mode)[INTER_NODE]
        per_copy = volume.dispatch_copy_bytes(mode, args.hidden, args.topk, wire, torch.float32)
        measured = stats.get("dispatch", INTER_NODE)
        row[mode] = {
            "dispatch_inter_bytes": measured.bytes,
            "dispatch_inter_bytes_analytic": copies * per_copy,
            "dispatch_inter_copies": measured.messages,
            "dispatch_inter_copies_analytic": copies,
            "combine_inter_bytes": stats.get("combine", INTER_NODE).bytes,
            "combine_inter_bytes_analytic": copies * wire.combine_bytes(args.hidden),
            "expected_copies_uniform": a
            * args.tokens
            * (volume.expected_nodes_hit(args.experts, nodes, args.topk) if mode == "two-stage" else args.topk),
            "seconds_in_process": seconds,
            "max_relative_error": err,
        }
    two, direct = row["two-stage"], row["direct"]
    row["dispatch_ratio"] = two["dispatch_inter_bytes"] / direct["dispatch_inter_bytes"]
    row["combine_ratio"] = two["combine_inter_bytes"] / direct["combine_inter_bytes"]
    return row


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'A x nodes x R':>14} {'mode':>9} {'dispatch B (between nodes)':>27} {'analytic':>13} "
        f"{'combine B':>13} {'analytic':>13} {'copies':>8} {'E[copies]':>10} {'sec':>7}"
    )
    print(head)
    for r in rows:
        topo = f"{r['a_ranks']}x{r['ffn_nodes']}x{r['ffn_ranks_per_node']}"
        for mode in ("two-stage", "direct"):
            m = r[mode]
            print(
                f"{topo:>14} {mode:>9} {m['dispatch_inter_bytes']:>27,} {m['dispatch_inter_bytes_analytic']:>13,} "
                f"{m['combine_inter_bytes']:>13,} {m['combine_inter_bytes_analytic']:>13,} "
                f"{m['dispatch_inter_copies']:>8,} {m['expected_copies_uniform']:>10.0f} "
                f"{m['seconds_in_process']:>7.2f}"
            )
        print(
            f"{'':>14} ratio two-stage/direct between nodes: dispatch {r['dispatch_ratio']:.4f} "
            f"(1/{1 / r['dispatch_ratio']:.2f}), combine {r['combine_ratio']:.4f} (1/{1 / r['combine_ratio']:.2f})"
        )


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a-ranks", type=int, help="attention ranks (default: the sweep)")
    p.add_argument("--ffn-nodes", type=int, default=2)
    p.add_argument("--ffn-ranks-per-node", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128, help="tokens per attention rank")
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--dispatch-dtype", default="fp8", choices=("fp8", "bf16", "fp32"))
    p.add_argument("--combine-dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the rows as JSON")
    p.add_argument("--quick", action="store_true", help="small shapes, for tests")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)
    if args.quick:
        args.tokens, args.hidden, args.experts, args.topk = 16, 256, 32, 4
        sweep = ((4, 2, 2),)
    else:
        sweep = ((args.a_ranks, args.ffn_nodes, args.ffn_ranks_per_node),) if args.a_ranks else DEFAULT_SWEEP
    rows = []
    for a, nodes, per_node in sweep:
        print(f"measuring {a} A ranks x {nodes} FFN nodes x {per_node} ranks ...", file=sys.stderr, flush=True)
        rows.append(measure(a, nodes, per_node, args))
    print_table(rows)
    if args.json:
        write_json(args.json, {"settings": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
