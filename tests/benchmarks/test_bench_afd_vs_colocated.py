"""bench_afd_vs_colocated: the concurrency search, the saturation point, whether the SLO bound and
the AFD / colocated ratio, exact on synthetic points (a fake measure function, no server); then one
quick run of both real deployments, end to end."""

from __future__ import annotations

import json

import pytest

from tests.process_helpers import bench_run, load_bench

SCRIPT = "bench_afd_vs_colocated.py"
COLO, AFD = "colocated dp2", "afd 1A + 1F"


@pytest.fixture(scope="module")
def avc():
    return load_bench(SCRIPT)


def fake(avc, tpot_ms, failed_from: int | None = None):
    """A measure function whose TPOT p50 is tpot_ms(concurrency), throughput 10 x concurrency, and
    every request failed from concurrency `failed_from` on; and the list of concurrencies it measured."""
    calls: list[int] = []

    def measure(c: int):
        calls.append(c)
        failed = 3 * c if failed_from is not None and c >= failed_from else 0
        return avc.Point(c, 3 * c, failed, 10.0 * c, tpot_ms(c), 2 * tpot_ms(c), 1.0)

    return measure, calls


def points(avc, rows):
    """Points from (concurrency, tok/s per worker, TPOT p50 ms) rows, no failures."""
    return tuple(avc.Point(c, 3 * c, 0, tok, tpot, tpot, 1.0) for c, tok, tpot in rows)


def test_search_doubles_until_the_slo_binds_then_bisects_once(avc):
    measure, calls = fake(avc, lambda c: 10.0 * c)
    s = avc.search(measure, slo_ms=100.0, cap=512)
    # 16 is the first over 100 ms; 12 lies between it and 8, the last under
    assert calls == [1, 2, 4, 8, 16, 12]
    assert [p.concurrency for p in s.points] == [1, 2, 4, 8, 12, 16]
    assert s.stopped_by == "slo" and s.slo_bound and s.saturation.concurrency == 8

    measure, calls = fake(avc, lambda c: 10.0 * c)
    assert avc.search(measure, 100.0, 512, bisect=False).saturation.concurrency == 8
    assert calls == [1, 2, 4, 8, 16]

    measure, calls = fake(avc, lambda c: 60.0 * c)  # 2 is over: nothing lies between 1 and 2
    s = avc.search(measure, 100.0, 512)
    assert calls == [1, 2] and s.saturation.concurrency == 1 and s.slo_bound


def test_search_stops_at_the_cap_and_says_the_slo_did_not_bind(avc):
    measure, calls = fake(avc, lambda c: 5.0)
    s = avc.search(measure, slo_ms=100.0, cap=12)
    assert calls == [1, 2, 4, 8, 12]  # the last doubling clipped to the cap
    assert s.stopped_by == "cap" and not s.slo_bound and s.saturation.concurrency == 12
    assert s.to_json()["slo_bound"] is False and s.to_json()["saturation"]["concurrency"] == 12
    line = avc.verdict(AFD, s, cap=12)
    assert line.startswith(f"{AFD}: the SLO did not bind: the cap (concurrency 12) was reached")
    assert "best 120.0 tok/s per worker at concurrency 12 is only a lower bound" in line


def test_failed_requests_stop_the_search_without_binding_it(avc):
    measure, calls = fake(avc, lambda c: 5.0, failed_from=8)
    s = avc.search(measure, slo_ms=100.0, cap=512)
    assert calls == [1, 2, 4, 8, 6]
    assert s.stopped_by == "failed" and not s.slo_bound and s.saturation.concurrency == 6


def test_saturation_is_the_best_throughput_under_the_slo(avc):
    rows = [(1, 10.0, 10.0), (4, 40.0, 20.0), (8, 80.0, 50.0), (16, 70.0, 90.0), (32, 90.0, 150.0)]
    s = avc.Sweep(points(avc, rows), 100.0, "list")
    # 32 has the most throughput but is over; 16 is under but slower than 8
    assert s.saturation.concurrency == 8 and s.slo_bound
    assert not avc.Sweep(points(avc, rows[:4]), 100.0, "list").slo_bound
    # a noisy point over the SLO below the saturation point does not make the SLO bind
    noisy = avc.Sweep(points(avc, [(1, 10.0, 10.0), (4, 40.0, 120.0), (8, 80.0, 90.0)]), 100.0, "list")
    assert noisy.saturation.concurrency == 8 and not noisy.slo_bound
    measure, calls = fake(avc, lambda c: 10.0 * c)
    listed = avc.measure_list(measure, 100.0, [4, 32])
    assert calls == [4, 32] and listed.stopped_by == "list" and listed.saturation.concurrency == 4


