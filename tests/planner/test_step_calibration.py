"""The step time fitted to the engine's recorded steps (planner/step_calibration.py), its
`afd plan simulate --step-calibration` flag, and the engine's `--record-steps` writer."""

from __future__ import annotations

import json

import numpy as np
import pytest

from afd_engine.cli import main
from afd_engine.errors import ConfigError
from afd_engine.planner.step_calibration import (
    KINDS,
    LATER_FIELDS,
    RECORD_FIELDS,
    TERMS,
    FittedStepTime,
    StepCalibration,
    balanced_fit,
    computing_at,
    fit,
    fit_records,
    kind_ratios,
    nnls,
    read_records,
    speed_matched,
    step_kinds,
    step_rows,
    step_spans,
)

AFTER_AT = 10  # after_prefill's place in a step_rows load

COEF = (0.004, 3e-5, 2e-4, 1e-7, 5e-9, 2e-9, 3e-8, 1e-5, 0.003, 4e-17, 7e-4, 4e-4, 9e-4, 1.1e-3, 1.6e-3, 5e-4, 6e-6)


def synthetic(n: int = 200, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    loads = np.column_stack(
        [
            rng.integers(1, 2048, n),
            rng.integers(1, 64, n),
            rng.integers(0, 50_000, n),
            rng.integers(0, 2_000_000, n) * (rng.random(n) < 0.5),  # half the steps decode only
            rng.integers(0, 4_000_000, n),
            rng.integers(0, 80_000, n),
        ]
    ).astype(float)
    # the instance's tokens, its busy ranks, whether another instance was computing, the micro-batches,
    # whether the step before prefilled, the requests that joined from a prefill instance (priced
    # once, however many) and the requests that left before the step (priced each); the step's
    # tokens are priced again while another instance computes (peer_tokens)
    extra = [rng.integers(1, 4, n), rng.integers(0, 2, n), rng.integers(1, 4, n), rng.integers(0, 2, n)]
    extra += [rng.integers(0, 2, n) * rng.integers(1, 4, n), rng.integers(0, 4, n)]
    loads = np.column_stack([loads, loads[:, 0] + rng.integers(0, 2048, n), *extra])
    seconds = COEF[0] + loads[:, :7] @ np.array(COEF[1:8]) + COEF[8] * (loads[:, 3] > 0)
    seconds += COEF[9] * loads[:, 4] ** 2 + COEF[10] * (loads[:, 7] - 1) + COEF[11] * loads[:, 8]
    seconds += COEF[12] * (loads[:, 9] - 1) + COEF[13] * loads[:, 10]
    seconds += COEF[14] * (loads[:, 11] > 0) + COEF[15] * loads[:, 12] + COEF[16] * loads[:, 8] * loads[:, 0]
    return loads, seconds


@pytest.mark.parametrize("power", [0.0, 0.25, 1.0])
def test_fit_recovers_known_coefficients(power):
    loads, seconds = synthetic()
    cal = fit(loads, seconds, "synthetic", power)
    assert cal.steps == 200 and cal.rms_s < 1e-12 and cal.power == power and cal.micro_batches == 3
    for got, want in zip(cal.coef, COEF):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-15)


def test_step_kinds():
    # decode-only (no pairs), then prefills of 32, 33 and 257 tokens (a load of four: tokens, seqs, kv, pairs)
    loads = [(5, 5, 200, 0), (32, 1, 0, 528), (33, 2, 40, 561), (257, 3, 0, 9000)]
    assert step_kinds(loads).tolist() == [0, 1, 2, 3]


