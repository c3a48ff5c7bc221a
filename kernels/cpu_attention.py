"""Attention on CPUs: the torch references (kernels.mla.TorchMLA, kernels.gqa.TorchGQA) with the
decode attention core as a C kernel (kernels/csrc/paged_decode.c) that reads the paged cache in
place.

The references gather every decode sequence's cached rows into one padded copy per layer (MLA at
32 sequences of 130 tokens: 9.6 MB written and read twice per layer), then run two batched
matmuls and a softmax over it. The kernel makes one pass over the rows with an online softmax, so
the cache is read once and nothing is copied. Everything around the core (MLA's absorbed query and
output projection, the extend path of both) stays torch code.

The kernel takes fp32 tensors on the CPU; anything else (another dtype or device, a non-contiguous
cache, no C compiler on the machine) runs the reference instead. The kernel is the operator
torch.ops.afd.paged_decode_f32 (see kernels/native.py), what tracing sees.
"""

from __future__ import annotations

import torch

from kernels import native
from kernels.gqa import TorchGQA
from kernels.mla import PagedKV, TorchMLA, absorb_query, unabsorb_output

MAX_HEADS_PER_TASK = 128  # MAX_HEADS in paged_decode.c


def heads_per_task(tasks: int, heads: int, threads: int) -> int:
    """Query heads per kernel task when `tasks` (sequence, key/value head) pairs share `heads` query
    heads each: all of them, unless that gives fewer than two tasks per thread; then fewer, so that
    it does (one sequence of MLA: the threads split its heads)."""
    groups = max(1, -(-2 * threads // tasks))
    return max(1, min(MAX_HEADS_PER_TASK, -(-heads // groups)))


def _function():
    return native.function("paged_decode", "afd_paged_decode_f32", pointers=5, sizes=11)


class PagedDecodeKernel:
    """Calls the C kernel; `fn` is None where it could not be built (see kernels/native.py)."""

    def __init__(self) -> None:
        self.fn = _function()

    def runs(self, q: torch.Tensor, cache: torch.Tensor) -> bool:
        """Whether these inputs go to the kernel (else to the reference)."""
        return (
            self.fn is not None
            and cache.device.type == "cpu"
            and cache.dtype == torch.float32
            and q.dtype == torch.float32
            and cache.is_contiguous()
            and q.shape[0] > 0
        )

    def __call__(self, q: torch.Tensor, cache: torch.Tensor, kv: PagedKV, kv_heads: int, dv: int, val_base: int):
        """q [B, H, Dk] fp32, already scaled -> out [B, H, dv] (see paged_decode.c)."""
        return paged_decode_f32(q, cache, kv.pages, kv.kv_lens, kv_heads, dv, val_base, kv.page_size)


def _decode_fake(q, cache, pages, kv_lens, kv_heads, dv, val_base, page_size):
    return q.new_empty(q.shape[0], q.shape[1], dv)


@native.cpu_op(fake=_decode_fake)
def paged_decode_f32(
    q: torch.Tensor,
    cache: torch.Tensor,
    pages: torch.Tensor,
    kv_lens: torch.Tensor,
    kv_heads: int,
    dv: int,
    val_base: int,
    page_size: int,
) -> torch.Tensor:
    """afd::paged_decode_f32, the kernel: q [B, H, Dk] fp32, already scaled; cache [slots, row] fp32
    contiguous; pages [B, P], kv_lens [B] int64 -> out [B, H, dv], a new tensor (see paged_decode.c)."""
    B, H, Dk = q.shape
    q, cache, pages, kv_lens = (t.contiguous() for t in (q, cache, pages, kv_lens))
    out = q.new_empty(B, H, dv)
    threads = torch.get_num_threads()
    sizes = (B, H, kv_heads, Dk, dv, cache.shape[-1], val_base, cache.shape[0], pages.shape[1], page_size)
    hpt = heads_per_task(B * kv_heads, H // kv_heads, threads)
    ptrs = (t.data_ptr() for t in (q, cache, pages, kv_lens, out))
    rc = _function()(*ptrs, *sizes, hpt, threads)
    if rc == -2:
        raise ValueError(
            f"paged decode: a sequence's length (max {int(kv_lens.max())}) exceeds its page table row "
            f"({pages.shape[1]} pages of {page_size}) or a page it reads is outside the cache "
            f"({cache.shape[0]} slots)"
        )
    if rc != 0:
        raise ValueError(f"paged decode: sizes the kernel cannot take (B, H, KVH, Dk, Dv, stride, ...) = {sizes}")
    return out


class _CpuDecode:
    """What both backends share: the kernel, and whether it was built."""

    name = "cpu"

    def __init__(self) -> None:
        self.kernel = PagedDecodeKernel()

    @property
    def native(self) -> bool:
        """Whether the C kernel was built and loaded (else every decode runs the reference)."""
        return self.kernel.fn is not None


class CpuMLA(_CpuDecode, TorchMLA):
    """TorchMLA with the C decode core for fp32 CPU tensors; see the module docstring."""

    def decode(self, q_nope, q_pe, cache, kv: PagedKV, w_uk, w_uv, scale: float):
        """See `kernels.mla.mla_decode_attention`: one query per sequence [B, H, *] -> [B, H, Dv]."""
        if not self.kernel.runs(q_nope, cache):
            return super().decode(q_nope, q_pe, cache, kv, w_uk, w_uv, scale)
        q = torch.cat((absorb_query(q_nope, w_uk), q_pe), dim=-1).mul_(scale)  # [B, H, C + R]
        out_latent = self.kernel(q, cache, kv, kv_heads=1, dv=w_uk.shape[-1], val_base=0)  # [B, H, C]
        return unabsorb_output(out_latent, w_uv)


class CpuGQA(_CpuDecode, TorchGQA):
    """TorchGQA with the C decode core for fp32 CPU tensors; see the module docstring."""

    def decode(self, q, cache, kv: PagedKV, num_kv_heads: int, scale: float):
        """See `kernels.gqa.gqa_decode_attention`: one query per sequence [B, H, D] -> [B, H, D]."""
        if not self.kernel.runs(q, cache):
            return super().decode(q, cache, kv, num_kv_heads, scale)
        D = q.shape[-1]
        return self.kernel((q * scale).contiguous(), cache, kv, num_kv_heads, dv=D, val_base=num_kv_heads * D)
