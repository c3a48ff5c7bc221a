"""Tests of the batched sampler: greedy, top-k/top-p, seeded batch invariance, distribution."""

from __future__ import annotations

import pytest
import torch

from afd_engine.runtime.sampler import (
    Sampler,
    SamplingBatch,
    apply_top_k_top_p,
    mix64,
    random_uniforms,
)
from afd_engine.sampling_params import SamplingParams

sampler = Sampler()


def batch_of(params: list[SamplingParams], vocab: int, seeds=None, offsets=None) -> SamplingBatch:
    seeds = seeds if seeds is not None else [1234] * len(params)
    offsets = offsets if offsets is not None else [0] * len(params)
    return SamplingBatch.build(params, seeds, offsets, vocab)


def sample_offsets(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int = 7) -> torch.Tensor:
    """n draws of one request from the same logits, at offsets 0..n-1, in one batch -> [n]."""
    logits = logits_row[None, :].expand(n, -1)  # [n, V]
    return sampler(logits, batch_of([params] * n, logits.shape[-1], [seed] * n, list(range(n))))


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


# ---- RNG -------------------------------------------------------------------------------------


def test_mix64_matches_reference_splitmix64():
    mask = (1 << 64) - 1

    def reference(x: int) -> int:
        x &= mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    values = [0, 1, 42, 2**62 + 12345, 2**63 - 1, -1, -(2**63), -987654321]
    mixed = mix64(torch.tensor(values, dtype=torch.int64))
    assert [int(m) & mask for m in mixed] == [reference(v) for v in values]


def test_uniforms_strictly_inside_and_uniform():
    u = random_uniforms(torch.arange(8), torch.arange(8) * 3, 125_000)  # [8, 125000]
    assert u.dtype == torch.float32
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 2e-3
    assert abs(float(u.var()) - 1 / 12) < 2e-3
    hist = torch.histc(u, bins=10, min=0.0, max=1.0) / u.numel()
    assert torch.all((hist - 0.1).abs() < 0.005)
    assert torch.all(torch.isfinite(-torch.log(-torch.log(u))))


def test_uniforms_depend_only_on_seed_and_offset():
    seeds, offsets = torch.tensor([5, 6, 5, 5]), torch.tensor([0, 0, 1, 0])
    u = random_uniforms(seeds, offsets, 64)  # [4, 64]
    assert torch.equal(u[0], u[3])
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    # Same rows, permuted and in a different batch: bitwise the same numbers.
    perm = torch.tensor([2, 0, 3, 1])
    assert torch.equal(random_uniforms(seeds[perm], offsets[perm], 64), u[perm])


# ---- SamplingBatch ---------------------------------------------------------------------------


def test_build_tensors():
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=5, top_p=0.5), SamplingParams(top_k=0)]
    b = SamplingBatch.build(params, [1, 2**64 - 1, 3], [0, 4, 9], vocab_size=100)
    assert b.temperatures.tolist() == [0.0, 1.0, 1.0] and b.temperatures.dtype == torch.float32
    assert b.top_ks.tolist() == [100, 5, 100] and b.top_ks.dtype == torch.int64
    assert b.top_ps.tolist() == [1.0, 0.5, 1.0]
    assert b.seeds.tolist() == [1, -1, 3]  # seeds >= 2**63 wrap to their int64 reading
    assert b.offsets.tolist() == [0, 4, 9]
    assert not b.all_greedy and b.any_top_k_top_p
    plain = SamplingBatch.build([SamplingParams(), SamplingParams(temperature=0.0, top_k=3)], [1, 2], [0, 0], 100)
    assert not plain.any_top_k_top_p  # top-k of a greedy row is irrelevant
    assert SamplingBatch.build([SamplingParams(temperature=0.0)] * 2, [1, 2], [0, 0], 100).all_greedy


# ---- greedy ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_greedy_equals_argmax(dtype):
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(0)).to(dtype)
    batch = batch_of([SamplingParams(temperature=0.0)] * 16, 300)
    assert batch.all_greedy
    out = sampler(logits, batch)
    assert out.dtype == torch.int64 and torch.equal(out, torch.argmax(logits.float(), dim=-1))


def test_greedy_ties_take_lowest_index():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 5.0, 5.0]])
    greedy = sampler(logits, batch_of([SamplingParams(temperature=0.0)] * 2, 4))
    assert greedy.tolist() == [1, 0]
    mixed = sampler(logits, batch_of([SamplingParams(temperature=0.0), SamplingParams(top_k=1)], 4))
    assert mixed.tolist() == [1, 0]  # top_k=1 keeps the lowest index among ties, too


def test_mixed_batch_greedy_and_sampled_rows():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 200, generator=gen)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=1),
        SamplingParams(temperature=1.3, top_p=0.9),
        SamplingParams(temperature=0.0, top_k=50, top_p=0.5),
    ]
    seeds, offsets = [11, 12, 13, 14, 15, 16], [0, 3, 5, 7, 9, 2]
    out = sampler(logits, batch_of(params, 200, seeds, offsets))
    argmax = torch.argmax(logits, dim=-1)
    for row in (0, 2, 3, 5):
        assert out[row] == argmax[row]
    for row in (1, 4):  # each sampled row equals that request sampled alone
        alone = sampler(logits[row : row + 1], batch_of([params[row]], 200, [seeds[row]], [offsets[row]]))
        assert out[row] == alone[0]


# ---- top-k / top-p ---------------------------------------------------------------------------


def test_top_k_1_always_argmax():
    logits = torch.randn(500, generator=torch.Generator().manual_seed(2))
    draws = sample_offsets(logits, SamplingParams(temperature=1.5, top_k=1), 1000)
    assert torch.all(draws == torch.argmax(logits))


