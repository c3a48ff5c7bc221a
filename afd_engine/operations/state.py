"""Per-micro-batch state: the only channel between the operations of one micro-batch.

Each micro-batch owns one `MicroBatchState`, filled from its inputs. Operations `pop` what they
consume and `set` what they produce, so that at the end of a run the state holds only the output;
anything else left over means an operation forgot to consume a value (or one consumer is missing),
which the executor reports instead of silently dropping tensors or leaking them to the next step.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

# The key whose value is the micro-batch's result; every other key must be consumed by the end.
OUTPUT_KEY = "output"


class OperationsStateError(RuntimeError):
    """Misuse of a micro-batch state by the operations (a bug in a layer's op list)."""


class MissingStateError(OperationsStateError, KeyError):
    """An operation popped or read a key the micro-batch does not hold."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


class DuplicateStateError(OperationsStateError):
    """An operation set a key that is already held (the previous value was never consumed)."""


class LeftoverStateError(OperationsStateError):
    """Keys other than the output were still held at the end of a run."""

    def __init__(self, leftovers: Mapping[int, tuple[str, ...]]) -> None:
        self.leftovers = dict(leftovers)  # micro-batch -> keys left over
        parts = [f"micro-batch {m} still holds {list(keys)}" for m, keys in sorted(self.leftovers.items())]
        super().__init__("operations must pop every value they consume: " + "; ".join(parts))


class MicroBatchState:
    """Named values of one micro-batch: `set` / `pop` / `get` / `in`, plus `set_output`."""

    __slots__ = ("_values", "micro_batch")

    def __init__(self, micro_batch: int, values: Mapping[str, Any] | None = None) -> None:
        self.micro_batch = micro_batch
        self._values: dict[str, Any] = dict(values or {})

    def set(self, name: str, value: Any) -> None:
        """Store `value`; a key already held is an error (pop the old value first to replace it)."""
        if name in self._values:
            raise DuplicateStateError(
                f"micro-batch {self.micro_batch} already holds {name!r}; pop it before setting it again"
            )
        self._values[name] = value

    def pop(self, name: str) -> Any:
        """Remove and return `name`; raises `MissingStateError` naming the key and the micro-batch."""
        if name not in self._values:
            raise self._missing(name)
        return self._values.pop(name)

    def get(self, name: str, default: Any = None) -> Any:
        """Read without consuming (for values several operations need, popped by the last one)."""
        return self._values.get(name, default)

    def __getitem__(self, name: str) -> Any:
        if name not in self._values:
            raise self._missing(name)
        return self._values[name]

    def set_output(self, value: Any) -> None:
        """Store the micro-batch's result (returned by the executor)."""
        self.set(OUTPUT_KEY, value)

    def take_output(self) -> Any:
        """Pop the result, or None when the operations produced none (e.g. the FFN side)."""
        return self._values.pop(OUTPUT_KEY, None)

    def snapshot(self) -> dict[str, Any]:
        """Every value held, by name (a copy of the mapping, not of the values)."""
        return dict(self._values)

    def restore(self, values: Mapping[str, Any]) -> None:
        """Holds exactly `values` from now on: what a stage replayed from a graph leaves behind."""
        self._values = dict(values)

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def keys(self) -> tuple[str, ...]:
        return tuple(self._values)

    def __repr__(self) -> str:
        return f"MicroBatchState(micro_batch={self.micro_batch}, keys={list(self._values)})"

    def _missing(self, name: str) -> MissingStateError:
        return MissingStateError(
            f"micro-batch {self.micro_batch} holds no {name!r} (it holds {list(self._values)}); "
            "was it never set, or already popped by an earlier operation?"
        )
