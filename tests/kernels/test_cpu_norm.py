"""The C RMSNorm (kernels/cpu_norm.py, kernels/csrc/rms_norm.c) against torch's, and which inputs
it leaves to torch; RMSNorm (models/norm.py) uses it where it can."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from afd_engine.models.norm import RMSNorm
from kernels import cpu_norm, native


def reference(x, w, eps):
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


@pytest.fixture
def kernel():
    if not cpu_norm._kernel():
        pytest.skip("no C compiler on this machine: RMSNorm runs torch")


@pytest.mark.parametrize("shape", [(32, 256), (7, 33), (1, 512), (3, 4, 64)])
def test_matches_torch(kernel, shape):
    gen = torch.Generator().manual_seed(len(shape))
    x, w = torch.randn(*shape, generator=gen) * 3, torch.randn(shape[-1], generator=gen)
    with torch.inference_mode():
        out = cpu_norm.rms_norm(x, w, 1e-6)
    assert out is not None and out.shape == x.shape
    torch.testing.assert_close(out, reference(x, w, 1e-6), rtol=1e-6, atol=1e-6)


def test_rows_of_a_wider_tensor_are_read_in_place(kernel):
    """MLA normalises the latent, the first 512 of each 576-wide row: no copy is needed."""
    x, w = torch.randn(5, 40), torch.randn(32)
    latent = x[:, :32]
    with torch.inference_mode():
        out = cpu_norm.rms_norm(latent, w, 1e-5)
    torch.testing.assert_close(out, reference(latent, w, 1e-5), rtol=1e-6, atol=1e-6)
    assert out.is_contiguous()


def test_eps_is_used(kernel):
    x, w = torch.full((2, 8), 1e-3), torch.ones(8)
    with torch.inference_mode():
        torch.testing.assert_close(cpu_norm.rms_norm(x, w, 1e-2), reference(x, w, 1e-2))


def test_what_it_does_not_take_is_left_to_torch(kernel):
    x, w = torch.randn(4, 16), torch.randn(16)
    with torch.inference_mode():
        assert cpu_norm.rms_norm(x.double(), w.double(), 1e-6) is None  # another dtype
        assert cpu_norm.rms_norm(x.t(), torch.randn(4), 1e-6) is None  # columns, not rows
        assert cpu_norm.rms_norm(torch.randn(2, 4, 32)[:, :, :16], w, 1e-6) is None  # strided 3-d
        assert cpu_norm.rms_norm(x[:0], w, 1e-6) is None  # nothing to do
    w_grad = w.clone().requires_grad_()
    assert cpu_norm.rms_norm(x, w_grad, 1e-6) is None  # autograd needs torch's
    with torch.no_grad():
        assert cpu_norm.rms_norm(x, w_grad, 1e-6) is not None


def test_the_module_uses_the_kernel_where_it_can(kernel, monkeypatch):
    norm = RMSNorm(16, 1e-6)
    calls = []
    monkeypatch.setattr("afd_engine.models.norm.rms_norm", lambda *a: calls.append(a) or cpu_norm.rms_norm(*a))
    x = torch.randn(3, 16)
    with torch.inference_mode():
        torch.testing.assert_close(norm(x), reference(x, norm.weight, 1e-6))
        norm(x.double())  # falls back to torch (the kernel says None)
    assert len(calls) == 2


def test_without_a_compiler_rms_norm_runs_torch(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(cpu_norm, "_fn", None)
    monkeypatch.setenv("AFD_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    x, w = torch.randn(4, 16), torch.randn(16)
    with torch.inference_mode():
        assert cpu_norm.rms_norm(x, w, 1e-6) is None
        norm = RMSNorm(16, 1e-6)
        torch.testing.assert_close(norm(x), reference(x, norm.weight, 1e-6))
