"""A step-time model fitted to this engine's own steps (`afd plan simulate --step-calibration FILE`).

`afd serve|generate ... --record-steps PATH` writes one JSON line per forward step of each rank:
its load as the simulator counts it (tokens, sequences, KV positions its decodes read, query-key
pairs of its prefill chunks), what the CPU attention computes once it pads (the chunks' pairs
padded to the longest chunk and context, the decodes' positions padded to the longest context),
and the monotonic start `t0` and end `t1` of the forward. `fit_records` turns them into (load,
seconds) rows and fits

    step_s = c0 + c1 * tokens + c2 * seqs + c3 * kv_positions + c4 * pairs
                 + c5 * padded_pairs + c6 * padded_positions + c7 * instance_tokens
                 + c8 * [the step prefills] + c9 * padded_pairs^2 + c10 * other_busy_ranks
                 + c11 * [another instance was computing when the step started]
                 + c12 * (micro_batches - 1) + c13 * [the step follows a prefill step]
                 + c14 * [requests from a prefill instance joined the step]
                 + c15 * requests_left (since the instance's previous step)
                 + c16 * tokens * [another instance was computing when the step started]

by non-negative least squares, each row weighted by seconds^-power: power 0 fits the absolute error
(the long prefill steps dominate), power 1 the relative error (3 ms decode steps count as much as 1
s prefill steps). `balanced_fit` picks the power whose fit gets the busy time of every kind of step
closest: decode-only steps and steps that prefill few, some or many tokens (a fit that misses the
short prefill steps of a burst's first request changes how the rest of the burst is batched). The
square term is there because the padded attention's score tensors outgrow the caches: fitted
linearly on steps of up to 8M padded pairs, a step of 13M took 2.1 s where the fit said 1.6 s. A
step's seconds run from the start of the engine's round that made it (the record's `ts`, once the
requests it had received were in) to the start of the next round, or, before an idle gap, to its
forward's end plus the usual tail of its kind (`step_spans`): what a simulated step lasts, from the
moment it takes its requests to the moment the next can. Records without `ts` count the forward
plus the gap since the previous forward ended when that gap is short, only the forward after an
idle gap (which left out the scheduling of a step that woke the engine: 0.5-0.7 ms here). For a
deployment of several attention ranks the i-th records of the ranks are the same lockstep step:
the step spans from its first rank's round start to its last rank's end, its load each term's
largest over the ranks (a rank that prefills makes the step a prefill step even when another has more tokens), and
`instance_tokens` the tokens of all its ranks (colocated ranks each run their experts for every
rank's tokens; for one rank it equals `tokens`), and `other_busy_ranks` how many ranks besides one
had tokens (on this 2-core machine a dp2 decode step with both ranks busy took 4.5 ms where a fit
without the term said 2.8; a calibration where one rank never works cannot price it: its
coefficient stays 0). `peer_busy` is 1 where another instance of the deployment was in a step
(as counted here: from the end of its previous forward when the gap was short) when the step's
forward started (`step_rows`' `peers`): instances that share CPUs slow each other (on this
2-core machine a PD decode step took 0.4-0.5 ms longer, about 40%, while the prefill instance
computed); instances on their own hardware fit it to 0. `peer_tokens` is the step's tokens where
`peer_busy` is 1: sharing the cores slows a step's work, not only its start (on this machine a PD
decode step of 1 sequence took 1.5 ms more while the prefill instance computed, one of 6-8 took
2.1-2.7 ms more; the fit of the 2026-11-29 14:12 UTC calibration runs put 1.15 ms on the flag and
0.125 ms on each token, against 0.18 ms a token alone, and 0.018 ms a token, against 0.06, on the
prefill instance's steps while the decode instance computed). `FittedStepTime` reads a simulated step the
same way. `extra_micro_batches` is the step's micro-batches with tokens beyond the first (the
record's `micro_batches`): an AFD attention rank splits its sequences into up to three that
pipeline through the FFN ranks, and on this machine a decode step took 1.9, 3.0 and 4.0 ms at 1,
2 and 3 sequences, then only 0.1-0.2 ms more per sequence up to 16 (5.5 ms), where the other terms
alone priced 16 at 9.3 ms; a simulated step has min(sequences, the most the fitted steps ran)
micro-batches. `after_prefill` is 1 for a step that follows a prefill step of the instance without
an idle gap: the gap before it, counted in its seconds, holds the prefilled requests' first tokens
(on this machine such a decode step took 1.3 ms longer than the other terms said in single mode,
2.1 ms under AFD). `joined` is 1 for a step of a PD decode instance whose round took in requests
from the prefill instance (the record's `joins`: their KV pages and first tokens, handed on with the
step's outputs): on this machine such a step took 1.3-1.7 ms longer than a fit without the term
said, in three sets of runs, about as much for one request as for four. `requests_left` counts the
requests that left the instance's ranks since its previous step (finished, failed, or prefilled and
handed to a decode instance: the record's `left`): on this machine a decode step after one request
finished took 0.4-0.7 ms longer than the other terms said with data-parallel, AFD or PD ranks, the
one after two 0.6-1.8 ms (its forward, not the scheduling around it, grew), 0.1-0.3 ms in single
mode. A fit keeps its steps' measured / predicted times too (`ratio_bins`: the means of 100
equal bins of them, sorted), from which `FittedStepTime` can draw each simulated step's time
around the fit.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from afd_engine.errors import ConfigError
from afd_engine.planner.files import read_json
from afd_engine.planner.sim.front_end import equal_bins

TERMS = (
    "fixed",
    "tokens",
    "seqs",
    "kv_positions",
    "pairs",
    "padded_pairs",
    "padded_positions",
    "instance_tokens",
    "prefill_step",
    "padded_pairs_sq",
    "other_busy_ranks",
    "peer_busy",
    "extra_micro_batches",
    "after_prefill",
    "joined",
    "requests_left",
    "peer_tokens",
)
# calibrations written before the later terms (which count 0 there): the first five, nine, ..., sixteen
OLD_TERMS = (TERMS[:5], TERMS[:9], TERMS[:10], TERMS[:11], TERMS[:12], TERMS[:14], TERMS[:16])
# a fit row: these load terms, then busy ranks, peer_busy, micro-batches, after_prefill, joined,
# requests left
LOAD_TERMS = TERMS.index("instance_tokens")
ROW_WIDTH = LOAD_TERMS + 6
RANK_TERMS = LOAD_TERMS - 1  # what a simulated rank's load gives (the instance's tokens come from all)
PADDED_PAIRS = TERMS.index("padded_pairs") - 1  # its place in a load
PREFILL, SQUARE = TERMS.index("prefill_step"), TERMS.index("padded_pairs_sq")
# the terms from other_busy_ranks on, in order
OTHER_BUSY, PEER_BUSY, MICRO, AFTER, JOINED, LEFT, PEER_TOKENS = range(TERMS.index("other_busy_ranks"), len(TERMS))
RECORD_FIELDS = ("step", "tokens", "seqs", "kv", "pairs", "t0", "t1")
PADDED_FIELDS = ("ext_pad", "dec_pad")
# absent from older recordings: these
LATER_FIELDS = {"ext_pad": 0, "dec_pad": 0, "micro_batches": 1, "ts": math.nan, "joins": 0, "left": 0}
GAP_CAP_S = 0.02  # a longer gap between two forwards is idle time, not part of the step
# the kinds of step `balanced_fit` weighs: decode-only, then prefilling up to 32, up to 256, more tokens
PREFILL_KIND_TOKENS = (32, 256)
KINDS = ("decode", "prefill<=32", "prefill<=256", "prefill>256")
BALANCE_POWERS = (0.0, 0.25, 0.5, 0.75, 1.0)
MIN_KIND_STEPS = 10  # a kind with fewer steps is not weighed
RATIO_BINS = 100  # the fitted steps' measured / predicted times kept as the means of this many equal bins


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a few columns: the best unconstrained fit over every subset
    of columns whose solution is non-negative (exact, and cheap for 10 terms). The columns are
    solved at unit norm (a square term is some 1e14 where the fixed one is 1), the coefficients
    given back in the columns' own units."""
    n = x.shape[1]
    norms = np.linalg.norm(x, axis=0)
    live = [j for j in range(n) if norms[j] > 0]  # an all-zero column gets 0
    norms[norms == 0] = 1.0
    x = x / norms
    best, best_err = np.zeros(n), float(np.sum(y * y))
    for k in range(1, len(live) + 1):
        for cols in itertools.combinations(live, k):
            sub = x[:, cols]
            coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(coef < 0):
                continue
            err = float(np.sum((sub @ coef - y) ** 2))
            if err < best_err - 1e-18 * max(1.0, best_err):
                full = np.zeros(n)
                full[list(cols)] = coef
                best, best_err = full, err
    return best / norms


