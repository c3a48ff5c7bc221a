"""Building blocks every model family shares: RMSNorm and bias-free linear layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu_norm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = rms_norm(x, self.weight, self.eps)  # the C kernel for fp32 CPU tensors (kernels/cpu_norm.py)
        if out is not None:
            return out
        # normalise in fp32, scale in the activation dtype (as the reference does)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)
