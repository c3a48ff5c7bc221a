"""The C rotary embedding (kernels/cpu_rope.py, kernels/csrc/rope.c) against torch's, bit for bit,
and which inputs it leaves to torch; RotaryEmbedding (models/rope.py) uses it where it can."""

from __future__ import annotations

import pytest
import torch

from afd_engine.model_config import RopeConfig
from afd_engine.models.rope import RotaryEmbedding
from kernels import cpu_rope


def reference(x, cos, sin, interleave):
    if x.dim() == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :half], x[..., half:])
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@pytest.fixture
def kernel():
    if not cpu_rope._kernel():
        pytest.skip("no C compiler on this machine: rope runs torch")


def tables(T, D, seed):
    gen = torch.Generator().manual_seed(seed)
    angles = torch.rand(T, D // 2, generator=gen) * 100
    return angles.cos() * 1.3, angles.sin() * 1.3


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("shape", [(32, 4, 64), (7, 3, 16), (1, 1, 2), (5, 64), (33, 128)])
def test_matches_torch_bit_for_bit(kernel, shape, interleave):
    gen = torch.Generator().manual_seed(len(shape) + 10 * interleave)
    x = torch.randn(*shape, generator=gen) * 5
    cos, sin = tables(shape[0], shape[-1], 3)
    with torch.inference_mode():
        out = cpu_rope.apply_rope(x, cos, sin, interleave)
    assert out is not None and out.shape == x.shape and out.is_contiguous()
    assert torch.equal(out, reference(x, cos, sin, interleave))


@pytest.mark.parametrize("interleave", [True, False])
def test_a_slice_of_the_query_is_read_in_place(kernel, interleave):
    """MLA's rope part of the query: the last 64 of each head's 192, heads 192 apart."""
    q = torch.randn(9, 4, 192)
    q_pe = q.split([128, 64], dim=-1)[1]
    cos, sin = tables(9, 64, 4)
    with torch.inference_mode():
        out = cpu_rope.apply_rope(q_pe, cos, sin, interleave)
    assert torch.equal(out, reference(q_pe, cos, sin, interleave))
    k_pe = torch.randn(9, 576)[:, 512:]  # the key's rope part: the end of each latent row
    with torch.inference_mode():
        assert torch.equal(cpu_rope.apply_rope(k_pe, cos, sin, interleave), reference(k_pe, cos, sin, interleave))


def test_one_head_whatever_its_stride(kernel):
    """A single head's stride (here 0, as as_strided may leave it) is never followed."""
    base = torch.randn(3, 16)
    x = base.as_strided((3, 1, 16), (16, 0, 1))
    cos, sin = tables(3, 16, 6)
    with torch.inference_mode():
        assert torch.equal(cpu_rope.apply_rope(x, cos, sin, True), reference(x, cos, sin, True))


def test_what_it_does_not_take_is_left_to_torch(kernel):
    x = torch.randn(4, 2, 16)
    cos, sin = tables(4, 16, 5)
    with torch.inference_mode():
        assert cpu_rope.apply_rope(x.double(), cos.double(), sin.double(), True) is None  # another dtype
        assert cpu_rope.apply_rope(x.transpose(1, 2), *tables(4, 2, 5), True) is None  # strided heads
        assert cpu_rope.apply_rope(x[:0], cos[:0], sin[:0], True) is None  # nothing to do
        assert cpu_rope.apply_rope(x, cos[:, :4], sin[:, :4], True) is None  # tables of another size
        assert cpu_rope.apply_rope(torch.randn(4, 2, 15), cos, sin, True) is None  # odd width
    x_grad = x.clone().requires_grad_()
    assert cpu_rope.apply_rope(x_grad, cos, sin, True) is None  # autograd needs torch's


@pytest.mark.parametrize("interleave", [True, False])
def test_the_model_rope_runs_the_kernel(kernel, interleave, monkeypatch):
    rope = RotaryEmbedding(RopeConfig(interleave=interleave), 64)
    cos, sin = rope.cos_sin(torch.arange(6), torch.float32)
    x = torch.randn(6, 4, 64)
    calls = []
    real = cpu_rope._fn
    monkeypatch.setattr(cpu_rope, "_fn", lambda *a: calls.append(a) or real(*a))
    with torch.inference_mode():
        out = rope.apply(x, cos, sin)
    assert len(calls) == 1
    assert torch.equal(out, reference(x, cos, sin, interleave))
