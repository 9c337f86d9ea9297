"""`python -m pijax.bench_ops`: the sparse FFN operators at real layer shapes, weights from DRAM.

  python -m pijax.bench_ops                 # LLaMA-2 7B/13B/70B layers, host f32 + q8 (+ Pallas)
  python -m pijax.bench_ops --shapes=smollm2-135m --sparsities=0,90 --formats=f32 --seconds=0.2
  python -m pijax.bench_ops --shapes=llama2-7b --sparsities=0,90 -o json

Ops (b = 1 token, family swiglu, so every active neuron reads its gate, up and down rows):
  host    `host_ops.sparse_ffn.HostFFNWeights` (numba, `--threads` threads), weight formats "f32"
          and "q8" (`host_ops.quant`: int8 + one f32 scale per 32 values, 1.125 bytes/weight).
          Time per call = one Python call `w(x, ids)` (wrapper, id checks and the final reduction
          included), median over every timed call.
  pallas  `pallas_kernels.sparse_ffn.sparse_ffn` (Triton, default blocks), formats "f32" and
          "bf16"; only where `jax.default_backend() == "gpu"`. Timed inside one jitted fori_loop
          of data-dependent calls (x <- x + 1e-6 * y, as inside a decode step: no per-call
          dispatch), time per call = loop time / calls, median over 5 loops.

Active sets (the power law; neurons sorted by frequency as in our bundles, neuron 0 the hottest):
neuron i (0-based) of a layer with n neurons is active, independently per call, with probability

  p_i = min(1, c * (i + 1) ** -alpha)          alpha = --alpha (default 1.0)

with c > 0 solved (bisection, float64) so that sum_i p_i = (1 - sparsity) * n: the expected active
fraction is exactly the target and the id lists are sorted ascending. At alpha = 1 and 90% sparsity
on n = 11008 the first ~220 neurons are always active, the last fires with p ~ 0.02, and the top
26% of neurons carry ~74% of the activations. Each row draws 16 id sets with
`np.random.default_rng([seed, n, round(sparsity * 1e4)])` (--seed, default 0), so every op and
format at one (shape, sparsity) sees the same sets; the weights are N(0, 1/D) from
`np.random.default_rng([seed, n, D])` (host) or `jax.random.key(seed)` (pallas).

Rows come from DRAM, not cache. The layer is stored `copies` times in one array of copies * n
neurons (copy c = rows [c n, (c + 1) n), its ids offset by c n), and successive calls cycle over
the copies, so the bytes read between two reads of one copy (the "reuse distance") are
copies * (bytes per call). With power-law sets the hot head of a layer is read by every call, so
one copy of a layer bigger than the cache is not enough at high sparsity (70B f32 at 95%: 141 MB
per call, 260 MB L3). Host: copies are as many as `--max_gb` allows, up to what the sparsest row
needs; when copies * bytes per call stay under the cold target (--cold_mb, default 2.3 x the L3
size: /sys, else lscpu, else 260 MiB -> 627 MB), each call is preceded by an untimed read of
(cold - copies * bytes per call) / copies bytes of a separate buffer (CacheFlusher), so every row
reads weights last touched at least `cold` bytes ago. Memory: copies * layer bytes (3 * n * D * 4
f32; 3 * n * D * 1.125 q8) + the flush buffer (cold bytes) <= --max_gb (default 6 GB; 70B f32 is
2.82 GB a copy, so one); layers are generated and quantized 4096 rows at a time (no full f32 layer
beside the q8 one). Pallas: copies fill up to 40% of the
device memory and the int32 offset limit of the kernel (copies * n * D < 2**31), no flush; the
JSON says per row whether the reuse distance reached the cold target.

Columns: time/call (median), bytes read = mean over the timed calls of (active neurons) * (bytes
per neuron: 3 D * 4 f32, 3 D * 1.125 q8, 3 D * 2 bf16), GB/s = bytes read / time/call, vs dense =
this row's GB/s / GB/s of the same op, format and shape at 0% sparsity ("-" when 0 is not among
--sparsities). Issue target: >= 70% at 90% sparsity, LLaMA-2-7B shapes.

Dense decode matvecs (`--matvec`, on by default): `host_ops.qmatmul.QMatrix.matmul` of one row
x over each shape's gate [n, D] and down [D, n] matrices in the GGUF block formats q4_1 and q8_0
(random codes and scales), with dot "f32" (x kept f32) and "int8" (x quantized per block, integer
SIMD products: `host_ops.qdot`). Copies of the matrix are cycled so each call reads it from DRAM
(as the host op above). Columns: time/call (median), G weights/s, GB/s of the GGUF block bytes,
and that as a share of the measured read bandwidth.

The machine line also gives the memory read bandwidth (`read_bandwidth`: the best of 5 integer-sum
passes over a buffer of the cold target's size, with --threads threads; --nobandwidth skips it),
the ceiling of every bandwidth-bound row, and the same over a random half of 2560-byte rows
(`gathered_read_bandwidth`: a 7B Q4_1 up row), the ceiling of the sparse kernels, which read only
the rows of active neurons.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import time
from typing import Any

import numba
import numpy as np

from host_ops import _common as host_common
from pijax.errors import ConfigError

# name -> (hidden D, intermediate n) of one FFN layer.
SHAPES = {
    "smollm2-135m": (576, 1536),
    "llama2-7b": (4096, 11008),
    "llama2-13b": (5120, 13824),
    "llama2-70b": (8192, 28672),
}
DEFAULT_SHAPES = ("llama2-7b", "llama2-13b", "llama2-70b")
DEFAULT_SPARSITIES = (0.0, 0.5, 0.8, 0.9, 0.95)
OP_HOST = "host"
OP_PALLAS = "pallas"
HOST_FORMATS = ("f32", "q8")
PALLAS_FORMATS = ("f32", "bf16")
FORMATS = ("f32", "q8", "bf16")
DEFAULT_ALPHA = 1.0
ID_SETS = 16  # Independent active sets drawn per row, cycled over the calls.
MIN_CALLS = 5  # Timed calls per host row, whatever --seconds says.
MAX_CALLS = 200_000
PALLAS_LOOPS = 5  # Timed fori_loops per pallas row.
DEFAULT_L3_BYTES = 260 * 2**20
COLD_FACTOR = 2.3  # cold target = 2.3 x L3 (627 MB on the 260 MiB L3 of the dev machines).
DEFAULT_MAX_GB = 6.0
GPU_POOL_FRACTION = 0.4  # Share of the device memory the pallas copies may take.
GPU_POOL_DEFAULT = 16e9  # When the backend reports no memory limit.
_I32_LIMIT = 2**31 - 1  # The Triton kernel addresses n_hot * D with int32 offsets.
_LINE_INT64 = 8  # int64 values per 64-byte cache line.
_Q8_BYTES_PER_WEIGHT = 1 + 4 / 32


# ------------------------------------------------------------------ active sets (power law)


def power_law_probs(n: int, sparsity: float, alpha: float = DEFAULT_ALPHA) -> np.ndarray:
  """Per-neuron activation probabilities: f64[n], p_i = min(1, c * (i + 1) ** -alpha).

  c is solved by bisection so that sum(p) = (1 - sparsity) * n (to ~1e-12 relative); p is
  non-increasing (neuron 0 the most frequent, as in a bundle sorted by frequency). sparsity 0 gives
  all ones, sparsity 1 all zeros; alpha 0 gives the uniform p_i = 1 - sparsity.
  """
  n = int(n)
  if n < 0:
    raise ValueError(f"n must be >= 0, got {n}")
  if not 0.0 <= sparsity <= 1.0:
    raise ValueError(f"sparsity must be in [0, 1], got {sparsity}")
  if not alpha >= 0.0:
    raise ValueError(f"alpha must be >= 0, got {alpha}")
  target = (1.0 - sparsity) * n
  if n == 0 or target <= 0.0:
    return np.zeros(n)
  if target >= n:
    return np.ones(n)
  w = np.arange(1, n + 1, dtype=np.float64) ** -alpha  # [n], w_0 = 1
  lo, hi = 0.0, 1.0 / w[-1]  # sum(min(1, c w)) is 0 at c = lo and n at c = hi.
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    if np.minimum(1.0, mid * w).sum() < target:
      lo = mid
    else:
      hi = mid
    if hi - lo <= 1e-15 * hi:
      break
  return np.minimum(1.0, 0.5 * (lo + hi) * w)


def power_law_active(n: int, sparsity: float, rng: np.random.Generator,
                     alpha: float = DEFAULT_ALPHA) -> np.ndarray:
  """One random active set: i32[k] ascending ids in [0, n), neuron i drawn with power_law_probs.

  E[k] = (1 - sparsity) * n; sparsity 0 -> every neuron, 1 -> an empty array.
  """
  p = power_law_probs(n, sparsity, alpha)
  return np.flatnonzero(rng.random(n) < p).astype(np.int32)


def draw_sets(n: int, sparsity: float, alpha: float, seed: int,
              count: int = ID_SETS) -> list[np.ndarray]:
  """`count` active sets (i32[k_j] each) for one (n, sparsity), reproducible from the seed."""
  rng = np.random.default_rng([seed, n, int(round(sparsity * 1e4))])
  return [power_law_active(n, sparsity, rng, alpha) for _ in range(count)]


# ------------------------------------------------------------------ machine and memory


def _parse_size(text: str) -> int | None:
  """"266240K" / "260 MiB" / "32 MB" -> bytes (binary units); None if unparsable."""
  m = re.match(r"\s*([0-9.]+)\s*([KMGT]?)(i?B)?", text, re.IGNORECASE)
  if not m:
    return None
  scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2).upper()]
  return int(float(m.group(1)) * scale)


def _lscpu() -> str:
  try:
    return subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                          env=dict(os.environ, LC_ALL="C")).stdout
  except (OSError, subprocess.SubprocessError):
    return ""


def l3_bytes() -> int:
  """L3 size in bytes (one instance): /sys cpu0 cache, else lscpu "L3 cache", else 260 MiB."""
  best = (0, 0)  # (level, bytes) of the highest cache level seen
  for index in pathlib.Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
    try:
      level = int((index / "level").read_text())
      size = _parse_size((index / "size").read_text())
    except (OSError, ValueError):
      continue
    if size and (level, size) > best:
      best = (level, size)
  if best[0] >= 3:
    return best[1]
  m = re.search(r"^L3 cache:\s*(.+)$", _lscpu(), re.MULTILINE)
  size = _parse_size(m.group(1)) if m else None
  return size or DEFAULT_L3_BYTES


def machine_info(threads: int | None = None, backend: str | None = None) -> dict[str, Any]:
  """The machine line's facts: cpu model (lscpu "Model name"), cores, L3 bytes, numba, jax."""
  m = re.search(r"^Model name:\s*(.+)$", _lscpu(), re.MULTILINE)
  cpu = m.group(1).strip() if m else None
  if cpu is None:
    try:
      m = re.search(r"^model name\s*:\s*(.+)$", pathlib.Path("/proc/cpuinfo").read_text(),
                    re.MULTILINE)
      cpu = m.group(1).strip() if m else "unknown cpu"
    except OSError:
      cpu = "unknown cpu"
  info = {"cpu": cpu, "cores": os.cpu_count(), "l3_bytes": l3_bytes(),
          "numba": numba.__version__, "threads": threads, "backend": backend}
  if backend is not None:
    import jax
    info["jax"] = jax.__version__
    info["device"] = jax.devices()[0].device_kind
  return info


