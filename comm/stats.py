"""Traffic counters per phase (dispatch, combine) and link class (between nodes, inside a node).

`messages` counts token copies (one hidden vector sent to one peer), the unit in which the
two-stage saving is stated; `transfers` counts transport sends; `bytes` counts payload bytes
(activations, fp8 scales, routing metadata), not headers. Sends to oneself cross no link and are
not counted.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from comm.topology import LOCAL


@dataclass
class Counter:
    messages: int = 0
    transfers: int = 0
    bytes: int = 0

    def add(self, other: Counter) -> None:
        self.messages += other.messages
        self.transfers += other.transfers
        self.bytes += other.bytes


class CommStats:
    """Counters of one call (`CommStats()` per call) or cumulative (`merge` the calls in)."""

    def __init__(self) -> None:
        self.counters: dict[tuple[str, str], Counter] = defaultdict(Counter)

    def record(self, phase: str, link: str, messages: int, nbytes: int) -> None:
        if link == LOCAL:
            return
        c = self.counters[(phase, link)]
        c.messages += messages
        c.transfers += 1
        c.bytes += nbytes

    def get(self, phase: str, link: str) -> Counter:
        return self.counters.get((phase, link), Counter())

    def merge(self, other: CommStats) -> None:
        for k, c in other.counters.items():
            self.counters[k].add(c)

    @staticmethod
    def total(stats: list[CommStats]) -> CommStats:
        out = CommStats()
        for s in stats:
            out.merge(s)
        return out

    def as_dict(self) -> dict:
        return {f"{phase}.{link}": vars(c) for (phase, link), c in sorted(self.counters.items())}
