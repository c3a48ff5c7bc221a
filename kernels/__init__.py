"""Compute kernels: a torch reference for every op (runs anywhere), GPU kernels picked by device.

Nothing GPU-only is imported at module import time.
"""
