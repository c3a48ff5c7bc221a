"""Wire formats of activations: as they are (fp32/bf16), or fp8 e4m3 with one fp32 scale per 128 values.

Sizes are static helpers so that volumes can be computed without sending anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from comm.messages import CommError
from comm.protocol import DTYPES

FP8_GROUP = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> q [T, H] float8_e4m3fn, scales [T, ceil(H/128)] fp32 with x ~= q * scale per group."""
    T, H = x.shape
    groups = -(-H // FP8_GROUP)
    padded = torch.nn.functional.pad(x.float(), (0, groups * FP8_GROUP - H)).view(T, groups, FP8_GROUP)
    # divided by a tensor on x's device, not by the Python number: CUDA divides by a host scalar as
    # a multiplication by its reciprocal, which rounds differently from the CPU and the Triton kernel
    fp8_max = torch.full((), FP8_MAX, device=x.device)
    scales = (padded.abs().amax(-1) / fp8_max).clamp(min=1e-12)  # [T, G]
    q = (padded / scales[..., None]).to(torch.float8_e4m3fn).view(T, groups * FP8_GROUP)[:, :H]
    return q.contiguous(), scales


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [T, H] fp8, scales [T, G] fp32 -> [T, H] in dtype."""
    scale = scales.repeat_interleave(FP8_GROUP, dim=1)[:, : q.shape[1]]
    return (q.float() * scale).to(dtype)


@dataclass(frozen=True)
class WireFormat:
    """dispatch: "auto" (the activations' dtype), "fp32", "bf16" or "fp8"; combine: "fp32" or "bf16"."""

    dispatch: str = "auto"
    combine: str = "bf16"

    def __post_init__(self) -> None:
        if self.dispatch not in ("auto", "fp8", *DTYPES):
            raise CommError(f"dispatch wire dtype {self.dispatch!r}: use auto, fp32, bf16 or fp8")
        if self.combine not in DTYPES:
            raise CommError(f"combine wire dtype {self.combine!r}: use fp32 or bf16")

    @property
    def combine_dtype(self) -> torch.dtype:
        return DTYPES[self.combine]

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Activations [T, H] -> (values [T, H], scales): fp8 values with scales [T, ceil(H/128)] fp32,
        or the activations as they travel with an empty scales [T, 0] (zero bytes on the wire)."""
        if self.dispatch == "fp8":
            return quantize_fp8(x)
        values = x.contiguous() if self.dispatch == "auto" else x.to(DTYPES[self.dispatch]).contiguous()
        return values, torch.empty(x.shape[0], 0, device=x.device)

    def decode(self, values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The inverse of `encode`, back in the senders' activation dtype."""
        if self.dispatch == "fp8":
            return dequantize_fp8(values, scales, dtype)
        return values.to(dtype)

    def hidden_bytes(self, hidden: int, activation_dtype: torch.dtype) -> int:
        """Bytes one token's activations take on the wire in dispatch."""
        if self.dispatch == "fp8":
            return hidden + 4 * -(-hidden // FP8_GROUP)
        dtype = activation_dtype if self.dispatch == "auto" else DTYPES[self.dispatch]
        return hidden * dtype.itemsize

    def combine_bytes(self, hidden: int) -> int:
        return hidden * self.combine_dtype.itemsize


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.nbytes for t in tensors)
