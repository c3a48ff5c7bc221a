"""Hardware catalog and user YAML files."""

from __future__ import annotations

import pytest

from afd_engine.errors import ConfigError
from afd_engine.planner.hardware import HARDWARE, get_hardware, load_hardware_file


def test_catalog_has_the_platforms_of_the_published_designs():
    assert {"H800", "H20", "H100", "H200", "A800", "L20", "910B"} <= set(HARDWARE)
    assert get_hardware("h800") is HARDWARE["H800"]
    assert HARDWARE["H800"].nic_gbs_per_gpu == 50.0  # 8 x 400 Gb/s over 8 GPUs
    assert HARDWARE["A800"].tflops("fp8") == 312  # no fp8 units: bf16 math


def test_yaml_adds_hardware_from_scratch_or_from_a_base(tmp_path):
    f = tmp_path / "hw.yaml"
    f.write_text(
        "B200x:\n  base: H200\n  bf16_tflops: 2250\n  fp8_tflops: 4500\n  efficiency:\n    nic: 0.9\n"
        "Tiny:\n  bf16_tflops: 10\n  fp8_tflops: null\n  mem_bw_tbs: 0.5\n  mem_gb: 16\n"
        "  scaleup_gbs: 16\n  nic_gbps: 100\n  nics_per_node: 1\n  gpus_per_node: 4\n"
    )
    extra = load_hardware_file(f)
    b = get_hardware("B200x", extra)
    assert (b.bf16_tflops, b.mem_bw_tbs, b.efficiency.nic) == (2250, 4.8, 0.9)
    assert b.efficiency.gemm_memory == HARDWARE["H200"].efficiency.gemm_memory
    assert extra["Tiny"].nic_gbs_per_gpu == 100 / 4 / 8


@pytest.mark.parametrize(
    "text,match",
    [
        ("X:\n  base: H800\n  warp_speed: 9\n", "hardware X: .*warp_speed"),
        ("X:\n  base: H800\n  efficiency:\n    nic: 1.5\n", "efficiency nic=1.5 must be in"),
        ("X:\n  base: H800\n  mem_gb: 0\n", "mem_gb must be > 0"),
        ("- just a list\n", "expected a mapping"),
        ("X: [unclosed\n", "not valid YAML"),
    ],
)
def test_bad_yaml_names_the_problem(tmp_path, text, match):
    f = tmp_path / "hw.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_hardware_file(f)


def test_unknown_hardware_lists_the_known_ones():
    with pytest.raises(ConfigError, match="unknown hardware 'B300'.*H800.*910B.*--hw-file"):
        get_hardware("B300")
    with pytest.raises(ConfigError, match="no such file"):
        load_hardware_file("/nonexistent/hw.yaml")
