"""Tests that need a CUDA GPU (marked `gpu`): the Triton kernels against the torch reference at
DeepSeek-V3 and Qwen3-30B-A3B shapes, and the engine on the GPU against transformers there. Skipped
where torch sees no GPU; `python -m pytest -m gpu tests/gpu` runs them where it does (as
`python -m benchmarks.kernels.gpu_check` does, beside its timings).

AFD_GPU_TESTS_ON_CPU=1 runs them on the CPU instead, at tiny shapes with the Triton kernels under
the interpreter: what they check then is the tests themselves (the GPU check's dry run does this).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from tests.gpu import engines

ON_CPU = os.environ.get("AFD_GPU_TESTS_ON_CPU") == "1"
SKIP_REASON = (
    "needs a CUDA GPU: torch.cuda.is_available() is False (AFD_GPU_TESTS_ON_CPU=1 runs these tests "
    "on the CPU at tiny shapes)"
)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") and not (torch.cuda.is_available() or ON_CPU):
        pytest.skip(SKIP_REASON)


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def tiny(device) -> bool:
    """Tiny shapes and fewer tokens: on the CPU the Triton kernels run under the interpreter."""
    return device.type != "cuda"


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """arch -> the path of a tiny random checkpoint of it (afd_engine.tiny_model), written once."""
    from afd_engine.tiny_model import make_tiny_model

    @functools.cache
    def make(arch: str) -> str:
        return str(make_tiny_model(tmp_path_factory.mktemp(arch), arch=arch))

    return make


@pytest.fixture(scope="session")
def single_run(checkpoint, device, tiny):
    """(arch, dtype, backend) -> engines.Run of the single-process engine, greedy over the fixed
    prompts; each run once per session (the AFD test compares its tokens with it)."""

    @functools.cache
    def run(arch: str, dtype: str, backend: str) -> engines.Run:
        return engines.greedy(checkpoint(arch), device, engines.fixed_prompts(tiny), dtype, backend, tiny)

    return run