def design(loads: Sequence[Sequence[float]]) -> np.ndarray:
    """Rows (1, tokens, seqs, kv_positions, pairs, padded_pairs, padded_positions, instance_tokens,
    prefill_step, padded_pairs_sq, other_busy_ranks, peer_busy, extra_micro_batches, after_prefill,
    joined, requests_left, peer_tokens) of the loads, each (tokens, seqs, kv, pairs, padded_pairs,
    padded_positions, instance_tokens, busy_ranks, peer_busy, micro_batches, after_prefill, joined,
    requests_left): a load of four has no padded terms (0), one without instance_tokens is an
    instance of one rank (its tokens, one busy rank), one without the later flags has no peer
    computing, one micro-batch, no prefill step before, no requests joining and none left;
    prefill_step is 1 where pairs > 0, peer_tokens the tokens where peer_busy is 1."""
    a = np.asarray(loads, dtype=float)
    a = a.reshape(len(loads), -1) if len(loads) else a.reshape(0, ROW_WIDTH)
    width = a.shape[1]
    a = np.pad(a, ((0, 0), (0, ROW_WIDTH - width)))
    if width < LOAD_TERMS:
        a[:, RANK_TERMS] = a[:, 0]
    if width <= LOAD_TERMS:
        a[:, LOAD_TERMS] = 1.0
    padded = a[:, PADDED_PAIRS : PADDED_PAIRS + 1]
    prefill = (a[:, 3:4] > 0).astype(float)
    others = a[:, LOAD_TERMS : LOAD_TERMS + 1] - 1.0
    peer = a[:, LOAD_TERMS + 1 : LOAD_TERMS + 2]
    extra = np.maximum(a[:, LOAD_TERMS + 2 : LOAD_TERMS + 3] - 1.0, 0.0)  # 0 where absent
    after = a[:, LOAD_TERMS + 3 : LOAD_TERMS + 4]
    joined = (a[:, LOAD_TERMS + 4 : LOAD_TERMS + 5] > 0).astype(float)
    left = a[:, LOAD_TERMS + 5 : LOAD_TERMS + 6]
    ones = np.ones((a.shape[0], 1))
    peer_tokens = (peer > 0) * a[:, :1]
    return np.hstack(
        [ones, a[:, :LOAD_TERMS], prefill, padded * padded, others, peer, extra, after, joined, left, peer_tokens]
    )


