"""Messages on the A <-> F data plane: a typed header plus a list of tensors.

Every message names the (step, layer, micro-batch) it belongs to. Channels are FIFO per
(source, kind), so a receiver that expects key K and finds another key at the head of the
channel has found a desynchronised peer: it raises at once instead of waiting or mixing data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch


class CommError(RuntimeError):
    """A transport or protocol failure (timeout, mismatched message, closed peer).

    Its own base class: the comm library does not depend on the rest of the engine."""


class CommTimeout(CommError):
    pass


class KeyMismatchError(CommError):
    pass


@dataclass(frozen=True, order=True)
class MsgKey:
    step: int
    layer: int
    micro_batch: int

    def __str__(self) -> str:
        return f"(step {self.step}, layer {self.layer}, micro-batch {self.micro_batch})"


@dataclass
class Message:
    """kind: what the payload is ("dispatch", "forward", "expert_out", "combine", ...).
    src: the sending endpoint's id. meta: small JSON-able values. tensors: the payload."""

    kind: str
    key: MsgKey
    src: int
    tensors: list[torch.Tensor] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def header(self) -> bytes:
        """The header as bytes: kind, key, src, meta and each tensor's dtype and shape."""
        return json.dumps(
            {
                "kind": self.kind,
                "key": [self.key.step, self.key.layer, self.key.micro_batch],
                "src": self.src,
                "meta": self.meta,
                "tensors": [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in self.tensors],
            }
        ).encode()

    def encode(self) -> list[bytes | memoryview]:
        """Frames: the header, then each tensor's raw bytes (no copy for contiguous CPU tensors)."""
        return [self.header()] + [_raw(t) for t in self.tensors]

    @staticmethod
    def decode(frames: list) -> Message:
        head = json.loads(bytes(frames[0]))
        tensors = [_tensor(buf, dtype, shape) for buf, (dtype, shape) in zip(frames[1:], head["tensors"])]
        return Message(head["kind"], MsgKey(*head["key"]), head["src"], tensors, head["meta"])


def _raw(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous().cpu()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _tensor(buf, dtype: str, shape: list[int]) -> torch.Tensor:
    dt = getattr(torch, dtype)
    if len(memoryview(buf)) == 0:
        return torch.empty(shape, dtype=dt)
    raw = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
    return raw.view(dt).view(shape)


def check_key(msg: Message, expected: MsgKey, kind: str) -> Message:
    if msg.key != expected or msg.kind != kind:
        raise KeyMismatchError(
            f"expected {kind} {expected} from endpoint {msg.src}, received {msg.kind} {msg.key}: "
            "the peers are out of step"
        )
    return msg
