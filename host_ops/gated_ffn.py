"""Gate-first sparse FFN over quantized host weights (numba): the gate decides, up and down rows
of inactive neurons are never read.

With 4-bit weights a separate predictor costs as much as the rows it saves (the low-bit
predictor reads 4.5 bits per gate/up weight, a Q4_1 row 5), so on quantized host weights the
gate itself is the predictor: gate . h is computed for every neuron (it is needed anyway), and
only neurons it marks active read their up row and their down row:

  ReGLU, dReLU:  active iff gate . h > 0 (exact: relu(g) = 0 makes the neuron's output 0;
                 dReLU also drops u <= 0 after reading the up row);
  SwiGLU:        active iff |silu(gate . h)| >= cut_l, a per-layer cut calibrated for a target
                 sparsity (CATS, Lee et al. 2024, arXiv 2404.08763 §3: threshold the gate
                 activation's magnitude; no fine-tuning here).

The down projection is read neuron-major (`down_t`: row i = neuron i's output weights), so it is
stored re-quantized to Q8_0 from the file's values (the file's down blocks run along the neuron
axis, where skipping cannot save bytes).

Per-thread partial sums over contiguous shares of each row's active list, summed in thread
order: bitwise reproducible for a fixed thread count. Layout: kernels -> `gated_ffn` (validates) -> reference.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from host_ops import _common
from host_ops import qdot
from host_ops import qmatmul
from host_ops._common import HostOpError


@numba.njit(**_common._JIT)
def _active_ids(g, cut, code):
  """Per row, the neurons whose gate passes: ids i32[b, F] (valid first), counts i64[b].

  SwiGLU: |silu(g)| >= cut in f32; ReLU families: g > 0. A separate serial pass (F exps per row
  in f32) so the parallel pass can split the active neurons evenly between threads.
  """
  b, f = g.shape
  ids = np.empty((b, f), np.int32)
  counts = np.zeros(b, np.int64)
  for r in range(b):
    c = 0
    for i in range(f):
      gi = g[r, i]
      if code == 0:
        keep = abs(gi / (np.float32(1.0) + np.exp(-max(gi, np.float32(-80.0))))) >= cut
      else:
        keep = gi > 0
      if keep:
        ids[r, c] = i
        c += 1
    counts[r] = c
  return ids, counts


@numba.njit(inline="always", **_common._JIT)
def _add_row_q8_0(acc, a, q_row, d_row, block):
  """acc += a * dequant(q_row) (acc: f32[D]; q_row: i8[D]; d_row: f32[D/32]; block = 32 passed
  at run time: with a constant inner trip count LLVM unrolls the loop and cannot vectorize the
  store, as numba cannot tell it acc and the rows do not alias; see host_ops/quant.py)."""
  for blk in range(d_row.shape[0]):
    base = blk * block
    s = a * d_row[blk]
    for j in range(block):
      acc[base + j] += s * np.float32(q_row[base + j])


@numba.njit(parallel=True, **_common._JIT)
def _gated_q4_1_kernel(g, h, up_qs, up_d, up_m, dt_q, dt_d, cut, code, n_threads, block):
  """y[r] = sum over active i of act(g[r, i], up_i . h[r]) * down_t[i]; returns (y, counts).

  g: f32[b, F] gate pre-activations; h: f32[b, D]; up: Q4_1 rows [F, D]; down_t: Q8_0 rows [F, D].
  Each thread takes a contiguous share of each row's active list, prefetching the next one's rows.
  """
  b, f = g.shape
  dim = h.shape[1]
  ids, counts = _active_ids(g, cut, code)
  xlo, xhi, xsum = qmatmul.split_q4_1_x(h)
  partials = np.zeros((n_threads, b, dim), np.float32)
  done = np.zeros((n_threads, b), np.int64)
  for t in numba.prange(n_threads):
    for r in range(b):
      lo = t * counts[r] // n_threads
      hi = (t + 1) * counts[r] // n_threads
      for j in range(lo, hi):
        if j + 1 < hi:
          nxt = ids[r, j + 1]
          _common.prefetch_head(up_qs[nxt])
          _common.prefetch_head(dt_q[nxt])
        i = ids[r, j]
        u = qmatmul._dot_q4_1(up_qs[i], up_d[i], up_m[i], xlo[r], xhi[r], xsum[r])
        a = _common.activation(g[r, i], u, code)
        if a == 0:
          continue
        done[t, r] += 1
        _add_row_q8_0(partials[t, r], a, dt_q[i], dt_d[i], block)
  return _reduce(partials, done)


@numba.njit(parallel=True, **_common._JIT)
def _gated_q8_0_kernel(g, h, up_q, up_d, dt_q, dt_d, cut, code, n_threads, block):
  """`_gated_q4_1_kernel` with Q8_0 up rows."""
  b, f = g.shape
  dim = h.shape[1]
  ids, counts = _active_ids(g, cut, code)
  partials = np.zeros((n_threads, b, dim), np.float32)
  done = np.zeros((n_threads, b), np.int64)
  for t in numba.prange(n_threads):
    for r in range(b):
      lo = t * counts[r] // n_threads
      hi = (t + 1) * counts[r] // n_threads
      for j in range(lo, hi):
        if j + 1 < hi:
          nxt = ids[r, j + 1]
          _common.prefetch_head(up_q[nxt])
          _common.prefetch_head(dt_q[nxt])
        i = ids[r, j]
        u = qmatmul._dot_q8_0(up_q[i], up_d[i], h[r])
        a = _common.activation(g[r, i], u, code)
        if a == 0:
          continue
        done[t, r] += 1
        _add_row_q8_0(partials[t, r], a, dt_q[i], dt_d[i], block)
  return _reduce(partials, done)


@numba.njit(parallel=True, **_common._JIT)
def _gated_int8_kernel(g, h, up_w, up_d, up_m, dt_q, dt_d, cut, code, n_threads, block, q4):
  """`_gated_q4_1_kernel` with up . h as an integer dot on h quantized per block
  (`host_ops.qdot`); up_w: Q4_1 nibbles u8[F, D/2] (q4 true, up_m its offsets) or Q8_0 codes
  i8[F, D] (up_m unused)."""
  b, f = g.shape
  dim = h.shape[1]
  ids, counts = _active_ids(g, cut, code)
  xq, dx, xsum = qdot.quantize_x(h)
  partials = np.zeros((n_threads, b, dim), np.float32)
  done = np.zeros((n_threads, b), np.int64)
  for t in numba.prange(n_threads):
    for r in range(b):
      lo = t * counts[r] // n_threads
      hi = (t + 1) * counts[r] // n_threads
      for j in range(lo, hi):
        if j + 1 < hi:
          nxt = ids[r, j + 1]
          _common.prefetch_head(up_w[nxt])
          _common.prefetch_head(dt_q[nxt])
        i = ids[r, j]
        if q4:
          u = qdot._row_dot_q4_1(up_w[i], up_d[i], xq[r], dx[r])
          for blk in range(up_m.shape[1]):
            u += up_m[i, blk] * xsum[r, blk]
        else:
          u = qdot._row_dot_q8_0(up_w[i], up_d[i], xq[r], dx[r])
        a = _common.activation(g[r, i], u, code)
        if a == 0:
          continue
        done[t, r] += 1
        _add_row_q8_0(partials[t, r], a, dt_q[i], dt_d[i], block)
  return _reduce(partials, done)


@numba.njit(**_common._JIT)
def _reduce(partials, counts):
  """Thread-order sum: y = ((p0 + p1) + p2) ...; active counts per row."""
  y = partials[0].copy()
  total = counts[0].copy()
  for t in range(1, partials.shape[0]):
    y += partials[t]
    total += counts[t]
  return y, total


def gated_ffn(g, h, up: qmatmul.QMatrix, down_t: qmatmul.QMatrix, *, cut: float, family: str,
              dot: str = qmatmul.DOT_F32) -> tuple[np.ndarray, np.ndarray]:
  """The gate-first sparse FFN (module docstring).

  Args:
    g: f32[b, F] gate pre-activations (gate . h, computed densely by the caller).
    h: f32[b, D] the FFN input (after ffn_norm).
    up: [F, D] Q4_1 or Q8_0; down_t: [F, D] Q8_0, neuron-major.
    cut: SwiGLU: minimum |silu(g)| of an active neuron (>= 0); ignored by ReLU families.
    family: "swiglu" | "reglu" | "drelu".
    dot: "f32", or "int8": up . h on h quantized per block of 32 (`host_ops.qdot`; f32 where
      qdot.AVAILABLE is False).

  Returns:
    (y: f32[b, D], active: i64[b] neurons computed per row).

  Raises:
    HostOpError: shapes or formats that do not match, an unknown dot.
  """
  code = _common.family_code(family)
  g = np.ascontiguousarray(g, np.float32)
  h, _ = _common.prepare_x(h, up.shape[1])
  f = up.shape[0]
  if g.shape != (h.shape[0], f) or down_t.shape != up.shape or down_t.kind != qmatmul.Q8_0:
    raise HostOpError(f"gated_ffn: g {g.shape}, h {h.shape}, up {up.shape}, down_t "
                      f"{down_t.kind} {down_t.shape} do not match (down_t must be Q8_0 [F, D])")
  if not (cut >= 0 and math.isfinite(cut)):
    raise HostOpError(f"gated_ffn: cut must be a finite number >= 0, got {cut}")
  if dot not in qmatmul.DOTS:
    raise HostOpError(f"gated_ffn: dot must be one of {', '.join(qmatmul.DOTS)}, got {dot!r}")
  n_threads = _common.ensure_host_threads()
  if dot == qmatmul.DOT_INT8 and qdot.AVAILABLE:
    q4 = up.kind == qmatmul.Q4_1
    m = up.arrays[2] if q4 else up.arrays[1]  # Q8_0: a placeholder f32[F, D/32], never read.
    return _gated_int8_kernel(g, h, up.arrays[0], up.arrays[1], m, *down_t.arrays,
                              np.float32(cut), code, n_threads, np.int64(qmatmul.BLOCK), q4)
  if up.kind == qmatmul.Q4_1:
    return _gated_q4_1_kernel(g, h, *up.arrays, *down_t.arrays, np.float32(cut), code, n_threads,
                              np.int64(qmatmul.BLOCK))
  return _gated_q8_0_kernel(g, h, *up.arrays, *down_t.arrays, np.float32(cut), code, n_threads,
                            np.int64(qmatmul.BLOCK))


def gated_ffn_reference(g, h, up: qmatmul.QMatrix, down_t: qmatmul.QMatrix, *, cut: float,
                        family: str, dot: str = qmatmul.DOT_F32) -> tuple[np.ndarray, np.ndarray]:
  """Float64 NumPy reference of `gated_ffn` (dot "int8": up . h as `qdot.matmul_reference`)."""
  g = np.asarray(g, np.float64)
  if dot == qmatmul.DOT_INT8 and qdot.AVAILABLE:
    u = qdot.matmul_reference(up.kind, up.arrays, np.asarray(h, np.float32)).astype(np.float64)
  else:
    u = np.asarray(h, np.float64) @ qmatmul.dequantize_reference(up).T
  a = _common.activation_reference(g, u, family)
  if family == "swiglu":
    with np.errstate(over="ignore"):
      keep = np.abs(_common.activation_reference(g, 1.0, family)) >= cut
  else:
    keep = g > 0
  a = np.where(keep, a, 0.0)
  y = a @ qmatmul.dequantize_reference(down_t)
  return y.astype(np.float32), (a != 0).sum(axis=1)