@dataclass(frozen=True)
class StepCalibration:
    """Coefficients of `TERMS` (seconds, seconds per token, ...), with what they were fitted on."""

    coef: tuple[float, ...]
    source: str = ""
    steps: int = 0
    rms_s: float = 0.0
    power: float = 1.0  # rows weighted by seconds^-power in the fit
    median_rel_error: float = 0.0  # the fit's residual: median |predicted - measured| / measured
    kind_scale: tuple[float, ...] = ()  # per kind of step (KINDS), a factor on the line (none: 1)
    ratio_bins: tuple[float, ...] = ()  # measured / predicted over the fitted steps (none: not known)
    micro_batches: int = 1  # the most a fitted step ran in

    def __post_init__(self) -> None:  # fewer coefficients: from before the later terms, which count 0
        if len(self.coef) < len(TERMS):
            object.__setattr__(self, "coef", (*self.coef, *(0.0,) * (len(TERMS) - len(self.coef))))

    def seconds(
        self,
        load: Sequence[float],
        instance_tokens: float | None = None,
        busy_ranks: int = 1,
        peer_busy: bool = False,
        micro_batches: int = 1,
        after_prefill: bool = False,
        joined: bool = False,
        left: int = 0,
    ) -> float:
        """The step time of a load: a fit row, or a rank's load with its instance's tokens, busy
        ranks, whether a peer instance computes, its micro-batches, whether the instance's previous
        step prefilled, whether requests from a prefill instance joined it and how many requests
        left the instance since its previous step apart."""
        c = self.coef
        t = c[0] + sum(k * v for k, v in zip(c[1 : RANK_TERMS + 1], load[:RANK_TERMS]))
        if instance_tokens is None:  # a fit row: its later fields where it has them, else their defaults
            instance_tokens = load[RANK_TERMS] if len(load) > RANK_TERMS else load[0]
            absent = (busy_ranks, 0, 1, 0, 0, 0)[max(len(load) - LOAD_TERMS, 0) :]
            busy_ranks, peer, micro_batches, after, join, left = (*load[LOAD_TERMS:ROW_WIDTH], *absent)
            peer_busy, after_prefill, joined = peer > 0, after > 0, join > 0
        padded = load[PADDED_PAIRS] if len(load) > PADDED_PAIRS else 0.0
        t += c[LOAD_TERMS] * instance_tokens + (c[PREFILL] if load[3] > 0 else 0.0) + c[SQUARE] * padded * padded
        t += c[OTHER_BUSY] * (busy_ranks - 1) + ((c[PEER_BUSY] + c[PEER_TOKENS] * load[0]) if peer_busy else 0.0)
        t += c[MICRO] * max(micro_batches - 1, 0) + (c[AFTER] if after_prefill else 0.0)
        t += (c[JOINED] if joined else 0.0) + c[LEFT] * left
        if self.kind_scale:
            t *= self.kind_scale[0 if load[3] <= 0 else 1 + bisect.bisect_left(PREFILL_KIND_TOKENS, load[0])]
        return t

    def as_dict(self) -> dict:
        return {
            "model": "step_s = "
            + " + ".join(f"c_{t}*{t}" if t != "fixed" else "c_fixed" for t in TERMS)
            + " (padded_pairs_sq = padded_pairs^2)",
            "coef": dict(zip(TERMS, self.coef)),
            "source": self.source,
            "steps": self.steps,
            "rms_s": self.rms_s,
            "median_rel_error": self.median_rel_error,
            "weight_power": self.power,
            "kind_scale": dict(zip(KINDS, self.kind_scale or (1.0,) * len(KINDS))),
            "ratio_bins": list(self.ratio_bins),
            "micro_batches": self.micro_batches,
        }

    def draw(self, u: float) -> float:
        """A measured / predicted ratio of the fitted steps for `u` uniform in [0, 1): the mean of
        the ratios in one of `ratio_bins`' equal bins, each as likely (1 where they are not known).
        A step's time drawn around the fit is the fit's times it; the bins keep the ratios' mean
        and, in the top bin, their rare long steps."""
        bins = self.ratio_bins
        return bins[min(int(u * len(bins)), len(bins) - 1)] if bins else 1.0

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.as_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> StepCalibration:
        where = f"--step-calibration {path}"
        d = read_json(path, "--step-calibration")
        coef = d.get("coef") if isinstance(d, dict) else None
        if not isinstance(coef, dict) or set(coef) not in [set(TERMS), *map(set, OLD_TERMS)]:
            raise ConfigError(f'{where}: expected {{"coef": {{...}}}} with exactly the keys {", ".join(TERMS)}')
        values = tuple(coef.get(t, 0.0) for t in TERMS)
        if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in values):
            raise ConfigError(f"{where}: every coefficient must be a finite number")
        if any(v < 0 for v in values):
            raise ConfigError(f"{where}: every coefficient must be >= 0 (a step cannot take negative time)")
        if not any(values):
            raise ConfigError(f"{where}: all coefficients are 0 (every step would take no time)")
        scale = d.get("kind_scale", dict.fromkeys(KINDS, 1.0))  # files from before it: 1
        if not isinstance(scale, dict) or set(scale) != set(KINDS):
            raise ConfigError(f'{where}: "kind_scale" must have exactly the keys {", ".join(KINDS)}')
        factors = tuple(scale[k] for k in KINDS)
        if not all(isinstance(v, int | float) and not isinstance(v, bool) and 0 < v < math.inf for v in factors):
            raise ConfigError(f"{where}: every kind_scale factor must be a finite number > 0")
        bins = d.get("ratio_bins", [])  # files from before them: none
        if not (
            isinstance(bins, list)
            and all(isinstance(v, int | float) and not isinstance(v, bool) and 0 < v < math.inf for v in bins)
            and all(a <= b for a, b in zip(bins, bins[1:]))
        ):
            raise ConfigError(f'{where}: "ratio_bins" must be a list of finite numbers > 0 in rising order')
        micro = d.get("micro_batches", 1)  # files from before it: 1
        if not isinstance(micro, int) or isinstance(micro, bool) or micro < 1:
            raise ConfigError(f'{where}: "micro_batches" must be an integer >= 1')
        extra = (str(d.get("source", "")), int(d.get("steps", 0)), float(d.get("rms_s", 0.0)))
        power, rel = float(d.get("weight_power", 1.0)), float(d.get("median_rel_error", 0.0))
        return cls(values, *extra, power, rel, tuple(float(v) for v in factors), tuple(map(float, bins)), micro)


