"""Process bodies for the cross-process transport tests (a module, so "spawn" can pickle them).

Each role runs in its own OS process and reports one dict through a multiprocessing queue:
("ok", name, results) or ("error", name, traceback). Tensors travel back as (dtype, shape,
raw bytes) so that the parent compares bytes exactly, float8 included.
"""

from __future__ import annotations

import hashlib
import threading
import time
import traceback

import torch

from comm.messages import CommError, Message, MsgKey

K0 = MsgKey(0, 0, 0)
WAIT = 20.0  # generous: a receive that should succeed never gets near this
RACE_DELAY = 1.0  # how much later the slow racer answers: ample margin on a loaded machine
DIST_TIMEOUT = 2.5  # the default process group's timeout in the gloo test...
DIST_IDLE = 3.0  # ...which an idle period exceeds: the transport's receives must survive it


def sample_tensors(seed: int = 0) -> list[torch.Tensor]:
    """Every dtype the data plane carries, empty tensors included, and one over 64 KiB (the
    size above which pyzmq sends without copying)."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(3, 4, generator=g),
        torch.randn(2, 5, generator=g).to(torch.bfloat16),
        torch.randn(4, 8, generator=g).to(torch.float8_e4m3fn),
        torch.randint(-(2**40), 2**40, (6,), generator=g),
        torch.randint(-(2**20), 2**20, (2, 3), generator=g, dtype=torch.int32),
        torch.empty(0, 3),
        torch.empty(0, dtype=torch.bfloat16),
        torch.empty(2, 0, dtype=torch.float8_e4m3fn),
        torch.randn(128, 160, generator=g),
    ]


def wire(tensors: list[torch.Tensor]) -> list[tuple[str, list[int], bytes]]:
    """(dtype, shape, raw bytes) of each tensor: what "exactly the same" means."""
    return [
        (str(t.dtype), list(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()) for t in tensors
    ]


def run_role(role, name: str, results, *args) -> None:
    torch.set_num_threads(1)
    try:
        results.put(("ok", name, role(*args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put(("error", name, traceback.format_exc()))


def timed_error(fn) -> tuple[str, str, float]:
    """(exception type, message, seconds until it was raised) of fn(), which must raise."""
    start = time.monotonic()
    try:
        fn()
    except CommError as e:
        return type(e).__name__, str(e), time.monotonic() - start
    raise AssertionError("expected a CommError")


# -- ZeroMQ and shared memory: one scenario, built by make_transport(kind, endpoint, **kwargs) ------


def big_tensor(seed: int) -> torch.Tensor:
    """3 MiB: larger than the rings the shared-memory tests give their endpoints."""
    return torch.randn(3 << 18, generator=torch.Generator().manual_seed(seed))


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def early_sender(kind: str, kwargs: dict, sent) -> dict:
    """Endpoint 1: sends before endpoint 0 exists (a large message too), then answers "go" late
    (the slow racer); reports the digest of the large message endpoint 0 sends back."""
    from comm.transport.factory import make_transport

    t = make_transport(kind, 1, **kwargs)
    t.send(0, Message("data", K0, 1, sample_tensors(1), {"note": "early"}))
    t.send(0, Message("check", MsgKey(0, 0, 1), 1))
    t.send(0, Message("big", K0, 1, [big_tensor(1)]))
    sent.set()
    back = t.recv(0, "big", K0, WAIT).tensors[0]
    t.recv(0, "go", K0, WAIT)
    time.sleep(RACE_DELAY)
    t.send(0, Message("race", K0, 1))
    t.recv(0, "done", K0, WAIT)
    inline = inline_frames(t)
    t.close()
    return {"big_back": digest(back), "inline": inline}


def inline_frames(t) -> int | None:
    """Frames a shared-memory transport with a payload area sent as bytes, being larger than the
    area (None for other transports)."""
    counts = [getattr(out.medium, "inline", None) for out in getattr(t, "_outboxes", {}).values()]
    return None if not counts or None in counts else sum(counts)


def fast_racer(kind: str, kwargs: dict) -> dict:
    """Endpoint 2: answers "go" at once."""
    from comm.transport.factory import make_transport

    t = make_transport(kind, 2, **kwargs)
    t.recv(0, "go", K0, WAIT)
    t.send(0, Message("race", K0, 2))
    t.recv(0, "done", K0, WAIT)
    t.close()
    return {}


def late_receiver(kind: str, kwargs: dict) -> dict:
    """Endpoint 0, started after endpoint 1 has sent: collects everything the parent checks."""
    from comm.transport.factory import make_transport

    t = make_transport(kind, 0, **kwargs)
    big = t.recv(1, "big", K0, WAIT).tensors[0]
    t.send(1, Message("big", K0, 0, [big_tensor(2)]))
    out = receive_checks(t, data_from=1)
    out["big"] = digest(big)
    t.close()
    return out


def receive_checks(t, data_from: int) -> dict:
    """The receiver side shared by both backends: data, key mismatch, timeout, recv_any."""
    data = t.recv(data_from, "data", K0, WAIT)
    out = {"data": wire(data.tensors), "data_src": data.src, "data_meta": data.meta}
    out["mismatch"] = timed_error(lambda: t.recv(data_from, "check", K0, 5.0))
    out["timeout"] = timed_error(lambda: t.recv(2, "never", MsgKey(7, 8, 9), 0.5))
    for peer in (1, 2):
        t.send(peer, Message("go", K0, 0))
    start = time.monotonic()
    first = t.recv_any([1, 2], "race", K0, WAIT)
    out["race"] = [(first.src, time.monotonic() - start), (t.recv_any([1, 2], "race", K0, WAIT).src, 0.0)]
    for peer in (1, 2):
        t.send(peer, Message("done", K0, 0))
    return out


# -- torch.distributed (gloo) ------------------------------------------------------------------


def dist_rank(rank: int, init_method: str, started) -> dict:
    """One of three gloo ranks: 0 is the receiver of `receive_checks`, 1 the slow racer that
    also sends the data after an idle period longer than the process group's timeout, 2 the fast
    racer. Rank 0 sends data to 1 and 2 while they send to it: traffic flows both ways at once."""
    import torch.distributed as dist

    from comm.transport.torch_dist import TorchDistTransport, init_torch_dist

    started.wait(30)  # every rank has imported torch: the rendezvous fits the short timeout
    init_torch_dist("gloo", rank, 3, init_method, timeout_s=DIST_TIMEOUT)
    t = TorchDistTransport("cpu", close_timeout_s=10)
    try:
        out = DIST_ROLES[rank](t)
        out["close"] = close_while_receiving(t)
        out["threads_alive"] = [th.name for th in threading.enumerate() if th.name.startswith("torch-dist")]
    finally:
        t.close()
        dist.destroy_process_group()
    return out


def dist_receiver(t) -> dict:
    for peer in (1, 2):
        t.send(peer, Message("data", K0, 0, sample_tensors(10 + peer)))
    return receive_checks(t, data_from=1)


def dist_slow_racer(t) -> dict:
    time.sleep(DIST_IDLE)
    t.send(0, Message("data", K0, 1, [*sample_tensors(1), torch.tensor(2.5)], {"note": "gloo"}))
    t.send(0, Message("check", MsgKey(0, 0, 1), 1))
    back = t.recv(0, "data", K0, WAIT)
    t.recv(0, "go", K0, WAIT)
    time.sleep(RACE_DELAY)
    t.send(0, Message("race", K0, 1))
    t.recv(0, "done", K0, WAIT)
    return {"back": wire(back.tensors)}


def dist_fast_racer(t) -> dict:
    back = t.recv(0, "data", K0, WAIT)
    t.recv(0, "go", K0, WAIT)
    t.send(0, Message("race", K0, 2))
    t.recv(0, "done", K0, WAIT)
    return {"back": wire(back.tensors), "send_to_closed": send_until_refused(t, 1)}


def send_until_refused(t, dst: int) -> str:
    """Sends to dst until the transport refuses because dst has closed (dst closes soon)."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        try:
            t.send(dst, Message("late", K0, t.endpoint))
        except CommError as e:
            return str(e)
        time.sleep(0.05)
    return "never refused"


