"""The operations executor: one layer's forward written once, run over N interleaved micro-batches.

    ops = repeat_layers(lambda layer: [attn(layer), dispatch(layer), YieldOperation(),
                                       combine(layer)], num_layers)
    outputs = run_micro_batches(ops, [{"hidden": h} for h in micro_batch_inputs], delays=[0, 0, 0])

- stages.py: `YieldOperation`, `Operation`, `split_stages`, `repeat_layers`
- state.py: `MicroBatchState` (set / pop / get; leftovers are an error) and its errors
- executor.py: `run_micro_batches` and the column-major `schedule` (with a diagram)
- split.py: `split_micro_batches` (token-balanced contiguous micro-batches)
"""

from afd_engine.operations.executor import Slot, TraceEvent, run_micro_batches, schedule
from afd_engine.operations.split import split_micro_batches
from afd_engine.operations.stages import (
    Operation,
    Stage,
    YieldOperation,
    repeat_layers,
    split_stages,
)
from afd_engine.operations.state import (
    OUTPUT_KEY,
    DuplicateStateError,
    LeftoverStateError,
    MicroBatchState,
    MissingStateError,
    OperationsStateError,
)

__all__ = [
    "OUTPUT_KEY",
    "DuplicateStateError",
    "LeftoverStateError",
    "MicroBatchState",
    "MissingStateError",
    "Operation",
    "OperationsStateError",
    "Slot",
    "Stage",
    "TraceEvent",
    "YieldOperation",
    "repeat_layers",
    "run_micro_batches",
    "schedule",
    "split_micro_batches",
    "split_stages",
]
