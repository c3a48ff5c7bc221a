"""Speculative decoding with the MTP module in the simulator: how many drafts a verify step keeps,
and what the module's draft passes cost.

A drafting request verifies `drafts` k tokens in every decode step (its newest token and k drafts,
k + 1 rows through the model) and keeps `accepted + 1` tokens, `accepted` in 0..k drawn from
`probs`. The draws are seeded per simulation and taken per request in order (a request's i-th
verify always uses its i-th draw), so runs are deterministic and deployments compared on one trace
see the same acceptance.

A mean accepted length m (tokens per verify, accepted drafts + 1, as `bench_spec` reports it)
becomes a truncated geometric distribution: each draft is kept with the same probability a given
that all before it were, so P(accepted = i) = a^i (1 - a) for i < k and a^k for i = k, with a solved
from 1 + a + ... + a^k = m.

The module's passes after a verify (engine: runtime/spec_step.py) are one pass over the step's
rows, then k - 1 chained passes over one row per drafting request. A step-time model with a
`draft_pass(loads)` method prices each pass itself (`StageStepTime`: one MoE layer and the head);
any other costs `draft_fraction` of its step over the same rows: one layer of the model's
(1 / layers), the module being one decoder layer; its head and the per-pass overhead are taken as
that layer's share, which undercounts them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from afd_engine.errors import ConfigError
from afd_engine.planner.files import read_json
from afd_engine.planner.sim.step_time import Load, StepTimeModel

MAX_DRAFTS = 16


@dataclass(frozen=True)
class SpecDecoding:
    """Speculative decoding of the instances that decode: `probs[i]` the chance a verify keeps i of
    its len(probs) - 1 drafts; `draft_fraction` one draft pass over a step's rows as a share of
    that step (for step-time models without `draft_pass`); `seed` of the draws."""

    probs: tuple[float, ...]
    draft_fraction: float
    seed: int = 0
    source: str = ""  # where the distribution came from, for the report

    @property
    def drafts(self) -> int:
        return len(self.probs) - 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify keeps on average (accepted drafts + 1)."""
        return 1.0 + sum(i * p for i, p in enumerate(self.probs))

    def validate(self, where: str) -> None:
        if not 1 <= self.drafts <= MAX_DRAFTS:
            raise ConfigError(f"{where}: speculative decoding needs 1 to {MAX_DRAFTS} drafts (got {self.drafts})")
        if any(not (p >= 0) for p in self.probs) or abs(sum(self.probs) - 1.0) > 1e-6:
            raise ConfigError(f"{where}: accepted-draft probabilities must be >= 0 and sum to 1 (got {self.probs})")
        if not 0.0 <= self.draft_fraction <= 1.0:
            raise ConfigError(f"{where}: a draft pass's share of a step must be in [0, 1]")

    def draws(self, n: int) -> np.ndarray:
        """n tokens-per-verify (accepted + 1) from the seeded generator, as int64."""
        rng = np.random.default_rng(self.seed)
        p = np.asarray(self.probs, dtype=float)
        return rng.choice(len(p), size=n, p=p / p.sum()).astype(np.int64) + 1

    def as_dict(self) -> dict:
        return {
            "drafts": self.drafts,
            "accepted_drafts_probs": list(self.probs),
            "mean_accepted_length": self.mean_accepted_length,
            "seed": self.seed,
            "source": self.source,
        }


def geometric_probs(mean: float, drafts: int) -> tuple[float, ...]:
    """The truncated geometric distribution over 0..drafts accepted drafts whose mean accepted
    length (accepted + 1) is `mean` (module docstring)."""
    if not 1 <= drafts <= MAX_DRAFTS:
        raise ConfigError(f"--spec-drafts must be 1 to {MAX_DRAFTS} (got {drafts})")
    if not 1.0 <= mean <= drafts + 1:
        raise ConfigError(f"a mean accepted length of {mean:g} must be between 1 and drafts + 1 ({drafts + 1})")

    if mean == drafts + 1:  # every draft kept (a = 1)
        return (0.0,) * drafts + (1.0,)

    def length(a: float) -> float:
        return sum(a**i for i in range(drafts + 1))

    lo, hi = 0.0, 1.0
    for _ in range(64):  # length() rises with a: bisection to float precision
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if length(mid) < mean else (lo, mid)
    a = (lo + hi) / 2
    return tuple([a**i * (1 - a) for i in range(drafts)] + [a**drafts])