def test_speed_matched_prices_a_later_run_at_the_first_runs_speed():
    """A dp2 calibration: the first run has one rank busy; the second (another router) runs the
    same loads 8% slower and adds steps with both ranks busy, 2 ms more than one. The second run's
    speed is measured on the steps the first has seen (one busy rank), its seconds divided by it,
    and the fit then prices the second rank at 2 ms, not 2.16."""
    rng = np.random.default_rng(2)

    def steps(n: int, busy: np.ndarray, speed: float) -> tuple[list, list]:
        seqs = rng.integers(1, 16, n)
        kv = seqs * rng.integers(50, 500, n)
        loads = [(s, s, k, 0, 0, k, s * b, b, 0, 1, 0) for s, k, b in zip(seqs, kv, busy)]
        secs = speed * (0.002 + 1.5e-4 * seqs + 1e-7 * kv + 0.002 * (busy - 1))
        return loads, secs.tolist()

    first = steps(300, np.ones(300, dtype=int), 1.0)
    second = steps(300, rng.integers(1, 3, 300), 1.08)
    loads, secs, speeds = speed_matched([first, second])
    assert speeds == pytest.approx((1.0, 1.08), rel=1e-9)
    assert loads == first[0] + second[0]
    assert secs == pytest.approx(first[1] + [s / 1.08 for s in second[1]], rel=1e-12)
    cal = balanced_fit(loads, secs)
    assert cal.coef[TERMS.index("other_busy_ranks")] == pytest.approx(0.002, rel=1e-6)
    # unmatched, the second rank is priced at the slower run's speed and one-busy steps in between
    plain = balanced_fit(first[0] + second[0], first[1] + second[1])
    assert plain.coef[TERMS.index("other_busy_ranks")] > 0.0021
    # one run, or a later run with no step of a kind the first has seen: speed 1
    assert speed_matched([first])[2] == (1.0,)
    both = [ld for ld in second[0] if ld[7] == 2], [s for ld, s in zip(*second) if ld[7] == 2]
    assert speed_matched([first, both])[2] == (1.0, 1.0)


def test_balanced_fit_gets_every_kind_of_step_closest():
    """Decode steps, short prefills with a cost of their own and long ones growing faster than the
    terms: weighting by absolute error (power 0) misses the short prefills by 8%, by relative error
    (power 1) the long ones by 3.6%; the balanced fit takes the weighting whose worst kind is closest."""
    rng = np.random.default_rng(1)
    loads, secs = [], []
    for s in rng.integers(1, 16, 400):
        loads.append((s, s, 40 * s, 0))
        secs.append(0.002 + 1e-4 * s)
    for t in rng.integers(8, 33, 30):
        loads.append((t, 1, 0, t * t / 2))
        secs.append(0.004 + 2e-5 * t)
    for t in rng.integers(300, 2048, 20):
        loads.append((t, 1, 0, t * t / 2))
        secs.append(1e-5 * t**1.5)

    def worst(cal):
        return max(abs(np.log(r)) for r in kind_ratios(cal, loads, secs).values())

    by_power = {p: worst(fit(loads, secs, "x", p)) for p in (0.0, 0.25, 0.5, 0.75, 1.0)}
    assert by_power[0.0] > np.log(1.07) and by_power[1.0] > np.log(1.03)
    best = balanced_fit(loads, secs, "x")
    assert best.power == min(by_power, key=by_power.get) == 0.75
    line = fit(loads, secs, "x", 0.75)
    assert worst(line) < np.log(1.011) and best.coef == line.coef
    # then each kind is scaled to its measured busy time; a kind without steps keeps its line
    raw = kind_ratios(line, loads, secs)
    assert set(raw) == {"decode", "prefill<=32", "prefill>256"}  # no medium steps
    assert best.kind_scale == pytest.approx((1 / raw["decode"], 1 / raw["prefill<=32"], 1.0, 1 / raw["prefill>256"]))
    assert all(r == pytest.approx(1.0, rel=1e-12) for r in kind_ratios(best, loads, secs).values())
    load = (300, 1, 0, 45_000)  # a long prefill step: its line times its kind's factor
    assert best.seconds(load) == pytest.approx(line.seconds(load) * best.kind_scale[3], rel=1e-12)
    # the steps' measured / predicted times, sorted, as the means of 100 equal bins (450 steps:
    # 50 bins of 5, then 50 of 4)
    ratios = np.sort(np.array(secs) / np.array([best.seconds(ld) for ld in loads]))
    want = [ratios[5 * i : 5 * i + 5].mean() for i in range(50)]
    want += [ratios[250 + 4 * i : 254 + 4 * i].mean() for i in range(50)]
    assert best.ratio_bins == pytest.approx(want, rel=1e-12)
    assert np.mean(best.ratio_bins) != pytest.approx(1.0, abs=1e-3)  # not all 1: this line misses steps


