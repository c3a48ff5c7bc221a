"""How an attention rank tells its FFN ranks alive (fault tolerance): each FFN rank sends every
attention rank a heartbeat every HEARTBEAT_S from a thread of its own (HeartbeatSender), and an
attention rank counts an FFN rank lost once its current process has sent none for --comm-timeout,
or, on the same machine, has exited (FfnLiveness).

A heartbeat names its process: its incarnation (0 for the first process at an endpoint, 1 for
its first replacement, ...), so that a lost process's heartbeats, arriving late or from a process
that came back, say nothing of its replacement; and its pid and process space, so that a rank of
the same machine sees it exit at once instead of waiting out the timeout. It also carries the most
expert slots the rank may hold (ranks/expert_capacity.py), which recoveries plan within.
"""

from __future__ import annotations

import os
import threading
import time

from afd_engine.ranks.fault_tolerance import HEARTBEAT, HEARTBEAT_S, ffn_rank, heartbeat_key
from comm.messages import CommError, CommTimeout, KeyMismatchError, Message
from comm.transport.base import Transport


def process_space() -> str:
    """Equal for two processes exactly when each can look the other up by pid: the same running
    kernel and pid namespace ("" where that cannot be told)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() + ":" + os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def process_exited(pid: int) -> bool:
    """Whether process `pid` (of this process space) has exited: gone, or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def _incarnation(beat: Message) -> int:
    return beat.meta.get("incarnation", 0)


class HeartbeatSender:
    """An FFN rank's heartbeats to every attention rank, whatever its main thread is doing (a
    rank blocked on a lost peer is alive too)."""

    def __init__(
        self, transport: Transport, endpoint: int, senders: list[int], incarnation: int, rank: int, cap: int | None
    ) -> None:
        """`cap`: the most expert slots per MoE layer this rank may hold (None: it never grows)."""
        self.transport, self.endpoint, self.senders = transport, endpoint, senders
        self.incarnation, self.rank, self.cap = incarnation, rank, cap
        self._stopped = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._run, name=f"heartbeat-{self.rank}", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        who = {"pid": os.getpid(), "space": process_space(), "incarnation": self.incarnation, "cap": self.cap}
        count = 0
        while not self._stopped.wait(HEARTBEAT_S):
            try:
                for ep in self.senders:
                    self.transport.send(ep, Message(HEARTBEAT, heartbeat_key(count), self.endpoint, meta=who))
            except CommError:  # the transport closed: the rank is stopping
                return
            count += 1


class FfnLiveness:
    """An attention rank's watch over FFN endpoints: the heartbeats of each one's current process
    (`incarnations`), and why one counts lost."""

    def __init__(self, transport: Transport, topology, comm_timeout: float, endpoints: list[int]) -> None:
        self.transport, self.topology, self.comm_timeout = transport, topology, comm_timeout
        self.incarnations = dict.fromkeys(endpoints, 0)  # FFN endpoint -> its current process's incarnation
        self.expected = dict.fromkeys(endpoints, 0)  # next heartbeat id expected from each FFN endpoint
        self.heard = dict.fromkeys(endpoints, time.monotonic())  # when each last sent one
        self.beating: set[int] = set()  # FFN endpoints whose current process has sent a heartbeat
        self.pids: dict[int, int] = {}  # FFN endpoint -> its pid, where this rank can look it up
        self.caps: dict[int, int] = {}  # FFN rank -> the most expert slots it may hold, as its heartbeats say
        self.space = process_space()
        self.checked = 0.0  # when lost() last looked

    def lost(self, endpoints: list[int]) -> dict[int, str]:
        """The FFN ranks (not endpoints) among `endpoints` that have sent no heartbeat for
        --comm-timeout, or whose process (on this machine) has exited: rank -> why."""
        now = self.checked = time.monotonic()
        for ep in endpoints:
            self.take_heartbeats(ep, now)
        lost = {}
        for ep in endpoints:
            rank = ffn_rank(self.topology, ep)
            if ep in self.pids and process_exited(self.pids[ep]):
                lost[rank] = "its process exited"
            elif now - self.heard[ep] > self.comm_timeout:
                lost[rank] = f"no heartbeat for {now - self.heard[ep]:.1f} s" + (
                    "" if ep in self.beating else " (none ever: was it started without --enable-ffn-fault-tolerance?)"
                )
        return lost

    def take_heartbeats(self, ep: int, now: float) -> None:
        """Every heartbeat ep's current process has sent; a lost process's (an older incarnation,
        over ZeroMQ, or one that came back after it was given up) are dropped."""
        while True:
            try:
                beat = self.transport.recv(ep, HEARTBEAT, heartbeat_key(self.expected[ep]), 0.0)
            except CommTimeout:
                return
            except KeyMismatchError:  # not the next one expected: take it whatever its id
                beat = self.transport.inbox.pop(ep, HEARTBEAT)
                if beat is None:
                    return
                if _incarnation(beat) == self.incarnations.get(ep, 0):
                    self.expected[ep] = beat.key.step  # the current process's: count on from it
            if _incarnation(beat) != self.incarnations.get(ep, 0):
                continue
            self.expected[ep] += 1
            self.heard[ep] = now
            self.beating.add(ep)
            if beat.meta.get("cap") is not None:
                self.caps[ffn_rank(self.topology, ep)] = beat.meta["cap"]
            if self.space and beat.meta.get("space") == self.space:
                self.pids[ep] = beat.meta["pid"]

    def restart(self, ep: int, now: float) -> None:
        """Watches ep's new process (a replacement just linked to) from its first heartbeat on."""
        self.expected[ep], self.heard[ep] = 0, now
        self.pids.pop(ep, None)
        self.caps.pop(ffn_rank(self.topology, ep), None)
        self.beating.discard(ep)

    def keep_only(self, endpoints: list[int]) -> None:
        """Forgets the endpoints not in `endpoints` (the lost ones, after a recovery)."""
        self.heard = {ep: self.heard[ep] for ep in endpoints}


class PeerProcesses:
    """An attention rank's watch over its attention peers (fault tolerance): their processes, from
    the pid and process space every agreement round carries, and whether one has exited. Attention
    ranks run beside the front end, on one machine, so an exit is seen at once; a peer in another
    process space is never counted lost here (its silence fails the round as without fault
    tolerance)."""

    def __init__(self) -> None:
        self.space = process_space()
        self.me = {"pid": os.getpid(), "space": self.space}
        self.pids: dict[int, int] = {}  # attention endpoint -> its pid, where this rank can look it up

    def heard(self, endpoint: int, meta: dict) -> None:
        """Takes note of a peer's process from its round meta."""
        if endpoint not in self.pids and self.space and meta.get("space") == self.space:
            self.pids[endpoint] = meta["pid"]

    def exited(self, endpoints: list[int]) -> list[int]:
        """The endpoints among `endpoints` whose process has exited."""
        return [ep for ep in endpoints if ep in self.pids and process_exited(self.pids[ep])]
