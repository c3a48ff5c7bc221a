"""Messages on the A <-> F data plane: a typed header plus a list of tensors.

Every message names the (step, layer, micro-batch) it belongs to. Channels are FIFO per
(source, kind), so a receiver that expects key K and finds another key at the head of the
channel has found a desynchronised peer: it raises at once instead of waiting or mixing data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import msgpack
import torch


class CommError(RuntimeError):
    """A transport or protocol failure (timeout, mismatched message, closed peer).

    Its own base class: the comm library does not depend on the rest of the engine."""


class CommTimeout(CommError):
    pass


class KeyMismatchError(CommError):
    pass


class MalformedMessage(CommError):
    """Bytes that are not a message of this protocol (a stray or hostile peer, a truncated frame):
    the receiver drops them, logs, and goes on. Checked before anything a header claims is
    allocated."""


MAX_DIMS = 8  # a tensor on the wire has at most this many dimensions


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
    src: the sending endpoint's id. meta: small values msgpack carries (str keys, as in JSON).
    tensors: the payload."""

    kind: str
    key: MsgKey
    src: int
    tensors: list[torch.Tensor] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def header(self) -> bytes:
        """The header as bytes (one msgpack array): kind, key, src, meta and each tensor's dtype and
        shape. About 1 us to pack and to parse, where JSON took 4-5 us each way (per message)."""
        specs = [(_dtype_name(t.dtype), t.shape) for t in self.tensors]
        key = self.key
        return msgpack.packb([self.kind, key.step, key.layer, key.micro_batch, self.src, self.meta, specs])

    @staticmethod
    def parse_header(raw) -> tuple[Message, list[tuple[torch.dtype, list[int]]]]:
        """The inverse of `header`: the message without its tensors, and each tensor's (dtype, shape).
        Raises MalformedMessage for anything `header` could not have written."""
        try:
            fields_ = msgpack.unpackb(raw, strict_map_key=False)
        except Exception as exc:  # noqa: BLE001 - msgpack raises several kinds for bad bytes
            raise MalformedMessage(f"the header is not msgpack: {type(exc).__name__}") from None
        if not (isinstance(fields_, list) and len(fields_) == 7):
            raise MalformedMessage("the header is not a 7-field array")
        kind, step, layer, micro_batch, src, meta, specs = fields_
        ints = (step, layer, micro_batch, src)
        if not (isinstance(kind, str) and all(type(v) is int for v in ints) and isinstance(meta, dict)):
            raise MalformedMessage("the header's kind, key, source or meta has the wrong type")
        if not isinstance(specs, list) or not all(_valid_spec(spec) for spec in specs):
            raise MalformedMessage("a tensor spec is not [known dtype, shape of at most 8 sizes >= 0]")
        return Message(kind, MsgKey(step, layer, micro_batch), src, [], meta), [(_DTYPES[d], s) for d, s in specs]

    def encode(self) -> list[bytes | memoryview]:
        """Frames: the header, then each tensor's raw bytes (no copy for contiguous CPU tensors)."""
        return [self.header()] + [_raw(t) for t in self.tensors]

    @staticmethod
    def decode(frames: list) -> Message:
        """The inverse of `encode`; MalformedMessage unless the frames are exactly the header and
        one frame per tensor of the size its dtype and shape give (checked before any copy)."""
        if not frames:
            raise MalformedMessage("no frames")
        msg, specs = Message.parse_header(frames[0])
        if len(frames) != 1 + len(specs):
            raise MalformedMessage(f"{len(frames) - 1} payload frames for {len(specs)} tensors")
        for buf, (dtype, shape) in zip(frames[1:], specs):
            want = math.prod(shape) * dtype.itemsize
            if len(memoryview(buf)) != want:
                raise MalformedMessage(f"a {dtype} {list(shape)} tensor needs {want} bytes, its frame has {len(buf)}")
        msg.tensors = [_tensor(buf, dtype, shape) for buf, (dtype, shape) in zip(frames[1:], specs)]
        return msg


_DTYPES = {  # wire name -> dtype, for every dtype a tensor can travel in
    str(dt).removeprefix("torch."): dt
    for dt in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
    + (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
}
_NAMES = {dt: name for name, dt in _DTYPES.items()}


def _valid_spec(spec) -> bool:
    """Whether `spec` is [dtype name, shape] as `header` writes it."""
    if not (isinstance(spec, list) and len(spec) == 2 and spec[0] in _DTYPES and isinstance(spec[1], list)):
        return False
    shape = spec[1]
    return len(shape) <= MAX_DIMS and all(type(n) is int and n >= 0 for n in shape)


def _dtype_name(dtype: torch.dtype) -> str:
    name = _NAMES.get(dtype)
    if name is None:
        raise CommError(f"tensors of {dtype} cannot travel; use one of {', '.join(_DTYPES)}")
    return name


def _raw(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous().cpu()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _tensor(buf, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    if len(memoryview(buf)) == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
    return raw.view(dtype).view(shape)


def check_key(msg: Message, expected: MsgKey, kind: str) -> Message:
    if msg.key != expected or msg.kind != kind:
        raise KeyMismatchError(
            f"expected {kind} {expected} from endpoint {msg.src}, received {msg.kind} {msg.key}: "
            "the peers are out of step"
        )
    return msg
