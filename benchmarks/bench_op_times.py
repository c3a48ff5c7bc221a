#!/usr/bin/env python3
"""Time per layer operation in every process of a deployment: where a token's time goes.

For each deployment, runs `afd generate` (one prompt, greedy, concurrency 1) with a hook that
times every call of a layer operation (attention, gate, dispatch, shared_expert, combine, ...
on attention ranks; receive, experts, send_combine on FFN ranks) and sums it per operation name.
The hook is a `sitecustomize` module on PYTHONPATH, so the ranks (forked from a process that ran
it) time theirs too; each process writes its sums to a JSON file when it exits (and every 100
calls, in case it is killed).

Prints, per deployment and process, the mean time per call of each operation and the call count;
writes them to --json. Profiling adds a timer pair per operation, so compare deployments with each
other, not with bench_latency's figures.

    python -m benchmarks.bench_op_times [--max-new-tokens 300] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.lib.results import write_json

DEPLOYMENTS = {
    "single": "--mode single --num-threads 1",
    "afd 1A+1F": "--mode afd --dp-size 1 --num-threads 1",
    "colocated dp2": "--mode colocated --dp-size 2 --num-threads 1",
}
DUMP_EVERY = 100

HOOK = f"""
import atexit, json, os, time
from collections import defaultdict
from multiprocessing import util as mp_util

import afd_engine.operations.stages as _stages

_sums, _calls, _n = defaultdict(float), defaultdict(int), [0]


def _timed(self, state):
    t0 = time.perf_counter()
    try:
        self.fn(state)
    finally:
        _sums[self.name] += time.perf_counter() - t0
        _calls[self.name] += 1
        _n[0] += 1
        if _n[0] % {DUMP_EVERY} == 0:
            _dump()


def _dump():
    if _n[0]:
        with open(os.environ["AFD_OP_TIMES"] + f".{{os.getpid()}}.json", "w") as f:
            json.dump({{k: [_sums[k], _calls[k]] for k in _sums}}, f)


def _forked(_):  # a rank forked from the forkserver that ran this hook: counts of its own, dumped at its exit
    _sums.clear()
    _calls.clear()
    _n[0] = 0
    mp_util.Finalize(None, _dump, exitpriority=0)


_stages.Operation.__call__ = _timed
atexit.register(_dump)  # a process that exits through the interpreter
mp_util.register_after_fork(_forked, _forked)  # a forked rank exits through multiprocessing, without atexit
"""


def run(name: str, args: argparse.Namespace, workdir: Path) -> list[dict]:
    """One process's operations per element: {"pid", "ops": {name: {"mean_us", "calls"}}}."""
    hook_dir, prefix = workdir / "hook", workdir / name.replace(" ", "_").replace("+", "")
    hook_dir.mkdir(exist_ok=True)
    (hook_dir / "sitecustomize.py").write_text(HOOK)
    env = dict(os.environ, AFD_OP_TIMES=str(prefix))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hook_dir), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "afd_engine.cli", "generate", "--prompt", args.prompt, "--ignore-eos"]
    cmd += ["--max-new-tokens", str(args.max_new_tokens), *DEPLOYMENTS[name].split()]
    cmd += ["--model-path", args.model_path] if args.model_path else []
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: afd generate exited with {done.returncode}: {done.stderr[-2000:]}")
    procs = []
    for path in sorted(workdir.glob(f"{prefix.name}.*.json")):
        sums = json.loads(path.read_text())
        ops = {op: {"mean_us": 1e6 * s / n, "calls": n} for op, (s, n) in sums.items()}
        procs.append({"pid": int(path.name.split(".")[-2]), "ops": ops})
    if not procs:
        raise RuntimeError(f"{name}: no process timed any operation (too few calls: raise --max-new-tokens)")
    return sorted(procs, key=lambda p: ("receive" in p["ops"] and "attention" not in p["ops"], p["pid"]))


def role(ops: dict) -> str:
    if "attention" in ops:
        return "attention + experts" if "receive" in ops else "attention"
    return "experts"


def report(results: dict[str, list[dict]]) -> str:
    lines = []
    for name, procs in results.items():
        for p in procs:
            lines.append(f"{name}, {role(p['ops'])} process {p['pid']}:")
            for op, v in sorted(p["ops"].items(), key=lambda kv: -kv[1]["mean_us"] * kv[1]["calls"]):
                lines.append(f"    {op:<16} {v['mean_us']:>9.1f} us x {v['calls']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="checkpoint (default: the embedded tiny model)")
    p.add_argument("--deployments", nargs="+", choices=list(DEPLOYMENTS), default=list(DEPLOYMENTS))
    p.add_argument("--prompt", default="def main():")
    p.add_argument("--max-new-tokens", type=int, default=300)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per deployment")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run(name, args, Path(tmp)) for name in args.deployments}
    print(report(results))
    if args.json:
        write_json(args.json, {"deployments": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
