"""Benchmarks of the engine, each run from the repository root as ``python -m benchmarks.NAME``;
what they share (starting servers, request datasets, writing results) is in ``benchmarks.lib``."""