def test_top_k_never_leaves_the_k_largest():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(3)) * 0.3  # flat: tail is likely
    draws = sample_offsets(logits, SamplingParams(temperature=2.0, top_k=5), 3000)
    top5 = set(torch.topk(logits, 5).indices.tolist())
    assert set(draws.tolist()) == top5  # inside the top 5, and every one of them is reached


def test_top_p_tiny_is_argmax():
    logits = torch.randn(300, generator=torch.Generator().manual_seed(4))
    draws = sample_offsets(logits, SamplingParams(temperature=1.0, top_p=1e-6), 500)
    assert torch.all(draws == torch.argmax(logits))


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.4, {1}), (0.75, {1, 3}), (0.85, {1, 3, 2}), (0.97, {1, 3, 2, 0}), (1.0, {0, 1, 2, 3, 4})],
)
def test_top_p_keeps_exactly_the_expected_set(top_p, kept):
    probs = torch.tensor([0.04, 0.5, 0.15, 0.3, 0.01])
    logits = torch.log(probs)
    masked = apply_top_k_top_p(logits[None], torch.tensor([5]), torch.tensor([top_p]))[0]
    assert set(torch.nonzero(torch.isfinite(masked)).flatten().tolist()) == kept
    assert torch.equal(masked[list(kept)], logits[list(kept)])  # kept logits are untouched
    draws = sample_offsets(logits, SamplingParams(top_p=top_p), 4000)
    assert set(draws.tolist()) == kept


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]] * 2))
    # top-2 renormalised: 0.625, 0.375. top_p=0.6 -> only the top token; top_p=0.7 -> both.
    masked = apply_top_k_top_p(logits, torch.tensor([2, 2]), torch.tensor([0.6, 0.7]))
    assert torch.isfinite(masked).tolist() == [[True, False, False], [True, True, False]]


# ---- seeds and offsets -----------------------------------------------------------------------


def test_same_seed_and_offset_same_token_whatever_the_batch():
    gen = torch.Generator().manual_seed(5)
    vocab, n = 1000, 64
    logits = torch.randn(n, vocab, generator=gen)
    params = [
        SamplingParams(temperature=1.0 + (i % 3) * 0.3, top_k=(0, 50, 200)[i % 3], top_p=(1.0, 0.9)[i % 2])
        for i in range(n)
    ]
    seeds, offsets = list(range(100, 100 + n)), [i * 7 % 13 for i in range(n)]
    full = sampler(logits, batch_of(params, vocab, seeds, offsets))
    # Every request alone ...
    alone = [sampler(logits[i : i + 1], batch_of([params[i]], vocab, [seeds[i]], [offsets[i]]))[0] for i in range(n)]
    assert torch.equal(full, torch.stack(alone))
    # ... and in a shuffled half batch with greedy intruders.
    perm = torch.randperm(n, generator=gen)[: n // 2].tolist()
    intruders = torch.randn(3, vocab, generator=gen)
    mixed_logits = torch.cat([logits[perm], intruders])
    mixed = batch_of(
        [params[i] for i in perm] + [SamplingParams(temperature=0.0)] * 3,
        vocab,
        [seeds[i] for i in perm] + [1, 2, 3],
        [offsets[i] for i in perm] + [0, 0, 0],
    )
    assert torch.equal(sampler(mixed_logits, mixed)[: len(perm)], full[perm])


def test_sampling_is_deterministic_and_offsets_matter():
    logits = torch.zeros(1000)  # uniform over 1000 tokens
    first = sample_offsets(logits, SamplingParams(), 100, seed=9)
    assert torch.equal(first, sample_offsets(logits, SamplingParams(), 100, seed=9))
    assert len(set(first.tolist())) > 90  # different offsets -> different draws
    other_seed = sample_offsets(logits, SamplingParams(), 100, seed=10)
    assert int((first == other_seed).sum()) < 5


# ---- distribution ----------------------------------------------------------------------------

# Chi-square critical value for 3 degrees of freedom at p = 0.001. The draws are deterministic
# (fixed seed), so this is a check of correctness, not a flaky statistical test.
CHI2_3DOF_999 = 16.27


def test_temperature_1_matches_the_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    draws = sample_offsets(torch.log(probs) + 3.0, SamplingParams(temperature=1.0), 4000)
    assert chi_square(draws, probs) < CHI2_3DOF_999
    freq = torch.bincount(draws, minlength=4).double() / 4000
    assert torch.allclose(freq, probs.double(), atol=0.03)


def test_temperature_half_sharpens_to_p_squared():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    sharpened = probs**2 / (probs**2).sum()  # softmax(log p / 0.5) = p^2 / sum p^2
    draws = sample_offsets(torch.log(probs), SamplingParams(temperature=0.5), 4000, seed=21)
    assert chi_square(draws, sharpened) < CHI2_3DOF_999
    assert float((draws == 3).double().mean()) > 0.5  # 0.4 -> 0.533


def test_low_precision_logits_are_sampled_in_fp32():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(6))
    batch = batch_of([SamplingParams(temperature=0.8, top_p=0.9)] * 4, 50, [1, 2, 3, 4], [0, 1, 2, 3])
    low = logits.to(torch.bfloat16)
    assert torch.equal(sampler(low, batch), sampler(low.float(), batch))


def test_extreme_temperatures_are_finite():
    logits = torch.randn(2, 100, generator=torch.Generator().manual_seed(8))
    batch = batch_of([SamplingParams(temperature=1e-4), SamplingParams(temperature=100.0)], 100, [1, 2], [0, 0])
    out = sampler(logits, batch)
    assert out[0] == torch.argmax(logits[0])  # near-zero temperature is near-greedy
    assert 0 <= int(out[1]) < 100
