"""`afd serve --pd`: the command line each instance gets."""

from __future__ import annotations

import pytest

from afd_engine.errors import ConfigError
from afd_engine.server.pd_launch import instance_argv


def test_each_instance_gets_the_shared_flags_its_role_and_its_own_flags():
    argv = ["--pd", "--prefill-mode", "single", "--port", "5", "--model-path", "m", "--decode-args=--dp-size 2"]
    assert instance_argv(argv, "single", "prefill", 7, "--page-size 32", 9) == [
        "--model-path", "m", "--mode", "single", "--disaggregation-mode", "prefill", "--port", "7",
        "--disaggregation-bootstrap-port", "9", "--page-size", "32",
    ]  # fmt: skip
    assert instance_argv(argv, "afd", "decode", 8, "--dp-size 2", None) == [
        "--model-path", "m", "--mode", "afd", "--disaggregation-mode", "decode", "--port", "8", "--dp-size", "2",
    ]  # fmt: skip


@pytest.mark.parametrize("flag", ["--mode=afd", "--disaggregation-mode"])
def test_the_roles_flags_are_its_own(flag):
    with pytest.raises(ConfigError, match="afd serve --pd sets --"):
        instance_argv(["--pd", flag, "x"], "single", "prefill", 7, "", None)
