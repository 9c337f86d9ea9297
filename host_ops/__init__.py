"""Host (CPU) kernels in numba with their NumPy references; imports nothing from pijax.

Public errors and thread settings live here; the kernels are in the submodules.
"""

from host_ops._common import HostOpError, get_host_threads, set_host_threads

__all__ = ["HostOpError", "get_host_threads", "set_host_threads"]
