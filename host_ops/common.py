"""Pieces shared by the host (CPU) kernels: families, activation, id lists, thread count, errors.

Host kernels are numba functions over NumPy arrays. They never call JAX, so they can run inside a
`jax.pure_callback` or in a worker thread while the device works (numba `nogil=True`).

Threads: numba's `set_num_threads` is thread-local (it only affects the calling Python thread),
and a `jax.pure_callback` runs on a thread that XLA chooses. So the wanted count is kept here, set
by `set_host_threads(n)`, and every public host op re-applies it on its own thread before launching
a kernel (`ensure_host_threads()`, a cheap comparison when it already holds).

Concurrency: the kernels may be called from several Python threads at once with numba's "omp" or
"tbb" threading layer (the dev machines use omp); the "workqueue" layer is not thread-safe.
The parallel split is static (one contiguous range per thread), so a core busy with another process
stalls the whole call until that thread is scheduled again (whole scheduler slices): on a machine
shared with other work, or where XLA's own threads are busy, use fewer host threads than cores.
"""

from __future__ import annotations

import math
import numbers
import os
import platform

import llvmlite.binding
import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils
from numba.core import types
import numba.extending
from numba.extending import intrinsic

# Family codes passed to the numba kernels (strings cannot select a branch cheaply inside them).
# The names are the FFN family names the model code uses (plain strings: host_ops stands alone).
FAMILY_CODES = {"swiglu": 0, "reglu": 1, "drelu": 2, "geglu": 3}
FAMILIES = tuple(FAMILY_CODES)

_GELU_C = math.sqrt(2.0 / math.pi)  # gelu_tanh(g) = g/2 (1 + tanh(c (g + 0.044715 g^3))).

# exp_f32's range: arguments are clamped to it, so 2^n stays a normal f32 and nothing overflows
# (fastmath assumes no infinities); silu_f32 and gelu_tanh_f32 give 0 where their exp argument
# passes the top.
_EXP_LO, _EXP_HI = np.float32(-87.0), np.float32(88.0)
_LOG2E = np.float32(1.4426950408889634)
# ln 2 split in two (Cody & Waite 1980): n * _LN2_HI is exact for |n| < 256 (16-bit mantissa).
_LN2_HI = np.float32(0.693145751953125)
_LN2_LO = np.float32(1.428606765330187e-06)

# error_model "numpy": a float division by zero gives inf/nan (as NumPy) instead of raising
# ZeroDivisionError out of a kernel (seen with NaN weights in a corrupt file).
JIT = dict(nogil=True, fastmath=True, cache=True, error_model="numpy")
# fastmath without reassoc and contract (and without nnan/ninf: -inf is a value here): for
# kernels inside parallel regions whose results must not depend on how LLVM optimized them.
# numba re-optimizes a parallel kernel's gufunc where a caller links it, and caches that copy,
# while the process that compiled it runs the first one; with reassoc the two sum in other
# orders (BUILD_NOTES.md, issue 11, "Compiled in-process or loaded ...").
JIT_ORDERED = dict(JIT, fastmath={"nsz", "arcp", "afn"})
# Activations compile without fastmath: their bits must not depend on whether LLVM vectorized
# the caller's loop (the sparse FFN's per-neuron activations equal the dense loop's).
JIT_IEEE = dict(JIT, fastmath=False)

# Software prefetch of the next active neuron's rows: PREFETCH_AHEAD neurons ahead in a thread's
# range (0 = off; read at each call), the first PREFETCH_BYTES of each row and Q8 scale row (fixed
# at compile time). It helps short rows the hardware streamer does not follow (BUILD_NOTES.md,
# "Lab notes moved from docstrings"); prefetching never changes results.
PREFETCH_AHEAD = 1
PREFETCH_BYTES = 1024
_CACHE_LINE = 64
# Whether this host is x86-64: the intrinsics (AVX2, F16C, rdtsc) exist only there.
IS_X86 = platform.machine().lower() in ("x86_64", "amd64")
# llvm.prefetch's name carries its pointer type: "p0" from LLVM 15 (opaque pointers), else "p0i8".
_PREFETCH_FN = "llvm.prefetch.p0" if llvmlite.binding.llvm_version_info[0] >= 15 else \
    "llvm.prefetch.p0i8"
