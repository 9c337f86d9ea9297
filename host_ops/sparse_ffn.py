"""The cold FFN neurons on the host: a sparse gated FFN over neuron-major f32 rows (numba).

One layer's host weights are neuron-major, so one neuron is one contiguous row of each matrix
(PowerInfer's row-column bundling, arXiv 2312.12456 §5; the down projection is stored transposed):

  gate_rows, up_rows, down_rows: f32[n, D]    (n host neurons, D = hidden size)

For a token x: f32[D] and its active host neurons A (ids into [0, n)):

  y = sum_{i in A} act(gate_i . x, up_i . x) * down_i                              f32[D]

with act = silu(g)*u ("swiglu"), relu(g)*u ("reglu") or relu(g)*relu(u) ("drelu"). Only the rows of
active neurons are read; a ReLU-family neuron whose activation is exactly 0 skips its down row.

Batches: x: f32[b, D] with either one padded id list per row, ids: i32[b, k] (-1 = padding), or
one shared (union) list, ids: i32[k], applied to every row (each active row is then read once for
all b).
Ids must be unique within a list (not checked; a repeated id is counted twice) and < n (checked).
Negative ids are padding wherever they sit. Empty and full lists work.

Parallel scheme (deterministic; PowerInfer's CPU down-projection reduction raced on a shared
output): each list is cut into one contiguous range per thread; thread t accumulates its range
into its own partial output, partials: f32[n_threads, b, D]; the partials are then summed in
thread order.
So a fixed thread count gives bitwise identical results on every run. Dots accumulate in f32.

Layout, per STYLE.md: numba kernel (`sparse_ffn_f32_kernel`) -> public function
(`sparse_ffn_host`, validates) -> NumPy reference (`sparse_ffn_host_reference`, float64) -> the
per-layer owner `HostFFNWeights`, which a JAX callback closes over so that only activations and id
vectors cross it (`pijax.backends.bridge`). Quantized rows: `host_ops.quant`.
"""

from __future__ import annotations

import numba
import numpy as np

from host_ops import common
from host_ops import quant
from host_ops.common import HostOpError, get_host_threads, set_host_threads  # noqa: F401 (API)

WEIGHT_F32 = "f32"
WEIGHT_Q8 = "q8"
WEIGHT_FORMATS = (WEIGHT_F32, WEIGHT_Q8)


@numba.njit(inline="always", **common.JIT)
def _neuron_f32(g_row, u_row, d_row, x_row, acc_row, code):
  """acc_row += act(g_row . x_row, u_row . x_row) * d_row. All f32[D]; acc_row is written."""
  g = np.float32(0.0)
  u = np.float32(0.0)
  for d in range(x_row.shape[0]):
    xd = x_row[d]
    g += g_row[d] * xd
    u += u_row[d] * xd
  a = common.activation(g, u, code)
  if a != 0:
    for d in range(acc_row.shape[0]):
      acc_row[d] += a * d_row[d]


@numba.njit(inline="always", **common.JIT)
def _prefetch_f32(gate, up, down, ids_row, j, hi, ahead):
  """Prefetches the rows of neuron ids_row[j + ahead] when it is still in this thread's range."""
  if ahead > 0 and j + ahead < hi:
    p = ids_row[j + ahead]
    common.prefetch_head(gate[p])
    common.prefetch_head(up[p])
    common.prefetch_head(down[p])


