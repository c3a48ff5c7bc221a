"""Rank processes fork from the forkserver (afd_engine/processes/rank_process.py), yet each sees
the launcher's environment as it is when the rank starts, runs on the cores given to it, and gets
its arguments."""

from __future__ import annotations

import os

from afd_engine.processes import rank_process


def report(ready, value: str) -> None:
    """A rank's entry point: what it sees, sent back through `ready`."""
    ready.send(
        {
            "env": os.environ.get("AFD_RANK_PROCESS_TEST"),
            "cores": sorted(os.sched_getaffinity(0)),
            "value": value,
            "parent": os.getppid(),
            "torch_preloaded": "torch" in __import__("sys").modules,
        }
    )


def run_one(ctx, value: str, cores=None) -> dict:
    parent, child = ctx.Pipe(duplex=False)
    proc = rank_process.start(ctx, "test-rank", report, {"value": value}, child, cores)
    assert parent.poll(120), "the rank did not report"
    got = parent.recv()
    proc.join(30)
    assert proc.exitcode == 0
    return got


def test_a_forked_rank_sees_the_environment_of_its_start_and_its_cores(monkeypatch):
    ctx = rank_process.context()
    monkeypatch.delenv("AFD_RANK_PROCESS_TEST", raising=False)
    first = run_one(ctx, "one")  # the forkserver is up now, started without the variable
    assert first["env"] is None and first["value"] == "one" and first["torch_preloaded"]
    assert first["parent"] != os.getpid()  # forked from the forkserver, not from this process
    monkeypatch.setenv("AFD_RANK_PROCESS_TEST", "set later")
    core = sorted(os.sched_getaffinity(0))[-1]
    second = run_one(ctx, "two", cores=[core])
    assert second == {**second, "env": "set later", "cores": [core], "value": "two"}
