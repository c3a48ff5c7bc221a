"""Tests of speculative decoding's verification step: greedy exactness, the target distribution
preserved under sampling, batch invariance, and the sampler's processing applied to p and q."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from afd_engine.runtime.sampler import Sampler, SamplingBatch
from afd_engine.runtime.spec_verify import verify
from afd_engine.sampling_params import SamplingParams

sampler = Sampler()
GREEDY = SamplingParams(temperature=0.0)


def batch_of(params, vocab: int, seeds=None, offsets=None) -> SamplingBatch:
    seeds = seeds if seeds is not None else list(range(1, len(params) + 1))
    offsets = offsets if offsets is not None else [0] * len(params)
    return SamplingBatch.build(params, seeds, offsets, vocab)


def sample_drafts(draft_logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """What a draft sampling with the sampler at the request's own keys proposes: [B, N, V] -> [B, N]."""
    columns = [
        sampler(draft_logits[:, j], dataclasses.replace(batch, offsets=batch.offsets + j))
        for j in range(draft_logits.shape[1])
    ]
    return torch.stack(columns, dim=1) if columns else torch.empty(draft_logits.shape[0], 0, dtype=torch.int64)


def chi_square_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of Pearson's chi-square test of `tokens` against `probs` (zero-mass tokens must not occur)."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    support = probs > 0
    assert int(counts[~support].sum()) == 0, f"tokens outside the target's support: {counts.tolist()}"
    expected = probs.double()[support] / probs.double()[support].sum() * tokens.numel()
    statistic = ((counts[support] - expected) ** 2 / expected).sum()
    dof = torch.tensor((int(support.sum()) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, statistic / 2))  # chi-square survival function


# ---- greedy ----------------------------------------------------------------------------------


def one_hot_logits(argmaxes: list[list[int]], vocab: int = 5) -> torch.Tensor:
    """[B, P, V] logits whose argmax at [b, j] is argmaxes[b][j] (other tokens get varied values)."""
    base = torch.arange(len(argmaxes) * len(argmaxes[0]) * vocab, dtype=torch.float32).remainder(3.0)
    logits = base.view(len(argmaxes), len(argmaxes[0]), vocab)
    # A small margin: sampling these rows instead of taking the argmax would often differ.
    return logits.scatter(2, torch.tensor(argmaxes)[:, :, None], 2.5)


# Target argmaxes at 4 positions, drafts at 3, how many each row proposed, and the expected result.
GREEDY_CASES = [
    # (argmax per position, drafts, num_drafts, accepted, tokens)
    ([1, 2, 3, 4], [1, 2, 3], 3, 3, [1, 2, 3, 4]),  # all kept, then the bonus token
    ([1, 2, 3, 4], [0, 2, 3], 3, 0, [1, -1, -1, -1]),  # rejected at once: the target's token
    ([1, 2, 3, 4], [1, 0, 3], 3, 1, [1, 2, -1, -1]),  # rejected in the middle (later match ignored)
    ([1, 2, 3, 4], [1, 2, 3], 2, 2, [1, 2, 3, -1]),  # fewer drafts: position 2 is the bonus
    ([0, 2, 3, 4], [-1, -1, -1], 0, 0, [0, -1, -1, -1]),  # no drafts (padding ignored)
    ([4, 4, 0, 1], [4, 4, 1], 3, 2, [4, 4, 0, -1]),  # rejected at the last draft
]


def greedy_inputs():
    logits = one_hot_logits([c[0] for c in GREEDY_CASES])
    drafts = torch.tensor([c[1] for c in GREEDY_CASES])
    num = torch.tensor([c[2] for c in GREEDY_CASES])
    return logits, drafts, num


def test_greedy_exact_accepts_and_tokens():
    logits, drafts, num = greedy_inputs()
    batch = batch_of([GREEDY] * len(GREEDY_CASES), 5)
    assert batch.all_greedy
    out = verify(logits, drafts, num, batch)
    assert out.accepted.dtype == torch.int64 and out.tokens.dtype == torch.int64
    assert out.accepted.tolist() == [c[3] for c in GREEDY_CASES]
    assert out.tokens.tolist() == [c[4] for c in GREEDY_CASES]


