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

Two passes (`_up_pass`: the activations of the neurons the gate passes; `_down_pass`: the down
rows of the nonzero ones), each thread on a contiguous share of a row's list; per-thread partial
sums added in thread order: bitwise reproducible for a fixed thread count. Layout: kernels -> `gated_ffn` (validates) -> reference.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from host_ops import _common
from host_ops import qblocks
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


# Neurons ahead whose whole rows (codes and scales) a thread prefetches in each pass.
AHEAD = 3


@numba.njit(inline="always", **_common._JIT)
def _prefetch_at(ids, j, hi, rows):
  """Prefetches every cache line of rows[ids[j]] (nothing once j >= hi)."""
  if j < hi:
    _common.prefetch_row(rows[ids[j]])


@numba.njit(inline="always", **_common._JIT)
def _prefetch_up(ids, j, hi, up_w, up_d, up_m, q4):
  """Prefetches up row ids[j]: codes, scales and (Q4_1) offsets."""
  _prefetch_at(ids, j, hi, up_w)
  _prefetch_at(ids, j, hi, up_d)
  if q4:
    _prefetch_at(ids, j, hi, up_m)


@numba.njit(inline="always", **_common._JIT)
def _add_row_q8_0(acc, a, q_row, d_row, block):
  """acc += a * dequant(q_row) (acc: f32[D]; q_row: i8[D]; d_row: u16[D/32], f16 bits; block =
  32 passed at run time: with a constant inner trip count LLVM unrolls the loop and cannot
  vectorize the store, as numba cannot tell it acc and the rows do not alias; see
  host_ops/quant.py)."""
  for blk in range(d_row.shape[0]):
    base = blk * block
    s = a * qblocks.f16_to_f32(d_row[blk])
    for j in range(block):
      acc[base + j] += s * np.float32(q_row[base + j])


@numba.njit(inline="always", **_common._JIT)
def _add_rows4_q8_0(acc, a, ids, dt_q, dt_d, block):
  """acc += sum_k a[k] * dequant(dt_q[ids[k]]) for k < 4 in one pass over acc (one row at a
  time loads and stores acc once per row: 7B shapes, 25% of the rows, 1.8 -> 1.4 ms)."""
  q0, q1, q2, q3 = dt_q[ids[0]], dt_q[ids[1]], dt_q[ids[2]], dt_q[ids[3]]
  d0, d1, d2, d3 = dt_d[ids[0]], dt_d[ids[1]], dt_d[ids[2]], dt_d[ids[3]]
  for blk in range(d0.shape[0]):
    base = blk * block
    s0, s1 = a[0] * qblocks.f16_to_f32(d0[blk]), a[1] * qblocks.f16_to_f32(d1[blk])
    s2, s3 = a[2] * qblocks.f16_to_f32(d2[blk]), a[3] * qblocks.f16_to_f32(d3[blk])
    for j in range(block):
      k = base + j
      acc[k] += (s0 * np.float32(q0[k]) + s1 * np.float32(q1[k])) + \
          (s2 * np.float32(q2[k]) + s3 * np.float32(q3[k]))


@numba.njit(**_common._JIT)
def _down_pass(acts, dt_q, dt_d, n_threads, block):
  """Pass 2: y[r] = sum over i with acts[r, i] != 0 of acts[r, i] * down_t[i]; returns (y, counts).

  Each thread takes a contiguous share of each row's nonzero list, whole rows prefetched AHEAD
  neurons ahead, rows added four at a time (`_add_rows4_q8_0`) then the rest one by one."""
  b, f = acts.shape
  dim = dt_q.shape[1]
  ids = np.empty((b, f), np.int32)
  counts = np.zeros(b, np.int64)
  for r in range(b):
    c = 0
    for i in range(f):
      if acts[r, i] != 0:
        ids[r, c] = i
        c += 1
    counts[r] = c
  partials = np.zeros((n_threads, b, dim), np.float32)
  _down_threads(acts, ids, counts, dt_q, dt_d, partials, n_threads, block)
  y = partials[0].copy()  # Thread order: y = ((p0 + p1) + p2) ...
  for t in range(1, n_threads):
    y += partials[t]
  return y, counts


@numba.njit(parallel=True, **_common._JIT)
def _down_threads(acts, ids, counts, dt_q, dt_d, partials, n_threads, block):
  for t in numba.prange(n_threads):
    four = np.empty(4, np.int64)
    a4 = np.empty(4, np.float32)
    for r in range(acts.shape[0]):
      lo = t * counts[r] // n_threads
      hi = (t + 1) * counts[r] // n_threads
      for j in range(lo, min(lo + AHEAD, hi)):
        _prefetch_at(ids[r], j, hi, dt_q)
        _prefetch_at(ids[r], j, hi, dt_d)
      j = lo
      while j < hi:
        if j + 4 <= hi:
          for k in range(4):
            _prefetch_at(ids[r], j + AHEAD + k, hi, dt_q)
            _prefetch_at(ids[r], j + AHEAD + k, hi, dt_d)
            four[k] = ids[r, j + k]
            a4[k] = acts[r, four[k]]
          _add_rows4_q8_0(partials[t, r], a4, four, dt_q, dt_d, block)
          j += 4
        else:
          i = ids[r, j]
          _add_row_q8_0(partials[t, r], acts[r, i], dt_q[i], dt_d[i], block)
          j += 1