def format_machine(info: dict[str, Any]) -> str:
  """`machine: <lscpu Model name>, <cores> cores, L3 <MiB>[, read bandwidth <GB/s>[, <p>% of
  <n>-byte rows <GB/s>]]; numba <v>, <t> threads[; jax ...]`."""
  bandwidth = (f", read bandwidth {info['read_gb_s']:.1f} GB/s ({info['threads']} threads)"
               if info.get("read_gb_s") else "")
  if info.get("gathered_read_gb_s"):
    bandwidth += (f", {info['gathered_fraction']:.0%} of {info['gathered_row_bytes']}-byte rows "
                  f"{info['gathered_read_gb_s']:.1f} GB/s")
  line = (f"machine: {info['cpu']}, {info['cores']} cores, L3 {info['l3_bytes'] / 2**20:.0f} MiB"
          f"{bandwidth}; numba {info['numba']}, {info['threads']} threads")
  if info.get("backend"):
    line += f"; jax {info['jax']}, backend {info['backend']} ({info['device']})"
  return line


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


# Not cached on disk: it inlines host_ops._common, and numba would key a cache on this file only.
@numba.njit(parallel=True, nogil=True, error_model="numpy")
def _read_rows(rows, ids, n_threads):
  """Sum of every int64 of rows[ids] (rows: i64[n, row]; ids: i64[k], increasing), ids split in
  n_threads contiguous shares; each row's lines are prefetched while the row before is summed,
  into L2 for rows of >= 1 KB as the gathered decode kernels do (`host_ops._common.far_gather`:
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


# ------------------------------------------------------------------ rows


@dataclasses.dataclass
class Row:
  """One benchmark row: an (op, format, shape, sparsity).

  Times in seconds, bytes and MB in 10^6 bytes, GB/s in 10^9 bytes/s.
  """

  op: str  # "host" | "pallas"
  format: str  # "f32" | "q8" (host), "f32" | "bf16" (pallas)
  shape: str  # a SHAPES name
  hidden: int  # D
  intermediate: int  # n (neurons of the layer)
  sparsity: float  # target fraction of inactive neurons, [0, 1)
  active_neurons: float  # mean active neurons per timed call
  bytes_read: float  # mean weight bytes read per timed call
  time_s: float  # median seconds per call
  gb_s: float  # bytes_read / time_s / 1e9
  time_s_min: float  # fastest call (host) or loop (pallas)
  calls: int  # timed calls
  copies: int  # layer copies cycled over
  reuse_mb: float  # bytes read (weights + flush) between two reads of one copy, MB
  flush_mb: float  # untimed flush read before each call, MB (host; 0 for pallas)
  from_dram: bool  # reuse_mb >= the cold target
  vs_dense: float | None = None  # gb_s / gb_s of the same op, format, shape at 0%


def bytes_per_neuron(d: int, fmt: str) -> float:
  """Weight bytes one active neuron reads: gate, up and down rows of D values each."""
  per_weight = {"f32": 4.0, "q8": _Q8_BYTES_PER_WEIGHT, "bf16": 2.0}[fmt]
  return 3 * d * per_weight


def plan_copies(per_layer: float, min_bytes_per_call: float, cold_bytes: float, pool_bytes: float,
                max_copies: int | None = None) -> int:
  """Layer copies to cycle over: enough that copies * min_bytes_per_call >= cold_bytes, at most
  what pool_bytes holds (and max_copies), at least 1."""
  need = math.ceil(cold_bytes / max(min_bytes_per_call, 1.0))
  fit = int(pool_bytes // max(per_layer, 1.0))
  copies = min(need, fit)
  if max_copies is not None:
    copies = min(copies, max_copies)
  return max(1, copies)


def add_vs_dense(rows: list[Row]) -> list[Row]:
  """Fills each row's vs_dense from the 0%-sparsity row of its (op, format, shape), if any."""
  dense = {(r.op, r.format, r.shape): r.gb_s for r in rows if r.sparsity == 0.0}
  for r in rows:
    base = dense.get((r.op, r.format, r.shape))
    r.vs_dense = r.gb_s / base if base else None
  return rows