def test_greedy_rows_inside_a_sampled_batch_are_exact():
    logits, drafts, num = greedy_inputs()
    rows = len(GREEDY_CASES)
    # A sampled row (with top-k/top-p and min-p, so every processing step runs) beside them, and
    # draft logits that disagree with the drafts: a greedy row ignores both.
    sampled = SamplingParams(temperature=0.9, top_k=3, top_p=0.8, min_p=0.1)
    batch = batch_of([GREEDY] * rows + [sampled], 5, offsets=[3] * (rows + 1))
    assert not batch.all_greedy and batch.min_ps is not None
    logits = torch.cat([logits, torch.randn(1, 4, 5, generator=torch.Generator().manual_seed(0))])
    draft_logits = torch.randn(rows + 1, 3, 5, generator=torch.Generator().manual_seed(1))
    drafts, num = torch.cat([drafts, torch.tensor([[0, 1, 2]])]), torch.cat([num, torch.tensor([3])])
    for dl in (None, draft_logits):
        out = verify(logits, drafts, num, batch, dl)
        assert out.accepted[:rows].tolist() == [c[3] for c in GREEDY_CASES]
        assert out.tokens[:rows].tolist() == [c[4] for c in GREEDY_CASES]


def test_no_drafts_is_plain_decoding():
    logits = torch.randn(4, 1, 7, generator=torch.Generator().manual_seed(2))
    none = torch.empty(4, 0, dtype=torch.int64)
    greedy = verify(logits, none, torch.zeros(4, dtype=torch.int64), batch_of([GREEDY] * 4, 7))
    assert greedy.accepted.tolist() == [0] * 4
    assert greedy.tokens.tolist() == torch.argmax(logits, dim=-1).tolist()


def test_shapes_are_checked():
    logits = torch.zeros(2, 3, 5)
    batch = batch_of([GREEDY] * 2, 5)
    with pytest.raises(ValueError, match=r"draft_tokens has shape \(2, 3\), expected \(2, 2\)"):
        verify(logits, torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), batch)
    with pytest.raises(ValueError, match=r"draft_logits has shape \(2, 2, 4\), expected \(2, 2, 5\)"):
        verify(
            logits, torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), batch, torch.zeros(2, 2, 4)
        )


# ---- distribution preservation (the oracle) --------------------------------------------------

# Target distributions at 3 positions and draft distributions at the first 2, over 6 tokens. The
# draft puts mass where the target has none (token 5 at position 0, token 4 at position 1) and
# none where the target has some (token 0 at position 0, token 5 at position 1).
P = torch.tensor(
    [
        [0.30, 0.25, 0.20, 0.15, 0.10, 0.00],
        [0.05, 0.40, 0.05, 0.20, 0.00, 0.30],
        [0.10, 0.10, 0.10, 0.10, 0.30, 0.30],
    ]
)
Q = torch.tensor(
    [
        [0.00, 0.10, 0.15, 0.20, 0.20, 0.35],
        [0.50, 0.10, 0.10, 0.10, 0.20, 0.00],
    ]
)


