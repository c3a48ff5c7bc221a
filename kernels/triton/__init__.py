"""Triton kernels (backend name `triton`). Importing a module of this package imports triton, so
only the backend registry imports them, and only when the `triton` backend is chosen.

On a machine without a CUDA GPU the same kernels run under Triton's interpreter
(`TRITON_INTERPRET=1`, set before the first import): slow, for correctness tests at small shapes.

No RMSNorm kernel: RMSNorm (with or without the residual add) is an elementwise, memory-bound
pass that torch's fused `rms_norm` already does in one read and one write; a Triton kernel fusing
the residual add would save one pass over the hidden states per layer, which is worth writing only
once a GPU can show that pass matters next to attention and the experts.
"""