def fit(
    loads: Sequence[Sequence[float]], seconds: Sequence[float], source: str = "", power: float = 1.0
) -> StepCalibration:
    """The non-negative least-squares fit of step seconds to the loads, rows weighted by
    seconds^-power (0: absolute error, 1: relative error)."""
    x, y = design(loads), np.asarray(seconds, dtype=float)
    if len(y) < len(TERMS):
        raise ConfigError(f"need at least {len(TERMS)} steps to fit {len(TERMS)} coefficients (got {len(y)})")
    if power and np.any(y <= 0):
        raise ConfigError("a weighted fit needs every step's seconds > 0")
    w = y**-power if power else np.ones_like(y)
    coef = nnls(x * w[:, None], y * w)
    pred = x @ coef
    rms = float(np.sqrt(np.mean((pred - y) ** 2)))
    rel = float(np.median(np.abs(pred - y) / y)) if np.all(y > 0) else float("nan")
    micro = 1 + int(x[:, MICRO].max(initial=0.0))
    return StepCalibration(tuple(float(c) for c in coef), source, len(y), rms, power, rel, micro_batches=micro)


def step_kinds(loads: Sequence[Sequence[float]]) -> np.ndarray:
    """Each load's index in KINDS: decode-only (no query-key pairs), else by its tokens."""
    return _kinds(design(loads))


