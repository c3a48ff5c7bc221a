"""FFN ranks check every attention rank's step descriptor before serving a step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from afd_engine.ranks.attention_runner import PipelineRunner
from afd_engine.ranks.ffn_worker import DescriptorMismatchError, check_descriptors


def test_agreeing_descriptors_give_the_micro_batch_count_and_shutdown_gives_none():
    assert check_descriptors({0: {"tokens": [3, 0, 5], "shutdown": False}, 1: {"tokens": [0, 0, 0]}}, 3, 7) == 3
    assert check_descriptors({0: {"tokens": [1], "shutdown": False}}, 3, 7) == 1  # a lone rank's one sequence
    assert check_descriptors({0: {"tokens": [], "shutdown": True}, 1: {"tokens": [], "shutdown": True}}, 3, 7) is None


@pytest.mark.parametrize(
    "metas, match",
    [
        (
            {0: {"tokens": [1, 2, 3, 4], "shutdown": False}, 1: {"tokens": [1, 2, 3], "shutdown": False}},
            r"step 4: expected 1 to 3 token counts .* got \{0: \[1, 2, 3, 4\]\}: start every role with the same "
            r"--micro-batches",
        ),
        ({0: {"tokens": [], "shutdown": False}}, r"expected 1 to 3 token counts .* got \{0: \[\]\}"),
        (
            {0: {"tokens": [1, 2], "shutdown": False}, 1: {"tokens": [1, 2, 3], "shutdown": False}},
            r"step 4: attention endpoints disagree on the micro-batch count: \{0: 2, 1: 3\}",
        ),
        ({0: {"tokens": [1, -2, 3], "shutdown": False}}, r"got \{0: \[1, -2, 3\]\}"),
        ({0: {"tokens": [1, 2, "3"], "shutdown": False}}, r"got \{0: \[1, 2, '3'\]\}"),
        (
            {0: {"tokens": [], "shutdown": True}, 1: {"tokens": [1, 1, 1], "shutdown": False}},
            r"step 4: attention endpoints disagree on shutdown: \{0: True, 1: False\}",
        ),
    ],
)
def test_mismatching_descriptors_are_refused_loudly(metas, match):
    with pytest.raises(DescriptorMismatchError, match=match):
        check_descriptors(metas, 3, 4)


class _RecordingTransport:
    def __init__(self) -> None:
        self.log: list[tuple] = []

    def send(self, dst, msg) -> None:
        self.log.append(("send", dst, msg.kind, msg.meta.get("shutdown")))

    def close(self) -> None:
        self.log.append(("close",))


def test_a_closing_attention_rank_flushes_its_shutdown_descriptor_by_closing_its_transport():
    """The shutdown descriptor may still wait on a sender thread when the runner closes (--transport
    torch): without closing the transport, the process can exit first and an FFN rank sees its
    connection drop instead of the shutdown (it exits 1)."""
    runner = PipelineRunner.__new__(PipelineRunner)
    runner.transport = transport = _RecordingTransport()
    runner.recovery = SimpleNamespace(close=lambda: None, ffn=[2, 3])
    runner.rebalancer = SimpleNamespace(close=lambda: None)
    runner.server, runner.step_id, runner.sender = None, 5, SimpleNamespace(endpoint=0)
    runner.close()
    assert transport.log == [("send", 2, "step", True), ("send", 3, "step", True), ("close",)]


@pytest.mark.parametrize(
    "senders, live_peers, seqs, expected",
    [
        (1, [], 2, 2),  # a deployment of one attention rank plans no empty micro-batch
        (1, [], 7, 3),
        (2, [1], 2, 3),  # several plan the configured count, each without the others' sequences
        # a survivor whose peers are all lost, too: it prepares a step before the round that may
        # admit a replacement into it, and the FFN ranks refuse counts that disagree
        (2, [], 2, 3),
    ],
)
def test_attention_ranks_of_one_deployment_plan_one_micro_batch_count(senders, live_peers, seqs, expected):
    runner = SimpleNamespace(n=3, peers=live_peers, spec=SimpleNamespace(topology=SimpleNamespace(num_senders=senders)))
    assert PipelineRunner._micro_batches(runner, seqs) == expected
