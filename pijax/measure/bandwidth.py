"""Memory read bandwidth, measured by numba kernels that only read: a whole buffer
(`read_bandwidth`, the ceiling of decode's dense matvecs), a random share of its rows
(`gathered_read_bandwidth`, the ceiling of the sparse kernels that read only active rows), and a
`CacheFlusher` that evicts the caches between timed calls.
"""

from __future__ import annotations

import math
import time

import numba
import numpy as np

from host_ops import common as host_common

_LINE_INT64 = 8  # int64 values per 64-byte cache line.


class CacheFlusher:
  """Evicts the CPU caches by reading fresh lines of a private buffer.

  The buffer (int64, `nbytes`) is written once at creation so every page is real memory (zero
  pages would all map to one physical page and stay cached). `flush(b)` reads the next b bytes,
  one value per 64-byte line, wrapping around, so successive flushes walk the whole buffer.
  """

  def __init__(self, nbytes: int):
    self.nbytes = int(nbytes)
    self._buf = None
    self._pos = 0

  def flush(self, nbytes: float) -> None:
    """Reads `nbytes` (rounded down to lines; at most the buffer size) of the buffer."""
    count = int(nbytes) // 8
    if count <= 0:
      return
    if self._buf is None:
      self._buf = np.ones(max(self.nbytes // 8, _LINE_INT64), np.int64)
    size = self._buf.shape[0]
    count = min(count, size)
    lo = self._pos
    hi = lo + count
    if hi <= size:
      _read_lines(self._buf, lo, hi)
    else:
      _read_lines(self._buf, lo, size)
      _read_lines(self._buf, 0, hi - size)
    self._pos = hi % size


@numba.njit(nogil=True, cache=True)
def _read_lines(buf, lo, hi):
  """Sum of buf[lo:hi:8] (one int64 per 64-byte line): reads every line of buf[lo:hi]."""
  s = 0
  for j in range(lo, hi, _LINE_INT64):
    s += buf[j]
  return s


# int64s ahead that `_read_all` prefetches (1 KB). The hardware prefetchers alone read 15-20 GB/s
# on the 2-core AMD VM, where the decode matvecs, which prefetch in software, read 25-36; with
# this the read went from 15-22 to 20-27 GB/s, alternated in one process (BUILD_NOTES.md, issue 11).
_READ_AHEAD = 128


@numba.njit(parallel=True, nogil=True, error_model="numpy")  # Not cached: as `_read_rows`.
def _read_all(buf, n_threads):
  """Sum of every int64 of buf, split in n_threads contiguous shares, each prefetching
  _READ_AHEAD ahead (integer adds vectorize without fastmath, so the loop runs at memory speed,
  not at the adder's; an int32 buffer summed into int64 did not vectorize and read 6 GB/s where
  this reads 31, dev-2c AMX VM)."""
  n = buf.shape[0]
  partial = np.zeros(n_threads, np.int64)
  for t in numba.prange(n_threads):
    lo = t * n // n_threads
    hi = (t + 1) * n // n_threads
    acc = 0
    whole = lo + (hi - lo) // _LINE_INT64 * _LINE_INT64
    for line in range(lo, whole, _LINE_INT64):
      if line + _READ_AHEAD < hi:
        host_common.prefetch(buf, line + _READ_AHEAD)
      for k in range(_LINE_INT64):
        acc += buf[line + k]
    for i in range(whole, hi):
      acc += buf[i]
    partial[t] = acc
  return partial.sum()


def read_bandwidth(nbytes: float, threads: int, repeats: int = 5) -> float:
  """Memory read bandwidth (10^9 bytes/s): the best of `repeats` passes over a fresh buffer of
  `nbytes` (make it a few times the L3 size so the passes come from DRAM) with `threads`
  numba threads. The ceiling a bandwidth-bound kernel (decode's matrix-vector products) can
  reach on this machine."""
  host_common.set_host_threads(threads)
  n_threads = host_common.ensure_host_threads()
  buf = np.ones(max(int(nbytes) // 8, 1 << 16), np.int64)  # Written: real pages, not zero pages.
  _read_all(buf[: 1 << 16], n_threads)  # Compile (or load from cache) before timing.
  best = math.inf
  for _ in range(repeats):
    t0 = time.perf_counter()
    _read_all(buf, n_threads)
    best = min(best, time.perf_counter() - t0)
  return buf.nbytes / best / 1e9


# The gathered-read figure: rows of a LLaMA-2-7B-shaped Q4_1 up matrix (4096 weights: 2048 code
# bytes, 256 of scales, 256 of offsets), half of them read in increasing order, as the gate-first
# FFN reads the up rows of the neurons whose gate passed (dReLU: ~50%).
GATHER_ROW_BYTES = 2560
GATHER_FRACTION = 0.5


# Not cached on disk: it inlines host_ops.common, and numba would key a cache on this file only.
@numba.njit(parallel=True, nogil=True, error_model="numpy")
def _read_rows(rows, ids, n_threads):
  """Sum of every int64 of rows[ids] (rows: i64[n, row]; ids: i64[k], increasing), ids split in
  n_threads contiguous shares; each row's lines are prefetched while the row before is summed,
  into L2 for rows of >= 1 KB as the gathered decode kernels do (`host_ops.common.far_gather`:
  into L1 this read 11-12 GB/s over half of 2560-byte rows on the AMD VM, into L2 21-25)."""
  k = ids.shape[0]
  far = host_common.far_gather(rows.shape[1] * 8)
  partial = np.zeros(n_threads, np.int64)
  for t in numba.prange(n_threads):
    lo = t * k // n_threads
    hi = (t + 1) * k // n_threads
    acc = 0
    if lo < hi:
      host_common.prefetch_row(rows[ids[lo]])
    for j in range(lo, hi):
      if j + 1 < hi and far:
        host_common.prefetch_row_l2(rows[ids[j + 1]])
      elif j + 1 < hi:
        host_common.prefetch_row(rows[ids[j + 1]])
      row = rows[ids[j]]
      for i in range(row.shape[0]):
        acc += row[i]
    partial[t] = acc
  return partial.sum()


def gathered_read_bandwidth(nbytes: float, threads: int, *, row_bytes: int = GATHER_ROW_BYTES,
                            fraction: float = GATHER_FRACTION, repeats: int = 5,
                            seed: int = 0) -> float:
  """Memory read bandwidth over scattered rows (10^9 bytes/s): the best of `repeats` passes over
  a uniformly drawn `fraction` of the `row_bytes` rows of a fresh `nbytes` buffer, each pass on
  a new draw, in increasing row order, with `threads` numba threads. The ceiling of the sparse
  kernels that read only active rows; on the 2-core AMD VM about `read_bandwidth` with the
  prefetches into L2, 0.55-0.8x of it into L1 (BUILD_NOTES.md, issue 11).

  Raises:
    ValueError: row_bytes not a positive multiple of 8, or fraction outside (0, 1].
  """
  if row_bytes <= 0 or row_bytes % 8 or not 0 < fraction <= 1:
    raise ValueError(f"row_bytes must be a positive multiple of 8 and fraction in (0, 1], got "
                     f"{row_bytes} and {fraction}")
  host_common.set_host_threads(threads)
  n_threads = host_common.ensure_host_threads()
  n = max(int(nbytes) // row_bytes, 4)
  rows = np.ones((n, row_bytes // 8), np.int64)  # Written: real pages, not zero pages.
  rng = np.random.default_rng(seed)
  k = max(1, round(fraction * n))
  _read_rows(rows, np.arange(min(k, 4), dtype=np.int64), n_threads)  # Compile / load first.
  best = math.inf
  for _ in range(repeats):
    ids = np.sort(rng.choice(n, k, replace=False)).astype(np.int64)
    t0 = time.perf_counter()
    _read_rows(rows, ids, n_threads)
    best = min(best, time.perf_counter() - t0)
  return k * row_bytes / best / 1e9


