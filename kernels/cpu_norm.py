"""RMSNorm on CPUs: a C kernel (kernels/csrc/rms_norm.c) for fp32 CPU tensors.

torch's CPU rms_norm is half a dozen operators (square, mean, add, rsqrt, two products) and,
with the weight, a seventh, each a dispatch and a pass over the rows, and a DeepSeek layer has four
of them (timings: benchmarks/README.md, "Lab notes"). The kernel does a row in one pass over it and
one over the output, on one thread (no parallel region for microseconds of work). It sums the
squares in double; the result differs from torch's by rounding only.

Used by models/norm.py for every RMSNorm whose input and weight it takes (fp32, on the CPU, rows
with unit stride, no autograd); everything else, and a machine without a C compiler, runs torch.
The kernel is the operator torch.ops.afd.rms_norm_f32 (see kernels/native.py), what tracing sees.
"""

from __future__ import annotations

import torch

from kernels import native

_fn = None  # the kernel once built or found missing (False)


def _kernel():
    global _fn
    if _fn is None:
        _fn = native.function("rms_norm", "afd_rms_norm_f32", pointers=3, sizes=3, doubles=1, threads=False) or False
    return _fn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """weight * x / sqrt(mean(x^2 over the last dim) + eps), or None where the kernel does not
    take these inputs (the caller runs torch)."""
    if (
        x.dtype != torch.float32
        or weight.dtype != torch.float32
        or x.device.type != "cpu"
        or weight.device.type != "cpu"
        or not weight.is_contiguous()
        or weight.numel() != x.shape[-1]
        or x.numel() == 0
        or x.stride(-1) != 1
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        return None
    if not (x.is_contiguous() or x.dim() == 2) or not native.built(_kernel):
        return None
    return rms_norm_f32(x, weight, eps)


@native.cpu_op(fake=lambda x, weight, eps: x.new_empty(x.shape))
def rms_norm_f32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """afd::rms_norm_f32, the kernel: x [..., dim], weight [dim], fp32 -> a new contiguous tensor of
    x's shape. Reads x in place where it is contiguous or 2-d with unit-stride rows."""
    if not (x.is_contiguous() or (x.dim() == 2 and x.stride(-1) == 1)):
        x = x.contiguous()
    weight, dim = weight.contiguous(), x.shape[-1]
    stride = dim if x.is_contiguous() else x.stride(0)
    out = torch.empty(x.shape, dtype=x.dtype)
    if _kernel()(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, stride, eps) != 0:
        raise ValueError(f"rms_norm: sizes the kernel cannot take: {tuple(x.shape)}, stride {stride}")
    return out
