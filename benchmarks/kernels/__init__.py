"""Kernel and comm-library benchmarks, and the tile sweep that writes kernels/triton/configs/, each
run from the repository root as ``python -m benchmarks.kernels.NAME``: bench_kernels (kernels per
backend), tune_kernels (Triton tiles on a GPU), bench_cpu_attention (the C MLA decode kernel),
bench_comm and bench_comm_layer (the comm library), gpu_check (a GPU's first minutes: its timings,
and the correctness tests of tests/gpu)."""