def _kinds(x: np.ndarray) -> np.ndarray:
    """`step_kinds` of the rows of a `design`."""
    return np.where(x[:, PREFILL] > 0, 1 + np.searchsorted(np.array(PREFILL_KIND_TOKENS), x[:, 1], side="left"), 0)


def _predicted(coef: Sequence[float], x: np.ndarray, kinds: np.ndarray, scale: Sequence[float] = ()) -> np.ndarray:
    """The seconds of the rows of a `design`, each times its kind's `scale` factor (none: 1)."""
    pred = x @ np.asarray(coef)
    return pred * np.asarray(scale)[kinds] if scale else pred


def _kind_ratios(
    coef: Sequence[float], x: np.ndarray, kinds: np.ndarray, secs: np.ndarray, scale: Sequence[float] = ()
) -> dict:
    pred = _predicted(coef, x, kinds, scale)
    out = {}
    for k, name in enumerate(KINDS):
        m = kinds == k
        if m.sum() >= MIN_KIND_STEPS and secs[m].sum() > 0:
            out[name] = float(pred[m].sum() / secs[m].sum())
    return out


def kind_ratios(cal: StepCalibration, loads: Sequence[Sequence[float]], seconds: Sequence[float]) -> dict:
    """Predicted over measured busy seconds per kind of step (KINDS with at least MIN_KIND_STEPS)."""
    x = design(loads)
    return _kind_ratios(cal.coef, x, _kinds(x), np.asarray(seconds, dtype=float), cal.kind_scale)


