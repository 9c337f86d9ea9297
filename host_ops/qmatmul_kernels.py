"""The f32 numba kernels behind `qmatmul.QMatrix`: gemv, gemm tiles, dequantization (numba).

Q4_1 / Q8_0 rows as codes and f16-bit scales in separate arrays (`dot_q4_1`, `dot_q8_0`); the raw
kinds through `host_ops.qblocks`'s row intrinsics (`row_dot`, `row_dot_int8`, `row_dequant`).
For b <= qmatmul.GEMV_MAX_ROWS rows of x a flat loop reads every block once and dots it with each
row (`gemv_*`, parallel over output rows); for more, tiles of 16 weight rows are dequantized once
into an f32 buffer and dotted with every row of x, four at a time (`gemm_*`, `tile_dots`). The
flat loop is the fastest float shape measured (a loop nest over blocks was slower, BUILD_NOTES.md).

Layout per STYLE.md: these kernels -> `qmatmul.QMatrix` (validates, dispatches) -> the NumPy
references in `host_ops.qmatmul`.
"""

from __future__ import annotations

import numba
import numpy as np

from host_ops import common
from host_ops import qblocks
from host_ops import qdot
from host_ops.qblocks import f16_to_f32 as _f32


@numba.njit(inline="always", **common.JIT)
def dot_q4_1(qs_row, d_row, m_row, xlo, xhi, xsum):
  """One Q4_1 row . x, x given as xlo/xhi (f32[D/2], the first/second 16 values of each block)
  and xsum (f32[D/32], block sums: the m term). One flat loop with the scale looked up per byte
  (j >> 4): LLVM vectorizes it; a loop nest over blocks does not."""
  acc = np.float32(0.0)
  for j in range(qs_row.shape[0]):
    c = np.int32(qs_row[j])
    acc += _f32(d_row[j >> 4]) * (np.float32(c & 15) * xlo[j] + np.float32(c >> 4) * xhi[j])
  bias = np.float32(0.0)
  for b in range(m_row.shape[0]):
    bias += _f32(m_row[b]) * xsum[b]
  return acc + bias


@numba.njit(inline="always", **common.JIT)
def dot_q8_0(q_row, d_row, x):
  """One Q8_0 row . x (x: f32[D])."""
  acc = np.float32(0.0)
  for j in range(q_row.shape[0]):
    acc += _f32(d_row[j >> 5]) * np.float32(q_row[j]) * x[j]
  return acc


