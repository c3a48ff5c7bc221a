"""Stage times measured by the engine's timeline replace the roofline."""

from __future__ import annotations

import json

import pytest

from afd_engine import SamplingParams, make_engine
from afd_engine.errors import ConfigError
from afd_engine.planner.calibration import Calibration, LinearFit, calibrate, fit_line
from afd_engine.planner.deploy import Deployment, estimate
from afd_engine.planner.hardware import HARDWARE
from afd_engine.planner.model_spec import MODELS
from afd_engine.planner.stages import StageModel
from afd_engine.ranks.timeline import Timeline


def test_fit_line_recovers_a_line_and_clamps():
    fit = fit_line([(x, 30 + 2.5 * x) for x in (1, 4, 9, 16)])
    assert (fit.fixed_us, fit.per_unit_us, fit.samples) == (pytest.approx(30), pytest.approx(2.5), 4)
    assert fit(10) == pytest.approx(55) and fit(0) == 0.0
    flat = fit_line([(8, 10.0), (8, 14.0)])
    assert (flat.fixed_us, flat.per_unit_us) == (12.0, 0.0)
    with pytest.raises(ConfigError, match="no timed operations"):
        fit_line([])


def write_timeline(prefix: str) -> None:
    """Events as ranks write them, with stage times that follow known lines."""
    a, f = Timeline(prefix, "a", 0), Timeline(prefix, "f", 0)
    for step in range(4):
        for tokens in (2, 6, 10):
            a._events.append(
                {
                    "role": "a",
                    "rank": 0,
                    "step": step,
                    "kind": "attention",
                    "mb": 0,
                    "layer": 1,
                    "tokens": tokens,
                    "t0": 0.0,
                    "t1": (100 + 5 * tokens) * 1e-6,
                }
            )
            f._events.append(
                {
                    "role": "f",
                    "rank": 0,
                    "step": step,
                    "kind": "ffn",
                    "mb": 0,
                    "layer": 1,
                    "tokens": 4 * tokens,
                    "t0": 0.0,
                    "t1": (40 + 1 * 4 * tokens) * 1e-6,
                }
            )
        a.end_step(step)
        f.end_step(step)


def test_calibrate_from_timeline_files(tmp_path):
    prefix = str(tmp_path / "tl")
    write_timeline(prefix)
    calib = calibrate(prefix, source="test", skip_steps=1)
    assert calib.attention.samples == 9 and calib.ffn.samples == 9
    assert calib.attention.fixed_us == pytest.approx(100) and calib.attention.per_unit_us == pytest.approx(5)
    assert calib.ffn.fixed_us == pytest.approx(40) and calib.ffn.per_unit_us == pytest.approx(1)
    path = tmp_path / "calib.json"
    path.write_text(calib.to_json())
    assert Calibration.load(path) == calib


def test_calibrated_stages_replace_the_roofline():
    calib = Calibration(LinearFit(100.0, 5.0, 1), LinearFit(40.0, 1.0, 1))
    hw, model = HARDWARE["H800"], MODELS["step3"]
    sm = StageModel(model, hw, hw, 4096, "fp8", calib)
    e = estimate(sm, Deployment("afd", 16, 16, 3, 30, shared_expert="ffn"))
    assert e.attention_us == pytest.approx(100 + 5 * 10)  # 10 sequences per micro-batch
    roofline = estimate(StageModel(model, hw, hw, 4096, "fp8"), Deployment("afd", 16, 16, 3, 30, shared_expert="ffn"))
    assert e.ffn_us != roofline.ffn_us and e.dispatch_us == roofline.dispatch_us  # network stays modelled


def test_errors(tmp_path):
    with pytest.raises(ConfigError, match="no files .*record-timeline"):
        calibrate(str(tmp_path / "none"))
    (tmp_path / "bad.json").write_text(json.dumps({"attention": {}}))
    with pytest.raises(ConfigError, match="not a calibration file"):
        Calibration.load(tmp_path / "bad.json")


@pytest.mark.slow
def test_profiling_run_of_the_engine_calibrates(tmp_path, tiny_v3):
    """A real AFD run with --record-timeline gives token counts on both sides, and a fit."""
    prefix = str(tmp_path / "run")
    with make_engine(
        model_path=tiny_v3,
        mode="afd",
        dp_size=1,
        ffn_nodes=1,
        ffn_ranks_per_node=1,
        micro_batches=2,
        record_timeline=prefix,
        comm_timeout=60,
    ) as engine:
        engine.generate(
            prompts=["a b c", "hello there", "x", "one two three four"],
            sampling_params=SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True),
        )
    events = [json.loads(line) for p in tmp_path.glob("run.*.jsonl") for line in p.read_text().splitlines()]
    kinds = {e["kind"] for e in events if e["tokens"] > 0}
    assert {"attention", "ffn"} <= kinds
    calib = calibrate(prefix)
    assert calib.attention.samples > 10 and calib.ffn.samples > 10
    assert calib.attention(4) > 0 and calib.ffn(8) > 0
