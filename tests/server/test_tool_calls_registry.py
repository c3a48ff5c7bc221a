"""The registry of tool-call formats: every accepted name has a detector, an unknown one is refused."""

from __future__ import annotations

import pytest

from afd_engine.server.tool_calls.base import ToolCallDetector
from afd_engine.server.tool_calls.deepseekv3 import DeepSeekV3Detector
from afd_engine.server.tool_calls.qwen25 import Qwen25Detector
from afd_engine.server.tool_calls.registry import PARSERS, get_detector


@pytest.mark.parametrize(("name", "detector"), [("deepseekv3", DeepSeekV3Detector), ("qwen25", Qwen25Detector)])
def test_known_names_resolve(name: str, detector: type[ToolCallDetector]) -> None:
    assert type(get_detector(name)) is detector


def test_every_accepted_name_has_a_detector() -> None:
    assert PARSERS == ("deepseekv3", "qwen25")
    assert all(isinstance(get_detector(name), ToolCallDetector) for name in PARSERS)


def test_unknown_name_lists_the_accepted_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown tool call parser 'hermes'; known: deepseekv3, qwen25$"):
        get_detector("hermes")
