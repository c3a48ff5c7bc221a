"""A kernel launch as data: what a wrapper runs, and what `kernels.aot` compiles ahead of time.

Each wrapper builds its launches in one function (`decode_launches`, `expert_launches`,
`quantize_launch`, ...) from its tensors, then calls them. `kernels.aot` calls the same function
with tensors on the meta device (shapes and dtypes, no storage), so the kernels it compiles for
sm_90 / sm_100 are the ones the wrapper launches: the same arguments, constexprs, tile sizes,
num_warps and num_stages, never a copy of them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from triton.runtime.interpreter import InterpretedFunction


class Launch(NamedTuple):
    """One kernel launch: kernel[grid](*args, **constexprs, num_warps=..., num_stages=...)."""

    kernel: Any  # a triton.jit function (an InterpretedFunction under TRITON_INTERPRET=1)
    grid: tuple[int, ...]
    args: tuple  # runtime arguments in the kernel's order: tensors, ints, floats
    constexprs: dict[str, Any]  # compile-time arguments by name
    num_warps: int = 4
    num_stages: int = 3

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages)


def is_interpreted(kernel) -> bool:
    """Whether `kernel` runs under Triton's interpreter: triton.jit makes an InterpretedFunction iff
    TRITON_INTERPRET=1 was set before triton's import. Wrappers choose the interpreter's workarounds
    (constexpr switches) from this, so GPU code never carries them."""
    return isinstance(kernel, InterpretedFunction)
