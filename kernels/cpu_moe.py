"""Routed-expert compute on CPUs: the torch reference (kernels.moe.TorchMoE) with a C kernel
(kernels/csrc/fused_moe.c) for the batches a decode step gives.

The reference pads every expert's tokens into blocks and runs batched matmuls over them (or loops
over the experts a small batch uses): some 15 torch operators and a copy of the tokens into padded
blocks. The kernel sorts the routes by expert and computes up to four routes of an expert per task
straight from the stacked weights, then adds each token's routes in ascending expert order (as
the reference does). It is far ahead of the reference for one token and still ahead at 32; at 128
tokens the reference's matmuls win (timings: benchmarks/README.md, "Lab notes").

Batches of more than `MAX_ROUTES` routes (prefill) stay with the reference, whose matmuls block
for the caches; so does anything the kernel does not take (another dtype or device, non-contiguous
weights, more than `MAX_K` routes per token, no C compiler on the machine). The kernel is the
operator torch.ops.afd.fused_moe_f32 (see kernels/native.py), what tracing sees.
"""

from __future__ import annotations

import torch

from kernels import native
from kernels.moe import TorchMoE

MAX_ROUTES = 384  # tokens x top-k above which the reference's matmuls are faster
MAX_K = 64  # routes per token the kernel takes (MAX_K in fused_moe.c)


def _function():
    return native.function("fused_moe", "afd_fused_moe_f32", pointers=7, sizes=5)


class FusedMoEKernel:
    """Calls the C kernel; `fn` is None where it could not be built (see kernels/native.py)."""

    def __init__(self) -> None:
        self.fn = _function()

    def runs(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor) -> bool:
        """Whether these inputs go to the kernel (else to the reference)."""
        return (
            self.fn is not None
            and x.device.type == "cpu"
            and all(t.dtype == torch.float32 and t.is_contiguous() for t in (w13, w2))
            and x.dtype == torch.float32
            and 0 < topk_ids.numel() <= MAX_ROUTES
            and topk_ids.shape[1] <= MAX_K
        )

    def __call__(self, x, w13, w2, topk_ids, topk_weights) -> torch.Tensor:
        """See kernels.moe.fused_moe; the inputs passed `runs`."""
        return fused_moe_f32(x, w13, w2, topk_ids, topk_weights)


@native.cpu_op(fake=lambda x, w13, w2, topk_ids, topk_weights: x.new_empty(x.shape))
def fused_moe_f32(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """afd::fused_moe_f32, the kernel: x [T, H], w13 [E, 2I, H], w2 [E, H, I] fp32; topk_ids,
    topk_weights [T, K] (K <= MAX_K) -> out [T, H], a new tensor. See kernels.moe.fused_moe."""
    (T, H), (E, I2, _), K = x.shape, w13.shape, topk_ids.shape[1]
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    out, routed = x.new_empty(T, H), x.new_empty(T * K, H)  # routed: the kernel's scratch
    ptrs = (t.data_ptr() for t in (x, w13, w2, ids, weights, out, routed))
    rc = _function()(*ptrs, T, K, E, H, I2 // 2, torch.get_num_threads())
    if rc == -2:
        raise ValueError(f"fused MoE: expert ids must lie in [-1, {E}); got {ids.min().item()}..{ids.max().item()}")
    if rc != 0:
        raise RuntimeError(f"fused MoE kernel failed ({rc}) on T={T}, K={K}, E={E}, H={H}, I={I2 // 2}")
    return out


class CpuMoE(TorchMoE):
    """TorchMoE with the C kernel for decode-sized fp32 CPU batches; see the module docstring."""

    name = "cpu"

    def __init__(self) -> None:
        self.kernel = FusedMoEKernel()

    @property
    def native(self) -> bool:
        """Whether the C kernel was built and loaded (else every batch runs the reference)."""
        return self.kernel.fn is not None

    def fused_moe(self, x, w13, w2, topk_ids, topk_weights) -> torch.Tensor:
        """See TorchMoE.fused_moe."""
        if not self.kernel.runs(x, w13, w2, topk_ids):
            return super().fused_moe(x, w13, w2, topk_ids, topk_weights)
        return self.kernel(x, w13, w2, topk_ids, topk_weights)
