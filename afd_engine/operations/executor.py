"""Run N micro-batches over the same stages in a fixed column-major interleaving.

Micro-batch m's row is `delays[m]` empty stages followed by the stages. Rows are laid side by
side; the executor runs column by column (left to right), and inside a column the micro-batches
top to bottom (0 first). Example: 3 stages S0..S2, delays [0, 1, 2]::

    column      0     1     2     3     4
    mb 0        S0    S1    S2
    mb 1        --    S0    S1    S2
    mb 2        --    --    S0    S1    S2

    order: 0.S0 | 0.S1 1.S0 | 0.S2 1.S1 2.S0 | 1.S2 2.S1 | 2.S2

A short row has nothing in the later columns. The order is fixed and known in advance, which is
what makes overlap work: an operation that starts asynchronous work (dispatch) returns at once,
the other micro-batches' stages run while it is in flight, and the operation that needs its
result (combine) sits in a later stage of the same row.

Designing the FFN side (N >= 2). Per layer the stages [recv] [mlp] [combine] followed by N-2 nop
stages, and delays [0, 1, ..., N-1], make the receive of micro-batch m+1 come after the combine of
m-1 and before the combine of m, across layers too (micro-batch 0 of layer l+1 follows N-1 of
layer l), so the next receive is posted while the MLP of m runs. Why: rows are staggered by one
column and combine is two stages after recv, so recv(m+1) shares the column of combine(m-1)
(below it) and comes one column before combine(m); the nops make a layer N+1 stages long, so
micro-batch 0's next recv lands in the column of combine(N-1) (above it), after combine(N-2).
An equal delay on every row only shifts the columns and cannot give this order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from afd_engine.operations.stages import Stage, as_operation, split_stages
from afd_engine.operations.state import LeftoverStateError, MicroBatchState


class Slot(NamedTuple):
    """One cell of the layout: micro-batch `micro_batch` runs `stage` (its index) in `column`."""

    column: int
    micro_batch: int
    stage: int


class TraceEvent(NamedTuple):
    """One executed operation; `column` is the stage's index in the row (delays included)."""

    micro_batch: int
    column: int
    op: str


def schedule(num_stages: int, delays: Sequence[int]) -> list[Slot]:
    """The slots in execution order: column by column, micro-batch 0 first within a column."""
    width = max(delays) + num_stages
    return [
        Slot(column, m, column - delay)
        for column in range(width)
        for m, delay in enumerate(delays)
        if 0 <= column - delay < num_stages
    ]


def run_micro_batches(
    ops: Sequence[object],
    inputs: Sequence[Mapping[str, Any]],
    delays: Sequence[int] | None = None,
    trace: list | None = None,
    run_stage: Callable[[int, MicroBatchState, Callable[[], None]], None] | None = None,
) -> list[Any]:
    """Run every micro-batch through `ops`; return each one's output (None where it set none).

    ops: a flat operation list with `YieldOperation` markers, or stages from `split_stages`.
    inputs: one mapping per micro-batch (N = len(inputs) >= 1); it becomes the initial state.
    delays: empty stages in front of each micro-batch's row (default: none).
    trace: when given, a `TraceEvent(micro_batch, column, op_name)` is appended per operation run.
    run_stage: when given, runs each stage instead: `run_stage(stage_index, state, run_ops)`, where
      `run_ops()` runs the stage's operations on the state (a runner may replay them from a graph
      instead, and restore the state they would leave: ranks/static_decode.py).

    After the run, every value other than the output must have been popped by the operations,
    otherwise `LeftoverStateError` names the keys and micro-batches.
    """
    delays = _check_delays(len(inputs), delays)
    stages = _as_stages(ops)
    states = [MicroBatchState(m, values) for m, values in enumerate(inputs)]
    for slot in schedule(len(stages), delays):
        stage, state = stages[slot.stage], states[slot.micro_batch]
        if run_stage is None:
            _run_stage(stage, state, slot.column, trace)
        else:
            run_stage(slot.stage, state, functools.partial(_run_stage, stage, state, slot.column, trace))
    outputs = [state.take_output() for state in states]
    leftovers = {state.micro_batch: state.keys() for state in states if len(state)}
    if leftovers:
        raise LeftoverStateError(leftovers)
    return outputs


def _run_stage(stage: Stage, state: MicroBatchState, column: int, trace: list | None) -> None:
    for op in stage:
        if trace is not None:
            trace.append(TraceEvent(state.micro_batch, column, op.name))
        try:
            op(state)
        except Exception as exc:
            # Same ops run for every micro-batch: say which one and where it failed.
            exc.add_note(f"in operation {op.name!r} of micro-batch {state.micro_batch} (column {column})")
            raise


def _check_delays(num_micro_batches: int, delays: Sequence[int] | None) -> list[int]:
    if num_micro_batches < 1:
        raise ValueError("run_micro_batches needs at least one micro-batch (inputs is empty)")
    if delays is None:
        return [0] * num_micro_batches
    delays = list(delays)
    if len(delays) != num_micro_batches:
        raise ValueError(f"got {len(delays)} delays for {num_micro_batches} micro-batches; give one per micro-batch")
    bad = [d for d in delays if not isinstance(d, int) or isinstance(d, bool) or d < 0]
    if bad:
        raise ValueError(f"delays must be integers >= 0, got {delays}")
    return delays


def _as_stages(ops: Sequence[object]) -> list[Stage]:
    # Stages from split_stages are tuples; an operation never is (it must be callable).
    items = list(ops)
    if items and all(isinstance(item, tuple) for item in items):
        return [tuple(as_operation(op) for op in stage) for stage in items]
    return split_stages(items)
