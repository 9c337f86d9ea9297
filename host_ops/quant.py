"""Q8 host weights: int8 rows with one f32 scale per block of 32 values (like llama.cpp's Q8_0).

Why (issue "CPU speed"): host ops are bandwidth-bound, and int8 rows read
1.125 bytes per weight (1 + 4/32 for the scales) instead of 4. Activations stay f32 (never
quantized); products q * scale * x are accumulated in f32.

Format, for rows: f32[n, D] with D a multiple of 32 (Q8_BLOCK):
  q: i8[n, D], scales: f32[n, D // 32]; block j of row i is rows[i, 32j:32j+32] ~ q[i, 32j:32j+32] *
  scales[i, j], scale = max|block| / 127, q = round-to-nearest(block / scale) in [-127, 127] (an
  all-zero block has scale 0). Per value, |dequantized - original| <= scale / 2.

Contents, per STYLE.md (kernel -> public function -> reference):
  quantize_q8 / dequantize_q8 (NumPy; the dequantizer is the format's reference),
  sparse_ffn_host_q8 (numba; same ids, batching and deterministic per-thread partials as
  `host_ops.sparse_ffn.sparse_ffn_host`) / sparse_ffn_host_q8_reference,
  gemv_q8 (numba, dense: every row, parallel over rows; for attention projections, LM head) /
  gemv_q8_reference.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

from host_ops import common
from host_ops.common import HostOpError

Q8_BLOCK = 32  # Values per scale.
_Q8_MAX = 127


class Q8Rows(NamedTuple):
  """Quantized rows. q: i8[n, D]; scales: f32[n, D // 32]. Unpacks as `q, scales = rows`."""
  q: np.ndarray
  scales: np.ndarray


def quantize_q8(rows, chunk_rows: int = 1024) -> Q8Rows:
  """Quantizes f32[n, D] rows to Q8 blocks of 32 (D % 32 == 0, all values finite).

  Returns Q8Rows(q: i8[n, D], scales: f32[n, D // 32]), both C-contiguous. Works `chunk_rows` rows
  at a time so the float64 temporaries stay small (~chunk_rows * D * 8 bytes).
  """
  rows = np.asarray(rows)
  if rows.ndim != 2 or rows.dtype.kind != "f":
    raise HostOpError(f"quantize_q8 needs float rows [n, D], got {rows.dtype}{list(rows.shape)}")
  n, d = rows.shape
  if d % Q8_BLOCK:
    raise HostOpError(f"Q8 rows need D to be a multiple of {Q8_BLOCK}, got D={d}; pad the hidden "
                      f"dimension or keep this layer in f32")
  q = np.empty((n, d), np.int8)
  scales = np.empty((n, d // Q8_BLOCK), np.float32)
  for lo in range(0, n, chunk_rows):
    # [rows, blocks, 32]
    blk = rows[lo:lo + chunk_rows].astype(np.float64).reshape(-1, d // Q8_BLOCK, Q8_BLOCK)
    if not np.isfinite(blk).all():
      raise HostOpError(f"quantize_q8: rows {lo}..{lo + len(blk) - 1} hold NaN or inf")
    s32 = (np.abs(blk).max(axis=2) / _Q8_MAX).astype(np.float32)  # [rows, blocks]
    s64 = s32.astype(np.float64)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
      qb = np.where(s64 > 0, np.rint(blk / np.where(s64 > 0, s64, 1.0)), 0.0)
    q[lo:lo + chunk_rows] = np.clip(qb, -_Q8_MAX, _Q8_MAX).astype(np.int8).reshape(-1, d)
    scales[lo:lo + chunk_rows] = s32
  return Q8Rows(q, scales)


def dequantize_q8(q, scales) -> np.ndarray:
  """Reference dequantizer: (q: i8[n, D], scales: f32[n, D // 32]) -> f32[n, D] = q * scale."""
  q = np.asarray(q)
  scales = np.asarray(scales, np.float32)
  n, d = q.shape
  out = q.astype(np.float32).reshape(n, d // Q8_BLOCK, Q8_BLOCK) * scales[..., None]
  return out.reshape(n, d)


def check_q8(name: str, q, scales) -> Q8Rows:
  """Validates one Q8 matrix for the kernels (C-contiguous i8[n, D] and f32[n, D // 32])."""
  q = np.asarray(q)
  scales = np.asarray(scales)
  if q.ndim != 2 or q.dtype != np.int8 or not q.flags.c_contiguous or q.shape[1] % Q8_BLOCK:
    raise HostOpError(f"{name}.q must be a C-contiguous i8[n, D] with D % {Q8_BLOCK} == 0, got "
                      f"{q.dtype}{list(q.shape)} (contiguous={q.flags.c_contiguous})")
  want = (q.shape[0], q.shape[1] // Q8_BLOCK)
  if scales.shape != want or scales.dtype != np.float32 or not scales.flags.c_contiguous:
    raise HostOpError(f"{name}.scales must be a C-contiguous f32{list(want)}, got "
                      f"{scales.dtype}{list(scales.shape)}")
  return Q8Rows(q, scales)


# Loop shapes that vectorize:
# - dots: one flat loop over D with the scale folded in per element, s[d >> 5]; a loop over
#   blocks with a reduction per block of 32 is much slower (horizontal adds every 32 values).
# - the down axpy acc[d] += a * s * q[d]: numba cannot tell LLVM that acc, q and s do not alias,
#   so it vectorizes only behind runtime overlap checks, which LLVM emits for a loop over blocks
#   whose inner trip count is a *runtime* value (`block`, always Q8_BLOCK), not for the constant
#   32 (unrolled fully) nor for the flat loop. So the kernels take `block` as an argument.
_Q8_SHIFT = 5
assert Q8_BLOCK == 1 << _Q8_SHIFT


@numba.njit(inline="always", **common.JIT)
def _dot_q8(q_row, s_row, x_row):
  """sum_d q_row[d] * s_row[d // 32] * x_row[d] in f32. q_row: i8[D]; s_row: f32[D // 32]."""
  acc = np.float32(0.0)
  for d in range(q_row.shape[0]):
    acc += np.float32(q_row[d]) * x_row[d] * s_row[d >> _Q8_SHIFT]
  return acc


@numba.njit(inline="always", **common.JIT)
def _neuron_q8(gq, gs, uq, us, dq, ds, x_row, acc_row, code, block):
  """acc_row += act(gate . x, up . x) * down for one Q8 neuron.

  gq, uq, dq: i8[D]; gs, us, ds: f32[D // 32]; x_row, acc_row: f32[D]; block: Q8_BLOCK (runtime).
  """
  g = np.float32(0.0)
  u = np.float32(0.0)
  for d in range(x_row.shape[0]):
    xd = x_row[d]
    g += np.float32(gq[d]) * xd * gs[d >> _Q8_SHIFT]
    u += np.float32(uq[d]) * xd * us[d >> _Q8_SHIFT]
  a = common.activation(g, u, code)
  if a != 0:
    for blk in range(ds.shape[0]):
      base = blk * block
      s = a * ds[blk]
      for j in range(block):  # `block` is a runtime value on purpose (see above).
        acc_row[base + j] += s * np.float32(dq[base + j])


@numba.njit(inline="always", **common.JIT)
def _prefetch_q8(gq, gs, uq, us, dq, ds, ids_row, j, hi, ahead):
  """Prefetches rows and scales of neuron ids_row[j + ahead] if it is in this thread's range."""
  if ahead > 0 and j + ahead < hi:
    p = ids_row[j + ahead]
    common.prefetch_head(gq[p])
    common.prefetch_head(uq[p])
    common.prefetch_head(dq[p])
    common.prefetch_head(gs[p])
    common.prefetch_head(us[p])
    common.prefetch_head(ds[p])


@numba.njit(parallel=True, **common.JIT)
def _sparse_ffn_q8_kernel(gq, gs, uq, us, dq, ds, x, ids, counts, shared, code, n_threads,
                          ahead, block):
  """The sparse FFN over Q8 rows; same contract as sparse_ffn.sparse_ffn_f32_kernel.

  gq, uq, dq: i8[n, D]; gs, us, ds: f32[n, D // 32]; x: f32[b, D]; ids: i32[1 or b, k] compacted
  (counts: i32[1 or b]); ahead: prefetch distance (0 off); block: Q8_BLOCK passed at run time.
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
        _prefetch_q8(gq, gs, uq, us, dq, ds, ids[0], j, hi, ahead)
        i = ids[0, j]
        for r in range(b):
          _neuron_q8(gq[i], gs[i], uq[i], us[i], dq[i], ds[i], x[r], acc[r], code, block)
    else:
      for r in range(b):
        cnt = counts[r]
        hi = (t + 1) * cnt // n_threads
        for j in range(t * cnt // n_threads, hi):
          _prefetch_q8(gq, gs, uq, us, dq, ds, ids[r], j, hi, ahead)
          i = ids[r, j]
          _neuron_q8(gq[i], gs[i], uq[i], us[i], dq[i], ds[i], x[r], acc[r], code, block)
  # Fixed-order reduction: out = ((p0 + p1) + p2) + ...
  out = partials[0].copy()
  for t in range(1, n_threads):
    p = partials[t]
    for r in range(b):
      for d in range(dim):
        out[r, d] += p[r, d]
  return out


def sparse_ffn_host_q8(gate: Q8Rows, up: Q8Rows, down: Q8Rows, x, ids, family: str) -> np.ndarray:
  """The sparse FFN of `sparse_ffn_host` over Q8 rows (each `(q: i8[n, D], scales: f32[n, D/32])`).

  x: f32[b, D] or f32[D]; ids: i32[b, k] per row or i32[k] shared (negative = padding, valid ids
  unique and < n); family: "swiglu" | "reglu" | "drelu". Returns f32[b, D] (f32[D] for 1-D x),
  bitwise reproducible for a fixed `set_host_threads`.
  """
  gate = check_q8("gate", *gate)
  n, d = gate.q.shape
  up = check_q8("up", *up)
  down = check_q8("down", *down)
  for name, r in (("up", up), ("down", down)):
    if r.q.shape != (n, d):
      raise HostOpError(f"{name}.q has shape {r.q.shape}, expected ({n}, {d}) like gate.q")
  code = common.family_code(family)
  x2, squeeze = common.prepare_x(x, d)
  ids2, counts, shared = common.prepare_ids(ids, x2.shape[0], n)
  n_threads = common.ensure_host_threads()
  y = _sparse_ffn_q8_kernel(gate.q, gate.scales, up.q, up.scales, down.q, down.scales, x2, ids2,
                            counts, shared, code, n_threads, common.PREFETCH_AHEAD,
                            np.int64(Q8_BLOCK))
  return y[0] if squeeze else y


def sparse_ffn_host_q8_reference(gate: Q8Rows, up: Q8Rows, down: Q8Rows, x, ids,
                                 family: str) -> np.ndarray:
  """NumPy reference of `sparse_ffn_host_q8`: the float64 sparse FFN on the dequantized rows."""
  mats = [Q8Rows(*m) for m in (gate, up, down)]

  def rows_of(act_ids):
    return [dequantize_q8(m.q[act_ids], m.scales[act_ids]).astype(np.float64) for m in mats]

  return common.sparse_ffn_reference(rows_of, x, ids, family)


@numba.njit(parallel=True, **common.JIT)
def _gemv_q8_kernel(q, scales, x):
  """out[r, i] = dequant(q[i]) . x[r].

  q: i8[n, D]; scales: f32[n, D // 32]; x: f32[b, D] -> f32[b, n].
  """
  n = q.shape[0]
  b = x.shape[0]
  out = np.empty((b, n), dtype=np.float32)
  for i in numba.prange(n):
    for r in range(b):
      out[r, i] = _dot_q8(q[i], scales[i], x[r])
  return out


def gemv_q8(q, scales, x) -> np.ndarray:
  """Dense Q8 matrix-vector product over all rows, parallel over rows (deterministic).

  q: i8[n, D]; scales: f32[n, D // 32]; x: f32[D] -> f32[n], or x: f32[b, D] -> f32[b, n].
  E.g. an LM head stored as [vocab, hidden] rows, or a projection stored as [out, in].
  """
  rows = check_q8("gemv_q8", q, scales)
  x2, squeeze = common.prepare_x(x, rows.q.shape[1])
  common.ensure_host_threads()
  y = _gemv_q8_kernel(rows.q, rows.scales, x2)
  return y[0] if squeeze else y


def gemv_q8_reference(q, scales, x) -> np.ndarray:
  """NumPy reference of `gemv_q8` (float64 inside, f32 result)."""
  w = dequantize_q8(q, scales).astype(np.float64)
  return (np.asarray(x, np.float64) @ w.T).astype(np.float32)
