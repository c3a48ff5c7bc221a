"""A rank process keeps the memory torch frees for its next step instead of page-faulting it in again."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from afd_engine.runtime import host_memory

# Writes a 24 MB temporary and frees it, then writes a 12 MB one; prints whether the first came
# from the heap (glibc's default maps a fresh block that large and unmaps it when freed) and the
# page faults of the second.
TEMPORARIES = """
import json, resource, sys, torch
from afd_engine.runtime.host_memory import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
t = torch.empty(24 * 1024 * 256)
t.fill_(1.0)
for line in open("/proc/self/maps"):
    lo, hi = (int(a, 16) for a in line.split()[0].split("-"))
    if lo <= t.data_ptr() < hi:
        in_heap = line.rstrip().endswith("[heap]")
del t
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
t = torch.empty(12 * 1024 * 256)
t.fill_(1.0)
print(json.dumps([in_heap, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before]))
"""


def _temporaries(mode: str) -> list:
    out = subprocess.run(
        [sys.executable, "-c", TEMPORARIES, mode], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_freed_temporary_is_reused_without_page_faults():
    in_heap, faults = _temporaries("retain")
    default = _temporaries("default")
    assert in_heap, f"the 24 MB block was mapped on its own (default allocator: {default})"
    # 12 MB is 3,072 pages of 4 KiB: written into the freed block, they are already there
    assert faults < 50, f"{faults} page faults writing 12 MB into freed memory (default allocator: {default})"


def test_an_engine_process_retains_freed_memory(tiny_v3, monkeypatch):
    from afd_engine import Engine

    monkeypatch.setattr(host_memory, "_done", None)  # as in a fresh process
    engine = Engine(model_path=str(tiny_v3), num_threads=1)
    try:
        assert host_memory._done is True
    finally:
        engine.close()