def test_a_drawn_step_time_is_the_fit_times_a_ratio_bin():
    cal = StepCalibration(COEF, ratio_bins=(0.5, 1.0, 2.0))
    assert [cal.draw(u) for u in (0.0, 0.33, 0.34, 0.66, 0.67, 0.999)] == [0.5, 0.5, 1.0, 1.0, 2.0, 2.0]
    assert StepCalibration(COEF).draw(0.9) == 1.0  # ratios not known: the fit's time
    loads = [(100, 4, 2000.0, 0.0)]
    fitted = FittedStepTime(cal).step(loads)[0]
    drawn = FittedStepTime(cal, rng=np.random.default_rng(7))
    us = np.random.default_rng(7).random(50)
    got = [drawn.step(loads)[0] for _ in us]
    assert got == pytest.approx([fitted * cal.draw(u) for u in us], rel=1e-12)
    assert {round(g / fitted, 9) for g in got} == {0.5, 1.0, 2.0}


def test_fit_is_non_negative():
    # y = 1 + 2 x1 - 0.5 x2: the best non-negative fit drops x2
    x = np.array([[1, 0, 0], [1, 1, 0], [1, 2, 1], [1, 3, 2], [1, 0, 3]], float)
    y = x @ np.array([1.0, 2.0, -0.5])
    coef = nnls(x, y)
    assert np.all(coef >= 0) and coef[2] == 0.0
    assert fit(*synthetic(17)).coef  # and too few steps is refused
    with pytest.raises(ConfigError, match="at least 17 steps"):
        fit([(1, 1, 0, 0)] * 16, [0.1] * 16)


def test_a_lockstep_step_costs_each_terms_largest_over_its_ranks():
    cal = StepCalibration(COEF)
    model = FittedStepTime(cal, ("attention", "ffn"))
    loads = [(100, 4, 2000.0, 0.0), (512, 1, 0.0, 131_328.0)]  # a decode rank and a prefilling one
    # (loads without padded terms: 0 there): 512 tokens, 4 sequences, 2000 positions, the pairs,
    # both ranks' 612 tokens (instance_tokens), the step prefills, and a second busy rank
    want = 0.004 + 512 * 3e-5 + 4 * 2e-4 + 2000 * 1e-7 + 131_328 * 5e-9 + 612 * 1e-5 + 0.003 + 7e-4
    seconds, busy = model.step(loads)
    assert seconds == pytest.approx(want, abs=1e-12)
    assert busy == (seconds, seconds)
    # another instance computes: its flag, and again per token of the step (the largest rank's 512)
    assert model.step(loads, peer_busy=True)[0] == pytest.approx(want + 4e-4 + 512 * 6e-6, abs=1e-12)
    assert model.step(loads, after_prefill=True)[0] == pytest.approx(want + 1.1e-3, abs=1e-12)  # after a prefill
    assert model.step(loads, joined=True)[0] == pytest.approx(want + 1.6e-3, abs=1e-12)  # requests joined from prefill
    assert model.step(loads, left=3)[0] == pytest.approx(want + 3 * 5e-4, abs=1e-12)  # three left before it
    # fitted on steps of up to 3 micro-batches: 4 sequences run in 3 (2 beyond the first), 1 in 1
    split = FittedStepTime(StepCalibration(COEF, micro_batches=3))
    assert split.step(loads)[0] == pytest.approx(want + 2 * 9e-4, abs=1e-12)
    alone = 0.004 + 100 * 3e-5 + 4 * 2e-4 + 2000 * 1e-7 + 100 * 1e-5  # one rank: its own load
    assert split.step([(1, 1, 20.0, 0.0)])[0] == model.step([(1, 1, 20.0, 0.0)])[0]
    alone = 0.004 + 100 * 3e-5 + 4 * 2e-4 + 2000 * 1e-7 + 100 * 1e-5  # one rank: its own load
    assert model.step(loads[:1])[0] == pytest.approx(alone, abs=1e-12)


def _write_steps(path, rows):
    """Records without the padded fields, as recordings made before them (those count 0)."""
    path.write_text("".join(json.dumps(dict(zip(RECORD_FIELDS, r))) + "\n" for r in rows))
    return str(path)


