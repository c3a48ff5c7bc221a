"""The paged decode inputs the attention kernel tests share."""

from __future__ import annotations

import torch

from kernels.mla import PagedKV

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def paged_kv(kv_lens: list[int], page_size: int, g: torch.Generator, extra_columns: int = 0) -> tuple[PagedKV, int]:
    """A page table over scrambled pages, padded with poison page ids, and its PagedKV built the
    way afd_engine/models/forward_batch.py builds it. Page 0 is the (finite) padding slot's page;
    pages >= 1 + used are poison; `extra_columns` more padding columns of them. Returns (kv, number of pages)."""
    need = [-(-n // page_size) for n in kv_lens]
    used, poison = sum(need), 3
    order = (torch.randperm(used, generator=g) + 1).tolist()  # scrambled, never page 0
    width = max(need) + extra_columns
    pages = torch.randint(1 + used, 1 + used + poison, (len(kv_lens), width), generator=g)
    for b, n in enumerate(need):
        pages[b, :n] = torch.tensor(order[:n])
        order = order[n:]
    lens = torch.tensor(kv_lens, dtype=torch.int64)
    kv_pos = torch.arange(max(kv_lens))[None, :].expand(len(kv_lens), -1)  # [B, L]
    kv_valid = kv_pos < lens[:, None]
    page_idx = (kv_pos // page_size).clamp(max=width - 1)
    slots = torch.where(kv_valid, pages.gather(1, page_idx) * page_size + kv_pos % page_size, 0)
    bias = torch.zeros(slots.shape).masked_fill_(~kv_valid, float("-inf"))[:, None]
    kv = PagedKV(slots.to(DEVICE), bias.to(DEVICE), pages.to(DEVICE), lens.to(DEVICE), page_size)
    return kv, 1 + used + poison


def make_mla_case(kv_lens, page_size, heads, C, R, Dn, Dv, dtype, seed=0):
    """Random decode inputs with O(1) scores: (q_nope, q_pe, cache, kv, w_kv_b, scale)."""
    g = torch.Generator().manual_seed(seed)
    kv, num_pages = paged_kv(kv_lens, page_size, g)
    cache = torch.randn(num_pages * page_size, C + R, generator=g)
    owned = torch.zeros(len(cache), dtype=torch.bool)
    owned[kv.slots.cpu().flatten()] = True  # every sequence token, and slot 0 (the padding slot)
    cache[~owned] = float("nan")
    B = len(kv_lens)
    q_nope, q_pe = torch.randn(B, heads, Dn, generator=g), torch.randn(B, heads, R, generator=g)
    w_kv_b = torch.randn(heads * (Dn + Dv), C, generator=g) * C**-0.5
    tensors = [t.to(DEVICE, dtype) for t in (q_nope, q_pe, cache, w_kv_b)]
    return (*tensors[:3], kv, tensors[3], (Dn + R) ** -0.5)


def make_gqa_case(kv_lens, page_size, heads, kv_heads, D, dtype, seed=0):
    """Random decode inputs with O(1) scores: (q [B, H, D], cache [S, 2 * KVH * D], kv, scale)."""
    g = torch.Generator().manual_seed(seed)
    kv, num_pages = paged_kv(kv_lens, page_size, g, extra_columns=1)
    cache = torch.randn(num_pages * page_size, 2 * kv_heads * D, generator=g)
    owned = torch.zeros(len(cache), dtype=torch.bool)
    owned[kv.slots.cpu().flatten()] = True  # every sequence token, and slot 0 (the padding slot)
    cache[~owned] = float("nan")
    q = torch.randn(len(kv_lens), heads, D, generator=g)
    return q.to(DEVICE, dtype), cache.to(DEVICE, dtype), kv, D**-0.5
