"""Rotary embedding on CPUs: a C kernel (kernels/csrc/rope.c) for fp32 CPU tensors.

torch applies DeepSeek's rope as two strided slices, four products, a difference, a sum and a
concatenation: nine operators, twice per layer (queries and keys; timings: benchmarks/README.md,
"Lab notes"). The kernel reads each head once and
writes its rotated copy, on one thread, with torch's rounding (bit-identical output).

Used by models/rope.py wherever it takes the inputs (fp32 on the CPU, unit stride within a head,
no autograd); everything else, and a machine without a C compiler, runs torch. The kernel is the
operator torch.ops.afd.rope_f32 (see kernels/native.py), what tracing sees.
"""

from __future__ import annotations

import torch

from kernels import native

_fn = None  # the kernel once built or found missing (False)


def _kernel():
    global _fn
    if _fn is None:
        _fn = native.function("rope", "afd_rope_f32", pointers=4, sizes=6, threads=False) or False
    return _fn


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor | None:
    """x [T, heads, dim] or [T, dim]; cos, sin [T, dim/2] -> the rotated x, contiguous (see
    models/rope.py for the layout); None where the kernel does not take these inputs."""
    if (
        x.dtype != torch.float32
        or cos.dtype != torch.float32
        or sin.dtype != torch.float32
        or x.device.type != "cpu"
        or x.dim() not in (2, 3)
        or x.numel() == 0
        or x.stride(-1) != 1
        or x.shape[-1] % 2
        or not (cos.is_contiguous() and sin.is_contiguous())
        or cos.shape != (x.shape[0], x.shape[-1] // 2)
        or sin.shape != cos.shape
        or (torch.is_grad_enabled() and x.requires_grad)
    ):
        return None
    if not native.built(_kernel) or (x.dim() == 3 and x.shape[1] > 1 and x.stride(1) < x.shape[-1]):
        return None  # no kernel, or heads that overlap
    return rope_f32(x, cos, sin, interleave)


@native.cpu_op(fake=lambda x, cos, sin, interleave: x.new_empty(x.shape))
def rope_f32(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """afd::rope_f32, the kernel: x [T, heads, dim] or [T, dim], cos, sin [T, dim/2], fp32 -> the
    rotated x, a new contiguous tensor. Reads x in place where its heads have unit stride."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    T, D = x.shape[0], x.shape[-1]
    H = x.shape[1] if x.dim() == 3 else 1
    stride_h = x.stride(1) if H > 1 else D  # one head's stride is never followed: any will do
    out = torch.empty(x.shape, dtype=x.dtype)
    rc = _kernel()(
        x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), T, H, D, x.stride(0), stride_h, int(interleave)
    )
    if rc != 0:
        raise ValueError(f"rope: sizes the kernel cannot take: {tuple(x.shape)}, strides {x.stride()}")
    return out