def balanced_fit(
    loads: Sequence[Sequence[float]],
    seconds: Sequence[float],
    source: str = "",
    powers: Sequence[float] = BALANCE_POWERS,
) -> StepCalibration:
    """Of the fits weighted by seconds^-power for each of `powers`, the one whose worst kind of
    step (`kind_ratios`) has its busy time closest to measured (|log ratio|; ties: the first);
    then each kind of step scaled so that its busy time is the measured (`kind_scale`: a fit that
    weighs relative errors comes out low, by about 5% on this engine's steps, in every kind), and
    the steps' measured / predicted times kept (`ratio_bins`, for drawing step times around the
    fit: `FittedStepTime`'s rng)."""
    x, secs = design(loads), np.asarray(seconds, dtype=float)
    kinds = _kinds(x)

    def worst(cal: StepCalibration) -> float:
        ratios = _kind_ratios(cal.coef, x, kinds, secs).values()
        return max((abs(math.log(r)) if r > 0 else math.inf for r in ratios), default=0.0)

    best = min((fit(loads, seconds, source, p) for p in powers), key=worst)
    ratios = _kind_ratios(best.coef, x, kinds, secs)
    scale = tuple(1.0 / ratios[k] if ratios.get(k, 0) > 0 else 1.0 for k in KINDS)
    predicted = _predicted(best.coef, x, kinds, scale)
    ok = predicted > 0
    ratios = secs[ok] / predicted[ok]
    return replace(best, kind_scale=scale, ratio_bins=equal_bins(ratios, RATIO_BINS))


def speed_matched(
    runs: Sequence[tuple[Sequence[Sequence[float]], Sequence[float]]],
) -> tuple[list, list, tuple[float, ...]]:
    """The steps (loads, seconds) of several runs of one instance, each later run's seconds divided
    by its speed against the first, and those speeds (the first's: 1). A run's speed is its measured
    over predicted busy time, by the first run's `balanced_fit`, on its steps with as many busy ranks
    as some step of the first run had (what that fit has seen; 1 where it has no such step). A later
    run that adds a kind of step the first lacks (a dp2 run whose router keeps both ranks busy)
    then prices that kind at the first run's speed, not its own: on this machine a dp2 run with a
    round-robin router took 6-14% longer than a cache-aware run's fit priced its steps in three
    sets of runs (a one-sequence decode step 1.78-2.06 ms against 1.63-1.87), 2% less and 1% more
    in the two after."""
    loads = [list(ld) for ld, _ in runs]
    secs = [np.asarray(s, dtype=float) for _, s in runs]
    if len(runs) == 1:  # nothing to match: no fit
        return loads[0], [float(v) for v in secs[0]], (1.0,)
    first = balanced_fit(loads[0], secs[0])
    seen = set(design(loads[0])[:, OTHER_BUSY].tolist())
    speeds = [1.0]
    for ld, s in zip(loads[1:], secs[1:]):
        x = design(ld)
        m = np.isin(x[:, OTHER_BUSY], list(seen))
        pred = _predicted(first.coef, x[m], _kinds(x[m]), first.kind_scale)
        speeds.append(float(s[m].sum() / pred.sum()) if m.any() and pred.sum() > 0 else 1.0)
    out_loads = [row for ld in loads for row in ld]
    out_secs = [float(v) for s, f in zip(secs, speeds) for v in s / f]
    return out_loads, out_secs, tuple(speeds)


