"""Measuring the machine and the ops behind `python -m pijax.bench_ops`.

`machine` (what the CPU is: model name, cores, L3, the machine line), `bandwidth` (numba read
kernels: the memory's read bandwidth and a cache flusher), `active_sets` (synthetic power-law
active neurons), `sparse_op` (the sparse FFN op at layer shapes, host and Pallas), `matvec` (dense
decode matvecs and the sparse down pass), `tables` (the markdown tables). The CLIs that use them
(`pijax.bench_ops`, `pijax.bench_kernels`, `pijax.bench_compare`) stay at the package top level
with the other commands.
"""
