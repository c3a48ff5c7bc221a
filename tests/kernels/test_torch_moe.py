"""The torch MoE reference (kernels.moe.fused_moe) against a per-token loop, on each of its paths:
all experts in two batched matmuls, only the experts a small batch uses, and one expert at a time
(a batch using at most 4 experts, or a skewed routing)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels.moe as moe

E, H, I, K = 16, 32, 8, 4


def naive(x, w13, w2, ids, weights):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e >= 0:
                gate, up = F.linear(x[t], w13[e]).chunk(2)
                out[t] += weights[t, k] * F.linear(F.silu(gate) * up, w2[e])
    return out


def inputs(T: int, routing: str, K: int = K):
    gen = torch.Generator().manual_seed(T)
    x, w13, w2 = (
        torch.randn(T, H, generator=gen),
        torch.randn(E, 2 * I, H, generator=gen),
        torch.randn(E, H, I, generator=gen),
    )
    if routing == "spread":  # every expert gets tokens
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    elif routing == "few":  # 4 of 16 experts used
        ids = torch.stack([torch.randperm(4, generator=gen)[:K] + 8 for _ in range(T)])
    else:  # skewed: nearly everything on experts 0 and 1, padded blocks would be mostly padding
        ids = torch.stack([torch.arange(K) for _ in range(T)])
        ids[0] = torch.tensor([5, 9])
    ids[T // 2, 1] = -1  # a remote slot contributes nothing
    return x, w13, w2, ids, torch.rand(T, K, generator=gen)


@pytest.mark.parametrize(
    "T, routing, k, path",
    [
        (16, "spread", K, "all"),
        (2, "spread", K, "used"),  # 5 to 7 of 16 experts
        (1, "spread", K, "per-expert"),  # one token: 3 experts, the loop reads their weights in place
        (3, "few", K, "per-expert"),  # 4 experts
        (32, "skewed", 2, "per-expert"),
    ],
)
def test_fused_moe_matches_a_per_token_loop_on_every_path(T, routing, k, path, monkeypatch):
    seen = []
    grouped = moe._moe_grouped
    monkeypatch.setattr(moe, "_moe_grouped", lambda x, w13, *a: seen.append(w13.shape[0]) or grouped(x, w13, *a))
    x, w13, w2, ids, weights = inputs(T, routing, k)
    expected = naive(x, w13, w2, ids, weights)  # fp32, summed in another order: rounding-level differences
    out = moe.fused_moe(x, w13, w2, ids, weights)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6 * expected.abs().max())
    used = ids[ids >= 0].unique().numel()
    # how many experts' weights the batched matmuls read: all E, only those used, or none (the loop)
    assert seen == {"all": [E], "used": [used], "per-expert": []}[path]
    assert path != "used" or moe._LOOP_MAX_EXPERTS < used <= E // 2
