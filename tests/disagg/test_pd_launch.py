"""`afd serve --pd`: the command line each instance gets."""

from __future__ import annotations

import pytest

from afd_engine.errors import ConfigError
from afd_engine.server.pd_serve import instance_argv


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


def test_the_api_keys_reach_the_instances_by_environment_not_command_line(monkeypatch):
    """`ps` shows every process's command line: the keys travel in AFD_API_KEY, one per line."""
    from afd_engine.server.auth import ENV_KEY, resolve_keys
    from afd_engine.server.pd_serve import instance_env

    argv = ["--pd", "--api-key", "k1", "--api-key=k2", "--api-key-file", "/keys", "--model-path", "m"]
    cmd = instance_argv(argv, "single", "prefill", 7, "", None)
    assert not [a for a in cmd if "k1" in a or "k2" in a or "/keys" in a or a.startswith("--api-key")]
    monkeypatch.setenv(ENV_KEY, "stale")
    env = instance_env(("k1", "k2", "k3"))
    assert env[ENV_KEY] == "k1\nk2\nk3" and resolve_keys(None, None, env) == ("k1", "k2", "k3")
    assert ENV_KEY not in instance_env(())  # no key: the instances run open, as the router does
