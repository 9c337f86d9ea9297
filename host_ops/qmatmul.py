"""Quantized host matrices in llama.cpp's block formats, and their matrix products (numba).

Why (issue 5): on a CPU a decode step is bound by the bytes of weights it
reads, and XLA CPU cannot read 4/8-bit weights fast (it does not fuse the integer convert into
the dot). These host kernels read the GGUF's own blocks, so a Q4_1 file runs at 5 bits per
weight with exactly the values the f32 dense path dequantizes (activations stay f32; only the
summation order differs).

Formats (rows of a matrix stored [out, in], D = in, a multiple of 32):
  Q4_1 (kind "q4_1"): qs: u8[n, D/2], d: f32[n, D/32], m: f32[n, D/32]. Value k of block b is
    d[b] * q + m[b] with q = qs[16 b + k] & 15 for k < 16 and qs[16 b + k - 16] >> 4 for k >= 16
    (GGUF's nibble order; its f16 d and m are widened to f32 exactly).
  Q8_0 (kind "q8_0"): q: i8[n, D], d: f32[n, D/32]; value = d[j // 32] * q[j]. The same layout as
    `host_ops.quant`'s Q8 rows, so `quant.quantize_q8` makes one from f32.

Products: `QMatrix.matmul(x)` = x @ W.T for x: f32[b, D]. For b <= GEMV_MAX_ROWS a flat numba
loop reads every block once and dots it with each row of x (parallel over output rows); for
larger b (prefill, perplexity) each weight row is dequantized once into an f32 buffer and dotted
with every row of x, so the 4-bit decode is paid once per row, not once per token.

The flat loop is the fastest float shape measured (a loop nest over blocks was slower,
BUILD_NOTES.md). With dot="int8" the gemv quantizes x per block and uses the SIMD integer
kernels of `host_ops.qdot` instead.

Layout per STYLE.md: numba kernels -> QMatrix (validates, dispatches) -> NumPy references.
"""

from __future__ import annotations

import numba
import numpy as np

from host_ops import _common
from host_ops import qdot
from host_ops._common import HostOpError

BLOCK = 32  # Values per block in both formats.
Q4_1 = "q4_1"
Q8_0 = "q8_0"
KINDS = (Q4_1, Q8_0)
# Rows of x up to which the flat gemv loop is used; above it each weight row is dequantized
# once into an f32 buffer (tiles of 16 rows, dotted with 4 rows of x per pass) and dotted with
# every row of x: the two break even at about 8 rows, and the second gains with the batch.
# NumPy's BLAS is not used: its threads and numba's spin against each other on a 2-core machine.
GEMV_MAX_ROWS = 8
# How a product of at most GEMV_MAX_ROWS rows treats x: "f32" keeps it (the f32 dense path's
# values up to summation order); "int8" quantizes it per block of 32 and sums integer products
# (`host_ops.qdot`, llama.cpp's arithmetic, ~2-4x faster). "int8" runs as "f32" where
# qdot.AVAILABLE is False.
DOT_F32 = "f32"
DOT_INT8 = "int8"
DOTS = (DOT_INT8, DOT_F32)

# GGUF block sizes in bytes: Q4_1 = f16 d, f16 m, 16 bytes of nibbles; Q8_0 = f16 d, 32 int8.
_GGUF_BLOCK_BYTES = {Q4_1: 20, Q8_0: 34}


@numba.njit(inline="always", **_common._JIT)
def _dot_q4_1(qs_row, d_row, m_row, xlo, xhi, xsum):
  """One Q4_1 row . x, x given as xlo/xhi (f32[D/2], the first/second 16 values of each block)
  and xsum (f32[D/32], block sums: the m term). One flat loop with the scale looked up per byte
  (j >> 4): LLVM vectorizes it; a loop nest over blocks does not."""
  acc = np.float32(0.0)
  for j in range(qs_row.shape[0]):
    c = np.int32(qs_row[j])
    acc += d_row[j >> 4] * (np.float32(c & 15) * xlo[j] + np.float32(c >> 4) * xhi[j])
  bias = np.float32(0.0)
  for b in range(m_row.shape[0]):
    bias += m_row[b] * xsum[b]
  return acc + bias


@numba.njit(inline="always", **_common._JIT)
def _dot_q8_0(q_row, d_row, x):
  """One Q8_0 row . x (x: f32[D])."""
  acc = np.float32(0.0)
  for j in range(q_row.shape[0]):
    acc += d_row[j >> 5] * np.float32(q_row[j]) * x[j]
  return acc


