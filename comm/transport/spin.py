"""When a thread waiting for a message should look for it (spin) before it sleeps.

A sleeping thread costs a wake-up per message, which a virtual machine whose idle vCPUs halt makes
slow, and the woken process then runs on cold caches. Looking at the rings instead costs the CPU
time spent looking, which is worth it only when the wait is short: for a rank waiting a few
hundred microseconds for its peer's half of a MoE layer, not for an idle server or an FFN rank
waiting milliseconds for the attention rank's next batch.

`SpinPolicy` keeps the length of the last `history` waits and spins (for up to `max_s`) only
while at least a quarter of them ended within `max_s`: a run of long waits (idle, or a peer that
is busy for longer than the look would last) turns the spinning off, a couple of short ones turn
it back on. It starts on. A quarter, not a half: an AFD FFN rank at concurrency 1 waits once per
step for the next step's descriptor and once for its first MoE layer, both longer than the rest,
and with a half the spinning flickered off and on with those (about half of its waits).

With `idle`, a thread looks under Linux's SCHED_IDLE policy (`looking()`) and is back under
SCHED_OTHER before it reads what it found. A looking rank then gives way at once to any other work
of the machine, and the kernel counts its core as free when it places a woken thread: the front end
and the clients that a stream of tokens wakes run beside it instead of preempting a rank that
computes. Measured against looking at normal priority, the gain is small, of the size of the
machine's noise (benchmarks/README.md, "Lab notes"). Changing the policy costs two system calls
per look; where the kernel refuses the way back (no CAP_SYS_NICE and an RLIMIT_NICE under 20),
threads look at normal priority.

The price: a thread under SCHED_IDLE runs only when nothing else wants its core, so beside a
process that keeps that core busy it sees its message late (the scheduler leaves it a sliver of
the core: hundreds of milliseconds where normal priority takes a few), and under bursts of other
work (a front end taking in 32 requests at once) a look is late by their length. A look that
overruns its window by STARVED_S was kept off the CPU that way: the next BACKOFF_LOOKS looks run at
normal priority, twice as many after each further such look (up to MAX_BACKOFF_LOOKS), and back to
BACKOFF_LOOKS after as many clean looks at idle priority. So a busy neighbour costs a few late looks, spaced further
and further apart, and a server whose load comes and goes looks at idle priority while it is
quiet. The first such look is logged as a warning.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("afd.comm")
STARVED_S = 0.02  # a look at idle priority this much past its window was kept off the CPU
BACKOFF_LOOKS = 1000  # looks at normal priority after the first such look (doubling per further one)
MAX_BACKOFF_LOOKS = BACKOFF_LOOKS << 12


class SpinPolicy:
    """max_s: the longest look (0: never spin); history: the waits the decision looks back on;
    idle: look at idle priority where the OS allows, backing off for `backoff_looks` looks (twice
    as many after each further one) after a look kept off the CPU (module docstring)."""

    def __init__(
        self,
        max_s: float,
        history: int = 8,
        idle: bool = False,
        backoff_looks: int = BACKOFF_LOOKS,
        clock=time.perf_counter,
    ) -> None:
        if max_s < 0:
            raise ValueError(f"max_s must be >= 0, got {max_s}")
        self.max_s = max_s
        self.idle = idle and idle_priority_supported()
        self.starved = 0  # looks at idle priority kept off the CPU (past their window by STARVED_S)
        self._base = self._backoff = backoff_looks
        self._normal_left = 0  # looks still to run at normal priority after the last such look
        self._clean = 0  # looks at idle priority since then
        self._clock = clock
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

    @contextmanager
    def looking(self, window_s: float) -> Iterator[None]:
        """The calling thread's look of up to `window_s`: with `idle`, under SCHED_IDLE inside the
        block unless backing off (a thread under another policy than SCHED_OTHER, set by its
        owner, keeps it)."""
        lowered = self.idle and not self._normal_left and os.sched_getscheduler(0) == os.SCHED_OTHER
        if lowered:
            os.sched_setscheduler(0, os.SCHED_IDLE, _PARAM)
            start = self._clock()
        elif self._normal_left:
            self._normal_left -= 1
        try:
            yield
        finally:
            if lowered:
                os.sched_setscheduler(0, os.SCHED_OTHER, _PARAM)
                self._after_idle_look(self._clock() - start > window_s + STARVED_S)

    def _after_idle_look(self, starved: bool) -> None:
        if not starved:
            self._clean += 1
            if self._clean >= self._base:  # a clean stretch: the next back-off starts short again
                self._backoff = self._base
            return
        self.starved += 1
        self._normal_left, self._clean = self._backoff, 0
        (log.warning if self.starved == 1 else log.debug)(
            "a thread looking for messages at idle priority was kept off the CPU by other work on its core "
            "(%d such looks so far); its next %d looks run at normal priority",
            self.starved,
            self._backoff,
        )
        self._backoff = min(2 * self._backoff, MAX_BACKOFF_LOOKS)


_PARAM = os.sched_param(0) if hasattr(os, "sched_param") else None


@functools.cache
def idle_priority_supported() -> bool:
    """Whether a thread of this process may go to SCHED_IDLE and back to SCHED_OTHER: Linux, with
    CAP_SYS_NICE or an RLIMIT_NICE of 20 (without either the kernel refuses the way back). Tried
    once, on a thread made for it."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    ok = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, _PARAM)
            os.sched_setscheduler(0, os.SCHED_OTHER, _PARAM)
        except OSError:  # refused (the thread ends here, whatever its policy)
            return
        ok.append(True)

    thread = threading.Thread(target=probe, name="sched-idle-probe")
    thread.start()
    thread.join()
    return bool(ok)
