"""MLA on CPUs: the torch reference (kernels.mla.TorchMLA) with the decode attention core as a C
kernel (kernels/csrc/mla_decode.c) that reads the paged latent cache in place.

The reference gathers every decode sequence's cached rows into one padded copy per layer (at 32
sequences of 130 tokens, 9.6 MB written and read twice per layer), then runs two batched matmuls
and a softmax over it. The kernel makes one pass over the rows with an online softmax, so the
cache is read once and nothing is copied. Everything around the core (the absorbed query, the
output projection, the extend path) stays torch code.

The kernel takes fp32 tensors on the CPU; anything else (another dtype or device, a non-contiguous
cache, no C compiler on the machine) runs the reference instead.
"""

from __future__ import annotations

import ctypes

import torch

from kernels import native
from kernels.mla import PagedKV, TorchMLA, absorb_query, unabsorb_output

MAX_HEADS_PER_TASK = 128  # MAX_HEADS in mla_decode.c


def heads_per_task(batch: int, heads: int, threads: int) -> int:
    """Heads each (sequence, heads) task attends: all of a sequence's, unless the batch is too small
    to give every thread two tasks; then fewer, so that it does (one sequence: threads split its heads)."""
    groups = max(1, -(-2 * threads // batch))
    return max(1, min(MAX_HEADS_PER_TASK, -(-heads // groups)))


class CpuMLA(TorchMLA):
    """TorchMLA with a C decode core for fp32 CPU tensors; see the module docstring."""

    name = "cpu"

    def __init__(self) -> None:
        lib = native.library("mla_decode")
        self._core = None
        if lib is not None:
            self._core = lib.afd_mla_decode_f32
            self._core.restype = ctypes.c_int
            self._core.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 7 + [ctypes.c_int]

    @property
    def native(self) -> bool:
        """Whether the C kernel was built and loaded (else every decode runs the reference)."""
        return self._core is not None

    def decode(self, q_nope, q_pe, cache, kv: PagedKV, w_uk, w_uv, scale: float):
        """See `kernels.mla.mla_decode_attention`: one query per sequence [B, H, *] -> [B, H, Dv]."""
        if not self._runs_natively(cache, q_nope):
            return super().decode(q_nope, q_pe, cache, kv, w_uk, w_uv, scale)
        q = torch.cat((absorb_query(q_nope, w_uk), q_pe), dim=-1).mul_(scale)  # [B, H, C + R]
        B, H, D = q.shape
        C = w_uk.shape[-1]
        out = q.new_empty(B, H, C)
        pages, kv_lens = kv.pages.contiguous(), kv.kv_lens.contiguous()
        threads = torch.get_num_threads()
        rc = self._core(
            q.data_ptr(),
            cache.data_ptr(),
            pages.data_ptr(),
            kv_lens.data_ptr(),
            out.data_ptr(),
            B,
            H,
            C,
            D,
            pages.shape[1],
            kv.page_size,
            heads_per_task(B, H, threads),
            threads,
        )
        if rc != 0:
            raise RuntimeError(f"the mla_decode kernel refused B={B} H={H} C={C} D={D} page_size={kv.page_size}")
        return unabsorb_output(out, w_uv)

    def _runs_natively(self, cache: torch.Tensor, q_nope: torch.Tensor) -> bool:
        return (
            self._core is not None
            and cache.device.type == "cpu"
            and cache.dtype == torch.float32
            and q_nope.dtype == torch.float32
            and cache.is_contiguous()
            and q_nope.shape[0] > 0
        )