@numba.njit(parallel=True, **common.JIT)
def sparse_ffn_f32_kernel(gate, up, down, x, ids, counts, shared, code, n_threads, ahead):
  """The sparse FFN over f32 rows.

  gate, up, down: f32[n, D] neuron-major; x: f32[b, D]; ids: i32[1 or b, k] with each row's valid
  ids first (counts: i32[1 or b] of them); shared: ids[0] serves every row of x; code: family code;
  n_threads: the number of partials (= numba threads); ahead: prefetch distance in neurons (0 off).
  Returns f32[b, D].
  """
  b, dim = x.shape
  # [n_threads, b, D]: thread t's private sum over its contiguous range of each id list.
  partials = np.zeros((n_threads, b, dim), dtype=np.float32)
  for t in numba.prange(n_threads):
    acc = partials[t]
    if shared:
      cnt = counts[0]
      hi = (t + 1) * cnt // n_threads
      for j in range(t * cnt // n_threads, hi):
        _prefetch_f32(gate, up, down, ids[0], j, hi, ahead)
        i = ids[0, j]
        for r in range(b):
          _neuron_f32(gate[i], up[i], down[i], x[r], acc[r], code)
    else:
      for r in range(b):
        cnt = counts[r]
        hi = (t + 1) * cnt // n_threads
        for j in range(t * cnt // n_threads, hi):
          _prefetch_f32(gate, up, down, ids[r], j, hi, ahead)
          i = ids[r, j]
          _neuron_f32(gate[i], up[i], down[i], x[r], acc[r], code)
  # Fixed-order reduction: out = ((p0 + p1) + p2) + ...
  out = partials[0].copy()
  for t in range(1, n_threads):
    p = partials[t]
    for r in range(b):
      for d in range(dim):
        out[r, d] += p[r, d]
  return out


def _check_rows(name: str, rows, n: int | None = None, d: int | None = None) -> np.ndarray:
  rows = np.asarray(rows)
  if rows.ndim != 2 or rows.dtype != np.float32 or not rows.flags.c_contiguous:
    raise HostOpError(f"{name} must be a C-contiguous f32[n, D] array, got {rows.dtype}"
                      f"{list(rows.shape)} (contiguous={rows.flags.c_contiguous}); use "
                      f"np.ascontiguousarray(rows, dtype=np.float32)")
  if (n is not None and rows.shape[0] != n) or (d is not None and rows.shape[1] != d):
    raise HostOpError(f"{name} has shape {rows.shape}, expected ({n}, {d}) like gate_rows")
  return rows


def sparse_ffn_host(gate_rows, up_rows, down_rows, x, ids, family: str) -> np.ndarray:
  """y = sum over active ids of act(gate_i . x, up_i . x) * down_i, on the host CPU threads.

  Args:
    gate_rows, up_rows, down_rows: f32[n, D], C-contiguous, neuron-major (down transposed).
    x: f32[b, D] (or f32[D]).
    ids: i32[b, k] one list per row of x, or i32[k] shared by all rows; negative = padding;
      valid ids unique within a list and < n.
    family: "swiglu", "reglu" or "drelu".
  Returns:
    f32[b, D] (f32[D] when x is f32[D]). Bitwise reproducible for a fixed `set_host_threads`.
  """
  gate_rows = _check_rows("gate_rows", gate_rows)
  n, d = gate_rows.shape
  up_rows = _check_rows("up_rows", up_rows, n, d)
  down_rows = _check_rows("down_rows", down_rows, n, d)
  code = common.family_code(family)
  x2, squeeze = common.prepare_x(x, d)
  ids2, counts, shared = common.prepare_ids(ids, x2.shape[0], n)
  n_threads = common.ensure_host_threads()
  y = sparse_ffn_f32_kernel(gate_rows, up_rows, down_rows, x2, ids2, counts, shared, code,
                             n_threads, common.PREFETCH_AHEAD)
  return y[0] if squeeze else y


def sparse_ffn_host_reference(gate_rows, up_rows, down_rows, x, ids, family: str) -> np.ndarray:
  """NumPy reference of `sparse_ffn_host` (same arguments; float64 inside, f32 result)."""
  rows = [np.asarray(r) for r in (gate_rows, up_rows, down_rows)]
  return common.sparse_ffn_reference(
      lambda act_ids: [r[act_ids].astype(np.float64) for r in rows], x, ids, family)


class HostFFNWeights:
  """One layer's host-resident FFN neurons: owns C-contiguous NumPy rows, f32 or Q8 (int8 blocks).

  Attributes:
    family: "swiglu" | "reglu" | "drelu".
    weight_format: "f32" (gate/up/down: f32[n, D]) or "q8" (each a `quant.Q8Rows`:
      q: i8[n, D], scales: f32[n, D // 32]).
    n, d: host neurons and hidden size.
  Call it as `w(x, ids) -> f32[b, D]` (see `sparse_ffn_host` for x and ids).
  """

  def __init__(self, gate_rows, up_rows, down_rows, family: str, weight_format: str = WEIGHT_F32):
    """gate_rows, up_rows, down_rows: f32[n, D] (copied if not C-contiguous f32).

    weight_format "q8" quantizes them here (`quant.quantize_q8`; D must be a multiple of 32).
    """
    common.family_code(family)
    if weight_format not in WEIGHT_FORMATS:
      raise HostOpError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    rows = [np.ascontiguousarray(r, dtype=np.float32) for r in (gate_rows, up_rows, down_rows)]
    n, d = _check_rows("gate_rows", rows[0]).shape
    _check_rows("up_rows", rows[1], n, d)
    _check_rows("down_rows", rows[2], n, d)
    if weight_format == WEIGHT_Q8:
      rows = [quant.quantize_q8(r) for r in rows]
    self._init(rows, family, weight_format, n, d)

  @classmethod
  def from_q8(cls, gate: quant.Q8Rows, up: quant.Q8Rows, down: quant.Q8Rows,
              family: str) -> "HostFFNWeights":
    """Wraps already-quantized rows (each `(q: i8[n, D], scales: f32[n, D // 32])`)."""
    common.family_code(family)
    rows = [quant.check_q8(name, *r) for name, r in (("gate", gate), ("up", up), ("down", down))]
    n, d = rows[0].q.shape
    for name, r in zip(("up", "down"), rows[1:]):
      if r.q.shape != (n, d):
        raise HostOpError(f"{name} q has shape {r.q.shape}, expected ({n}, {d}) like gate")
    self = cls.__new__(cls)
    self._init(rows, family, WEIGHT_Q8, n, d)
    return self

  def _init(self, rows, family, weight_format, n, d):
    self.gate, self.up, self.down = rows
    self.family = family
    self.weight_format = weight_format
    self.n, self.d = n, d
    self.lowbit = None  # host_ops.lowbit.LowbitPredictor of these rows, for run_predicted.

  def run_predicted(self, x) -> tuple[np.ndarray, np.ndarray]:
    """Predict-and-compute with `self.lowbit` (f32 rows only): x f32[b, D] ->
    (y: f32[b, D], active: i64[b]); see `host_ops.lowbit`."""
    if self.lowbit is None or self.weight_format != WEIGHT_F32:
      raise HostOpError("run_predicted needs f32 rows with a low-bit predictor attached")
    return self.lowbit.run(self.gate, self.up, self.down, x, self.family)

  @property
  def nbytes(self) -> int:
    """Host bytes held by the three matrices (and Q8 scales)."""
    if self.weight_format == WEIGHT_F32:
      return sum(r.nbytes for r in (self.gate, self.up, self.down))
    return sum(r.q.nbytes + r.scales.nbytes for r in (self.gate, self.up, self.down))

  @property
  def bytes_per_neuron(self) -> int:
    """Bytes read per active neuron (its gate, up and down rows; Q8: int8 values + scales)."""
    return self.nbytes // max(self.n, 1)

  def __call__(self, x, ids) -> np.ndarray:
    """x: f32[b, D] or f32[D]; ids: i32[b, k] or i32[k] (padding < 0) -> f32[b, D] (or f32[D])."""
    if self.weight_format == WEIGHT_F32:
      return sparse_ffn_host(self.gate, self.up, self.down, x, ids, self.family)
    return quant.sparse_ffn_host_q8(self.gate, self.up, self.down, x, ids, self.family)

  def reference(self, x, ids) -> np.ndarray:
    """The NumPy reference of `self(x, ids)` (Q8: on the dequantized rows)."""
    if self.weight_format == WEIGHT_F32:
      return sparse_ffn_host_reference(self.gate, self.up, self.down, x, ids, self.family)
    return quant.sparse_ffn_host_q8_reference(self.gate, self.up, self.down, x, ids, self.family)

  def __repr__(self) -> str:
    return (f"HostFFNWeights(n={self.n}, d={self.d}, family={self.family!r}, "
            f"weight_format={self.weight_format!r}, nbytes={self.nbytes})")