# llvm.prefetch localities: 3 (x86 `prefetcht0`, into L1) and 2 (`prefetcht1`, into L2).
LOCALITY_L1, LOCALITY_L2 = 3, 2
# A matvec whose x (int8, D bytes) and two rows of codes (the one read, the one prefetched) pass
# this many bytes prefetches into L2 (`far_rows`): prefetched into L1 they evicted what was about
# to be read. Zen 3 (32 KiB L1D), 2 threads, from DRAM, L2 / L1 time alternated in one process:
# Q4_1 D = 4096 1.13, 5376 1.12, 7168 0.87, 8192 0.84, 11008 0.60; Q8_0 D = 2048 1.25, 4096 1.07,
# 5376 0.90, 11008 0.57 (BUILD_NOTES.md, issue 11).
FAR_BYTES = 12288
# Gathered passes prefetch rows of at least this many code bytes into L2 (`far_gather`).
GATHER_FAR_BYTES = 1024

_host_threads = [None]  # The count set by set_host_threads; None: numba's default (all cores).


class HostOpError(ValueError):
  """A host op got inputs of the wrong shape, dtype or range."""


def family_code(family: str) -> int:
  """The kernels' integer code for an FFN family name ("swiglu", "reglu", "drelu")."""
  try:
    return FAMILY_CODES[family]
  except KeyError:
    raise HostOpError(f"unknown FFN family {family!r}: host ops support {', '.join(FAMILIES)} "
                      f"(relu_mlp is not a gated FFN)") from None


def cut_value(name: str, value) -> np.float32:
  """A sparsity cut as the kernels read it: f32, finite and >= 0.

  Raises:
    HostOpError: not a real number, or negative, NaN or beyond f32's range.
  """
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
    raise HostOpError(f"{name} must be a number >= 0, got {value!r}")
  with np.errstate(over="ignore"):
    cut = np.float32(value)
  if not (cut >= 0 and math.isfinite(cut)):
    raise HostOpError(f"{name} must be a finite f32 number >= 0, got {value!r}")
  return cut


def set_host_threads(n: int) -> None:
  """Sets how many CPU threads the host kernels use (1 <= n <= numba.config.NUMBA_NUM_THREADS).

  The partial-sum split depends on this count, so results are bitwise reproducible for a fixed n
  (and may differ in the last bits between different n).
  """
  limit = numba.config.NUMBA_NUM_THREADS
  if not 1 <= int(n) <= limit:
    raise HostOpError(f"host threads must be in [1, {limit}] (NUMBA_NUM_THREADS), got {n}")
  _host_threads[0] = int(n)
  numba.set_num_threads(int(n))


def get_host_threads() -> int:
  """The thread count host kernels use: the one set by `set_host_threads`, else all of numba's."""
  n = _host_threads[0]
  return numba.config.NUMBA_NUM_THREADS if n is None else n


def ensure_host_threads() -> int:
  """Applies the configured thread count on the calling thread; returns it."""
  n = get_host_threads()
  if numba.get_num_threads() != n:
    numba.set_num_threads(n)
  return n


def _prefetch_codegen(locality):
  """LLVM IR of a prefetch of arr[idx] at `locality` (`prefetch`, `prefetch_l2`)."""

  def codegen(context, builder, signature, args):
    aryty, _ = signature.args
    ary = context.make_array(aryty)(context, builder, args[0])
    ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
    emit_prefetch(builder, ptr, locality)
    return context.get_dummy_value()

  return codegen


@intrinsic
def prefetch(typingctx, arr, idx):
  """Hints the CPU to load the cache line holding arr[idx] (1-D array) for reading; no effect on
  results and no fault on any address (llvm.prefetch, read, into L1, data cache)."""
  return types.void(arr, idx), _prefetch_codegen(LOCALITY_L1)


