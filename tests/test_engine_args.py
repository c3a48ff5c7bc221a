"""Settings are checked the same way whichever way they arrive (flags, Python keywords, YAML): type,
choices, ranges and unknown names, before any process starts, in a message naming the setting."""

from __future__ import annotations

import time

import pytest
import torch

from afd_engine import EngineArgs, make_engine
from afd_engine.deploy_config import load_config
from afd_engine.engine_args import setting_error
from afd_engine.errors import ConfigError
from afd_engine.server.serve import ServerArgs
from tests.process_helpers import afd_run

BAD = [
    ({"transport": "bogus"}, "--transport='bogus': choose one of auto, shm, zmq, torch"),
    ({"dispatch": "sideways"}, "--dispatch='sideways': choose one of two-stage, direct"),
    ({"dispatch_dtype": "int4"}, "--dispatch-dtype='int4': choose one of auto, fp32, bf16, fp8"),
    ({"combine_dtype": "fp8"}, "--combine-dtype='fp8': choose one of auto, fp32, bf16"),
    ({"comm_spin_priority": "high"}, "--comm-spin-priority='high': choose one of idle, normal"),
    ({"overlap_schedule": "yes"}, "--overlap-schedule='yes': choose one of auto, on, off"),
    ({"mode": "pd"}, "--mode='pd': choose one of single, colocated, afd"),
    ({"dp_size": "2"}, "--dp-size='2': must be an integer"),
    ({"dp_size": 2.0}, "--dp-size=2.0: must be an integer"),
    ({"micro_batches": True}, "--micro-batches=True: must be an integer"),
    ({"comm_timeout": "30"}, "--comm-timeout='30': must be a number"),
    ({"enable_eplb": 1}, "--enable-eplb=1: must be true or false"),
    ({"page_size": None}, "--page-size=None: must be given (it has no empty value)"),
    ({"model_path": 7}, "--model-path=7: must be a string"),
    ({"dp_size": 0}, "--dp-size=0: must be at least 1"),
    ({"micro_batches": 9}, "--micro-batches=9: must be in [1, 8]"),
    (
        {"transport": "torch", "inject_link_delay_ms": 2.0},
        "--inject-link-delay-ms=2.0: the added link delay exists on the shm and zmq transports only, not with "
        "--transport torch",
    ),
]


@pytest.mark.parametrize("kwargs, message", BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_python_api_checks_like_the_command_line(kwargs, message):
    with pytest.raises(ConfigError) as err:
        EngineArgs.from_kwargs(**kwargs).validate()
    assert str(err.value) == message
    with pytest.raises(ConfigError) as err:
        make_engine(**kwargs)  # refused before any process starts
    assert str(err.value) == message


def test_make_engine_refuses_both_bad_settings_of_the_report():
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"--dispatch='sideways': choose one of two-stage, direct"):
        make_engine(transport="bogus", dispatch="sideways", mode="afd")
    assert time.monotonic() - start < 2  # no rank was started
    with pytest.raises(ConfigError, match="unknown engine setting"):
        make_engine(transprot="shm")


def test_floats_take_integers_and_optional_fields_take_none():
    args = EngineArgs.from_kwargs(comm_timeout=5, micro_batches=None, dispatch=None, kv_cache_memory_mb=64)
    args.validate()
    assert setting_error(EngineArgs, "comm_timeout", 5) is None
    assert setting_error(ServerArgs, "api_key", None) is None


def test_server_settings_are_checked_too():
    with pytest.raises(ConfigError, match=r"^--port='80': must be an integer$"):
        ServerArgs(port="80")


@pytest.mark.parametrize(
    "yaml, message",
    [
        ("dispatch: sideways\n", "dispatch: 'sideways' choose one of two-stage, direct"),
        ("transport: bogus\n", "transport: 'bogus' choose one of auto, shm, zmq, torch"),
        ("dp-size: two\n", "dp_size: 'two' must be an integer"),
        ("enable_eplb: 'yes'\n", "enable_eplb: 'yes' must be true or false"),
        ("port: 30000.5\n", "port: 30000.5 must be an integer"),
        ("dp_sise: 2\n", "unknown setting(s) dp_sise; known: "),
    ],
)
def test_yaml_settings_are_checked_at_load_naming_file_and_key(tmp_path, yaml, message):
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml)
    allowed = {"dispatch", "transport", "dp_size", "enable_eplb", "port"}
    with pytest.raises(ConfigError) as err:
        load_config(path, allowed)
    assert str(err.value).startswith(f"{path}: {message}")


def test_yaml_with_a_bad_choice_exits_2_before_any_rank_starts(tmp_path, tiny_v3):
    path = tmp_path / "deploy.yaml"
    path.write_text("mode: afd\ndispatch: sideways\n")
    start = time.monotonic()
    res = afd_run("serve", "--config", str(path), "--model-path", tiny_v3, timeout=60)
    assert res.returncode == 2
    assert res.stderr.strip() == f"afd serve: error: {path}: dispatch: 'sideways' choose one of two-stage, direct"
    assert time.monotonic() - start < 30


def test_engine_takes_device_as_the_setting_it_is(tiny_v3):
    from afd_engine import Engine

    with Engine(model_path=tiny_v3, device="cpu", num_threads=1) as eng:
        assert eng.device == torch.device("cpu") and eng.args.device == "cpu"


def test_gpu_id_step_places_ranks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert [EngineArgs(device="cuda", base_gpu_id=1, gpu_id_step=2).device_for(r).index for r in range(3)] == [1, 3, 5]
    assert {EngineArgs(device="cuda", gpu_id_step=0).device_for(r).index for r in range(4)} == {0}
    with pytest.raises(ConfigError, match=r"^--gpu-id-step=-1: must be >= 0$"):
        EngineArgs(gpu_id_step=-1).validate()
