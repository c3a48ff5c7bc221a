"""Strategies: how a mode arranges the model's operations into stages for the executor.

A model hands out its forward as named operations (`ModelOps`: head, one `LayerOps` per decoder
layer, tail). A strategy decides only where `YieldOperation`s go, whether the rank also serves
its own experts, and the per-micro-batch delays; it never changes what an operation computes.
So single mode, the attention ranks of colocated and AFD deployments, and the FFN ranks all run
the same layer code. Op lists of a MoE layer (`|` is a YieldOperation)::

    single        attention gate dispatch shared_expert combine join
    afd-attention attention gate dispatch shared_expert | combine join
    colocated     attention gate dispatch shared_expert | post_dispatch receive experts send_combine
                  combine join
    afd-ffn       post_dispatch | receive experts | send_combine | (N-2 nops), delays 0..N-1
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from afd_engine.operations.stages import Operation, YieldOperation, is_yield


@dataclass(frozen=True)
class LayerOps:
    """One decoder layer's operations: `ops` on the attention side, in order; `serve` the expert
    side for the experts this rank holds (post_dispatch, receive, experts, send_combine), if any."""

    layer_id: int
    is_moe: bool
    ops: tuple[Operation, ...]
    serve: tuple[Operation, ...] = ()


@dataclass(frozen=True)
class ModelOps:
    head: tuple[Operation, ...]
    layers: tuple[LayerOps, ...]
    tail: tuple[Operation, ...]

    def wrap(self, name: str, wrapper: Callable[[Operation], Operation]) -> ModelOps:
        """The same operations, with every MoE layer's operation called `name` replaced by
        `wrapper(op)` (timing spans and injected delays of experiments)."""

        def swap(ops: tuple[Operation, ...]) -> tuple[Operation, ...]:
            return tuple(wrapper(op) if op.name == name else op for op in ops)

        layers = tuple(
            dataclasses.replace(la, ops=swap(la.ops), serve=swap(la.serve)) if la.is_moe else la for la in self.layers
        )
        return dataclasses.replace(self, layers=layers)


@dataclass(frozen=True)
class Strategy:
    """An attention-side arrangement: a YieldOperation before the op named `yield_before` of every
    MoE layer, and this rank's expert-serving ops before the op named `serve_before`."""

    name: str
    yield_before: str | None = None
    serve_before: str | None = None

    def arrange(self, model: ModelOps) -> list[object]:
        out: list[object] = list(model.head)
        for layer in model.layers:
            for op in layer.ops:
                if layer.is_moe and op.name == self.yield_before:
                    out.append(YieldOperation())
                if layer.is_moe and op.name == self.serve_before:
                    out.extend(layer.serve)
                out.append(op)
        return out + list(model.tail)

    def delays(self, num_micro_batches: int) -> list[int]:
        return [0] * num_micro_batches


SINGLE = Strategy("single")
AFD_ATTENTION = Strategy("afd-attention", yield_before="combine")
COLOCATED = Strategy("colocated", yield_before="combine", serve_before="combine")


@dataclass(frozen=True)
class FfnStrategy:
    """An FFN rank: per MoE layer [post_dispatch] [receive experts] [send_combine] and N-2 empty
    stages, rows staggered by one, so the receive of micro-batch m+1 is posted before the combine
    of m (see executor.py for why this order follows)."""

    name: str = "afd-ffn"

    def arrange(self, model: ModelOps, num_micro_batches: int) -> list[object]:
        out: list[object] = []
        for layer in model.layers:
            if not layer.serve:
                continue
            post, receive, experts, send = layer.serve
            out += [post, YieldOperation(), receive, experts, YieldOperation(), send]
            out += [YieldOperation()] * max(num_micro_batches - 1, 1)
        return out

    def delays(self, num_micro_batches: int) -> list[int]:
        return list(range(num_micro_batches))


AFD_FFN = FfnStrategy()


def describe(arranged: list[object]) -> str:
    """The arranged list as text: operation names, `|` for each YieldOperation."""
    return " ".join("|" if is_yield(item) else item.name for item in arranged)