def test_slo_missed_at_concurrency_one(avc):
    measure, calls = fake(avc, lambda c: 200.0)
    s = avc.search(measure, slo_ms=100.0, cap=512)
    assert calls == [1] and s.saturation is None and s.slo_bound
    assert s.to_json()["saturation"] is None
    assert (
        avc.verdict(COLO, s, 512)
        == f"{COLO}: no point meets TPOT p50 <= 100 ms; the SLO bound (concurrency 1: TPOT p50 200.0 ms)"
    )
    ok = avc.Sweep(points(avc, [(1, 10.0, 10.0)]), 100.0, "cap")
    assert avc.ratio(afd=ok, colocated=s) is None and avc.ratio(afd=s, colocated=ok) is None
    assert avc.ratio_line({COLO: s, AFD: ok}).endswith(": n/a (a deployment meets the SLO at no point)")


def test_ratio_at_saturation_and_the_report(avc):
    colo = avc.Sweep(points(avc, [(1, 10.0, 10.0), (2, 20.0, 40.0), (4, 24.0, 120.0)]), 100.0, "slo")
    afd = avc.Sweep(points(avc, [(1, 12.0, 12.0), (2, 30.0, 30.0), (4, 36.0, 110.0)]), 100.0, "slo")
    assert avc.ratio(afd, colo) == 1.5
    text = avc.report({COLO: colo, AFD: afd}, cap=512)
    assert text.splitlines()[-1] == f"ratio {AFD} / {COLO} of throughput per worker at saturation: 1.500"
    assert f"{COLO}: saturation at concurrency 2: 20.0 tok/s per worker, TPOT p50 40.0 ms <= 100 ms" in text
    assert "the SLO bound (concurrency 4: TPOT p50 110.0 ms)" in text
    rows = text.splitlines()[1:7]  # the point table, after its header: colocated 1 2 4, then AFD 1 2 4
    assert [row.split()[-1] for row in rows] == ["1.0", "saturation", "SLO"] * 2  # "1.0": TTFT, no note

    capped = avc.Sweep(points(avc, [(1, 12.0, 12.0), (2, 30.0, 30.0)]), 100.0, "cap")
    line = avc.ratio_line({COLO: colo, AFD: capped})
    assert line.endswith(f": 1.500 (not at saturation: the SLO did not bind for {AFD})")


def test_arguments(avc):
    args = avc.parse_args([])
    assert (args.cap, args.max_running_requests, args.concurrency) == (512, 512, None)
    assert (args.input_len, args.output_len, args.min_prompts, args.prompts_per_slot) == (32, 32, 16, 3)
    assert [avc.num_prompts(c, args) for c in (1, 8, 64)] == [16, 24, 192]
    quick = avc.parse_args(["--quick", "--output-len", "6"])
    assert (quick.cap, quick.input_len, quick.output_len, quick.min_prompts) == (4, 8, 6, 4)
    # the server's running-request limit caps the search too
    assert avc.parse_args(["--max-running-requests", "48"]).cap == 48
    listed = avc.parse_args(["--concurrency", "16", "4", "4"])
    assert listed.concurrency == [4, 16] and listed.max_running_requests == 16
    with pytest.raises(SystemExit):
        avc.parse_args(["--workers", "1"])


def test_quick_run_of_both_deployments(tmp_path, tiny_v3):
    out, png = tmp_path / "avc.json", tmp_path / "avc.png"
    # an SLO no point can miss: the search runs to the cap, and must say that the SLO did not bind
    flags = ["--quick", "--max-concurrency", "2", "--slo-tpot-ms", "1e6", "--model-path", tiny_v3]
    res = bench_run(SCRIPT, *flags, "--json", str(out), "--png", str(png), timeout=300)
    data = json.loads(out.read_text())
    assert list(data["deployments"]) == [COLO, AFD]
    best = {}
    for name, d in data["deployments"].items():
        assert [p["concurrency"] for p in d["points"]] == [1, 2]
        assert all(p["failed"] == 0 and p["output_tok_s_per_worker"] > 0 and p["tpot_p50_ms"] > 0 for p in d["points"])
        assert d["stopped_by"] == "cap" and d["slo_bound"] is False
        assert d["saturation"] == max(d["points"], key=lambda p: p["output_tok_s_per_worker"])
        assert "--max-running-requests" not in d["flags"]
        best[name] = d["saturation"]["output_tok_s_per_worker"]
        assert f"{name}: the SLO did not bind: the cap (concurrency 2) was reached" in res.stdout
    assert data["ratio_afd_over_colocated"] == pytest.approx(best[AFD] / best[COLO])
    assert data["ratio_at_saturation"] is False and data["settings"]["max_running_requests"] == 2
    assert f"ratio {AFD} / {COLO} of throughput per worker at saturation" in res.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
