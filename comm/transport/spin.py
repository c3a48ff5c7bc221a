"""When a thread waiting for a message should look for it (spin) before it sleeps.

A sleeping thread costs a wake-up per message: on a virtual machine whose idle vCPUs halt, about
50-90 us each way here, and the woken process then runs on cold caches. Looking at the rings
instead costs the CPU time spent looking, which is worth it only when the wait is short: for a
rank waiting a few hundred microseconds for its peer's half of a MoE layer, not for an idle server
or an FFN rank waiting milliseconds for the attention rank's next batch.

`SpinPolicy` keeps the length of the last `history` waits and spins (for up to `max_s`) only
while at least a quarter of them ended within `max_s`: a run of long waits (idle, or a peer that
is busy for longer than the look would last) turns the spinning off, a couple of short ones turn
it back on. It starts on. A quarter, not a half: an AFD FFN rank at concurrency 1 waits once per
step for the next step's descriptor and once for its first MoE layer, both longer than the rest,
and with a half the spinning flickered off and on with those (about half of its waits).
"""

from __future__ import annotations

from collections import deque


class SpinPolicy:
    """max_s: the longest look (0: never spin); history: the waits the decision looks back on."""

    def __init__(self, max_s: float, history: int = 8) -> None:
        if max_s < 0:
            raise ValueError(f"max_s must be >= 0, got {max_s}")
        self.max_s = max_s
        self._short: deque[bool] = deque([True] * history, maxlen=history)
        self._count = history  # how many of _short are True

    def window(self, limit_s: float) -> float:
        """How long the next wait should look before it sleeps (0: sleep at once); at most limit_s."""
        if self.max_s <= 0 or 4 * self._count < len(self._short):
            return 0.0
        return min(self.max_s, limit_s)

    def record(self, waited_s: float) -> None:
        """A wait ended after waited_s (looking and sleeping together)."""
        if self.max_s <= 0:
            return
        short = waited_s <= self.max_s
        self._count += short - self._short[0]
        self._short.append(short)
