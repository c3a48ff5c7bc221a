"""The `afd` command as users run it: real subprocesses, exit codes, no tracebacks on user errors."""

from __future__ import annotations

import pytest

from tests.process_helpers import ENV
from tests.process_helpers import afd_run as afd


def test_generate_prints_the_completion(tiny_v3):
    from afd_engine import Engine, SamplingParams

    with Engine(model_path=tiny_v3, num_threads=1) as eng:
        expected = eng.generate(
            prompts=["Hello world"], sampling_params=SamplingParams(max_new_tokens=8, temperature=0.0)
        )[0].text
    res = afd(
        "generate",
        "--model-path",
        tiny_v3,
        "--prompt",
        "Hello world",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0",
        "--num-threads",
        "1",
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout == expected + "\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["generate", "--model-path", "/no/such/dir", "--prompt", "hi"],
            "model directory '/no/such/dir' does not exist",
        ),
        (["generate", "--prompt", "hi", "--page-size", "0"], "--page-size=0: must be at least 1"),
        (["generate", "--prompt", "hi", "--comm-spin-us", "-5"], "--comm-spin-us=-5: must be between 0 and 1000000"),
        (["generate", "--prompt", "hi", "--temperature", "-2"], "invalid sampling parameter temperature=-2.0"),
        (["make-tiny-model", "/tmp/x", "--arch", "llama"], "supported: deepseek_v3, deepseek_v2"),
    ],
)
def test_user_errors_exit_2_without_traceback(args, message, tmp_path):
    res = afd(*args, env={**ENV, "AFD_CACHE_DIR": str(tmp_path)})
    assert res.returncode == 2
    assert message in res.stderr
    assert "Traceback" not in res.stderr


def test_make_tiny_model_then_generate(tmp_path):
    res = afd("make-tiny-model", str(tmp_path / "m"), "--arch", "deepseek_v2", "--shards", "2")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "m" / "model.safetensors.index.json").is_file()
    res = afd(
        "generate",
        "--model-path",
        str(tmp_path / "m"),
        "--prompt",
        "a",
        "--prompt",
        "b",
        "--max-new-tokens",
        "4",
        "--ignore-eos",
        "--num-threads",
        "1",
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("(length)") == 2


def test_deployment_from_yaml_and_bad_yaml(tiny_v3, tmp_path):
    prompt = ["--model-path", tiny_v3, *"--prompt hello --max-new-tokens 6 --temperature 0".split()]
    res = afd("generate", "--config", "configs/colocated_dp2.yaml", *prompt)
    single = afd("generate", *prompt, "--num-threads", "1")
    assert res.returncode == 0, res.stderr
    assert res.stdout == single.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("dp_sise: 2\n")
    res = afd("generate", "--config", str(bad), "--prompt", "hi")
    assert res.returncode == 2 and "unknown setting(s) dp_sise" in res.stderr