def test_step_rows_join_lockstep_ranks(tmp_path):
    # (step, tokens, seqs, kv, pairs, t0, t1); step 0 is warm-up
    a = _write_steps(
        tmp_path / "a0", [(0, 5, 1, 0, 15, 0.0, 0.5), (1, 10, 2, 40, 0, 0.501, 0.6), (2, 0, 0, 0, 0, 5.0, 5.1)]
    )
    b = _write_steps(
        tmp_path / "a1", [(0, 1, 1, 0, 1, 0.0, 0.4), (1, 3, 3, 9, 0, 0.502, 0.61), (2, 7, 1, 0, 28, 5.0, 5.2)]
    )
    loads, seconds = step_rows([read_records(a), read_records(b)])
    # step 1: from the previous end (a 1 ms gap) to the last rank's end
    # step 2: after an idle gap only the forward counts
    # each term's largest over the ranks; then both ranks' tokens, and how many ranks had tokens
    # step 1 began as the prefill step 0 ended (after_prefill 1), step 2 after an idle gap (0)
    assert loads == [
        (10, 3, 40, 0, 0, 0, 13, 2, 0.0, 1.0, 1.0, 0.0, 0),
        (7, 1, 0, 28, 0, 0, 7, 1, 0.0, 1.0, 0.0, 0.0, 0),
    ]
    assert seconds == pytest.approx([0.11, 0.2])
    # another instance on the same clock, in a forward from 5.0 s: step 2 started while it computed,
    # step 1 (at 0.501 s) between its forwards [0.2, 0.501) and [0.6, 0.7)
    peer = _write_steps(
        tmp_path / "p", [(0, 4, 1, 0, 10, 0.2, 0.501), (1, 4, 1, 0, 10, 0.6, 0.7), (2, 9, 1, 0, 45, 4.9, 5.3)]
    )
    peered, _ = step_rows([read_records(a), read_records(b)], peers=[[read_records(peer)]])
    assert [row[8] for row in peered] == [0.0, 1.0]
    # a peer whose next forward starts 15 ms after its last ended was in a step through the gap
    # (its scheduling, as step_rows counts a step), so step 1, starting in it, sees it computing
    near = _write_steps(
        tmp_path / "q", [(0, 4, 1, 0, 10, 0.2, 0.495), (1, 4, 1, 0, 10, 0.51, 0.6), (2, 9, 1, 0, 45, 4.9, 5.3)]
    )
    peered, _ = step_rows([read_records(a), read_records(b)], peers=[[read_records(near)]])
    assert [row[8] for row in peered] == [1.0, 1.0]
    # a step after a prefill step: after_prefill where it began at that step's end, not after an idle gap
    for start, want in ((0.501, 1.0), (5.0, 0.0)):
        two = _write_steps(tmp_path / "two", [(0, 5, 1, 0, 15, 0.0, 0.5), (1, 1, 1, 6, 0, start, start + 0.1)])
        assert step_rows([read_records(two)], skip=1)[0][0][AFTER_AT] == want
    # the micro-batches a step ran in (an AFD attention rank's split): the most of one rank
    split = [dict(zip(RECORD_FIELDS, (1, 3, 3, 9, 0, 0.502, 0.61)), ext_pad=0, dec_pad=9, micro_batches=3)]
    (tmp_path / "m").write_text("".join(json.dumps(r) + "\n" for r in split))
    micro, _ = step_rows([read_records(tmp_path / "m"), read_records(b)[1:2]], skip=0)
    assert micro == [(3, 3, 9, 0, 0, 9, 6, 2, 0.0, 3.0, 0.0, 0.0, 0)]
    # requests that joined from a prefill instance on some rank (joined: 1 however many), and those
    # that left each rank since its previous step (requests left: the ranks' sum)
    ctx = [dict(zip(RECORD_FIELDS, (1, 3, 3, 9, 0, 0.502, 0.61)), joins=2, left=1), dict(split[0], left=2)]
    (tmp_path / "j").write_text("".join(json.dumps(r) + "\n" for r in ctx[:1]))
    (tmp_path / "k").write_text("".join(json.dumps(r) + "\n" for r in ctx[1:]))
    joined, _ = step_rows([read_records(tmp_path / "j"), read_records(tmp_path / "k")], skip=0)
    assert joined[0][-2:] == (1.0, 3.0)
    alone, _ = step_rows([read_records(tmp_path / "k")], skip=0)
    assert alone[0][-2:] == (0.0, 2.0)
    rows = [(i, 10 + i, 1 + i % 3, 100 * i, 7 * i * i, i * 0.1, i * 0.1 + 0.09) for i in range(18)]
    cal = fit_records([[_write_steps(tmp_path / "s", rows)]], "one rank")
    assert cal.steps == 17 and cal.source == "one rank" and cal.micro_batches == 1
    (tmp_path / "bad").write_text('{"step": 0}\n')
    with pytest.raises(ConfigError, match="bad:1: expected a step record"):
        read_records(tmp_path / "bad")


