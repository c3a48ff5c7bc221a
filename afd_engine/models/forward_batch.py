"""The tensors one forward step needs, built once per step and shared by every layer.

A step's tokens are flat: first the extend segment (prefill chunks, each sequence's new tokens
back to back), then the decode segment (one token per sequence)::

    tokens:  [ e0 e0 e0 | e1 e1 | d0 | d1 | d2 ]
              extend (padded to [Be, Q] inside attention)  decode ([Bd])

Extend sequences attend through the expanded (non-absorbed) MLA form, decode sequences through
the absorbed form; both read the same paged latent cache through slot tables.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from kernels.mla import PagedKV


@dataclass(slots=True)
class SeqChunk:
    """One sequence's share of a step: `tokens` new tokens starting at position `start` (slotted,
    not frozen: a step builds one per sequence, and a frozen dataclass's init costs 3x more)."""

    row: int  # row of the sequence in the page table
    start: int  # tokens already in the cache (also the position of the first new token)
    tokens: list[int]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64: cache slot each new token's latent is written to
    num_extend_tokens: int
    ext_valid: torch.Tensor  # [Be, Q] bool: real (not padding) query positions
    ext_positions: torch.Tensor  # [Be, Q] int64
    ext_slots: torch.Tensor  # [Be, L] int64
    ext_kv_lens: torch.Tensor  # [Be]
    dec_slots: torch.Tensor  # [Bd, L] int64
    dec_kv_lens: torch.Tensor  # [Bd]
    dec_bias: torch.Tensor  # [Bd, 1, L] float32: 0 for cached tokens, -inf for padding
    dec_pages: torch.Tensor  # [Bd, P] int64: each decode sequence's pages in order (padding: page 0)
    page_size: int

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @staticmethod
    def build(
        extend: list[SeqChunk],
        decode: list[SeqChunk],
        page_table: torch.Tensor,
        page_size: int,
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        """page_table [rows, max_pages] int64: page ids of each sequence (row) in order. The tables
        are built on the host and moved to `device` once per step."""
        ext = _segment(extend, page_table, page_size)
        dec = _segment(decode, page_table, page_size)
        ids = [t for c in extend for t in c.tokens] + [t for c in decode for t in c.tokens]
        t = torch.from_numpy
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=t(np.concatenate((ext.q_pos[ext.q_valid], dec.q_pos[dec.q_valid]))),
            out_slots=t(np.concatenate((ext.q_slots[ext.q_valid], dec.q_slots[dec.q_valid]))),
            num_extend_tokens=int(ext.q_valid.sum()),
            ext_valid=t(ext.q_valid),
            ext_positions=t(ext.q_pos),
            ext_slots=t(ext.slots),
            ext_kv_lens=t(ext.kv_lens),
            dec_slots=t(dec.slots),
            dec_kv_lens=t(dec.kv_lens),
            dec_bias=t(np.where(dec.kv_valid, np.float32(0), np.float32("-inf"))[:, None]),
            dec_pages=t(dec.pages),
            page_size=page_size,
        ).to(device)

    def to(self, device: torch.device | str) -> ForwardBatch:
        """The same batch with every tensor on `device` (itself when already there)."""
        device = torch.device(device)
        if self.input_ids.device == device:
            return self
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device, non_blocking=True)
                for f in dataclasses.fields(self)
                if f.type == "torch.Tensor"
            },
        )

    def paged_decode(self) -> PagedKV:
        """Where the decode sequences' cached tokens are, for the MLA decode kernels."""
        return PagedKV(self.dec_slots, self.dec_bias, self.dec_pages, self.dec_kv_lens, self.page_size)


@dataclass
class _Segment:
    """A segment's tables as numpy arrays (host bookkeeping of a few thousand values, where torch's
    small ops would wake its thread pool: measured 0.3-2.6 ms per 256-sequence step on 2 threads)."""

    q_valid: np.ndarray  # [B, Q] bool
    q_pos: np.ndarray  # [B, Q]
    q_slots: np.ndarray  # [B, Q]
    slots: np.ndarray  # [B, L]
    kv_lens: np.ndarray  # [B]
    kv_valid: np.ndarray  # [B, L] bool
    pages: np.ndarray  # [B, P] page ids covering kv_lens


def _segment(chunks: list[SeqChunk], page_table: torch.Tensor, page_size: int) -> _Segment:
    if not chunks:
        none = np.zeros((0, 0), np.int64)
        return _Segment(none.astype(bool), none, none, none, np.zeros(0, np.int64), none.astype(bool), none)
    rows = np.fromiter((c.row for c in chunks), np.int64, len(chunks))
    starts = np.fromiter((c.start for c in chunks), np.int64, len(chunks))
    counts = np.fromiter((len(c.tokens) for c in chunks), np.int64, len(chunks))
    kv_lens = starts + counts
    q_max, kv_max = int(counts.max()), int(kv_lens.max())
    q_off = np.arange(q_max)
    q_valid = q_off[None, :] < counts[:, None]  # [B, Q]
    q_pos = np.where(q_valid, starts[:, None] + q_off[None, :], 0)
    kv_pos = np.arange(kv_max)
    kv_valid = kv_pos[None, :] < kv_lens[:, None]  # [B, L]
    pages = page_table.numpy()[rows, : -(-kv_max // page_size)]  # [B, P]
    slots = np.where(kv_valid, pages[:, kv_pos // page_size] * page_size + kv_pos % page_size, 0)
    return _Segment(q_valid, q_pos, np.take_along_axis(slots, q_pos, axis=1), slots, kv_lens, kv_valid, pages)