@intrinsic
def prefetch_l2(typingctx, arr, idx):
  """`prefetch` into L2 (`prefetcht1`): for rows that would evict from L1 what is read next."""
  return types.void(arr, idx), _prefetch_codegen(LOCALITY_L2)


# Float ops emitted by the intrinsics carry this flag. "arcp" changes nothing for +, - and *, but
# numba's fastmath pass only flags ops that have none, so these keep IEEE order and rounding.
# With fastmath's reassoc/contract, LLVM fused and reordered them differently in-process than
# in the object code numba caches: one Q4_1 gemv gave other last bits cold than loaded from the
# cache, and SmolLM2's greedy text changed (BUILD_NOTES.md, issue 11).
ORDERED = ("arcp",)


def fadd(bd, a, b):
  """a + b in IEEE order (`ORDERED`)."""
  return bd.fadd(a, b, flags=ORDERED)


def fsub(bd, a, b):
  """a - b in IEEE order (`ORDERED`)."""
  return bd.fsub(a, b, flags=ORDERED)


def fmul(bd, a, b):
  """a * b in IEEE order (`ORDERED`)."""
  return bd.fmul(a, b, flags=ORDERED)


def fma(bd, a, b, c):
  """a * b + c rounded once (llvm.fma, scalar or vector of f32): never left to the optimizer."""
  t = a.type
  name = f"llvm.fma.v{t.count}f32" if isinstance(t, ir.VectorType) else "llvm.fma.f32"
  fn = cgutils.get_or_insert_function(bd.module, ir.FunctionType(t, [t] * 3), name)
  return bd.call(fn, [a, b, c])


def emit_prefetch(builder, ptr, locality: int = LOCALITY_L1) -> None:
  """LLVM IR of a read prefetch of the cache line at `ptr` (any pointer) into the data cache
  (llvm.prefetch; `locality` LOCALITY_L1 or LOCALITY_L2): for intrinsics that prefetch inside
  their loops."""
  i32 = ir.IntType(32)
  fn = cgutils.get_or_insert_function(
      builder.module, ir.FunctionType(ir.VoidType(), [cgutils.voidptr_t, i32, i32, i32]),
      _PREFETCH_FN)
  builder.call(fn, [builder.bitcast(ptr, cgutils.voidptr_t), ir.Constant(i32, 0),
                    ir.Constant(i32, locality), ir.Constant(i32, 1)])


@intrinsic
def cycle_counter(typingctx):
  """The CPU's cycle counter as i64 (llvm.readcyclecounter: x86 `rdtsc`, which ticks at a
  constant rate whatever the clock): per-phase timing inside compiled loops
  (`decoder.PHASES`)."""
  def codegen(context, builder, sig, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                        "llvm.readcyclecounter")
    return builder.call(fn, [])
  return types.int64(), codegen


@numba.njit(**JIT)
def read_cycle_counter():
  """`cycle_counter` from Python (to convert counts to seconds)."""
  return cycle_counter()


def int_array(name: str, values) -> np.ndarray:
  """values as i64[N] (a scalar or any shape, flattened); HostOpError naming `name` for anything
  but integers (floats, bools, strings: nothing is rounded or reinterpreted)."""
  try:
    a = np.asarray(values)
  except (ValueError, TypeError):
    a = np.asarray([object()])
  mixed_bool = isinstance(values, (list, tuple)) and any(
      isinstance(v, (bool, np.bool_)) for v in values)  # [True, 2] would become [1, 2].
  if mixed_bool or a.size and (a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer)):
    raise HostOpError(f"{name} must be integers, got {a.dtype} values")
  try:
    return a.astype(np.int64, casting="safe" if a.dtype != np.uint64 else "unsafe").reshape(-1)
  except TypeError:
    raise HostOpError(f"{name} must be integers, got {a.dtype} values") from None


def physical_memory_bytes() -> int:
  """The machine's RAM in bytes (0 where the OS does not say)."""
  try:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError, AttributeError):
    return 0


