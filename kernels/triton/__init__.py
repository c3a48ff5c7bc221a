"""Triton kernels (backend name `triton`). Importing a module of this package imports triton, so
only the backend registry imports them, and only when the `triton` backend is chosen.

On a machine without a CUDA GPU the same kernels run under Triton's interpreter
(`TRITON_INTERPRET=1`, set before the first import): slow, for correctness tests at small shapes.
"""