# ------------------------------------------------------------------ host op


def host_layer_copies(d: int, n: int, fmt: str, copies: int, seed: int = 0):
  """One random SwiGLU layer (weights N(0, 1/D)) stored `copies` times, as one HostFFNWeights.

  Returns HostFFNWeights with copies * n neurons: copy c is rows [c n, (c + 1) n) of gate, up and
  down (f32[copies n, D], or q8: q i8[copies n, D] + scales f32[copies n, D / 32]). Built chunk by
  chunk: peak memory is the result plus one chunk of 4096 f32 rows.
  """
  from host_ops import quant
  from host_ops import sparse_ffn as sf
  if fmt not in HOST_FORMATS:
    raise ConfigError(f"the host op has formats {', '.join(HOST_FORMATS)}, got {fmt!r}")
  rng = np.random.default_rng([seed, n, d])
  chunk = 4096
  scale = np.float32(1.0 / np.sqrt(d))
  mats = []
  for _ in range(3):  # gate, up, down
    if fmt == "f32":
      rows = np.empty((copies * n, d), np.float32)
      for lo in range(0, n, chunk):
        part = rows[lo:min(lo + chunk, n)]
        rng.standard_normal(out=part, dtype=np.float32)
        part *= scale
      for c in range(1, copies):
        rows[c * n:(c + 1) * n] = rows[:n]
      mats.append(rows)
    else:
      q = np.empty((copies * n, d), np.int8)
      s = np.empty((copies * n, d // quant.Q8_BLOCK), np.float32)
      for lo in range(0, n, chunk):
        hi = min(lo + chunk, n)
        part = quant.quantize_q8(rng.standard_normal((hi - lo, d), dtype=np.float32) * scale)
        q[lo:hi], s[lo:hi] = part.q, part.scales
      for c in range(1, copies):
        q[c * n:(c + 1) * n] = q[:n]
        s[c * n:(c + 1) * n] = s[:n]
      mats.append(quant.Q8Rows(q, s))
  if fmt == "f32":
    return sf.HostFFNWeights(*mats, "swiglu")
  return sf.HostFFNWeights.from_q8(*mats, "swiglu")


def bench_host(weights, n: int, copies: int, sets: list[np.ndarray], *, seconds: float,
               cold_bytes: float, flusher: CacheFlusher | None, seed: int = 0) -> dict[str, Any]:
  """Times the host op on one (layer, sparsity): weights read from DRAM, not cache.

  Args:
    weights: HostFFNWeights of copies * n neurons (`host_layer_copies`).
    n: neurons per layer copy; copies: copies in `weights`.
    sets: active sets, i32[k_j] ascending ids in [0, n) (`draw_sets`).
    seconds: wall-time budget (flushes included); at least MIN_CALLS timed calls.
    cold_bytes: bytes that must be read between two reads of one copy; with copies * (bytes per
      call) below it, `flusher` reads the difference (split over the calls) untimed.
    flusher: CacheFlusher of >= cold_bytes (None: no flush).
  Returns:
    dict: time_s (median s per call), time_s_min, calls, active_neurons (mean k), bytes_read
    (mean bytes per call), gb_s, reuse_mb, flush_mb, from_dram.
  """
  d = weights.d
  bpn = weights.bytes_per_neuron
  x = np.random.default_rng([seed, d]).standard_normal(d).astype(np.float32)
  mean_k = float(np.mean([len(s) for s in sets]))
  per_call = mean_k * bpn
  flush = max(0.0, cold_bytes - copies * per_call) / copies if flusher is not None else 0.0
  weights(x, sets[0])  # Warm-up: compile (or load the numba cache), touch the code paths.
  weights(x, sets[-1] + np.int32((copies - 1) * n))
  if flusher is not None:
    flusher.flush(cold_bytes)  # Untimed: evict what the warm-up read.
  times, ks = [], []
  i = 0
  deadline = time.perf_counter() + seconds
  while (time.perf_counter() < deadline or i < MIN_CALLS) and i < MAX_CALLS:
    c = i % copies
    ids = sets[(i // copies) % len(sets)]
    if c:
      ids = ids + np.int32(c * n)
    if flush and flusher is not None:
      flusher.flush(flush)
    t0 = time.perf_counter()
    weights(x, ids)
    times.append(time.perf_counter() - t0)
    ks.append(len(ids))
    i += 1
  t = float(np.median(times))
  bytes_read = float(np.mean(ks)) * bpn
  reuse = copies * (per_call + flush)
  return dict(time_s=t, time_s_min=float(np.min(times)), calls=len(times),
              active_neurons=float(np.mean(ks)), bytes_read=bytes_read,
              gb_s=bytes_read / t / 1e9, reuse_mb=reuse / 1e6, flush_mb=flush / 1e6,
              from_dram=reuse >= cold_bytes * (1 - 1e-9))


# ------------------------------------------------------------------ dense decode matvecs
MATVEC_FORMATS = ("q4_1", "q8_0")


@dataclasses.dataclass
class MatvecRow:
  """One dense matvec row: a matrix of a shape in a GGUF block format, with a dot mode."""

  shape: str  # a SHAPES name
  matrix: str  # "gate" ([n, D]) | "down" ([D, n])
  rows: int
  cols: int
  format: str  # "q4_1" | "q8_0"
  dot: str  # "f32" | "int8"
  time_s: float  # median seconds per call
  g_weights_s: float  # rows * cols / time_s / 1e9
  gb_s: float  # GGUF block bytes / time_s / 1e9
  copies: int
  from_dram: bool  # copies * bytes >= the cold target
  vs_bandwidth: float | None = None  # gb_s / the machine's read bandwidth


def matvec_copies(rows: int, cols: int, fmt: str, copies: int, seed: int = 0):
  """`copies` random QMatrix views of one [copies * rows, cols] block array (codes uniform, scales
  in [0.001, 0.02], Q4_1 offsets in [-0.1, 0.1])."""
  from host_ops import qmatmul
  rng = np.random.default_rng([seed, rows, cols])
  nb = cols // qmatmul.BLOCK
  total = copies * rows
  d = qmatmul.f16_bits(rng.uniform(0.001, 0.02, (total, nb)))
  if fmt == "q4_1":
    arrays = (rng.integers(0, 256, (total, cols // 2), dtype=np.uint8), d,
              qmatmul.f16_bits(rng.uniform(-0.1, 0.1, (total, nb))))
  else:
    arrays = (rng.integers(-128, 128, (total, cols), dtype=np.int8), d)
  return [qmatmul.QMatrix(fmt, tuple(a[c * rows:(c + 1) * rows] for a in arrays))
          for c in range(copies)]


def _time_calls(fn, n_copies: int, seconds: float) -> float:
  """Median seconds of fn(i) over calls cycling i through the copies (two warm-up calls: compile
  or load the numba cache), for `seconds` and at least MIN_CALLS calls."""
  for i in range(min(2, n_copies)):
    fn(i)
  times = []
  i = 0
  deadline = time.perf_counter() + seconds
  while (time.perf_counter() < deadline or i < MIN_CALLS) and i < MAX_CALLS:
    t0 = time.perf_counter()
    fn(i % n_copies)
    times.append(time.perf_counter() - t0)
    i += 1
  return float(np.median(times))


def bench_matvec(mats, dot: str, *, seconds: float, cold_bytes: float,
                 seed: int = 0) -> dict[str, Any]:
  """Times `QMatrix.matmul` of one f32 row over the copies in turn (median s per call)."""
  w0 = mats[0]
  x = np.random.default_rng([seed, w0.shape[1]]).standard_normal((1, w0.shape[1])).astype(
      np.float32)
  out = np.empty((1, w0.shape[0]), np.float32)
  t = _time_calls(lambda i: mats[i].matmul(x, out=out, dot=dot), len(mats), seconds)
  n, dim = w0.shape
  return dict(time_s=t, g_weights_s=n * dim / t / 1e9, gb_s=w0.file_bytes() / t / 1e9,
              copies=len(mats), from_dram=len(mats) * w0.file_bytes() >= cold_bytes)


def run_matvec(opts: Options, read_gb_s: float | None, log=None) -> list[MatvecRow]:
  """Every (shape, gate/down, format, dot) of the dense matvec table."""
  from host_ops import qdot
  from host_ops import qmatmul
  log = log or (lambda s: None)
  host_common.set_host_threads(opts.threads)
  cold = opts.cold_bytes or COLD_FACTOR * l3_bytes()
  dots = [qmatmul.DOT_F32] + ([qmatmul.DOT_INT8] if qdot.AVAILABLE else [])
  out = []
  for name in opts.shapes:
    d, n = SHAPES[name]
    for matrix, (rows, cols) in (("gate", (n, d)), ("down", (d, n))):
      for fmt in MATVEC_FORMATS:
        per = rows * (cols // 32) * (20 if fmt == "q4_1" else 34)
        held = rows * cols * (0.5 if fmt == "q4_1" else 1.0) + rows * cols / 32 * (
            8 if fmt == "q4_1" else 4)
        copies = max(1, min(math.ceil(cold / per), int(opts.max_bytes // held)))
        mats = matvec_copies(rows, cols, fmt, copies, opts.seed)
        for dot in dots:
          m = bench_matvec(mats, dot, seconds=opts.seconds, cold_bytes=cold, seed=opts.seed)
          row = MatvecRow(shape=name, matrix=matrix, rows=rows, cols=cols, format=fmt, dot=dot,
                          vs_bandwidth=m["gb_s"] / read_gb_s if read_gb_s else None, **m)
          out.append(row)
          log(f"  matvec {fmt} {dot} {name} {matrix}: {_fmt_time(row.time_s)}, "
              f"{row.g_weights_s:.1f} G weights/s, {row.gb_s:.1f} GB/s")
        del mats
  return out


def format_matvec(rows: list[MatvecRow]) -> str:
  out = ["| shape | matrix | rows x cols | format | dot | time/call | G weights/s | GB/s "
         "| vs read bandwidth |",
         "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: |"]
  for r in rows:
    vs = "-" if r.vs_bandwidth is None else f"{r.vs_bandwidth:.0%}"
    warm = "" if r.from_dram else " (cache)"
    out.append(f"| {r.shape} | {r.matrix} | {r.rows} x {r.cols} | {r.format} | {r.dot} | "
               f"{_fmt_time(r.time_s)} | {r.g_weights_s:.1f} | {r.gb_s:.1f}{warm} | {vs} |")
  return "\n".join(out)


DOWN_ACTIVE = (0.25, 0.5, 1.0)  # Fractions of neurons active in the down-pass table.


@dataclasses.dataclass
class DownPassRow:
  """One row of the sparse down pass (`host_ops.gated_ffn.down_pass`): neuron-major rows of a
  format, a fraction of them active, against the dense Q4_1 down matvec of the same shape."""

  shape: str
  rows: int  # F: neurons (rows of the neuron-major matrix)
  cols: int  # D: hidden size
  format: str  # "q8_0" | "q4_1" | "file" (the file's Q4_1 blocks transposed)
  dot: str  # "f32" | "int8" (Q4_1: integer products on quantized coefficients)
  active: float  # fraction of the F rows read
  time_s: float  # median seconds per call
  g_weights_s: float  # active rows * cols / time_s / 1e9
  gb_s: float  # block bytes of the active rows / time_s / 1e9
  dense_time_s: float  # the dense Q4_1 down matvec ([D, F], same dot), median s per call
  vs_dense: float  # dense_time_s / time_s
  copies: int
  from_dram: bool
  vs_bandwidth: float | None = None


def run_down_pass(opts: Options, read_gb_s: float | None, log=None) -> list[DownPassRow]:
  """Every (shape, format, dot, active fraction) of the sparse down-pass table. Rows are random
  blocks (`matvec_copies`), activations standard normal on a uniformly drawn set of exactly
  round(fraction * F) neurons."""
  from host_ops import gated_ffn
  from host_ops import qdot
  from host_ops import qmatmul
  log = log or (lambda s: None)
  host_common.set_host_threads(opts.threads)
  cold = opts.cold_bytes or COLD_FACTOR * l3_bytes()
  dots = [qmatmul.DOT_F32] + ([qmatmul.DOT_INT8] if qdot.AVAILABLE else [])
  rng = np.random.default_rng(opts.seed)
  out = []
  for name in opts.shapes:
    d, n = SHAPES[name]
    dense_per = d * (n // 32) * 20
    dense = matvec_copies(d, n, qmatmul.Q4_1, max(1, min(math.ceil(cold / dense_per),
                                                          int(opts.max_bytes // dense_per))),
                          opts.seed)
    dense_t = {dot: bench_matvec(dense, dot, seconds=opts.seconds, cold_bytes=cold,
                                 seed=opts.seed)["time_s"] for dot in dots}
    del dense
    for fmt in gated_ffn.DOWN_KINDS:
      # Bytes per active row, and bytes read whatever the active set (the file layout's scales).
      active_bytes, fixed_bytes = gated_ffn.DOWN_BLOCK_BYTES[fmt]
      per_row = (d // 32) * active_bytes
      fixed = n * d // 32 * fixed_bytes
      size = n * per_row + fixed
      copies = max(1, min(math.ceil(cold / size), int(opts.max_bytes // size)))
      if fmt == gated_ffn.DOWN_FILE:  # The file's [D, F] Q4_1 blocks, transposed.
        mats = [gated_ffn.FileDownRows.from_down(w) for w in
                matvec_copies(d, n, qmatmul.Q4_1, copies, opts.seed)]
      else:
        mats = matvec_copies(n, d, fmt, copies, opts.seed)
      for active in DOWN_ACTIVE:
        k = max(1, round(active * n))
        acts = np.zeros((1, n), np.float32)
        acts[0, rng.choice(n, k, replace=False)] = rng.standard_normal(k).astype(np.float32)
        for dot in dots:
          t = _time_calls(lambda i: gated_ffn.down_pass(
              acts, mats[i].arrays, opts.threads, np.int64(qmatmul.BLOCK),
              dot == qmatmul.DOT_INT8), len(mats), opts.seconds)
          gb_s = (k * per_row + fixed) / t / 1e9
          row = DownPassRow(shape=name, rows=n, cols=d, format=fmt, dot=dot, active=k / n,
                            time_s=t, g_weights_s=k * d / t / 1e9, gb_s=gb_s,
                            dense_time_s=dense_t[dot], vs_dense=dense_t[dot] / t,
                            copies=len(mats), from_dram=copies * size >= cold,
                            vs_bandwidth=gb_s / read_gb_s if read_gb_s else None)
          out.append(row)
          log(f"  down pass {fmt} {dot} {name} {active:.0%}: {_fmt_time(t)}, "
              f"{row.g_weights_s:.1f} G weights/s, {gb_s:.1f} GB/s, {row.vs_dense:.2f}x dense")
      del mats
  return out


def format_down_pass(rows: list[DownPassRow]) -> str:
  out = ["| shape | F x D | format | dot | active | time/call | G weights/s | GB/s "
         "| vs read bandwidth | dense Q4_1 matvec | speedup |",
         "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
  for r in rows:
    vs = "-" if r.vs_bandwidth is None else f"{r.vs_bandwidth:.0%}"
    warm = "" if r.from_dram else " (cache)"
    out.append(f"| {r.shape} | {r.rows} x {r.cols} | {r.format} | {r.dot} | {r.active:.0%} | "
               f"{_fmt_time(r.time_s)} | {r.g_weights_s:.1f} | {r.gb_s:.1f}{warm} | {vs} | "
               f"{_fmt_time(r.dense_time_s)} | {r.vs_dense:.2f}x |")
  return "\n".join(out)


# ------------------------------------------------------------------ pallas op


def pallas_layer_copies(d: int, n: int, fmt: str, copies: int, seed: int = 0):
  """One random SwiGLU layer (N(0, 1/D), rounded to `fmt`) tiled `copies` times on the device.

  Returns (gate, up, down): w[copies n, D] jax arrays, w = f32 or bf16; copy c is rows
  [c n, (c + 1) n).
  """
  import jax
  import jax.numpy as jnp
  if fmt not in PALLAS_FORMATS:
    raise ConfigError(f"the pallas op has formats {', '.join(PALLAS_FORMATS)}, got {fmt!r}")
  dtype = jnp.float32 if fmt == "f32" else jnp.bfloat16
  out = []
  for k in jax.random.split(jax.random.key(seed), 3):
    base = (jax.random.normal(k, (n, d), jnp.float32) / np.sqrt(d)).astype(dtype)
    out.append(jnp.tile(base, (copies, 1)) if copies > 1 else base)
    del base
  return tuple(jax.block_until_ready(out))


@functools.lru_cache(maxsize=None)
def _pallas_loops(interpret: bool):
  """The jitted timing loop (built lazily, so importing this module does not import jax)."""
  import jax
  from jax import lax
  from pallas_kernels import sparse_ffn as pk

  @jax.jit
  def loop(x, gate, up, down, table, n_iter):
    """n_iter data-dependent calls; call i uses index row table[i % T]. x: f32[D] -> f32[D]."""
    def body(i, x):
      idx = table[i % table.shape[0]]  # i32[n_idx]
      y = pk.sparse_ffn(x, gate, up, down, idx, family="swiglu", interpret=interpret)
      return x + 1e-6 * y
    return lax.fori_loop(0, n_iter, body, x)

  return loop


def bench_pallas(weights, n: int, copies: int, sets: list[np.ndarray], *, seconds: float,
                 cold_bytes: float, seed: int = 0, interpret: bool = False) -> dict[str, Any]:
  """Times the Pallas op on one (layer, sparsity) inside a jitted loop cycling over the copies.

  Args:
    weights: (gate, up, down) w[copies n, D] (`pallas_layer_copies`).
    n: neurons per layer copy; copies: copies in `weights`.
    sets: active sets, i32[k_j] ascending ids in [0, n), padded with -1 to one power of two.
    seconds: time budget of the PALLAS_LOOPS timed loops together (plus compile and warm-up).
    cold_bytes: the cold target, only to report from_dram (reuse distance = copies * bytes/call).
    interpret: Pallas interpreter (CPU tests; times are meaningless there).
  Returns:
    the same dict as `bench_host` (flush_mb 0; calls = timed calls over all loops).
  """
  import jax
  import jax.numpy as jnp
  from pallas_kernels import sparse_ffn as pk
  gate = weights[0]
  d = gate.shape[1]
  bpn = 3 * d * gate.dtype.itemsize
  n_idx = pk.next_pow2(max(max(len(s) for s in sets), 1))
  rows_t = max(copies, len(sets))
  table = np.stack([pk.pad_indices(sets[r % len(sets)] + np.int32((r % copies) * n), n_idx)
                    for r in range(rows_t)])  # i32[T, n_idx]
  ks = np.array([len(sets[r % len(sets)]) for r in range(rows_t)])
  table = jnp.asarray(table)
  x = jnp.asarray(np.random.default_rng([seed, d]).standard_normal(d).astype(np.float32))
  loop = _pallas_loops(bool(interpret))
  jax.block_until_ready(loop(x, *weights, table, jnp.int32(rows_t)))  # Compile + warm.
  t0 = time.perf_counter()
  jax.block_until_ready(loop(x, *weights, table, jnp.int32(rows_t)))
  est = (time.perf_counter() - t0) / rows_t
  n_iter = int(min(max(rows_t, seconds / PALLAS_LOOPS / max(est, 1e-7)), 10_000_000))
  n_iter = -(-n_iter // rows_t) * rows_t  # Whole cycles: every copy and set equally often.
  per_call = []
  for _ in range(PALLAS_LOOPS):
    t0 = time.perf_counter()
    jax.block_until_ready(loop(x, *weights, table, jnp.int32(n_iter)))
    per_call.append((time.perf_counter() - t0) / n_iter)
  t = float(np.median(per_call))
  mean_k = float(ks.mean())
  bytes_read = mean_k * bpn
  reuse = copies * bytes_read
  return dict(time_s=t, time_s_min=float(np.min(per_call)), calls=n_iter * PALLAS_LOOPS,
              active_neurons=mean_k, bytes_read=bytes_read, gb_s=bytes_read / t / 1e9,
              reuse_mb=reuse / 1e6, flush_mb=0.0, from_dram=reuse >= cold_bytes * (1 - 1e-9))


def _gpu_pool_bytes() -> float:
  """Device bytes the pallas copies may take: GPU_POOL_FRACTION of the memory limit."""
  import jax
  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:  # noqa: BLE001 - backends without memory stats
    stats = {}
  limit = stats.get("bytes_limit")
  return GPU_POOL_FRACTION * limit if limit else GPU_POOL_DEFAULT


# ------------------------------------------------------------------ the run


@dataclasses.dataclass
class Options:
  """Validated settings of one run (see the flags)."""

  shapes: list[str]
  sparsities: list[float]  # fractions in [0, 1)
  formats: list[str]
  ops: list[str]
  threads: int
  seconds: float
  output: str
  alpha: float = DEFAULT_ALPHA
  seed: int = 0
  max_bytes: float = DEFAULT_MAX_GB * 1e9
  cold_bytes: float | None = None  # None: COLD_FACTOR * l3_bytes()
  backend: str | None = None  # jax.default_backend(), when it was asked


def _split(text: str) -> list[str]:
  return [v.strip() for v in str(text).split(",") if v.strip()]


def parse_options(*, shapes: str, sparsities: str, formats: str, ops: str, threads: int,
                  seconds: float, output: str, alpha: float = DEFAULT_ALPHA, seed: int = 0,
                  max_gb: float = DEFAULT_MAX_GB, cold_mb: float | None = None,
                  backend: str | None = None, sparse_ops: bool = True) -> Options:
  """Checks flag values; raises ConfigError with one line naming the bad flag.

  ops "auto" = host, plus pallas when backend == "gpu". backend: jax.default_backend() (only
  needed when ops is "auto" or names pallas).
  """
  names = _split(shapes)
  bad = [s for s in names if s not in SHAPES]
  if not names or bad:
    raise ConfigError(f"--shapes={shapes!r}: unknown shape {bad[0] if bad else ''!r}; choose from "
                      f"{', '.join(SHAPES)} (comma list).")
  try:
    pcts = [float(v) for v in _split(sparsities)]
  except ValueError:
    raise ConfigError(f"--sparsities={sparsities!r} must be a comma list of percentages, "
                      f"e.g. 0,50,90.") from None
  if not pcts or any(not 0.0 <= p < 100.0 for p in pcts):
    raise ConfigError(f"--sparsities={sparsities!r}: each value must be a percentage in [0, 100).")
  fmts = _split(formats)
  bad = [f for f in fmts if f not in FORMATS]
  if not fmts or bad:
    raise ConfigError(f"--formats={formats!r}: unknown format {bad[0] if bad else ''!r}; choose "
                      f"from {', '.join(FORMATS)} (host: f32, q8; pallas: f32, bf16).")
  op_names = _split(ops)
  if op_names == ["auto"]:
    op_list = [OP_HOST] + ([OP_PALLAS] if backend == "gpu" else [])
  else:
    bad = [o for o in op_names if o not in (OP_HOST, OP_PALLAS)]
    if not op_names or bad:
      raise ConfigError(f"--ops={ops!r} must be auto or a comma list of {OP_HOST}, {OP_PALLAS}.")
    if OP_PALLAS in op_names and backend != "gpu":
      raise ConfigError(f"--ops={ops!r}: the pallas op needs a GPU backend, "
                        f"jax.default_backend() is {backend!r}.")
    op_list = [o for o in (OP_HOST, OP_PALLAS) if o in op_names]
  usable = [(o, f) for o in op_list for f in fmts
            if f in (HOST_FORMATS if o == OP_HOST else PALLAS_FORMATS)]
  if not usable and sparse_ops:
    raise ConfigError(f"--formats={formats!r}: no format for the ops run here "
                      f"({', '.join(op_list)}; host: f32, q8; pallas: f32, bf16).")
  limit = numba.config.NUMBA_NUM_THREADS
  if not 1 <= threads <= limit:
    raise ConfigError(f"--threads={threads} must be in [1, {limit}] (NUMBA_NUM_THREADS).")
  if not seconds > 0:
    raise ConfigError(f"--seconds={seconds} must be > 0.")
  if output not in ("md", "json"):
    raise ConfigError(f"--output={output!r} must be md or json.")
  if not alpha >= 0:
    raise ConfigError(f"--alpha={alpha} must be >= 0.")
  if not max_gb > 0:
    raise ConfigError(f"--max_gb={max_gb} must be > 0.")
  if cold_mb is not None and not cold_mb > 0:
    raise ConfigError(f"--cold_mb={cold_mb} must be > 0.")
  opts = Options(shapes=list(dict.fromkeys(names)),
                 sparsities=list(dict.fromkeys(p / 100.0 for p in pcts)),
                 formats=list(dict.fromkeys(fmts)), ops=op_list, threads=int(threads),
                 seconds=float(seconds), output=output, alpha=float(alpha), seed=int(seed),
                 max_bytes=float(max_gb) * 1e9,
                 cold_bytes=None if cold_mb is None else float(cold_mb) * 1e6, backend=backend)
  if OP_HOST in op_list and sparse_ops:  # The sparse table's layer copies must fit.
    cold = opts.cold_bytes or COLD_FACTOR * l3_bytes()
    for name in opts.shapes:
      d, n = SHAPES[name]
      for f in opts.formats:
        need = n * bytes_per_neuron(d, f) + cold
        if f in HOST_FORMATS and need > opts.max_bytes:
          raise ConfigError(
              f"--max_gb={max_gb:g}: {name} {f} needs {need / 1e9:.2f} GB (one layer copy + the "
              f"{cold / 1e6:.0f} MB flush buffer); raise --max_gb.")
  return opts


def run(opts: Options, log=None) -> list[Row]:
  """Runs every (op, format, shape, sparsity) of `opts`; returns the rows (vs_dense filled).

  log(str): progress lines (stderr in the CLI), one per layer built and per row.
  """
  from host_ops import sparse_ffn as sf
  log = log or (lambda s: None)
  cold = opts.cold_bytes or COLD_FACTOR * l3_bytes()
  rows: list[Row] = []
  max_sp = max(opts.sparsities)
  sets = {(name, sp): draw_sets(SHAPES[name][1], sp, opts.alpha, opts.seed)
          for name in opts.shapes for sp in opts.sparsities}
  min_k = {name: max(min(np.mean([len(s) for s in sets[(name, sp)]]) for sp in opts.sparsities), 1)
           for name in opts.shapes}
  if OP_HOST in opts.ops:
    sf.set_host_threads(opts.threads)
    flusher = CacheFlusher(int(cold))
    for name in opts.shapes:
      d, n = SHAPES[name]
      for fmt in (f for f in opts.formats if f in HOST_FORMATS):
        per_layer = n * bytes_per_neuron(d, fmt)
        copies = plan_copies(per_layer, min_k[name] * bytes_per_neuron(d, fmt), cold,
                             opts.max_bytes - cold)
        t0 = time.perf_counter()
        weights = host_layer_copies(d, n, fmt, copies, opts.seed)
        log(f"host {fmt} {name}: {copies} layer copies ({copies * per_layer / 1e9:.2f} GB) built "
            f"in {time.perf_counter() - t0:.1f} s (max sparsity {max_sp:.0%})")
        for sp in opts.sparsities:
          m = bench_host(weights, n, copies, sets[(name, sp)], seconds=opts.seconds,
                         cold_bytes=cold, flusher=flusher, seed=opts.seed)
          rows.append(Row(op=OP_HOST, format=fmt, shape=name, hidden=d, intermediate=n,
                          sparsity=sp, copies=copies, **m))
          log(_progress(rows[-1]))
        del weights
  if OP_PALLAS in opts.ops:
    pool = _gpu_pool_bytes()
    for name in opts.shapes:
      d, n = SHAPES[name]
      for fmt in (f for f in opts.formats if f in PALLAS_FORMATS):
        per_layer = n * bytes_per_neuron(d, fmt)
        copies = plan_copies(per_layer, min_k[name] * bytes_per_neuron(d, fmt), cold, pool,
                             max_copies=_I32_LIMIT // (n * d))
        t0 = time.perf_counter()
        weights = pallas_layer_copies(d, n, fmt, copies, opts.seed)
        log(f"pallas {fmt} {name}: {copies} layer copies ({copies * per_layer / 1e9:.2f} GB) "
            f"built in {time.perf_counter() - t0:.1f} s")
        for sp in opts.sparsities:
          m = bench_pallas(weights, n, copies, sets[(name, sp)], seconds=opts.seconds,
                           cold_bytes=cold, seed=opts.seed)
          rows.append(Row(op=OP_PALLAS, format=fmt, shape=name, hidden=d, intermediate=n,
                          sparsity=sp, copies=copies, **m))
          log(_progress(rows[-1]))
        del weights
  return add_vs_dense(rows)


def _progress(r: Row) -> str:
  return (f"  {r.op} {r.format} {r.shape} {_pct(r.sparsity)}: {_fmt_time(r.time_s)}, "
          f"{r.gb_s:.1f} GB/s, {r.calls} calls, reuse {r.reuse_mb:.0f} MB "
          f"(flush {r.flush_mb:.1f} MB/call)")


def _pct(frac: float) -> str:
  return f"{frac * 100:.4g}%"


def _fmt_time(t: float) -> str:
  """Seconds -> "123.4 us" below 10 ms, else "12.34 ms"."""
  return f"{t * 1e6:.1f} us" if t < 1e-2 else f"{t * 1e3:.2f} ms"


MD_HEADER = ("| op | format | shape | hidden | intermediate | sparsity | active neurons "
             "| time/call | GB/s | vs dense |")


def format_markdown(rows: list[Row]) -> str:
  """The table: one line per row; vs dense as a percentage ("-" without a 0% row)."""
  out = [MD_HEADER, "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
  for r in rows:
    vs = "-" if r.vs_dense is None else f"{r.vs_dense:.0%}"
    out.append(f"| {r.op} | {r.format} | {r.shape} | {r.hidden} | {r.intermediate} | "
               f"{_pct(r.sparsity)} | {r.active_neurons:.0f} | {_fmt_time(r.time_s)} | "
               f"{r.gb_s:.2f} | {vs} |")
  return "\n".join(out)


def format_notes(rows: list[Row], opts: Options, cold_bytes: float) -> str:
  """Lines under the table: the active-set law, the timing rule, copies and flushes per layer."""
  lines = [
      f"b=1, swiglu. Active sets: neuron i active with p_i = min(1, c*(i+1)^-{opts.alpha:g}), c "
      f"set so E[active] = (1 - sparsity) * n; {ID_SETS} sets per row from "
      f"default_rng([{opts.seed}, n, round(sparsity*1e4)]).",
      f"time/call: host = median of every timed Python call ({opts.threads} numba threads); "
      f"pallas = median of {PALLAS_LOOPS} jitted loops / calls. GB/s = weight bytes read / "
      f"time. Cold target {cold_bytes / 1e6:.0f} MB between two reads of one layer copy.",
  ]
  if OP_PALLAS not in opts.ops:
    lines.append(f"pallas: not run (jax backend {opts.backend or 'not checked'}; it needs gpu).")
  seen = set()
  for r in rows:
    key = (r.op, r.format, r.shape)
    if key in seen:
      continue
    seen.add(key)
    same = [s for s in rows if (s.op, s.format, s.shape) == key]
    flush = ", ".join(f"{_pct(s.sparsity)} {s.flush_mb:.0f}" for s in same if s.flush_mb > 0)
    warm = [_pct(s.sparsity) for s in same if not s.from_dram]
    line = f"{r.op} {r.format} {r.shape}: {r.copies} layer copies"
    if flush:
      line += f"; untimed flush MB/call: {flush}"
    if warm:
      line += f"; reuse distance under the cold target at {', '.join(warm)} (may hit cache)"
    lines.append(line)
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  del argv
  from absl import flags
  f = flags.FLAGS
  backend = None
  if _split(f.ops) != [OP_HOST]:
    import jax
    backend = jax.default_backend()
  opts = parse_options(shapes=f.shapes, sparsities=f.sparsities, formats=f.formats, ops=f.ops,
                       threads=f.threads, seconds=f.seconds, output=f.output, alpha=f.alpha,
                       seed=f.seed, max_gb=f.max_gb, cold_mb=f.cold_mb, backend=backend,
                       sparse_ops=f.sparse_ops)
  if not f.sparse_ops and not ((f.matvec or f.down_pass) and OP_HOST in opts.ops):
    raise ConfigError("nothing to run: --nosparse_ops and no matvec or down-pass table (they "
                      "need --matvec or --down_pass and the host op in --ops); drop "
                      "--nosparse_ops or add --matvec or --down_pass.")
  info = machine_info(opts.threads, backend if OP_PALLAS in opts.ops else None)
  cold = opts.cold_bytes or COLD_FACTOR * info["l3_bytes"]
  opts.cold_bytes = cold
  if OP_HOST in opts.ops and f.bandwidth:
    info["read_gb_s"] = read_bandwidth(min(cold, opts.max_bytes / 2), opts.threads)
    info.update(gathered_read_gb_s=gathered_read_bandwidth(min(cold, opts.max_bytes / 2),
                                                           opts.threads, seed=opts.seed),
                gathered_row_bytes=GATHER_ROW_BYTES, gathered_fraction=GATHER_FRACTION)
  progress = (lambda s: print(s, file=sys.stderr, flush=True)) if f.progress else None
  rows = run(opts, log=progress) if f.sparse_ops else []
  matvec = (run_matvec(opts, info.get("read_gb_s"), log=progress)
            if f.matvec and OP_HOST in opts.ops else [])
  down = (run_down_pass(opts, info.get("read_gb_s"), log=progress)
          if f.down_pass and OP_HOST in opts.ops else [])
  if opts.output == "json":
    doc = {"machine": info,
           "settings": {"alpha": opts.alpha, "seed": opts.seed, "seconds": opts.seconds,
                        "threads": opts.threads, "cold_bytes": cold, "max_bytes": opts.max_bytes,
                        "id_sets": ID_SETS, "ops": opts.ops},
           "rows": [dataclasses.asdict(r) for r in rows],
           "matvec": [dataclasses.asdict(r) for r in matvec],
           "down_pass": [dataclasses.asdict(r) for r in down]}
    sys.stdout.write(json.dumps(doc, indent=1) + "\n")
  else:
    text = format_machine(info) + "\n"
    if rows:
      text += "\n" + format_markdown(rows) + "\n\n" + format_notes(rows, opts, cold) + "\n"
    if matvec:
      text += "\nDense decode matvecs (b = 1, GGUF block bytes):\n\n" + format_matvec(matvec) + "\n"
    if down:
      text += ("\nSparse down pass over neuron-major rows (b = 1; speedup: the dense Q4_1 down "
               "matvec's time over this one's):\n\n" + format_down_pass(down) + "\n")
    sys.stdout.write(text)


if __name__ == "__main__":
  from absl import flags
  from pijax import cli
  flags.DEFINE_string("shapes", ",".join(DEFAULT_SHAPES),
                      f"Comma list of layer shapes: {', '.join(SHAPES)}.")
  flags.DEFINE_string("sparsities", ",".join(f"{s * 100:g}" for s in DEFAULT_SPARSITIES),
                      "Comma list of target sparsities in percent, each in [0, 100).")
  flags.DEFINE_string("formats", "f32,q8,bf16",
                      "Comma list of weight formats; host runs f32/q8, pallas f32/bf16.")
  flags.DEFINE_string("ops", "auto", "auto (host, plus pallas on a GPU backend), host, pallas.")
  flags.DEFINE_integer("threads", 2, "Numba threads of the host op (set_host_threads).")
  flags.DEFINE_float("seconds", 1.0, "Time budget per row, seconds.")
  flags.DEFINE_string("output", "md", "md or json.", short_name="o")
  flags.DEFINE_float("alpha", DEFAULT_ALPHA, "Power-law exponent of the neuron frequencies.")
  flags.DEFINE_integer("seed", 0, "Seed of the weights and the active sets.")
  flags.DEFINE_float("max_gb", DEFAULT_MAX_GB,
                     "Host memory cap in GB (1e9 bytes): layer copies + the flush buffer.")
  flags.DEFINE_float("cold_mb", None, "Bytes (MB) read between two reads of one layer copy; "
                     "default 2.3 x the L3 size.")
  flags.DEFINE_boolean("progress", True, "Progress lines on stderr.")
  flags.DEFINE_boolean("sparse_ops", True, "Run the sparse FFN op table.")
  flags.DEFINE_boolean("matvec", True, "Run the dense decode matvec table (host: q4_1 and q8_0 "
                       "blocks, f32 and int8 dots).")
  flags.DEFINE_boolean("down_pass", True, "Run the sparse down-pass table (host: neuron-major "
                       "q8_0 and q4_1 rows and the file's Q4_1 blocks transposed, at 25/50/100% "
                       "active, against the dense Q4_1 down matvec).")
  flags.DEFINE_boolean("bandwidth", True, "Measure the memory read bandwidth (a pass over "
                       "--cold_mb of memory, default 2.3 x L3; and over half of its 2560-byte "
                       "rows) and print it on the machine line.")
  cli.run(main, "pijax.bench_ops")