def empty_aligned(shape, dtype) -> np.ndarray:
  """np.empty(shape, dtype), C-contiguous, its data starting on a cache line (64 bytes; NumPy
  gives 16). Rows whose bytes are a multiple of 64 then start on a line, so `prefetch_row`
  covers them whole: at 16 bytes off, each 2 KB 7B up row spanned 33 lines and its last one
  was a demand miss (gathered up pass at 50% 743-777 -> 671-709 us; BUILD_NOTES.md, issue 11)."""
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  buf = np.empty(nbytes + _CACHE_LINE, np.uint8)
  start = -buf.ctypes.data % _CACHE_LINE
  return buf[start:start + nbytes].view(dtype).reshape(shape)


def stack_aligned(parts) -> np.ndarray:
  """np.stack(parts) into an `empty_aligned` array."""
  parts = [np.asarray(p) for p in parts]
  out = empty_aligned((len(parts),) + parts[0].shape, np.result_type(*parts))
  for i, p in enumerate(parts):
    out[i] = p
  return out


@numba.njit(inline="always", **JIT)
def prefetch_row(row):
  """Prefetches every cache line of a contiguous 1-D row (any dtype): the next row a thread
  reads. From DRAM the 7B-shaped Q4_1 gate matvec went from 24.8 to 34.6 G weights/s with it,
  the down matvec from 22.7 to 24.9 (2 threads; two rows ahead or more gained less)."""
  step = max(_CACHE_LINE // row.itemsize, 1)
  for e in range(0, row.shape[0], step):
    prefetch(row, e)


@numba.njit(inline="always", **JIT)
def prefetch_row_l2(row):
  """`prefetch_row` into L2 (the rows of matvecs that `far_rows` picks)."""
  step = max(_CACHE_LINE // row.itemsize, 1)
  for e in range(0, row.shape[0], step):
    prefetch_l2(row, e)


@numba.njit(inline="always", **JIT)
def prefetch_gathered(row, far):
  """`prefetch_row_l2` when far (`far_gather`), else `prefetch_row`."""
  if far:
    prefetch_row_l2(row)
  else:
    prefetch_row(row)


@numba.njit(inline="always", **JIT)
def prefetch_first(rows, ids, lo, hi, ahead, far):
  """Prefetches rows[ids[lo]] .. rows[ids[lo + ahead - 1]] (not past hi): the first rows of a
  thread's share [lo, hi) of an id list, before its loop prefetches `ahead` rows ahead."""
  for j in range(lo, min(lo + ahead, hi)):
    prefetch_gathered(rows[ids[j]], far)


@numba.njit(inline="always", **JIT)
def prefetch_at(ids, j, hi, rows):
  """Prefetches every cache line of rows[ids[j]] (nothing once j >= hi): a row some neurons
  ahead in a thread's share [.., hi) of an id list (the gate-first FFN's passes)."""
  if j < hi:
    prefetch_row(rows[ids[j]])


@numba.njit(inline="always", **JIT)
def far_rows(dim, code_bytes):
  """True when a matvec over D = dim int8 activations and rows of code_bytes prefetches into L2
  (FAR_BYTES)."""
  return dim + 2 * code_bytes > FAR_BYTES


@numba.njit(inline="always", **JIT)
def far_gather(code_bytes):
  """True when a gathered pass over rows of code_bytes (only some rows read, in increasing
  order) prefetches into L2. 7B Q4_1 up rows (2048 code bytes), 50% read, from DRAM, L2 / L1
  time alternated in one process: 0.69-0.91; SmolLM2's 288-byte rows: 0.9-1.4, so L1 below
  1 KB (BUILD_NOTES.md, issue 11)."""
  return code_bytes >= GATHER_FAR_BYTES


@numba.njit(inline="always", **JIT)
def prefetch_head(row):
  """Prefetches the first PREFETCH_BYTES of a contiguous 1-D row (any dtype)."""
  step = max(_CACHE_LINE // row.itemsize, 1)
  for e in range(0, min(row.shape[0], PREFETCH_BYTES // row.itemsize), step):
    prefetch(row, e)


@intrinsic
def _f32_from_bits(typingctx, bits):
  """The f32 whose IEEE bits are the i32 `bits` (a bitcast; LLVM vectorizes it)."""
  def codegen(context, builder, sig, args):
    return builder.bitcast(args[0], ir.FloatType())
  return types.float32(types.int32), codegen


@numba.njit(**JIT_IEEE)
def exp_f32(x):
  """e^x for an f32 x clamped to [-87, 88] (NaN stays NaN), within 1.2 ulp of the f64 value
  there, branch-free so a loop of it vectorizes (libm's scalar exp left SmolLM2's 1536 SiLUs per
  token at 8-11 us per layer; this loop ~1 us: BUILD_NOTES.md, issue 11).

  e^x = 2^n e^r with n = rint(x / ln 2) and r = x - n ln 2 in [-ln2/2, ln2/2] (Cody & Waite
  1980, two-part ln 2); e^r by its Taylor series to r^7 (remainder < 0.347^8 / 8! ~ 5e-9, under
  an f32 ulp); 2^n built from its exponent bits."""
  x = min(max(x, _EXP_LO), _EXP_HI)
  n = np.float32(np.rint(x * _LOG2E))
  r = (x - n * _LN2_HI) - n * _LN2_LO
  p = np.float32(1.0 / 5040.0)
  p = p * r + np.float32(1.0 / 720.0)
  p = p * r + np.float32(1.0 / 120.0)
  p = p * r + np.float32(1.0 / 24.0)
  p = p * r + np.float32(1.0 / 6.0)
  p = p * r + np.float32(0.5)
  p = p * r + np.float32(1.0)
  p = p * r + np.float32(1.0)
  e = p * _f32_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))
  return e if x == x else x


@numba.njit(**JIT_IEEE)
def silu_f32(g):
  """silu(g) = g / (1 + e^-g) in f32 (`exp_f32`): within 2.5 ulp of the f64 value; 0 where
  e^-g would pass exp_f32's range (g < -88: |silu(g)| < 1e-36); NaN stays NaN."""
  s = g / (np.float32(1.0) + exp_f32(-g))
  return np.float32(0.0) if -g > _EXP_HI else s


@numba.njit(**JIT_IEEE)
def gelu_tanh_f32(g):
  """gelu_tanh(g) = g/2 (1 + tanh(z)), z = c (g + 0.044715 g^3) (Hendrycks & Gimpel 2016),
  computed as g / (1 + e^(-2z)) (1 + tanh(z) = 2 / (1 + e^(-2z))) in f32 (`exp_f32`); 0 where
  e^(-2z) would pass its range (g < -10.03: |gelu(g)| < 1e-37); NaN stays NaN."""
  z = np.float32(-2.0 * _GELU_C) * (g + np.float32(0.044715) * g * g * g)
  s = g / (np.float32(1.0) + exp_f32(z))
  return np.float32(0.0) if z > _EXP_HI else s


@numba.njit(inline="always", **JIT)
def activation(g, u, code):
  """act(g, u) for one neuron: g, u are f32 dot products; returns an f32 scalar.

  code 0 swiglu silu(g)*u, 1 reglu relu(g)*u, 2 drelu relu(g)*relu(u), 3 geglu gelu_tanh(g)*u
  (`silu_f32`, `gelu_tanh_f32`: no branch, so loops over neurons vectorize). ReLU families
  return an exact 0 for inactive neurons, which the kernels use to skip the down row.
  """
  if code == 0:
    return silu_f32(g) * u
  if code == 1:
    if g > 0:
      return np.float32(g * u)
    return np.float32(0.0)
  if code == 3:
    return gelu_tanh_f32(g) * u
  if g > 0 and u > 0:
    return np.float32(g * u)
  return np.float32(0.0)


def activation_reference(g: np.ndarray, u: np.ndarray, family: str) -> np.ndarray:
  """act(g, u) in NumPy (any float dtype, elementwise); the references' activation."""
  if family == "swiglu":
    with np.errstate(over="ignore"):
      return g / (1.0 + np.exp(-g)) * u
  if family == "reglu":
    return np.maximum(g, 0) * u
  if family == "drelu":
    return np.maximum(g, 0) * np.maximum(u, 0)
  if family == "geglu":
    return 0.5 * g * (1.0 + np.tanh(_GELU_C * (g + 0.044715 * g ** 3))) * u
  family_code(family)  # Raises the HostOpError.
  raise AssertionError("unreachable")


@numba.njit(**JIT)
def _compact_ids(ids):
  """Moves each row's valid ids (>= 0) to its front, keeping their order.

  ids: i32[b, k] (-1 or any negative = padding). Returns (compact: i32[b, k], counts: i32[b],
  max_id: int; -1 when there is no valid id). Serial: O(b * k), microseconds.
  """
  b, k = ids.shape
  compact = np.full((b, k), -1, dtype=np.int32)
  counts = np.zeros(b, dtype=np.int32)
  max_id = -1
  for r in range(b):
    c = 0
    for j in range(k):
      i = ids[r, j]
      if i >= 0:
        compact[r, c] = i
        c += 1
        if i > max_id:
          max_id = i
    counts[r] = c
  return compact, counts, max_id


def prepare_ids(ids, b: int, n: int):
  """Validates an active-id array and compacts it for the kernels.

  ids: i32[k] (shared by all b rows of x) or i32[b, k] (one padded list per row); any integer
  dtype is accepted and converted. Negative ids are padding. Valid ids must be < n and unique
  within a list (not checked: a repeated id is counted twice).

  Returns (compact: i32[1 or b, k], counts: i32[1 or b], shared: bool).
  """
  ids = np.asarray(ids)
  if ids.dtype.kind not in "iu":
    raise HostOpError(f"ids must be an integer array, got dtype {ids.dtype}")
  if ids.ndim == 1:
    shared = True
    ids2 = ids.reshape(1, -1)
  elif ids.ndim == 2:
    shared = False
    if ids.shape[0] != b:
      raise HostOpError(f"per-row ids must be [b={b}, k], got shape {ids.shape}; pass a 1-D "
                        f"array for one shared (union) list")
    ids2 = ids
  else:
    raise HostOpError(f"ids must be i32[k] (shared) or i32[b, k] (per row), got shape {ids.shape}")
  ids2 = np.ascontiguousarray(ids2, dtype=np.int32)
  compact, counts, max_id = _compact_ids(ids2)
  if max_id >= n:
    raise HostOpError(f"active id {max_id} out of range: this layer has {n} host neurons")
  return compact, counts, shared


def prepare_x(x, d: int):
  """x: f32[D] or f32[b, D] -> (f32[b, D] C-contiguous, squeeze: bool). Converts other floats."""
  x = np.asarray(x)
  if x.ndim not in (1, 2) or x.shape[-1] != d:
    raise HostOpError(f"x must be f32[{d}] or f32[b, {d}], got shape {x.shape}")
  squeeze = x.ndim == 1
  x2 = np.ascontiguousarray(x.reshape(1, d) if squeeze else x, dtype=np.float32)
  return x2, squeeze


def sparse_ffn_reference(rows_of, x, ids, family: str) -> np.ndarray:
  """The float64 NumPy sparse FFN the kernels are tested against.

  rows_of(act_ids: int[m]) -> (gate, up, down): f64[m, D] rows of those neurons. x: f32[b, D] or
  f32[D]; ids: int[b, k] or int[k] (negative = padding). Returns f32[b, D] (f32[D] for 1-D x).
  """
  x = np.asarray(x, np.float64)
  squeeze = x.ndim == 1
  x2 = x.reshape(1, -1) if squeeze else x
  ids = np.asarray(ids)
  per_row = ids if ids.ndim == 2 else np.broadcast_to(ids, (x2.shape[0], ids.shape[0]))
  y = np.zeros(x2.shape, np.float64)
  for r in range(x2.shape[0]):
    gate, up, down = rows_of(per_row[r][per_row[r] >= 0])
    a = activation_reference(gate @ x2[r], up @ x2[r], family)
    y[r] = a @ down
  y = y.astype(np.float32)
  return y[0] if squeeze else y


_F32 = ir.FloatType()
_V8 = ir.VectorType(_F32, 8)


def hsum(bd, v):
  """<2^k x float> -> float, halving pairwise (a fixed order: reproducible results)."""
  while v.type.count > 1:
    m = v.type.count // 2
    lanes = [ir.Constant(ir.VectorType(ir.IntType(32), m), list(range(o, o + m))) for o in (0, m)]
    v = fadd(bd, *(bd.shuffle_vector(v, v, k) for k in lanes))
  return bd.extract_element(v, ir.Constant(ir.IntType(32), 0))


@intrinsic
def _dot_f32_c(typingctx, a, b):
  """`dot_f32` on C-contiguous arrays. Eight lanes, four
  accumulators per 32 values, the rest into the first, then a fixed pairwise sum and the tail:
  one order whatever fastmath lets LLVM do to the caller (`ORDERED`), so the same bits compiled
  in-process or loaded from numba's cache (BUILD_NOTES.md, issue 11)."""
  for t in (a, b):
    if not (isinstance(t, types.Array) and t.ndim == 1 and t.dtype == types.float32
            and t.layout == "C"):
      return None
  sig = types.float32(a, b)

  def codegen(context, builder, signature, args):
    a_ary, b_ary = (context.make_array(t)(context, builder, v)
                    for t, v in zip(signature.args, args))
    ap, bp = a_ary.data, b_ary.data
    n = builder.extract_value(a_ary.shape, 0)
    it = n.type

    def load8(p, off):
      return builder.load(builder.bitcast(builder.gep(p, [off]), _V8.as_pointer()), align=4)

    def step(acc_p, off):
      builder.store(fma(builder, load8(ap, off), load8(bp, off), builder.load(acc_p)), acc_p)

    zero = ir.Constant(_V8, [0.0] * 8)
    accs = [cgutils.alloca_once_value(builder, zero) for _ in range(4)]
    groups = builder.lshr(n, ir.Constant(it, 5))
    with cgutils.for_range(builder, groups) as loop:
      base = builder.shl(loop.index, ir.Constant(it, 5))
      for k in range(4):
        step(accs[k], builder.add(base, ir.Constant(it, 8 * k)))
    with cgutils.for_range_slice(builder, builder.shl(groups, ir.Constant(it, 2)),
                                 builder.lshr(n, ir.Constant(it, 3)), ir.Constant(it, 1),
                                 inc=True) as (c, _):
      step(accs[0], builder.shl(c, ir.Constant(it, 3)))
    tail = cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0))
    with cgutils.for_range_slice(builder, builder.shl(builder.lshr(n, ir.Constant(it, 3)),
                                                      ir.Constant(it, 3)),
                                 n, ir.Constant(it, 1), inc=True) as (j, _):
      prod = fmul(builder, builder.load(builder.gep(ap, [j])), builder.load(builder.gep(bp, [j])))
      builder.store(fadd(builder, builder.load(tail), prod), tail)
    ld = [builder.load(p) for p in accs]
    acc = fadd(builder, fadd(builder, ld[0], ld[1]), fadd(builder, ld[2], ld[3]))
    return fadd(builder, hsum(builder, acc), builder.load(tail))

  return sig, codegen


def dot_f32(a, b):
  """f32: sum_j a[j] b[j] for a: f32[n], b: f32[>= n], in one fixed order (numba only)."""
  raise NotImplementedError("dot_f32 runs inside numba-compiled code only")


@numba.extending.overload(dot_f32, jit_options=JIT_ORDERED)
def _dot_f32_overload(a, b):
  """The vector intrinsic on C-contiguous rows; strided ones (never on the hot paths) a loop in
  index order."""
  if a.layout == "C" and b.layout == "C":
    return lambda a, b: _dot_f32_c(a, b)

  def strided(a, b):
    acc = np.float32(0.0)
    for j in range(a.shape[0]):
      acc += a[j] * b[j]
    return acc
  return strided
