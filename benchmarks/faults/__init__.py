"""The scenarios of bench_faults.py, a module each (ffn, attention, drain, pd), and what they share:
the streaming load and its figures (streams.py), and the deployment's processes (procs.py)."""
