"""The sparse FFN op at a real layer shape, timed with its weights read from DRAM, not cache.

Host: `host_ops.sparse_ffn.HostFFNWeights` (numba; formats f32 and q8). Pallas:
`pallas_kernels.sparse_ffn.sparse_ffn` inside one jitted loop (formats f32 and bf16; GPU). A layer
is stored `copies` times and the calls cycle over the copies (`plan_copies`), so the bytes read
between two reads of one copy reach the cold target (`pijax.bench_ops` explains the method).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from pijax.errors import ConfigError

if TYPE_CHECKING:  # Only a type here: importing it would load numba with this module.
  from pijax.measure.bandwidth import CacheFlusher

OP_HOST = "host"
OP_PALLAS = "pallas"
HOST_FORMATS = ("f32", "q8")
PALLAS_FORMATS = ("f32", "bf16")
FORMATS = ("f32", "q8", "bf16")
MIN_CALLS = 5  # Timed calls per host row, whatever --seconds says.
MAX_CALLS = 200_000
PALLAS_LOOPS = 5  # Timed fori_loops per pallas row.
GPU_POOL_FRACTION = 0.4  # Share of the device memory the pallas copies may take.
GPU_POOL_DEFAULT = 16e9  # When the backend reports no memory limit.
I32_LIMIT = 2**31 - 1  # The Triton kernel addresses n_hot * D with int32 offsets.
_Q8_BYTES_PER_WEIGHT = 1 + 4 / 32


@dataclasses.dataclass
class Row:
  """One benchmark row: an (op, format, shape, sparsity).

  Times in seconds, bytes and MB in 10^6 bytes, GB/s in 10^9 bytes/s.
  """

  op: str  # "host" | "pallas"
  format: str  # "f32" | "q8" (host), "f32" | "bf16" (pallas)
  shape: str  # a `pijax.bench_ops.SHAPES` name
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


def gpu_pool_bytes() -> float:
  """Device bytes the pallas copies may take: GPU_POOL_FRACTION of the memory limit."""
  import jax
  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:  # noqa: BLE001 - backends without memory stats
    stats = {}
  limit = stats.get("bytes_limit")
  return GPU_POOL_FRACTION * limit if limit else GPU_POOL_DEFAULT