def processed(probs: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the sampler draws from, by its definition, for one row of probabilities."""
    temperature, top_p = params.temperature, params.top_p
    top_k = params.top_k if params.top_k > 0 else probs.numel()
    sharpened = probs ** (1.0 / temperature)
    sharpened = sharpened / sharpened.sum()
    order = torch.argsort(sharpened, descending=True, stable=True)
    kept = torch.zeros_like(probs, dtype=torch.bool)
    kept[order[:top_k]] = True
    renormalised = torch.where(kept, sharpened, 0.0) / sharpened[kept].sum()
    before = torch.cumsum(renormalised[order], 0) - renormalised[order]  # mass ranked above each token
    if top_p < 1.0:
        kept[order[before >= top_p]] = False
    out = torch.where(kept, sharpened, 0.0)
    return out / out.sum()


ROWS = 20_000


@pytest.mark.parametrize(
    ("params", "draft"),
    [
        (SamplingParams(temperature=1.0), "sampled"),
        # the draft's q is also sharpened and cut to its own top 4: {5, 3, 4, 2} at position 0
        (SamplingParams(temperature=0.5, top_k=4), "sampled"),
        (SamplingParams(temperature=1.0, top_p=0.8), "sampled"),
        (SamplingParams(temperature=0.8), "deterministic"),
    ],
    ids=["plain", "temperature-top-k", "top-p", "deterministic-draft"],
)
def test_emitted_tokens_follow_the_target_distribution(params, draft):
    vocab = P.shape[1]
    target_logits = torch.log(P)[None].expand(ROWS, -1, -1)
    draft_logits = torch.log(Q)[None].expand(ROWS, -1, -1)
    batch = batch_of([params] * ROWS, vocab, seeds=list(range(ROWS)), offsets=[i % 97 for i in range(ROWS)])
    p = torch.stack([processed(P[j], params) for j in range(3)])
    if draft == "sampled":
        # Drawn by the sampler at the requests' own (seed, offset) keys, as the engine's draft
        # would: verification's own draws must stay independent of that noise.
        drafts = sample_drafts(draft_logits, batch)
        out = verify(target_logits, drafts, torch.full((ROWS,), 2), batch, draft_logits)
        q = torch.stack([processed(Q[j], params) for j in range(2)])
        keep_rates = torch.minimum(p[:2], q).sum(dim=-1)  # sum_x min(p(x), q(x))
    else:
        # Tokens picked by other means (here drawn from Q) and verified as certain (q one-hot):
        # the output still follows p, whatever picked them.
        drafts = torch.multinomial(Q, ROWS, replacement=True, generator=torch.Generator().manual_seed(5)).T
        out = verify(target_logits, drafts, torch.full((ROWS,), 2), batch)
        keep_rates = (Q * p[:2]).sum(dim=-1)  # draft x kept with probability p(x)

    # The first emitted token follows p at position 0; given the first draft was kept, the
    # second follows p at position 1; given both were kept, the bonus follows p at position 2.
    assert chi_square_pvalue(out.tokens[:, 0], p[0]) > 1e-3
    kept1 = out.accepted >= 1
    assert chi_square_pvalue(out.tokens[kept1, 1], p[1]) > 1e-3
    kept2 = out.accepted == 2
    assert chi_square_pvalue(out.tokens[kept2, 2], p[2]) > 1e-3
    assert torch.all(out.tokens[~kept1, 1:] == -1) and torch.all(out.tokens[~kept2, 2] == -1)
    assert torch.equal(out.tokens[kept1, 0], drafts[kept1, 0])

    # Each draft is kept at the expected rate (within 4 standard deviations).
    for j, rows_before in ((0, torch.ones(ROWS, dtype=torch.bool)), (1, kept1)):
        rate = float(keep_rates[j])
        kept = (out.accepted[rows_before] > j).double()
        sigma = (rate * (1 - rate) / kept.numel()) ** 0.5
        assert abs(float(kept.mean()) - rate) < 4 * sigma + 1e-9


def test_no_drafts_samples_the_target():
    params = SamplingParams(temperature=0.5, top_k=4)
    batch = batch_of([params] * ROWS, 6, seeds=list(range(ROWS)))
    out = verify(
        torch.log(P[:1])[None].expand(ROWS, -1, -1),
        torch.empty(ROWS, 0, dtype=torch.int64),
        torch.zeros(ROWS, dtype=torch.int64),
        batch,
    )
    assert out.tokens.shape == (ROWS, 1) and torch.all(out.accepted == 0)
    assert chi_square_pvalue(out.tokens[:, 0], processed(P[0], params)) > 1e-3


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_k=20, top_p=0.9, min_p=0.05)]
)
def test_a_draft_equal_to_the_target_is_always_kept(params):
    # Processing differently applied to p and q (say, the temperature to one only) would make
    # p != q and reject some drafts.
    rows, n, vocab = 2_000, 3, 50
    target_logits = torch.randn(rows, n + 1, vocab, generator=torch.Generator().manual_seed(3)) * 2.0
    draft_logits = target_logits[:, :n].clone()
    batch = batch_of([params] * rows, vocab, seeds=list(range(rows)), offsets=[i % 11 for i in range(rows)])
    drafts = sample_drafts(draft_logits, batch)
    out = verify(target_logits, drafts, torch.full((rows,), n), batch, draft_logits)
    assert torch.all(out.accepted == n)
    assert torch.equal(out.tokens[:, :n], drafts)
    # Rows that proposed fewer drafts keep exactly those: the slots past them (holding tokens that
    # would pass) are not tested, and the token after them comes from the target.
    num = torch.arange(rows) % (n + 1)
    fewer = verify(target_logits, drafts, num, batch, draft_logits)
    assert torch.equal(fewer.accepted, num)
    next_token = fewer.tokens.gather(1, num[:, None])  # [rows, 1]
    padded = torch.cat([drafts, torch.full((rows, 1), -1)], dim=1)
    expected = torch.where(torch.arange(n + 1)[None, :] < num[:, None], padded, -1).scatter(1, num[:, None], next_token)
    assert torch.equal(fewer.tokens, expected) and torch.all(next_token >= 0)


# ---- batch invariance ------------------------------------------------------------------------


def mixed_requests(rows: int = 12, n: int = 3, vocab: int = 40):
    gen = torch.Generator().manual_seed(4)
    target_logits = torch.randn(rows, n + 1, vocab, generator=gen)
    # A draft close to the target, so that rows keep some drafts and reject others.
    draft_logits = target_logits[:, :n] + 0.7 * torch.randn(rows, n, vocab, generator=gen)
    params = [
        [
            GREEDY,
            SamplingParams(temperature=1.0),
            SamplingParams(temperature=0.7, top_k=5),
            SamplingParams(temperature=1.2, top_p=0.8),
            SamplingParams(temperature=0.9, min_p=0.1),
            SamplingParams(temperature=1.0, top_k=1),
        ][i % 6]
        for i in range(rows)
    ]
    seeds, offsets = [100 + i for i in range(rows)], [(i * 5) % 9 for i in range(rows)]
    num = torch.tensor([(n, 2, n, 0, 1, n)[i % 6] for i in range(rows)])
    drafts = sample_drafts(draft_logits, batch_of(params, vocab, seeds, offsets))
    drafts[:, 1] = torch.where(torch.arange(rows) % 2 == 0, torch.argmax(target_logits[:, 1], -1), drafts[:, 1])
    return target_logits, draft_logits, drafts, num, params, seeds, offsets


@pytest.mark.parametrize("with_draft_logits", [True, False])
def test_a_request_gets_the_same_result_in_any_batch(with_draft_logits):
    target_logits, draft_logits, drafts, num, params, seeds, offsets = mixed_requests()
    rows, vocab = target_logits.shape[0], target_logits.shape[-1]

    def run(index: list[int]):
        return verify(
            target_logits[index],
            drafts[index],
            num[index],
            batch_of([params[i] for i in index], vocab, [seeds[i] for i in index], [offsets[i] for i in index]),
            draft_logits[index] if with_draft_logits else None,
        )

    full = run(list(range(rows)))
    assert 0 < int(full.accepted.sum()) < int(num.sum())  # some drafts kept, some rejected
    for i in range(rows):
        alone = run([i])
        assert alone.accepted[0] == full.accepted[i] and torch.equal(alone.tokens[0], full.tokens[i])
    perm = [7, 2, 11, 0, 5, 9, 3]
    shuffled = run(perm)
    assert torch.equal(shuffled.accepted, full.accepted[perm]) and torch.equal(shuffled.tokens, full.tokens[perm])
    # The draws are keyed by the seed: another seed gives other results on these rows.
    other = verify(target_logits, drafts, num, batch_of(params, vocab, [s + 1000 for s in seeds], offsets))
    assert not torch.equal(other.tokens, full.tokens)


# ---- processing applied to p and q -----------------------------------------------------------


@pytest.mark.parametrize("with_draft_logits", [True, False])
def test_top_k_1_behaves_like_greedy(with_draft_logits):
    target_logits, draft_logits, drafts, num, _, seeds, offsets = mixed_requests()
    rows, vocab = target_logits.shape[0], target_logits.shape[-1]
    dl = draft_logits if with_draft_logits else None
    greedy = verify(target_logits, drafts, num, batch_of([GREEDY] * rows, vocab, seeds, offsets), dl)
    top1 = batch_of([SamplingParams(temperature=1.5, top_k=1)] * rows, vocab, seeds, offsets)
    out = verify(target_logits, drafts, num, top1, dl)
    assert int(greedy.accepted.sum()) > 0
    assert torch.equal(out.accepted, greedy.accepted) and torch.equal(out.tokens, greedy.tokens)
