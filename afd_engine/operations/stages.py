"""Operations and stages: a layer's forward written once, cut into stages at `YieldOperation`.

A forward is a flat list of operations on ONE micro-batch's state, with markers where the
micro-batch hands control to the next one::

    [attn, gate, dispatch, YieldOperation(), shared, YieldOperation(), YieldOperation(), combine]
     \\_______ stage 0 _____/                 \\_ 1 _/                  (2: nop)          \\_ 3 _/

Markers are separators, so k markers always make k + 1 stages: two markers in a row make an
explicit empty (nop) stage, a leading marker an empty first stage, a trailing one an empty last
stage. Empty stages run nothing; they only hold a place in the interleaving (see executor.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any


class YieldOperation:
    """Stage boundary marker. Put an instance (or the class itself) between operations."""

    def __repr__(self) -> str:
        return "YieldOperation()"


@dataclass(frozen=True)
class Operation:
    """One step of a micro-batch's forward: `fn(state)`, with a name for traces and errors and,
    for a layer's operations, the layer it belongs to."""

    name: str
    fn: Callable[[Any], Any]
    layer: int | None = None

    def __call__(self, state: Any) -> None:
        self.fn(state)


# A stage is the operations one micro-batch runs before yielding; it may be empty (a nop stage).
Stage = tuple[Operation, ...]


def is_yield(item: object) -> bool:
    """True for the marker class and its instances."""
    return item is YieldOperation or isinstance(item, YieldOperation)


def as_operation(item: object) -> Operation:
    """Wrap a plain callable into an `Operation` named after it (functions keep their __name__)."""
    if isinstance(item, Operation):
        return item
    if not callable(item):
        raise TypeError(f"an operation must be callable(state) or a YieldOperation, got {item!r}")
    return Operation(_callable_name(item), item)


def _callable_name(fn: Callable) -> str:
    # functools.partial and callable objects have no __name__ of their own.
    inner = getattr(fn, "func", fn)
    return getattr(inner, "__name__", None) or type(fn).__name__


def split_stages(ops: Iterable[object]) -> list[Stage]:
    """Cut a flat operation list at its `YieldOperation` markers: k markers give k + 1 stages."""
    stages: list[Stage] = []
    current: list[Operation] = []
    for item in ops:
        if is_yield(item):
            stages.append(tuple(current))
            current = []
        else:
            current.append(as_operation(item))
    stages.append(tuple(current))
    return stages


def repeat_layers(make_layer_ops: Callable[[int], Sequence[object]], num_layers: int) -> list[object]:
    """The whole model's operation list: the per-layer lists of layers 0..num_layers-1, concatenated.

    Nothing is inserted between layers, so a stage may span two layers: a layer list that ends
    without a marker continues its last stage into the next layer's first operations (the A side's
    "shared expert of layer l .. dispatch of layer l+1" stage), and one that ends with a marker
    starts the next layer on a fresh stage.
    """
    if num_layers < 0:
        raise ValueError(f"num_layers must be >= 0, got {num_layers}")
    ops: list[object] = []
    for layer in range(num_layers):
        ops.extend(make_layer_ops(layer))
    return ops