@numba.njit(**_common._JIT)
def split_q4_1_x(x):
  """x: f32[b, D] -> (xlo, xhi: f32[b, D/2], xsum: f32[b, D/32]) for `_dot_q4_1`."""
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


@numba.njit(parallel=True, **_common._JIT)
def _gemv_q4_1_kernel(qs, d, m, x, out):
  """out[r, i] = W[i] . x[r]. qs: u8[n, D/2]; d, m: f32[n, D/32]; x: f32[b, D]; out: f32[b, n]."""
  xlo, xhi, xsum = split_q4_1_x(x)
  n = qs.shape[0]
  for i in numba.prange(n):
    for r in range(x.shape[0]):
      out[r, i] = _dot_q4_1(qs[i], d[i], m[i], xlo[r], xhi[r], xsum[r])


@numba.njit(parallel=True, **_common._JIT)
def _gemv_q8_0_kernel(q, d, x, out):
  """out[r, i] = W[i] . x[r]. q: i8[n, D]; d: f32[n, D/32]; x: f32[b, D]; out: f32[b, n]."""
  n = q.shape[0]
  for i in numba.prange(n):
    for r in range(x.shape[0]):
      out[r, i] = _dot_q8_0(q[i], d[i], x[r])


@numba.njit(inline="always", **_common._JIT)
def _dequant_row_q4_1(qs_row, d_row, m_row, out):
  """out: f32[D] = one Q4_1 row."""
  for blk in range(d_row.shape[0]):
    scale = d_row[blk]
    low = m_row[blk]
    for k in range(16):
      c = np.int32(qs_row[16 * blk + k])
      out[32 * blk + k] = scale * np.float32(c & 15) + low
      out[32 * blk + 16 + k] = scale * np.float32(c >> 4) + low


@numba.njit(inline="always", **_common._JIT)
def _dequant_row_q8_0(q_row, d_row, out):
  """out: f32[D] = one Q8_0 row."""
  for j in range(q_row.shape[0]):
    out[j] = d_row[j >> 5] * np.float32(q_row[j])


@numba.njit(inline="always", **_common._JIT)
def _dot_f32(a, b):
  acc = np.float32(0.0)
  for j in range(a.shape[0]):
    acc += a[j] * b[j]
  return acc


_TILE = 16  # Weight rows dequantized together by the many-row product.


@numba.njit(inline="always", **_common._JIT)
def _tile_dots(w, rows, x, out, lo):
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


