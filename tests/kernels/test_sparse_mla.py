"""The torch reference of sparse MLA (kernels/sparse_mla.py, absorbed in kernels/mla.py):
attending to every cached token of a sequence is MLA decode; unused entries and the order of the
chosen slots change nothing; the cache may be the MLA share of wider rows."""

from __future__ import annotations

import torch

from kernels.mla import PagedKV, absorb_kv_b, mla_decode_attention, sparse_mla_attention

H, DN, DV, C, R, EXTRA = 4, 8, 8, 16, 4, 6


def setup(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(40, C + R + EXTRA, generator=g)
    w_uk, w_uv = absorb_kv_b(torch.randn(H * (DN + DV), C, generator=g) * 0.3, H, DN, DV)
    q_nope, q_pe = torch.randn(3, H, DN, generator=g), torch.randn(3, H, R, generator=g)
    return wide, w_uk, w_uv, q_nope, q_pe


def test_every_token_chosen_is_mla_decode():
    wide, w_uk, w_uv, q_nope, q_pe = setup()
    cache = wide[:, : C + R]  # strided: each row also holds an index key
    slots = torch.tensor([[3, 7, 9, 0, 0], [11, 12, 13, 14, 15], [20, 0, 0, 0, 0]])
    lens = torch.tensor([3, 5, 1])
    valid = torch.arange(5)[None, :] < lens[:, None]
    bias = torch.where(valid, 0.0, float("-inf"))[:, None, :]
    dense = mla_decode_attention(q_nope, q_pe, cache.contiguous(), PagedKV(slots, bias, None, lens, 1), w_uk, w_uv, 0.3)
    chosen = slots.masked_fill(~valid, -1).flip(-1)  # unused entries first, the order reversed
    sparse = sparse_mla_attention(q_nope, q_pe, cache, chosen, w_uk, w_uv, 0.3)
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)


def test_the_index_key_columns_are_not_read():
    wide, w_uk, w_uv, q_nope, q_pe = setup(1)
    chosen = torch.tensor([[1, 2, -1], [5, -1, -1], [6, 7, 8]])
    before = sparse_mla_attention(q_nope, q_pe, wide[:, : C + R], chosen, w_uk, w_uv, 0.2)
    wide[:, C + R :] = 1e9
    wide[30:] = float("nan")  # rows never chosen
    torch.testing.assert_close(sparse_mla_attention(q_nope, q_pe, wide[:, : C + R], chosen, w_uk, w_uv, 0.2), before)