@numba.njit(**common.JIT)
def split_q4_1_x(x):
  """x: f32[b, D] -> (xlo, xhi: f32[b, D/2], xsum: f32[b, D/32]) for `dot_q4_1`."""
  b, dim = x.shape
  nb = dim // 32
  xlo = np.empty((b, dim // 2), np.float32)
  xhi = np.empty((b, dim // 2), np.float32)
  xsum = np.empty((b, nb), np.float32)
  for r in range(b):
    for blk in range(nb):
      s = np.float32(0.0)
      for k in range(16):
        lo = x[r, 32 * blk + k]
        hi = x[r, 32 * blk + 16 + k]
        xlo[r, 16 * blk + k] = lo
        xhi[r, 16 * blk + k] = hi
        s += lo + hi
      xsum[r, blk] = s
  return xlo, xhi, xsum


@numba.njit(parallel=True, **common.JIT)
def gemv_q4_1_kernel(qs, d, m, x, out):
  """out[r, i] = W[i] . x[r]. qs: u8[n, D/2]; d, m: u16[n, D/32] (f16 bits); x: f32[b, D];
  out: f32[b, n]."""
  xlo, xhi, xsum = split_q4_1_x(x)
  n = qs.shape[0]
  for i in numba.prange(n):
    for r in range(x.shape[0]):
      out[r, i] = dot_q4_1(qs[i], d[i], m[i], xlo[r], xhi[r], xsum[r])


@numba.njit(parallel=True, **common.JIT)
def gemv_q8_0_kernel(q, d, x, out):
  """out[r, i] = W[i] . x[r]. q: i8[n, D]; d: u16[n, D/32] (f16 bits); x: f32[b, D];
  out: f32[b, n]."""
  n = q.shape[0]
  for i in numba.prange(n):
    for r in range(x.shape[0]):
      out[r, i] = dot_q8_0(q[i], d[i], x[r])


@numba.njit(inline="always", **common.JIT)
def _dequant_row_q4_1(qs_row, d_row, m_row, out):
  """out: f32[D] = one Q4_1 row."""
  for blk in range(d_row.shape[0]):
    scale = _f32(d_row[blk])
    low = _f32(m_row[blk])
    for k in range(16):
      c = np.int32(qs_row[16 * blk + k])
      out[32 * blk + k] = scale * np.float32(c & 15) + low
      out[32 * blk + 16 + k] = scale * np.float32(c >> 4) + low


@numba.njit(inline="always", **common.JIT)
def _dequant_row_q8_0(q_row, d_row, out):
  """out: f32[D] = one Q8_0 row."""
  for j in range(q_row.shape[0]):
    out[j] = _f32(d_row[j >> 5]) * np.float32(q_row[j])


@numba.njit(inline="always", **common.JIT)
def _dot_f32(a, b):
  acc = np.float32(0.0)
  for j in range(a.shape[0]):
    acc += a[j] * b[j]
  return acc


_TILE = 16  # Weight rows dequantized together by the many-row product.


@numba.njit(inline="always", **common.JIT)
def tile_dots(w, rows, x, out, lo):
  """out[r, lo + k] = w[k] . x[r] for k < rows, every r: four rows of x per pass over a weight
  row, so each loaded weight feeds four FMAs."""
  b = x.shape[0]
  dim = x.shape[1]
  r = 0
  while r + 4 <= b:
    x0 = x[r]
    x1 = x[r + 1]
    x2 = x[r + 2]
    x3 = x[r + 3]
    for k in range(rows):
      wk = w[k]
      a0 = np.float32(0.0)
      a1 = np.float32(0.0)
      a2 = np.float32(0.0)
      a3 = np.float32(0.0)
      for j in range(dim):
        v = wk[j]
        a0 += v * x0[j]
        a1 += v * x1[j]
        a2 += v * x2[j]
        a3 += v * x3[j]
      out[r, lo + k] = a0
      out[r + 1, lo + k] = a1
      out[r + 2, lo + k] = a2
      out[r + 3, lo + k] = a3
    r += 4
  while r < b:
    for k in range(rows):
      out[r, lo + k] = _dot_f32(w[k], x[r])
    r += 1


@numba.njit(parallel=True, **common.JIT)
def gemm_q4_1_kernel(qs, d, m, x, out):
  """out = x @ W.T for many rows of x: tiles of 16 weight rows are dequantized once into an f32
  buffer and dotted with every row of x (4 at a time). qs: u8[n, D/2]; d, m: u16[n, D/32]
  (f16 bits); x: f32[b, D]."""
  n = qs.shape[0]
  for tile in numba.prange((n + _TILE - 1) // _TILE):
    lo = tile * _TILE
    rows = min(_TILE, n - lo)
    w = np.empty((_TILE, x.shape[1]), np.float32)
    for k in range(rows):
      _dequant_row_q4_1(qs[lo + k], d[lo + k], m[lo + k], w[k])
    tile_dots(w, rows, x, out, lo)


@numba.njit(parallel=True, **common.JIT)
def gemm_q8_0_kernel(q, d, x, out):
  """`gemm_q4_1_kernel` for Q8_0 rows."""
  n = q.shape[0]
  for tile in numba.prange((n + _TILE - 1) // _TILE):
    lo = tile * _TILE
    rows = min(_TILE, n - lo)
    w = np.empty((_TILE, x.shape[1]), np.float32)
    for k in range(rows):
      _dequant_row_q8_0(q[lo + k], d[lo + k], w[k])
    tile_dots(w, rows, x, out, lo)


@numba.njit(parallel=True, **common.JIT)
def dequant_q4_1_kernel(qs, d, m, lo, hi, out):
  """out[i - lo] = W[i] as f32, rows [lo, hi). out: f32[>= hi - lo, D]."""
  for i in numba.prange(lo, hi):
    _dequant_row_q4_1(qs[i], d[i], m[i], out[i - lo])


@numba.njit(parallel=True, **common.JIT)
def dequant_q8_0_kernel(q, d, lo, hi, out):
  """out[i - lo] = W[i] as f32, rows [lo, hi). out: f32[>= hi - lo, D]."""
  for i in numba.prange(lo, hi):
    _dequant_row_q8_0(q[i], d[i], out[i - lo])


@numba.njit(inline="always", **common.JIT)
def _prefetch_bytes(row, nbytes):
  """Prefetches the first nbytes (0: none) of a contiguous u8 row."""
  for e in range(0, min(row.shape[0], nbytes), 64):
    common.prefetch(row, e)


@numba.njit(parallel=True, **common.JIT)
def gemv_raw_kernel(code, raw, x, out, prefetch):
  """out[r, i] = W[i] . x[r] for a raw-kind matrix (`qblocks` kind code). raw: u8[n, row bytes];
  x: f32[b, D]; out: f32[b, n]; prefetch: bytes of its next row each thread prefetches."""
  xsum = qblocks.block_sums(x)
  n = raw.shape[0]
  for i in numba.prange(n):
    if i + 1 < n:
      _prefetch_bytes(raw[i + 1], prefetch)
    for r in range(x.shape[0]):
      out[r, i] = qblocks.row_dot(code, raw[i], x[r], xsum[r])


@numba.njit(parallel=True, **common.JIT)
def gemv_raw_int8_kernel(code, raw, x, out, prefetch):
  """`gemv_raw_kernel` with x quantized per block of 32 (`qdot.quantize_x`) and integer block
  dots (`qblocks.row_dot_int8`; kinds of qblocks.INT8_KINDS, x86 AVX2)."""
  xq, dx, xsum = qdot.quantize_x(x)
  n = raw.shape[0]
  for i in numba.prange(n):
    if i + 1 < n:
      _prefetch_bytes(raw[i + 1], prefetch)
    for r in range(x.shape[0]):
      out[r, i] = qblocks.row_dot_int8(code, raw[i], xq[r], dx[r], xsum[r])


@numba.njit(parallel=True, **common.JIT)
def gemm_raw_kernel(code, raw, x, out):
  """`gemm_q4_1_kernel` for a raw-kind matrix: tiles of 16 rows dequantized once, dotted with
  every row of x. raw: u8[n, row bytes]; x: f32[b, D]; out: f32[b, n]."""
  n = raw.shape[0]
  for tile in numba.prange((n + _TILE - 1) // _TILE):
    lo = tile * _TILE
    rows = min(_TILE, n - lo)
    w = np.empty((_TILE, x.shape[1]), np.float32)
    for k in range(rows):
      qblocks.row_dequant(code, raw[lo + k], w[k])
    tile_dots(w, rows, x, out, lo)


@numba.njit(parallel=True, **common.JIT)
def dequant_raw_kernel(code, raw, lo, hi, out):
  """out[i - lo] = W[i] as f32, rows [lo, hi). out: f32[>= hi - lo, D], C-contiguous."""
  for i in numba.prange(lo, hi):
    qblocks.row_dequant(code, raw[i], out[i - lo])


@numba.njit(parallel=True, **common.JIT)
def rows_raw_kernel(code, raw, ids, out):
  """out[k] = W[ids[k]] as f32. ids: i64[k] (in range); out: f32[k, D]."""
  for k in numba.prange(ids.shape[0]):
    qblocks.row_dequant(code, raw[ids[k]], out[k])


@numba.njit(parallel=True, **common.JIT)
def raw_finite_kernel(raw, block_bytes, fields, exp_mask):
  """False if any 16-bit float at byte offsets `fields` of any block of `raw` (u8[n, row
  bytes]) has all exponent bits set (inf or NaN; exp_mask 0x7C00 for f16, 0x7F80 for bf16)."""
  n = raw.shape[0]
  bad = np.zeros(n, np.bool_)
  for i in numba.prange(n):
    row = raw[i]
    for o in range(0, row.shape[0], block_bytes):
      for k in range(fields.shape[0]):
        h = np.int64(row[o + fields[k]]) | (np.int64(row[o + fields[k] + 1]) << 8)
        if h & exp_mask == exp_mask:
          bad[i] = True
  return not bad.any()
