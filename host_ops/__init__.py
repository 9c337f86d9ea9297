"""Host (CPU) kernels in numba with their NumPy references; imports nothing from pijax.

Public errors and thread settings live here; the kernels are in the submodules.
"""

import os

# numba's "omp" threading layer runs on libgomp, which cuts its spin-wait to ~nothing once it
# manages more threads than there are CPUs: that happens as soon as a second Python thread (a
# server worker, an XLA callback thread) starts a parallel region, and from then on every one
# of the ~240 parallel regions per decoded token sleeps and is woken (36 instead of 57 tok/s on
# 2 cores, BUILD_NOTES "OpenMP wait policy"). A bounded active wait keeps the threads spinning
# between regions. Read once, when libgomp loads: set before the first parallel kernel runs.
os.environ.setdefault("OMP_WAIT_POLICY", "active")
os.environ.setdefault("GOMP_SPINCOUNT", "2000000")

from host_ops import _cache  # noqa: E402  (the package's own private module: only here)

# Before any kernel module is imported: their cache entries are keyed on all of host_ops.
_cache.install()

from host_ops.common import HostOpError, get_host_threads, set_host_threads  # noqa: E402

__all__ = ["HostOpError", "get_host_threads", "set_host_threads"]
