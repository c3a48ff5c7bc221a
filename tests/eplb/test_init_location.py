"""--init-expert-location: a saved load report sets the starting placement, and a bad one is refused
at start with a message that names the flag."""

from __future__ import annotations

import json

import pytest

from afd_engine.engine_args import EngineArgs
from afd_engine.errors import ConfigError
from afd_engine.model_config import ModelConfig
from afd_engine.ranks.spec import DeploymentSpec


def spec_with(tiny_v3, path) -> DeploymentSpec:
    args = EngineArgs(mode="afd", ffn_ranks_per_node=2, ep_num_redundant_experts=2, init_expert_location=str(path))
    return DeploymentSpec.of(args, ModelConfig.from_pretrained(tiny_v3))


def test_a_report_sets_the_starting_placement(tiny_v3, tmp_path):
    path = tmp_path / "load.json"
    path.write_text(json.dumps({"moe_layers": [1, 2, 3], "load": [[1] * 15 + [90], [1] * 16, [90] + [1] * 15]}))
    emap = spec_with(tiny_v3, path).initial_map()
    assert emap.version == 0
    copies = {layer: emap.placements[layer].replicas(16) for layer in (1, 2, 3)}
    assert len(copies[1][15]) == 3 and len(copies[3][0]) == 3  # the hot expert takes both spare slots
    assert all(len(c) == 1 for c in copies[1][:15])


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "cannot read a JSON load report"),
        ("not json", "cannot read a JSON load report"),
        (json.dumps({"placement": {}}), 'no "load" in it'),
        (json.dumps({"load": [[1, 2]]}), "this model has layers [1, 2, 3] x 16 experts"),
        (json.dumps({"load": [["x"] * 16] * 3}), "is not a table of numbers"),
        (json.dumps({"load": [[-1] * 16] * 3}), "must not be negative"),
    ],
)
def test_a_bad_report_is_refused_naming_the_flag(tiny_v3, tmp_path, content, message):
    path = tmp_path / "load.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match="--init-expert-location") as err:
        spec_with(tiny_v3, path)
    assert message in str(err.value)


def test_single_mode_refuses_it():
    with pytest.raises(ConfigError, match="use --mode colocated or afd"):
        EngineArgs(init_expert_location="load.json").validate()