def read_records(path: str | Path) -> list[dict]:
    """The records of one `--record-steps` file, checked."""
    out = []
    for no, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            row = {k: float(rec[k]) for k in RECORD_FIELDS}
            out.append(row | {k: float(rec.get(k, default)) for k, default in LATER_FIELDS.items()})
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{path}:{no}: expected a step record with {', '.join(RECORD_FIELDS)} ({exc})") from None
    return out


def step_spans(
    t0: np.ndarray, t1: np.ndarray, ts: np.ndarray | None = None, prefilled: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Where each of a run's consecutive forwards [t0, t1) begins and ends as a step.

    With the rounds' starts `ts` (the records' `ts`: when the engine began the step's round, the
    requests it had received in), a step lasts from its round's start to the next round's, when
    that begins within GAP_CAP_S of its forward's end; before an idle gap, to its forward's end
    plus the median such tail of the steps of its kind (`prefilled` or not). A request
    that reaches the engine during a step waits for the next round, as in the simulation. Without
    them (older records), a step begins at the previous forward's end when the gap was short (the
    scheduling between forwards), else at its own start, and ends with its forward."""
    if ts is None or not np.all(np.isfinite(ts)):
        start = t0.copy()
        gap = t0[1:] - t1[:-1]
        start[1:] = np.where((gap >= 0) & (gap < GAP_CAP_S), t1[:-1], t0[1:])
        return start, t1.copy()
    start = np.minimum(ts, t0)
    tail = np.full(len(t1), np.nan)
    tail[:-1] = start[1:] - t1[:-1]
    joined = (tail >= 0) & (tail < GAP_CAP_S)  # (NaN: the last step)
    kind = np.zeros(len(t1), dtype=bool) if prefilled is None else np.asarray(prefilled, dtype=bool)
    end = t1.copy()
    end[:-1] = np.where(joined[:-1], start[1:], t1[:-1])
    for k in (False, True):
        usual = np.median(tail[joined & (kind == k)]) if np.any(joined & (kind == k)) else 0.0
        end[~joined & (kind == k)] += usual
    return start, end


def computing_at(ranks: Sequence[Sequence[dict]], times: np.ndarray) -> np.ndarray:
    """Whether one of these ranks (one instance's records, each rank's in step order) was in a step
    (`step_spans`) at each of `times`."""
    out = np.zeros(len(times), dtype=bool)
    for recs in ranks:
        start, end = step_spans(
            *(np.array([r.get(k, math.nan) for r in recs]) for k in ("t0", "t1", "ts")),
            np.array([r["pairs"] > 0 for r in recs]),
        )
        k = np.searchsorted(start, times, side="right") - 1
        out |= (k >= 0) & (times < end[np.maximum(k, 0)])
    return out


def step_rows(
    ranks: Sequence[Sequence[dict]], skip: int = 1, peers: Sequence[Sequence[Sequence[dict]]] = ()
) -> tuple[list[tuple], list[float]]:
    """(loads, seconds) of the lockstep steps of one run, from each rank's records (in step order);
    the first `skip` steps (warm-up) are left out. A step's span is `step_spans`' over the start of
    its round on its last rank (a lockstep step waits for every rank), its first rank's forward
    start and its last rank's forward end. `peers`: the records of
    the deployment's other instances (each its ranks'), on the same clock: a step's peer_busy is
    whether one of them was in a step as its forward started. Its micro-batches are the most of one
    rank; after_prefill whether the previous step prefilled on some rank and this one followed it
    (no idle gap between them); joined whether requests from a prefill instance joined it on some
    rank; its requests left the sum of the ranks' (those that left each since its previous step)."""
    n = min(len(r) for r in ranks)
    t0 = np.array([min(r[i]["t0"] for r in ranks) for i in range(n)])
    t1 = np.array([max(r[i]["t1"] for r in ranks) for i in range(n)])
    ts = np.array([max(r[i].get("ts", math.nan) for r in ranks) for i in range(n)])
    prefilled = np.array([max(r[i]["pairs"] for r in ranks) > 0 for i in range(n)], dtype=bool)
    starts, ends = step_spans(t0, t1, ts, prefilled)
    secs = ends - starts
    after = np.zeros(n, dtype=bool)
    after[1:] = prefilled[:-1] & (starts[1:] == ends[:-1])
    peer = np.zeros(n, dtype=bool)
    for inst in peers:
        peer |= computing_at(inst, t0)
    loads, seconds = [], []
    for i in range(n):
        recs = [r[i] for r in ranks]
        if i < skip or max(x["tokens"] for x in recs) <= 0:
            continue
        row = tuple(max(x[k] for x in recs) for k in ("tokens", "seqs", "kv", "pairs", *PADDED_FIELDS))
        busy = sum(1 for x in recs if x["tokens"] > 0)
        micro = max(x.get("micro_batches", 1.0) for x in recs)
        joined = float(max(x["joins"] for x in recs) > 0)
        context = (float(peer[i]), micro, float(after[i]), joined, sum(x["left"] for x in recs))
        loads.append((*row, sum(x["tokens"] for x in recs), busy, *context))
        seconds.append(float(secs[i]))
    return loads, seconds