@numba.njit(parallel=True, **_common._JIT)
def _up_pass(g, h, up_w, up_d, up_m, cut, code, n_threads, q4):
  """Pass 1: (acts f32[b, F]: act(g, up . h) for the neurons whose gate passes, 0 elsewhere;
  passed i64[b]: how many passed, i.e. up rows read).

  up: Q4_1 (q4 true: up_w nibbles u8[F, D/2], up_d, up_m u16[F, D/32]) or Q8_0 (up_w i8[F, D];
  up_m unused), f32 dots. Each thread takes a contiguous share of each row's gate-active list,
  whole rows prefetched AHEAD neurons ahead. Two passes, not one: prefetching a neuron's down
  row before its up row says it is active wasted half the down reads on dReLU (7B shapes: 4.0
  -> 3.1 ms per layer).
  """
  b, f = g.shape
  ids, counts = _active_ids(g, cut, code)
  xlo, xhi, xsum = qmatmul.split_q4_1_x(h)
  acts = np.zeros((b, f), np.float32)
  for t in numba.prange(n_threads):
    for r in range(b):
      lo = t * counts[r] // n_threads
      hi = (t + 1) * counts[r] // n_threads
      for j in range(lo, min(lo + AHEAD, hi)):
        _prefetch_up(ids[r], j, hi, up_w, up_d, up_m, q4)
      for j in range(lo, hi):
        _prefetch_up(ids[r], j + AHEAD, hi, up_w, up_d, up_m, q4)
        i = ids[r, j]
        if q4:
          u = qmatmul._dot_q4_1(up_w[i], up_d[i], up_m[i], xlo[r], xhi[r], xsum[r])
        else:
          u = qmatmul._dot_q8_0(up_w[i], up_d[i], h[r])
        acts[r, i] = _common.activation(g[r, i], u, code)
  return acts, counts


@numba.njit(parallel=True, **_common._JIT)
def _up_pass_int8(g, h, up_w, up_d, up_m, cut, code, n_threads, q4):
  """`_up_pass` with up . h an integer dot on h quantized per block (`host_ops.qdot`; compiled
  only where qdot.AVAILABLE)."""
  b, f = g.shape
  ids, counts = _active_ids(g, cut, code)
  xq, dx, xsum = qdot.quantize_x(h)
  acts = np.zeros((b, f), np.float32)
  for t in numba.prange(n_threads):
    for r in range(b):
      lo = t * counts[r] // n_threads
      hi = (t + 1) * counts[r] // n_threads
      for j in range(lo, min(lo + AHEAD, hi)):
        _prefetch_up(ids[r], j, hi, up_w, up_d, up_m, q4)
      for j in range(lo, hi):
        _prefetch_up(ids[r], j + AHEAD, hi, up_w, up_d, up_m, q4)
        i = ids[r, j]
        if q4:
          u = qdot._row_dot_q4_1(up_w[i], up_d[i], xq[r], dx[r]) + qdot.offset_dot(up_m[i],
                                                                                   xsum[r])
        else:
          u = qdot._row_dot_q8_0(up_w[i], up_d[i], xq[r], dx[r])
        acts[r, i] = _common.activation(g[r, i], u, code)
  return acts, counts


@numba.njit(**_common._JIT)
def _gated_kernel(g, h, up_w, up_d, up_m, dt_q, dt_d, cut, code, n_threads, block, q4):
  """y[r] = sum over active i of act(g[r, i], up_i . h[r]) * down_t[i]; returns (y, active
  i64[b]: neurons with a nonzero activation, passed i64[b]: neurons whose gate passed).

  g: f32[b, F] gate pre-activations; h: f32[b, D]; up: Q4_1 rows [F, D] (q4 true: up_w nibbles
  u8[F, D/2], up_d and up_m u16[F, D/32]) or Q8_0 (up_w i8[F, D], up_d; up_m unused);
  down_t: Q8_0 rows [F, D] (dt_q i8[F, D], dt_d u16[F, D/32]; scales as f16 bits).
  """
  acts, passed = _up_pass(g, h, up_w, up_d, up_m, cut, code, n_threads, q4)
  y, counts = _down_pass(acts, dt_q, dt_d, n_threads, block)
  return y, counts, passed


@numba.njit(**_common._JIT)
def _gated_int8_kernel(g, h, up_w, up_d, up_m, dt_q, dt_d, cut, code, n_threads, block, q4):
  """`_gated_kernel` with up . h as an integer dot on h quantized per block (`host_ops.qdot`)."""
  acts, passed = _up_pass_int8(g, h, up_w, up_d, up_m, cut, code, n_threads, q4)
  y, counts = _down_pass(acts, dt_q, dt_d, n_threads, block)
  return y, counts, passed


def gated_ffn(g, h, up: qmatmul.QMatrix, down_t: qmatmul.QMatrix, *, cut: float, family: str,
              dot: str = qmatmul.DOT_F32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
    (y: f32[b, D], active: i64[b] neurons with a nonzero activation per row (down rows read),
    passed: i64[b] neurons whose gate passed (up rows read)).

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
  q4 = up.kind == qmatmul.Q4_1
  m = up.arrays[2] if q4 else up.arrays[1]  # Q8_0: a placeholder u16[F, D/32], never read.
  kernel = _gated_int8_kernel if dot == qmatmul.DOT_INT8 and qdot.AVAILABLE else _gated_kernel
  return kernel(g, h, up.arrays[0], up.arrays[1], m, *down_t.arrays, np.float32(cut), code,
                _common.ensure_host_threads(), np.int64(qmatmul.BLOCK), q4)


def gated_ffn_reference(g, h, up: qmatmul.QMatrix, down_t: qmatmul.QMatrix, *, cut: float,
                        family: str, dot: str = qmatmul.DOT_F32
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
  return y.astype(np.float32), (a != 0).sum(axis=1), keep.sum(axis=1)