def test_step_spans_run_from_round_start_to_round_start(tmp_path):
    """With the rounds' starts (`ts`), a step spans from its round's start to the next round's; one
    before an idle gap to its forward's end plus the median tail of its kind (prefill or not)."""
    rows = [  # (step, tokens, seqs, kv, pairs, t0, t1, ts)
        (0, 5, 1, 0, 15, 0.001, 0.5, 0.0),  # warm-up, a prefill step
        (1, 1, 1, 6, 0, 0.501, 0.6, 0.5006),  # 0.6 ms after the prefill's forward
        (2, 1, 1, 7, 0, 0.6004, 0.7, 0.6002),  # 0.2 ms after a decode's
        (3, 4, 1, 0, 10, 5.003, 5.1, 5.0),  # after an idle gap: its round began 3 ms before its forward
        (4, 1, 1, 5, 0, 9.001, 9.2, 9.0),
    ]
    path = tmp_path / "ts"
    path.write_text("".join(json.dumps(dict(zip((*RECORD_FIELDS, "ts"), r))) + "\n" for r in rows))
    recs = read_records(path)
    t0, t1, ts = (np.array([r[k] for r in recs]) for k in ("t0", "t1", "ts"))
    start, end = step_spans(t0, t1, ts, np.array([r["pairs"] > 0 for r in recs]))
    assert start.tolist() == ts.tolist()
    # joined steps end where the next round began; before an idle gap the median tail of the kind:
    # prefill 0.6 ms (step 0's), decode 0.2 ms (step 1's)
    assert end.tolist() == pytest.approx([0.5006, 0.6002, 0.7002, 5.1006, 9.2002], abs=1e-12)
    loads, seconds = step_rows([recs])
    assert seconds == pytest.approx([0.0996, 0.1, 0.1006, 0.2002], abs=1e-12)
    # after_prefill: step 1 followed the prefill step 0; step 4 came after an idle gap
    assert [ld[AFTER_AT] for ld in loads] == [1.0, 0.0, 0.0, 0.0]
    # a peer instance counts as computing through a step's span, its round's scheduling included
    other = [dict(r, t0=r["t0"] + 0.0005, t1=r["t1"] + 0.0005, ts=r["ts"] + 0.0005) for r in recs]
    assert computing_at([recs], np.array([5.0001, 5.1004, 5.2, 0.6003])).tolist() == [True, True, False, True]
    marked, _ = step_rows([other], peers=[[recs]])
    assert [ld[8] for ld in marked] == [1.0, 1.0, 1.0, 1.0]
    # lockstep ranks: a step's round starts when its last rank began it (rank a began step 1's
    # round at 10.5 ms, before rank b's forward of step 0 ended: the step waits for b)
    fields = (*RECORD_FIELDS, "ts")
    a = [
        (0, 4, 1, 0, 10, 0.001, 0.010, 0.0),
        (1, 1, 1, 5, 0, 0.0122, 0.014, 0.0105),
        (2, 1, 1, 6, 0, 0.016, 0.017, 0.015),
    ]
    b = [
        (0, 4, 1, 0, 10, 0.002, 0.012, 0.0),
        (1, 1, 1, 5, 0, 0.0121, 0.0135, 0.0120),
        (2, 1, 1, 6, 0, 0.0155, 0.018, 0.0152),
    ]
    ranks = []
    for name, rows_ in (("a", a), ("b", b)):
        (tmp_path / name).write_text("".join(json.dumps(dict(zip(fields, r))) + "\n" for r in rows_))
        ranks.append(read_records(tmp_path / name))
    loads, seconds = step_rows(ranks, skip=0)
    # rounds at 0, 12 and 15.2 ms (the later rank's); the last ends at 18 ms plus the decode tail
    # (15.2 ms - 14 ms, the first decode step's)
    assert seconds == pytest.approx([0.012, 0.0032, 0.0040], abs=1e-12)
    assert [ld[AFTER_AT] for ld in loads] == [0.0, 1.0, 0.0]
    # without round starts (older records) the spans are the forwards after the scheduling gap
    start, end = step_spans(t0, t1)
    assert start.tolist() == [0.001, 0.5, 0.6, 5.003, 9.001] and end.tolist() == t1.tolist()