def fit_records(runs: Iterable[Sequence[str | Path]], source: str = "", power: float = 1.0) -> StepCalibration:
    """The fit over several runs, each the `--record-steps` files of its ranks."""
    loads: list[tuple] = []
    seconds: list[float] = []
    for files in runs:
        ld, s = step_rows([read_records(f) for f in files])
        loads += ld
        seconds += s
    return fit(loads, seconds, source, power)


class FittedStepTime:
    """A StepTimeModel from a `StepCalibration`: a lockstep step's time from each load term's largest
    over its ranks and the tokens of all of them (as `step_rows` reads the engine's steps); every
    role is busy for the whole step. `peer_busy`: another instance is computing as the step starts;
    `after_prefill`: the instance's previous step prefilled; `joined`: requests from a prefill
    instance joined the step; `left`: requests that left the instance since its previous step.
    With `rng`, each step's time is the fit's times a measured / predicted ratio of the fitted steps
    drawn at random (`StepCalibration.draw`): a simulation with the engine's step-to-step spread
    (without `rng`, or for a calibration without its ratios, every step takes the fit's time)."""

    padded_loads = True  # the simulated ranks add the padded terms to their loads
    prices_context = True  # the simulation says whether another instance computes, whether the
    # instance's previous step prefilled, whether requests joined it and how many left before it
    # (loop.Group.start)

    def __init__(
        self, cal: StepCalibration, roles: tuple[str, ...] = ("gpu",), rng: np.random.Generator | None = None
    ) -> None:
        self.cal, self.roles, self.rng = cal, roles, rng

    def step(
        self,
        loads: Sequence[Sequence[float]],
        peer_busy: bool = False,
        after_prefill: bool = False,
        joined: bool = False,
        left: int = 0,
    ) -> tuple[float, tuple[float, ...]]:
        total = sum(ld[0] for ld in loads)
        worst = loads[0] if len(loads) == 1 else tuple(map(max, *loads))  # as step_rows reads a lockstep step
        micro = min(int(worst[1]), self.cal.micro_batches)  # a rank splits its sequences, up to the fit's most
        busy = sum(1 for ld in loads if ld[0] > 0)
        seconds = self.cal.seconds(worst, total, busy, peer_busy, micro, after_prefill, joined, left)
        if self.rng is not None:
            seconds *= self.cal.draw(self.rng.random())
        return seconds, (seconds,) * len(self.roles)
