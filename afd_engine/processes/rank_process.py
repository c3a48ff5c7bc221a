"""How the launcher starts rank processes: forked from one server process per launcher that has
imported torch and transformers once (multiprocessing's "forkserver" start method), instead of a
fresh interpreter per rank ("spawn") that imports them again. A deployment of N ranks on a machine
pays those imports (about 2.5 s of CPU each) once instead of N times.

The server process never runs a kernel or touches a GPU (importing torch initialises no CUDA
context), so forking from it is as safe as spawning. What a forked rank would otherwise inherit
from the server instead of from the launcher is set again first thing: the launcher's environment
as it is when the rank starts (a secret or a flag set after the server started), the rank's CPU
cores (set by the rank itself, before any of its threads exist), and its arguments, which are
unpickled only after that (their modules may read the environment when imported).
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import pickle

# imported once by the server process that ranks fork from (afd_engine/processes/rank_preload.py)
PRELOAD = ["afd_engine.processes.rank_preload"]


def context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start(ctx, name: str, target, kwargs: dict, ready, cores: list[int] | None):
    """Starts `target(ready=ready, **kwargs)` (a module-level function) in a rank process."""
    payload = {
        "target": f"{target.__module__}:{target.__name__}",
        "payload": pickle.dumps(kwargs),
        "env": dict(os.environ),
        "cores": cores,
        "ready": ready,
    }
    proc = ctx.Process(target=run_rank, kwargs=payload, daemon=True, name=name)
    proc.start()
    return proc


def run_rank(target: str, payload: bytes, env: dict, cores: list[int] | None, ready) -> None:
    os.environ.clear()
    os.environ.update(env)
    if cores:  # before the rank starts any thread: threads inherit the cores of the thread that made them
        os.sched_setaffinity(0, cores)
    module, name = target.split(":")
    getattr(importlib.import_module(module), name)(ready=ready, **pickle.loads(payload))