DIST_ROLES = {0: dist_receiver, 1: dist_slow_racer, 2: dist_fast_racer}


def close_while_receiving(t) -> tuple[str, float]:
    """A receive blocked in another thread must fail promptly when the transport closes:
    (what it raised, seconds from the start of close() to that failure)."""
    raised: list = []
    waiter = threading.Thread(target=record_failure, args=(raised, lambda: t.recv(0, "never", K0, 30.0)))
    waiter.start()
    time.sleep(0.2)
    start = time.monotonic()
    t.close()
    waiter.join(5.0)
    return (raised[0][0], raised[0][1] - start) if raised else ("nothing", float("inf"))


def record_failure(raised: list, fn) -> None:
    """Runs fn, which should raise a CommError; records its type name and when it was raised."""
    try:
        fn()
    except CommError as e:
        raised.append((type(e).__name__, time.monotonic()))


def echo(kind: str, kwargs: dict, rounds: int) -> dict:
    """Endpoint 1: sends back each of endpoint 0's `rounds` pings as it comes."""
    from comm.transport.factory import make_transport

    t = make_transport(kind, 1, **kwargs)
    try:
        for i in range(rounds):
            ping = t.recv(0, "ping", MsgKey(i, 0, 0), WAIT)
            t.send(0, Message("pong", ping.key, 1, ping.tensors))
    finally:
        t.close()
    return {}
