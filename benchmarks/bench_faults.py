#!/usr/bin/env python3
"""Faults under streaming load: what do the streams see? One scenario per run (``--scenario``):

  * ``ffn`` (the default): a deployment of roles on this machine (``afd launch --role attention``
    and one ``--role ffn`` per FFN node, each a process group, with
    ``--enable-ffn-fault-tolerance``); after ``--before-s`` the FFN role of node ``--victim-node``
    gets SIGKILL (a lost machine), and ``--rejoin-after-s`` later a replacement starts;
  * ``attention``: ``afd serve`` of an AFD deployment with two attention ranks and
    ``--enable-fault-tolerance``; after ``--before-s`` attention rank ``--victim-rank`` gets SIGKILL,
    and the front end resumes its requests on the survivor;
  * ``drain``: ``afd serve`` with ``--drain-timeout``; ``--concurrency`` long streams run once
    undisturbed, then again, and once each has a quarter of its tokens the server gets SIGTERM;
    new requests sent meanwhile must get 503, the streams must all complete, the server exit 0;
  * ``pd``: a prefill instance, two decode instances and ``afd router``; after ``--before-s``
    decode instance ``--victim-decode`` gets SIGKILL (with its engine), and the router resumes
    its streams on the other one.

In ``ffn``, ``attention`` and ``pd``, ``--concurrency`` clients stream greedy requests from a fixed
set of prompts back to back (native ``/generate``, ``ignore_eos``) until ``--after-s`` seconds after
the kill. Every scenario reports:

  * requests failed (target 0): a non-200 answer, an error event, or a stream that ended short;
  * the longest gap between two tokens of any stream (a request's wait for its first token counts);
  * time to resume: from the fault until every stream in flight then had its next token;
  * whether every request of a prompt produced the same tokens (greedy: it must);

and its own figures: for ``ffn`` output tokens per second before the kill, during the recovery,
degraded and rejoined, the time to full size, experts read from the checkpoint; for ``attention``
``afd_requests_resumed_total`` and ``afd_attention_ranks_alive``; for ``drain`` the 503s, the
drain's length and the exit status; for ``pd`` the router's failovers. KV pages still held once
the load stops, where the server lives on. Exit status 1 when a request failed, the tokens of a
prompt differed, or the scenario's own check failed.

    python -m benchmarks.bench_faults --json faults.json
    python -m benchmarks.bench_faults --scenario attention --quick     # about 30-45 seconds each
    python -m benchmarks.bench_faults --scenario drain --quick
    python -m benchmarks.bench_faults --scenario pd --quick
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from benchmarks.faults import attention, drain, ffn, pd
from benchmarks.lib.results import write_json

SCENARIOS = {"ffn": ffn, "attention": attention, "drain": drain, "pd": pd}
# what a scenario does not set itself (its module's DEFAULTS and, with --quick, QUICK come first)
DEFAULTS = {
    "deployment": None,
    "concurrency": 8,
    "output_len": 64,
    "before_s": 20.0,
    "after_s": 60.0,
    "rejoin_after_s": 10.0,
    "drain_timeout": 60.0,
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=list(SCENARIOS), default="ffn")
    p.add_argument("--model-path", default=None, help="checkpoint (default: the embedded tiny model)")
    p.add_argument(
        "--deployment",
        help="the topology flags every role (ffn), the server (attention, drain) or every instance (pd) gets",
    )
    p.add_argument("--victim-node", type=int, default=1, help="ffn: the FFN node whose role is killed")
    p.add_argument("--victim-rank", type=int, default=1, help="attention: the attention rank killed")
    p.add_argument("--victim-decode", type=int, default=0, help="pd: the decode instance killed (0 or 1)")
    p.add_argument("--rejoin-after-s", type=float, help="ffn: seconds from the kill to the replacement (<0: none)")
    p.add_argument("--drain-timeout", type=float, help="drain: the server's --drain-timeout")
    p.add_argument("--concurrency", type=int, help="concurrent streams")
    p.add_argument("--output-len", type=int)
    p.add_argument("--prompts", type=int, default=6, help="distinct prompts the requests draw from")
    p.add_argument("--before-s", type=float, help="seconds of load before the kill")
    p.add_argument("--after-s", type=float, help="seconds of load after it")
    p.add_argument("--quick", action="store_true", help="a short run of the scenario (flags given still count)")
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    scenario = SCENARIOS[args.scenario]
    layers = [scenario.QUICK if args.quick else {}, scenario.DEFAULTS, DEFAULTS]
    for key in DEFAULTS:
        if getattr(args, key) is None:
            setattr(args, key, next(layer[key] for layer in layers if key in layer))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    scenario = SCENARIOS[args.scenario]
    logdir = tempfile.mkdtemp(prefix=f"afd-faults-{args.scenario}-")
    r = scenario.run(args, logdir)
    print(scenario.format_report(r))
    print(f"logs: {logdir}")
    if args.json:  # (the log directory is this machine's: not in the results)
        write_json(args.json, r)
    return 0 if scenario.passed(args, r) else 1


if __name__ == "__main__":
    sys.exit(main())