def parse_histogram(text: str) -> tuple[float, ...]:
    """`0.3,0.4,0.3` -> the chances of accepting 0, 1, 2 drafts (normalised if they sum near 1)."""
    try:
        probs = [float(x) for x in text.split(",")]
    except ValueError:
        probs = []
    total = sum(probs)
    if len(probs) < 2 or any(not (p >= 0) for p in probs) or abs(total - 1.0) > 1e-3:
        raise ConfigError(
            f"--spec-accepted-histogram {text!r}: give the chances of accepting 0, 1, ... k drafts, "
            "numbers >= 0 that sum to 1, e.g. 0.3,0.4,0.3"
        )
    return tuple(p / total for p in probs)


def bench_mean(path: str, drafts: int) -> float:
    """The mean accepted length `benchmarks/bench_spec.py --json` measured with `drafts` steps:
    the mean of its rows' `accepted_length` at that `steps`, over their concurrencies."""
    doc = read_json(path, "--spec-from")
    rows = doc.get("results") if isinstance(doc, dict) else None
    if not isinstance(rows, list):
        raise ConfigError(f"--spec-from {path}: no 'results' list (a benchmarks/bench_spec.py --json file)")
    got = [r["accepted_length"] for r in rows if isinstance(r, dict) and r.get("steps") == drafts]
    got = [x for x in got if isinstance(x, int | float)]
    if not got:
        have = sorted({r.get("steps") for r in rows if isinstance(r, dict) and r.get("accepted_length")})
        raise ConfigError(f"--spec-from {path}: no accepted length measured at {drafts} steps (has {have})")
    return sum(got) / len(got)


def from_flags(
    drafts: int | None, mean: float | None, histogram: str | None, bench: str | None, seed: int, fraction: float
) -> SpecDecoding | None:
    """The SpecDecoding the flags of `afd plan simulate` ask for (None: off)."""
    given = [x for x in (mean, histogram, bench) if x is not None]
    if len(given) > 1:
        raise ConfigError("give one of --spec-accepted-length, --spec-accepted-histogram and --spec-from")
    if not given:
        if drafts:
            raise ConfigError(
                "--spec-drafts needs the acceptance: --spec-accepted-length MEAN, "
                "--spec-accepted-histogram P0,P1,... or --spec-from BENCH_SPEC_JSON"
            )
        return None
    if histogram is not None:
        probs = parse_histogram(histogram)
        if drafts is not None and drafts != len(probs) - 1:
            raise ConfigError(
                f"--spec-accepted-histogram has {len(probs)} entries (0..{len(probs) - 1} drafts) "
                f"but --spec-drafts is {drafts}"
            )
        source = f"histogram {histogram}"
    else:
        if not drafts:
            raise ConfigError("--spec-accepted-length and --spec-from need --spec-drafts K (drafts per verify)")
        if bench is not None:
            mean = bench_mean(bench, drafts)
            source = f"{bench}: mean accepted length {mean:.3f} at {drafts} steps, truncated geometric"
        else:
            source = f"mean accepted length {mean:g}, truncated geometric"
        probs = geometric_probs(mean, drafts)
    spec = SpecDecoding(probs, fraction, seed, source)
    spec.validate("speculative decoding")
    return spec


def draft_time(
    model: StepTimeModel, spec: SpecDecoding, loads: Sequence[Load], chain: Sequence[Load], step: tuple
) -> tuple[float, tuple[float, ...]]:
    """Seconds and busy seconds per role of the MTP module's passes after a step: one over the
    step's `loads` (whose own step time is `step`), drafts - 1 over the `chain` loads (one row per
    drafting request; empty: none drafting)."""
    passes = getattr(model, "draft_pass", None)
    if passes is not None:
        seconds, busy = passes(loads)
    else:
        seconds, busy = step[0] * spec.draft_fraction, tuple(b * spec.draft_fraction for b in step[1])
    if chain and spec.drafts > 1:
        c_s, c_b = passes(chain) if passes is not None else model.step(chain)
        k = (spec.drafts - 1) * (1.0 if passes is not None else spec.draft_fraction)
        seconds += k * c_s
        busy = tuple(b + k * c for b, c in zip(busy, c_b))
    return seconds, busy