def one_request_trace(tmp_path) -> str:
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 32, "output_length": 4, "hash_ids": []}) + "\n")
    return str(path)


def test_cli_simulates_with_a_step_calibration(tmp_path, capsys):
    cal_file = tmp_path / "cal.json"
    StepCalibration(COEF, "test", kind_scale=(1.0, 1.1, 0.9, 1.2)).save(cal_file)
    assert StepCalibration.load(cal_file).kind_scale == (1.0, 1.1, 0.9, 1.2)
    StepCalibration(COEF, "test", ratio_bins=(0.9, 1.0, 1.3)).save(cal_file)
    assert StepCalibration.load(cal_file).ratio_bins == (0.9, 1.0, 1.3)
    StepCalibration(COEF, "test").save(cal_file)
    assert StepCalibration.load(cal_file).coef == COEF and StepCalibration.load(cal_file).ratio_bins == ()
    old = tmp_path / "old.json"  # written before the padded and prefill terms: those count 0
    old.write_text(json.dumps({"coef": dict(zip(TERMS[:5], COEF))}))
    assert StepCalibration.load(old).coef == (*COEF[:5], *(0.0,) * 12)
    old.write_text(json.dumps({"coef": dict(zip(TERMS[:9], COEF))}))  # before the square term
    assert StepCalibration.load(old).coef == (*COEF[:9], *(0.0,) * 8)
    old.write_text(json.dumps({"coef": dict(zip(TERMS[:10], COEF))}))  # before the busy ranks
    assert StepCalibration.load(old).coef == (*COEF[:10], *(0.0,) * 7)
    old.write_text(json.dumps({"coef": dict(zip(TERMS[:11], COEF))}))  # before peer_busy
    assert StepCalibration.load(old).coef == (*COEF[:11], *(0.0,) * 6)
    old.write_text(json.dumps({"coef": dict(zip(TERMS[:12], COEF))}))  # before the micro-batches
    assert StepCalibration.load(old).coef == (*COEF[:12], *(0.0,) * 5) and StepCalibration.load(old).micro_batches == 1
    old.write_text(json.dumps({"coef": dict(zip(TERMS[:14], COEF))}))  # before joined and requests_left
    assert StepCalibration.load(old).coef == (*COEF[:14], 0.0, 0.0, 0.0)
    old.write_text(json.dumps({"coef": dict(zip(TERMS[:16], COEF))}))  # before peer_tokens
    assert StepCalibration.load(old).coef == (*COEF[:16], 0.0)
    args = ["plan", "simulate", "--trace", one_request_trace(tmp_path), "--deployment", "colocated:gpus=1"]
    args += ["--kv-pages", "64", "--step-calibration", str(cal_file), "--json", "-"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stage_times"].startswith("fitted to this engine's steps")
    d = out["deployments"][0]
    # the chunk's pairs padded to 32 queries x 32 positions; each decode's positions padded to its own
    prefill = (
        COEF[0]
        + 32 * (COEF[1] + COEF[7])
        + COEF[2]
        + 32 * 33 / 2 * COEF[4]
        + 32 * 32 * COEF[5]
        + COEF[8]
        + (32 * 32) ** 2 * COEF[9]
    )
    assert d["ttft_s"]["p50"] == pytest.approx(prefill, rel=1e-9)
    # (the first decode step follows the prefill step: after_prefill)
    decode = [COEF[0] + COEF[1] + COEF[7] + COEF[2] + kv * (COEF[3] + COEF[6]) for kv in (33, 34, 35)]
    decode[0] += COEF[13]
    assert d["tpot_s"]["p50"] == pytest.approx(sum(decode) / 3, rel=1e-9)


@pytest.mark.parametrize(
    "text, msg",
    [
        ("not json", "not a JSON file"),
        (json.dumps({"coef": {"fixed": 1.0}}), "exactly the keys"),
        (json.dumps({"coef": dict.fromkeys(TERMS, "x")}), "finite number"),
        (json.dumps({"coef": {**dict.fromkeys(TERMS, 0.0), "tokens": -1.0}}), ">= 0"),
        (json.dumps({"coef": dict.fromkeys(TERMS, 0.0)}), "all coefficients are 0"),
        (json.dumps({"coef": dict.fromkeys(TERMS, 1.0), "kind_scale": {"decode": 1.0}}), '"kind_scale" must have'),
        (json.dumps({"coef": dict.fromkeys(TERMS, 1.0), "kind_scale": dict.fromkeys(KINDS, 0.0)}), "finite number > 0"),
        (json.dumps({"coef": dict.fromkeys(TERMS, 1.0), "ratio_bins": [1.0, 0.9]}), '"ratio_bins" must be'),
        (json.dumps({"coef": dict.fromkeys(TERMS, 1.0), "ratio_bins": [0.0, 0.9]}), '"ratio_bins" must be'),
        (json.dumps({"coef": dict.fromkeys(TERMS, 1.0), "ratio_bins": 1.0}), '"ratio_bins" must be'),
    ],
)
def test_cli_refuses_a_malformed_step_calibration(tmp_path, capsys, text, msg):
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    args = ["plan", "simulate", "--poisson", "1", "--duration", "5", "--deployment", "colocated:gpus=1"]
    assert main([*args, "--step-calibration", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("afd plan simulate: error: --step-calibration") and msg in err
    assert main([*args, "--step-calibration", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_engine_records_one_line_per_step(tiny_v3, tmp_path):
    from afd_engine.engine import Engine
    from afd_engine.sampling_params import SamplingParams

    path = tmp_path / "steps.jsonl"
    with Engine(model_path=tiny_v3, num_threads=1, max_num_batched_tokens=8, record_steps=str(path)) as eng:
        eng.generate(
            prompt_token_ids=[[5] * 12, [7] * 3], sampling_params=SamplingParams(max_new_tokens=3, ignore_eos=True)
        )
        first = len(path.read_text().splitlines())
        eng.generate(prompt_token_ids=[[9] * 4], sampling_params=SamplingParams(max_new_tokens=2, ignore_eos=True))
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    # the two requests that finished with the first batch's last step count in the rank's next step
    assert [r["left"] for r in recs] == [0] * first + [2] + [0] * (len(recs) - first - 1)
    assert {r["joins"] for r in recs} == {0}  # no prefill instance: nothing joins from one
    recs = recs[:first]
    assert [r["step"] for r in recs] == list(range(len(recs)))
    assert all(set(r) == {*RECORD_FIELDS, *LATER_FIELDS} and r["t1"] >= r["t0"] for r in recs)
    assert {r["micro_batches"] for r in recs} == {1}  # single mode: one batch a step
    # each step's round began after the forward before it ended, and before its own forward
    assert all(r["t0"] >= r["ts"] for r in recs) and all(b["ts"] >= a["t1"] for a, b in zip(recs, recs[1:]))
    # step 0: 8 tokens of the 12-token prompt (budget 8), a fresh chunk: 8 * 9 / 2 pairs
    assert (recs[0]["tokens"], recs[0]["seqs"], recs[0]["kv"], recs[0]["pairs"]) == (8, 1, 0, 36)
    # the rest of the first prompt (4 tokens after 8) and the second (3 tokens)
    assert (recs[1]["tokens"], recs[1]["seqs"], recs[1]["pairs"]) == (7, 2, 4 * 8 + 10 + 6)
    # padded: one 8-token chunk over 8 positions; two chunks padded to 4 queries x 12 positions
    assert (recs[0]["ext_pad"], recs[0]["dec_pad"], recs[1]["ext_pad"], recs[1]["dec_pad"]) == (64, 0, 96, 0)
    # the first decode step: both sequences padded to the longer context (12 + 1 cached)
    assert (recs[2]["seqs"], recs[2]["kv"], recs[2]["ext_pad"], recs[2]["dec_pad"]) == (2, 13 + 4, 0, 2 * 13)
    assert sum(r["tokens"] for r in recs) == 12 + 3 + 2 * 2  # prompts, then 2 decodes each (first token from prefill)
