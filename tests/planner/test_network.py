"""Dispatch/combine times: byte counts per link and which link binds."""

from __future__ import annotations

import pytest

from afd_engine.errors import ConfigError
from afd_engine.planner.hardware import HARDWARE
from afd_engine.planner.network import CommCase, comm_time, copy_bytes, expected_distinct

H800 = HARDWARE["H800"]


def test_copy_bytes_match_the_wire_format():
    assert copy_bytes(7168, "fp8") == 7168 + 4 * 56 + 8  # one fp32 scale per 128 values, then metadata
    assert copy_bytes(7168, "bf16") == 2 * 7168 + 8
    with pytest.raises(ConfigError, match="wire dtype 'int4'"):
        copy_bytes(7168, "int4")


def test_expected_distinct_groups():
    assert expected_distinct(1, 256, 8) == 1.0
    assert expected_distinct(256, 256, 8) == pytest.approx(8)  # one expert per group: every pick distinct
    assert 1.99 < expected_distinct(2, 256, 8) < 2.0


def test_direct_bipartite_bytes_and_binding_link():
    t = comm_time(CommCase(tokens=100, hidden=7168, topk=8, experts=256, senders=32, receivers=16, mode="direct"), H800)
    per_copy = copy_bytes(7168, "fp8")
    assert t.inter_node_bytes == 32 * 100 * 8 * per_copy
    nic = 50e3 * 0.8  # bytes per microsecond at 80% of 400 Gb/s
    assert t.sender_nic_us == pytest.approx(100 * 8 * (per_copy + copy_bytes(7168, "bf16")) / nic)
    assert t.receiver_nic_us == pytest.approx(2 * t.sender_nic_us)  # 32 senders onto 16 receivers
    assert t.dispatch_us == pytest.approx(20 + 2 * 100 * 8 * per_copy / nic)
    assert t.scaleup_us == 0


def test_balanced_bipartite_is_bound_by_nothing_but_the_nic():
    t = comm_time(CommCase(tokens=128, hidden=7168, topk=8, experts=256, senders=16, receivers=16, mode="direct"), H800)
    assert t.sender_nic_us == pytest.approx(t.receiver_nic_us)


def test_two_stage_uses_the_scale_up_link_and_less_network():
    case = dict(tokens=128, hidden=7168, topk=8, experts=256, senders=32, receivers=16)
    direct = comm_time(CommCase(mode="direct", **case), H800)
    two = comm_time(CommCase(mode="two-stage", **case), H800)
    assert two.copies_per_token == pytest.approx(expected_distinct(2, 256, 8))
    assert two.scaleup_us > 0 and two.inter_node_bytes < direct.inter_node_bytes / 3.9


def test_symmetric_ep_within_one_node_uses_only_nvlink():
    t = comm_time(
        CommCase(tokens=128, hidden=7168, topk=8, experts=256, senders=8, receivers=8, mode="direct", symmetric=True),
        H800,
    )
    assert t.inter_node_bytes == 0 and t.sender_nic_us == 0 and t.scaleup_us > 0


def test_empty_and_invalid():
    assert comm_time(CommCase(tokens=0, hidden=64, topk=2, experts=8, senders=2, receivers=2), H800).total_us == 0
    with pytest.raises(ConfigError, match="must be 'direct' or 'two-stage'"):
        comm_time(CommCase(tokens=1, hidden=64, topk=2, experts=8, senders=2, receivers=2, mode="bcast"), H800)
    with pytest.raises(ConfigError, match="hidden, topk, experts, senders and receivers >= 1"):
        comm_time(CommCase(tokens=1, hidden=64, topk=2, experts=8, senders=0, receivers=2), H800)