@numba.njit(parallel=True, **_common._JIT)
def _gemm_q4_1_kernel(qs, d, m, x, out):
  """out = x @ W.T for many rows of x: tiles of 16 weight rows are dequantized once into an f32
  buffer and dotted with every row of x (4 at a time). qs: u8[n, D/2]; d, m: f32[n, D/32];
  x: f32[b, D]."""
  n = qs.shape[0]
  for tile in numba.prange((n + _TILE - 1) // _TILE):
    lo = tile * _TILE
    rows = min(_TILE, n - lo)
    w = np.empty((_TILE, x.shape[1]), np.float32)
    for k in range(rows):
      _dequant_row_q4_1(qs[lo + k], d[lo + k], m[lo + k], w[k])
    _tile_dots(w, rows, x, out, lo)


@numba.njit(parallel=True, **_common._JIT)
def _gemm_q8_0_kernel(q, d, x, out):
  """`_gemm_q4_1_kernel` for Q8_0 rows."""
  n = q.shape[0]
  for tile in numba.prange((n + _TILE - 1) // _TILE):
    lo = tile * _TILE
    rows = min(_TILE, n - lo)
    w = np.empty((_TILE, x.shape[1]), np.float32)
    for k in range(rows):
      _dequant_row_q8_0(q[lo + k], d[lo + k], w[k])
    _tile_dots(w, rows, x, out, lo)


@numba.njit(parallel=True, **_common._JIT)
def _dequant_q4_1_kernel(qs, d, m, lo, hi, out):
  """out[i - lo] = W[i] as f32, rows [lo, hi). out: f32[>= hi - lo, D]."""
  for i in numba.prange(lo, hi):
    row = out[i - lo]
    for j in range(qs.shape[1]):
      c = np.int32(qs[i, j])
      blk = j >> 4
      k = j & 15
      row[32 * blk + k] = d[i, blk] * np.float32(c & 15) + m[i, blk]
      row[32 * blk + 16 + k] = d[i, blk] * np.float32(c >> 4) + m[i, blk]


@numba.njit(parallel=True, **_common._JIT)
def _dequant_q8_0_kernel(q, d, lo, hi, out):
  """out[i - lo] = W[i] as f32, rows [lo, hi). out: f32[>= hi - lo, D]."""
  for i in numba.prange(lo, hi):
    row = out[i - lo]
    for j in range(q.shape[1]):
      row[j] = d[i, j >> 5] * np.float32(q[i, j])


class QMatrix:
  """A [n, D] weight matrix on the host in a llama.cpp block format (see the module docstring).

  Attributes:
    kind: "q4_1" | "q8_0".
    arrays: (qs, d, m) for q4_1, (q, d) for q8_0; C-contiguous.
    shape: (n, D): output rows, input columns.
  """

  def __init__(self, kind: str, arrays: tuple[np.ndarray, ...]):
    if kind not in KINDS:
      raise HostOpError(f"unknown host weight format {kind!r}; use one of {', '.join(KINDS)}")
    arrays = tuple(np.ascontiguousarray(a) for a in arrays)
    if len(arrays) != (3 if kind == Q4_1 else 2) or arrays[0].ndim != 2:
      raise HostOpError(f"{kind} matrix needs {'(qs, d, m)' if kind == Q4_1 else '(q, d)'} "
                        f"2-D arrays, got {len(arrays)} arrays")
    n, width = arrays[0].shape
    if kind == Q4_1:
      want = ((np.uint8, (n, width)), (np.float32, (n, width // 16)),
              (np.float32, (n, width // 16)))
    else:
      want = ((np.int8, (n, width)), (np.float32, (n, width // 32)))
    for a, (dtype, shape) in zip(arrays, want):
      if a.dtype != dtype or a.shape != shape:
        raise HostOpError(f"{kind} matrix: got {[f'{x.dtype}{list(x.shape)}' for x in arrays]}; "
                          f"expected {[f'{np.dtype(t)}{list(s)}' for t, s in want]}")
    self.kind = kind
    self.arrays = arrays
    n = arrays[0].shape[0]
    self.shape = (n, arrays[1].shape[1] * BLOCK)
    if self.shape[1] == 0 or self.shape[1] % BLOCK:
      raise HostOpError(f"{kind} matrix needs D a positive multiple of {BLOCK}, got {self.shape}")

  @property
  def nbytes(self) -> int:
    """Bytes held (codes and f32 scales)."""
    return sum(a.nbytes for a in self.arrays)

  @property
  def bits_per_weight(self) -> float:
    """Bits per weight as stored in GGUF (f16 scales): 5.0 for Q4_1, 8.5 for Q8_0."""
    return 8.0 * _GGUF_BLOCK_BYTES[self.kind] / BLOCK

  def file_bytes(self) -> int:
    """Bytes of this matrix in GGUF's block format (what a decode step reads, f16 scales)."""
    return self.shape[0] * (self.shape[1] // BLOCK) * _GGUF_BLOCK_BYTES[self.kind]

  def take_rows(self, rows) -> QMatrix:
    """A new matrix of the given rows (copies)."""
    rows = np.asarray(rows)
    return QMatrix(self.kind, tuple(a[rows] for a in self.arrays))

  def rows_f32(self, ids) -> np.ndarray:
    """Rows `ids` (int[k]) dequantized: f32[k, D] (e.g. token embeddings)."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= self.shape[0]):
      raise HostOpError(f"row id out of range [0, {self.shape[0]}): {ids.min()}..{ids.max()}")
    return np.stack([self.dequantize(int(i), int(i) + 1)[0] for i in ids]) if ids.size else \
        np.zeros((0, self.shape[1]), np.float32)

  def dequantize(self, lo: int = 0, hi: int | None = None, out: np.ndarray | None = None
                 ) -> np.ndarray:
    """Rows [lo, hi) as f32[hi - lo, D] (numba, parallel over rows)."""
    hi = self.shape[0] if hi is None else hi
    if out is None:
      out = np.empty((hi - lo, self.shape[1]), np.float32)
    _common.ensure_host_threads()
    if self.kind == Q4_1:
      _dequant_q4_1_kernel(*self.arrays, lo, hi, out)
    else:
      _dequant_q8_0_kernel(*self.arrays, lo, hi, out)
    return out[:hi - lo]

  def matmul(self, x, out: np.ndarray | None = None, dot: str = DOT_F32) -> np.ndarray:
    """x @ W.T: x f32[b, D] -> f32[b, n] (f32[D] -> f32[n]).

    dot: "f32" or "int8" (x quantized per block for b <= GEMV_MAX_ROWS; see DOT_INT8).
    Deterministic for a given b (each output is one row's dot in a fixed order).

    Raises:
      HostOpError: x of the wrong shape, an unknown dot.
    """
    if dot not in DOTS:
      raise HostOpError(f"dot must be one of {', '.join(DOTS)}, got {dot!r}")
    x2, squeeze = _common.prepare_x(x, self.shape[1])
    b = x2.shape[0]
    if out is None:
      out = np.empty((b, self.shape[0]), np.float32)
    _common.ensure_host_threads()
    int8 = dot == DOT_INT8 and qdot.AVAILABLE
    if self.kind == Q4_1:
      kernel = _gemm_q4_1_kernel if b > GEMV_MAX_ROWS else (
          qdot.gemv_q4_1 if int8 else _gemv_q4_1_kernel)
    else:
      kernel = _gemm_q8_0_kernel if b > GEMV_MAX_ROWS else (
          qdot.gemv_q8_0 if int8 else _gemv_q8_0_kernel)
    kernel(*self.arrays, x2, out)
    return out[0] if squeeze else out

  def __repr__(self) -> str:
    return f"QMatrix({self.kind}, {self.shape[0]}x{self.shape[1]}, {self.nbytes / 1e6:.2f} MB)"


def from_gguf_blocks(kind: str, data: np.ndarray, shape: tuple[int, int]) -> QMatrix:
  """A QMatrix from a GGUF tensor's raw block bytes (no re-quantization: exactly the file's values).

  Args:
    kind: "q4_1" or "q8_0" (the tensor's GGML type).
    data: u8[n, D / 32 * block_bytes] (gguf.GGUFReader's `tensor.data` for a quantized matrix).
    shape: (n, D) in NumPy order ([out, in]).

  Raises:
    HostOpError: a size that does not match the format.
  """
  n, dim = shape
  if kind not in _GGUF_BLOCK_BYTES:
    raise HostOpError(f"no GGUF block reader for {kind!r}; kept formats: {', '.join(KINDS)}")
  nb = dim // BLOCK
  raw = np.asarray(data, np.uint8)
  if dim % BLOCK or raw.size != n * nb * _GGUF_BLOCK_BYTES[kind]:
    raise HostOpError(f"{kind} tensor of shape {shape} has {raw.size} bytes, expected "
                      f"{n * nb * _GGUF_BLOCK_BYTES[kind]}")
  blocks = raw.reshape(n, nb, _GGUF_BLOCK_BYTES[kind])
  d = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16).reshape(n, nb).astype(np.float32)
  if kind == Q4_1:
    m = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16).reshape(n, nb).astype(np.float32)
    qs = np.ascontiguousarray(blocks[:, :, 4:20]).reshape(n, nb * 16)
    return QMatrix(Q4_1, (qs, d, m))
  q = np.ascontiguousarray(blocks[:, :, 2:34]).view(np.int8).reshape(n, dim)
  return QMatrix(Q8_0, (q, d))


def stack_rows(mats: list[QMatrix]) -> QMatrix:
  """One matrix with the rows of `mats` in order (same kind and D), e.g. a fused q | k | v."""
  kinds = {w.kind for w in mats}
  dims = {w.shape[1] for w in mats}
  if len(kinds) != 1 or len(dims) != 1:
    raise HostOpError(f"stack_rows needs one kind and one D, got {sorted(kinds)} / {sorted(dims)}")
  return QMatrix(mats[0].kind, tuple(np.concatenate(parts) for parts in
                                     zip(*(w.arrays for w in mats))))


def quantize_q8_0(rows) -> QMatrix:
  """f32[n, D] -> Q8_0 QMatrix (scale max|block| / 127, round to nearest; see host_ops.quant)."""
  from host_ops import quant
  q8 = quant.quantize_q8(rows)
  return QMatrix(Q8_0, (q8.q, q8.scales))


def dequantize_reference(w: QMatrix) -> np.ndarray:
  """NumPy reference dequantizer: f64[n, D] from the format's definition (module docstring)."""
  n, dim = w.shape
  nb = dim // BLOCK
  if w.kind == Q4_1:
    qs, d, m = w.arrays
    codes = qs.reshape(n, nb, 16).astype(np.float64)
    q = np.concatenate([np.mod(codes, 16), np.floor(codes / 16)], axis=2)  # [n, nb, 32]
    vals = q * d[..., None].astype(np.float64) + m[..., None].astype(np.float64)
  else:
    q, d = w.arrays
    vals = q.reshape(n, nb, BLOCK).astype(np.float64) * d[..., None].astype(np.float64)
  return vals.reshape(n, dim)


def matmul_reference(w: QMatrix, x) -> np.ndarray:
  """NumPy reference of `QMatrix.matmul` (float64 inside, f32 result)."""
  return (np.asarray(x, np.float64) @ dequantize_reference(w).T).astype(np.float32)
