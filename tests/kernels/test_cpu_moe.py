"""CpuMoE (kernels/cpu_moe.py, the C kernel of kernels/csrc/fused_moe.c) against the torch
reference and a per-token loop: remote (-1) routes, odd sizes, the order it adds a token's routes
in, which batches it takes, and what it does without a compiler or with bad expert ids."""

from __future__ import annotations

import pytest
import torch

import kernels.moe as torch_moe
from kernels import cpu_moe, native
from kernels.cpu_moe import MAX_ROUTES, CpuMoE
from tests.kernels.test_torch_moe import naive

REFERENCE = torch_moe.fused_moe  # before any test patches it


def case(T, E, H, I, K, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    w13, w2 = torch.randn(E, 2 * I, H, generator=gen), torch.randn(E, H, I, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]) if T else torch.empty(0, K).long()
    weights = torch.rand(T, K, generator=gen)
    if T > 1:
        ids[1, 0] = -1  # a route to an expert held elsewhere
    if T > 2:
        ids[2] = -1  # a token none of whose experts is here: zeros
    return x, w13, w2, ids, weights


@pytest.fixture
def kernel_only(monkeypatch):
    """CpuMoE whose reference path raises: whatever it returns, the kernel computed."""
    moe = CpuMoE()
    if not moe.native:
        pytest.skip("no C compiler on this machine: CpuMoE runs the torch reference")

    def no_reference(*_):
        raise AssertionError("ran the reference")

    monkeypatch.setattr(torch_moe, "fused_moe", no_reference)
    return moe


def test_the_kernel_is_built_where_a_c_compiler_is():
    if native.compiler() is None:
        pytest.skip("no C compiler on this machine")
    assert CpuMoE().native


@pytest.mark.parametrize(
    "T, E, H, I, K",
    [
        (1, 16, 256, 64, 4),  # one decode token: four experts, one route each
        (32, 16, 256, 64, 4),  # a decode batch: several tiles per expert
        (7, 5, 33, 9, 3),  # sizes no vector width or tile divides
        (3, 8, 16, 8, 1),  # top-1
        (40, 64, 48, 16, 8),  # many experts, DeepSeek-V3's top-8
    ],
)
def test_matches_the_reference_and_a_per_token_loop(kernel_only, T, E, H, I, K):
    x, w13, w2, ids, weights = case(T, E, H, I, K, seed=T)
    out = kernel_only.fused_moe(x, w13, w2, ids, weights)
    expected = naive(x, w13, w2, ids, weights)
    tol = 1e-6 * expected.abs().max()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=tol)
    torch.testing.assert_close(out, REFERENCE(x, w13, w2, ids, weights), rtol=1e-5, atol=tol)
    if T > 2:
        assert torch.equal(out[2], torch.zeros(H))


def test_a_token_s_routes_are_added_in_expert_order_whatever_the_slots_or_threads(kernel_only):
    """The sum does not depend on which top-k slot holds which expert, nor on how the tasks were
    spread over the threads: bit for bit."""
    x, w13, w2, ids, weights = case(24, 16, 64, 32, 4, seed=3)
    out = kernel_only.fused_moe(x, w13, w2, ids, weights)
    perm = torch.tensor([2, 0, 3, 1])
    assert torch.equal(kernel_only.fused_moe(x, w13, w2, ids[:, perm], weights[:, perm]), out)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernel_only.fused_moe(x, w13, w2, ids, weights), out)
    finally:
        torch.set_num_threads(threads)


def test_expert_ids_outside_the_layer_are_refused(kernel_only):
    x, w13, w2, ids, weights = case(4, 8, 16, 8, 2)
    ids[3, 1] = 8
    with pytest.raises(ValueError, match=r"expert ids must lie in \[-1, 8\); got -1\.\.8"):
        kernel_only.fused_moe(x, w13, w2, ids, weights)


def test_prefill_sized_and_other_batches_run_the_reference(monkeypatch):
    moe = CpuMoE()
    ran = []
    reference = torch_moe.fused_moe
    monkeypatch.setattr(torch_moe, "fused_moe", lambda *a: ran.append(len(a[0])) or reference(*a))
    K = 4
    big = case(MAX_ROUTES // K + 1, 16, 32, 8, K)
    moe.fused_moe(*big)
    x, w13, w2, ids, weights = case(8, 16, 32, 8, K)
    moe.fused_moe(x.double(), w13.double(), w2.double(), ids, weights)  # another dtype
    moe.fused_moe(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, ids, weights)  # strided weights
    moe.fused_moe(*case(0, 16, 32, 8, K))  # no tokens
    assert ran == [MAX_ROUTES // K + 1, 8, 8, 0]
    small = case(MAX_ROUTES // K, 16, 32, 8, K)
    moe.fused_moe(*small)
    assert ran == [MAX_ROUTES // K + 1, 8, 8, 0] + ([] if moe.native else [MAX_ROUTES // K])


def test_without_a_compiler_it_runs_the_reference(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("AFD_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    moe = CpuMoE()
    assert not moe.native
    x, w13, w2, ids, weights = case(5, 8, 16, 8, 2)
    torch.testing.assert_close(moe.fused_moe(x, w13, w2, ids, weights), naive(x, w13, w2, ids, weights))


def test_the_kernel_takes_at_most_max_k_routes_per_token():
    x, w13, w2, ids, _ = case(2, 80, 16, 8, cpu_moe.MAX_K + 1)
    assert not CpuMoE().kernel.runs(x, w13, w2, ids)
    assert CpuMoE().kernel.runs(x, w13, w2, ids[:, : cpu_moe.MAX_K]) == CpuMoE().native
