"""Quantized host matrices in llama.cpp's block formats, and their matrix products (numba).

Why (issue 5): on a CPU a decode step is bound by the bytes of weights it
reads, and XLA CPU cannot read 4/8-bit weights fast (it does not fuse the integer convert into
the dot). These host kernels read the GGUF's own blocks, so a Q4_1 file runs at 5 bits per
weight with exactly the values the f32 dense path dequantizes (activations stay f32; only the
summation order differs).

Formats (rows of a matrix stored [out, in], D = in, a multiple of `block_size(kind)`):
  Q4_1 (kind "q4_1"): qs: u8[n, D/2], d: u16[n, D/32], m: u16[n, D/32] (the bits of the file's
    f16 scales: numba has no f16 type; kernels widen them with `qblocks.f16_to_f32`). Value k of
    block b is d[b] * q + m[b] with q = qs[16 b + k] & 15 for k < 16 and qs[16 b + k - 16] >> 4
    for k >= 16 (GGUF's nibble order).
  Q8_0 (kind "q8_0"): q: i8[n, D], d: u16[n, D/32] (f16 bits); value = d[j // 32] * q[j].
    `quantize_q8_0` makes one from f32 rows (`host_ops.quant`'s Q8 rows, scales rounded to f16
    as ggml's Q8_0 stores them).
  Codes and scales sit in separate arrays (the SIMD kernels load 16/32 code bytes per block);
  they hold exactly the file's bytes, 20 (Q4_1) / 34 (Q8_0) per block of 32 as in the file. f32
  scales took 24 / 36: SmolLM2's host blocks were 13.5 MB larger.
  Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, F16, BF16 (kinds "q4_0" ... "bf16", `RAW_KINDS`): raw:
    u8[n, row bytes], the file's own blocks (a view of the GGUF's memory map when made by
    `from_gguf_blocks`: no copy, f16 scales decoded inside the kernels). Formats and kernels:
    `host_ops.qblocks`. D is a multiple of 256 for the K-quants, of 32 for Q4_0/Q5_0/Q5_1, any
    for F16/BF16.

Products: `QMatrix.matmul(x)` = x @ W.T for x: f32[b, D]. With f32 activations, for b <=
GEMV_MAX_ROWS a flat numba loop reads every block once and dots it with each row of x (parallel
over output rows); for larger b each weight row is dequantized once into an f32 buffer and dotted
with every row of x, so the 4-bit decode is paid once per row, not once per token. With
dot="int8" every b takes the integer row dots (each output its own row's dot: the same bits
whatever the batch). The host decoder's layers use `host_ops.pool` (packed integer kernels,
`host_ops.qpack`), and so does its LM head with int8 products where it packs
(`pool.PackedMatrix`); QMatrix serves the other embeddings and heads and the sparse FFN's copies.

The flat loop is the fastest float shape measured (a loop nest over blocks was slower,
BUILD_NOTES.md). With dot="int8" the gemv quantizes x per block and uses the SIMD integer
kernels of `host_ops.qdot` instead. The raw kinds take the same paths through `host_ops.qblocks`:
`row_dot` (f32 gemv), `row_dot_int8` (int8 gemv, the block kinds of qblocks.INT8_KINDS; F16 and
BF16 always run f32) and `row_dequant` (gemm tiles, `dequantize`, `rows_f32`).

Layout per STYLE.md: numba kernels (`host_ops.qmatmul_kernels`) -> QMatrix (validates,
dispatches) -> NumPy references (here).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from host_ops import common
from host_ops import fgemm
from host_ops import qblocks
from host_ops import qdot
from host_ops import qmatmul_kernels as kernels
from host_ops.common import HostOpError

BLOCK = 32  # Values per block of Q4_1 and Q8_0.
Q4_1 = "q4_1"
Q8_0 = "q8_0"
Q4_0 = "q4_0"
Q5_0 = "q5_0"
Q5_1 = "q5_1"
Q4_K = "q4_k"
Q5_K = "q5_k"
Q6_K = "q6_k"
F16 = "f16"
BF16 = "bf16"
# Kinds kept as the file's raw bytes (u8[n, row bytes]) and run by `host_ops.qblocks`.
RAW_KINDS = (Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, F16, BF16)
KINDS = (Q4_1, Q8_0) + RAW_KINDS
# GGML type names (gguf.GGMLQuantizationType.name) -> kind.
GGML_KINDS = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q5_0": Q5_0, "Q5_1": Q5_1, "Q8_0": Q8_0,
              "Q4_K": Q4_K, "Q5_K": Q5_K, "Q6_K": Q6_K, "F16": F16, "BF16": BF16}
# Rows of x up to which the flat gemv loop is used; above it each weight row is dequantized
# once into an f32 buffer (tiles of 16 rows, dotted with 4 rows of x per pass) and dotted with
# every row of x: the two break even at about 8 rows, and the second gains with the batch.
# NumPy's BLAS is not used: its threads and numba's spin against each other on a 2-core machine.
GEMV_MAX_ROWS = 8
# How a product treats x: "f32" keeps it (the f32 dense path's values up to summation order);
# "int8" quantizes it per block and sums integer products (`host_ops.qdot`, `host_ops.qpack`,
# llama.cpp's arithmetic, ~2-4x faster). "int8" runs as "f32" where qdot.AVAILABLE is False,
# and for F16/BF16 matrices.
DOT_F32 = "f32"
DOT_INT8 = "int8"
DOTS = (DOT_INT8, DOT_F32)

# (values, bytes) per GGUF block: Q4_1 = f16 d, f16 m, 16 bytes of nibbles; Q8_0 = f16 d, 32
# int8; the raw kinds' in `qblocks.GEOMETRY` (F16/BF16: one value, 2 bytes).
_GEOMETRY = {Q4_1: (BLOCK, 20), Q8_0: (BLOCK, 34), **qblocks.GEOMETRY}
# Byte offsets of the f16 scales in one block (raw kinds; F16/BF16: every value), for
# `QMatrix.all_finite`: NaN/inf can only sit there (codes and 6-/8-bit sub-scales are integers).
F16_FIELDS = {Q4_0: (0,), Q5_0: (0,), Q5_1: (0, 2), Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,),
               F16: (0,), BF16: (0,)}


def block_size(kind: str) -> int:
  """Values per block of a kind (32; 256 for the K-quants; 1 for F16/BF16): D must be a
  multiple of it. Accepts GGML type names too."""
  kind = GGML_KINDS.get(kind, kind)
  if kind not in _GEOMETRY:
    raise HostOpError(f"unknown host weight format {kind!r}; use one of {', '.join(KINDS)}")
  return _GEOMETRY[kind][0]


# Bytes of each thread's next row the raw-kind gemv prefetches, per kind: (f32, int8). Measured
# (2 threads, [11008, 4096] copies cycled from DRAM, G weights/s with the first 1 KB / the whole
# row / nothing prefetched): int8 Q4_0 32/28/15, Q4_K 40/27/19, Q5_K 29/25/15, Q6_K 14/19/23;
# f32 Q4_0 25/21/15, Q5_0 17/16/12, Q4_K 25/22/26, Q5_K 20/18/22, Q6_K 15/16/18, F16 11/11/13.
# A run-time byte count, not a flag: `if flag:` around the prefetch cost int8 Q4_K 30 -> 22.
_PREFETCH_BYTES = {Q4_0: (1024, 1024), Q5_0: (1024, 1024), Q5_1: (1024, 1024),
                   Q4_K: (0, 1024), Q5_K: (0, 1024), Q6_K: (0, 0), F16: (0, 0), BF16: (0, 0)}


class QMatrix:
  """A [n, D] weight matrix on the host in a llama.cpp block format (see the module docstring).

  Attributes:
    kind: one of KINDS ("q4_1", "q8_0", or a raw kind: "q4_0" ... "bf16").
    arrays: (qs, d, m) for q4_1, (q, d) for q8_0, (raw,) for the raw kinds; C-contiguous (a
      contiguous input is kept as is: no copy).
    shape: (n, D): output rows, input columns.
  """

  def __init__(self, kind: str, arrays: tuple[np.ndarray, ...]):
    if kind not in KINDS:
      raise HostOpError(f"unknown host weight format {kind!r}; use one of {', '.join(KINDS)}")
    arrays = tuple(np.ascontiguousarray(a) for a in arrays)
    if kind in RAW_KINDS:
      self._init_raw(kind, arrays)
      return
    if len(arrays) != (3 if kind == Q4_1 else 2) or arrays[0].ndim != 2:
      raise HostOpError(f"{kind} matrix needs {'(qs, d, m)' if kind == Q4_1 else '(q, d)'} "
                        f"2-D arrays, got {len(arrays)} arrays")
    n, width = arrays[0].shape
    if kind == Q4_1:
      want = ((np.uint8, (n, width)), (np.uint16, (n, width // 16)),
              (np.uint16, (n, width // 16)))
    else:
      want = ((np.int8, (n, width)), (np.uint16, (n, width // 32)))
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

  def _init_raw(self, kind: str, arrays: tuple[np.ndarray, ...]) -> None:
    values, nbytes = _GEOMETRY[kind]
    if len(arrays) != 1 or arrays[0].dtype != np.uint8 or arrays[0].ndim != 2:
      raise HostOpError(f"{kind} matrix needs (raw,) with raw u8[n, row bytes], got "
                        f"{[f'{a.dtype}{list(a.shape)}' for a in arrays]}")
    n, row_bytes = arrays[0].shape
    if row_bytes == 0 or row_bytes % nbytes:
      raise HostOpError(f"{kind} matrix rows of {row_bytes} bytes: need a positive multiple of "
                        f"the {nbytes}-byte block ({values} values)")
    self.kind = kind
    self.arrays = arrays
    self.shape = (n, row_bytes // nbytes * values)

  @property
  def nbytes(self) -> int:
    """Bytes held (codes and scales: f32 for q4_1/q8_0, the file's f16 for the raw kinds)."""
    return sum(a.nbytes for a in self.arrays)

  @property
  def bits_per_weight(self) -> float:
    """Bits per weight as stored in GGUF (f16 scales): 5.0 for Q4_1, 8.5 for Q8_0, 4.5 for
    Q4_0 and Q4_K, 6.5625 for Q6_K, 16 for F16 ..."""
    values, nbytes = _GEOMETRY[self.kind]
    return 8.0 * nbytes / values

  def file_bytes(self) -> int:
    """Bytes of this matrix in GGUF's block format (what a decode step reads, f16 scales)."""
    values, nbytes = _GEOMETRY[self.kind]
    return self.shape[0] * (self.shape[1] // values) * nbytes

  def all_finite(self) -> bool:
    """Whether no scale (no value, for F16/BF16) is NaN or inf: a corrupt file's only way to
    hold them. Reads the scales in place (numba; no f32 copy)."""
    if self.kind not in RAW_KINDS:
      return all(np.isfinite(a.view(np.float16)).all() for a in self.arrays[1:])
    common.ensure_host_threads()
    fields = np.asarray(F16_FIELDS[self.kind], np.int64)
    return bool(kernels.raw_finite_kernel(self.arrays[0], _GEOMETRY[self.kind][1], fields,
                                   0x7F80 if self.kind == BF16 else 0x7C00))

  def take_rows(self, rows) -> QMatrix:
    """A new matrix of the given rows (copies)."""
    rows = np.asarray(rows)
    return QMatrix(self.kind, tuple(a[rows] for a in self.arrays))

  def rows_f32(self, ids) -> np.ndarray:
    """Rows `ids` (int[k]) dequantized: f32[k, D] (e.g. token embeddings)."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= self.shape[0]):
      raise HostOpError(f"row id out of range [0, {self.shape[0]}): {ids.min()}..{ids.max()}")
    if self.kind in RAW_KINDS:
      out = np.empty((ids.size, self.shape[1]), np.float32)
      common.ensure_host_threads()
      kernels.rows_raw_kernel(qblocks.KIND_CODES[self.kind], self.arrays[0], ids, out)
      return out
    return np.stack([self.dequantize(int(i), int(i) + 1)[0] for i in ids]) if ids.size else \
        np.zeros((0, self.shape[1]), np.float32)

  def dequantize(self, lo: int = 0, hi: int | None = None, out: np.ndarray | None = None
                 ) -> np.ndarray:
    """Rows [lo, hi) as f32[hi - lo, D] (numba, parallel over rows)."""
    hi = self.shape[0] if hi is None else hi
    if out is None:
      out = np.empty((hi - lo, self.shape[1]), np.float32)
    common.ensure_host_threads()
    if self.kind in RAW_KINDS:
      if not 0 <= lo <= hi <= self.shape[0]:
        raise HostOpError(f"rows [{lo}, {hi}) out of range [0, {self.shape[0]}]")
      if (out.dtype != np.float32 or out.ndim != 2 or out.shape[0] < hi - lo
          or out.shape[1] != self.shape[1] or not out.flags.c_contiguous):
        raise HostOpError(f"out must be a C-contiguous f32[>= {hi - lo}, {self.shape[1]}], got "
                          f"{out.dtype}{list(out.shape)}")
      kernels.dequant_raw_kernel(qblocks.KIND_CODES[self.kind], self.arrays[0], lo, hi, out)
    elif self.kind == Q4_1:
      kernels.dequant_q4_1_kernel(*self.arrays, lo, hi, out)
    else:
      kernels.dequant_q8_0_kernel(*self.arrays, lo, hi, out)
    return out[:hi - lo]

  def matmul(self, x, out: np.ndarray | None = None, dot: str = DOT_F32) -> np.ndarray:
    """x @ W.T: x f32[b, D] -> f32[b, n] (f32[D] -> f32[n]).

    dot: "f32" or "int8" (x quantized per block of 32 and integer dots, any number of rows,
      each output its own row's dot; see DOT_INT8; F16 and BF16 always run "f32").
    Deterministic for a given b (each output is one row's dot in a fixed order).

    Raises:
      HostOpError: x of the wrong shape, an unknown dot.
    """
    if dot not in DOTS:
      raise HostOpError(f"dot must be one of {', '.join(DOTS)}, got {dot!r}")
    x2, squeeze = common.prepare_x(x, self.shape[1])
    b = x2.shape[0]
    if out is None:
      out = np.empty((b, self.shape[0]), np.float32)
    common.ensure_host_threads()
    int8 = dot == DOT_INT8 and qdot.AVAILABLE
    if self.kind in RAW_KINDS:
      code = qblocks.KIND_CODES[self.kind]
      if int8 and self.kind in qblocks.INT8_KINDS:  # Any number of rows: each row's own dot.
        kernels.gemv_raw_int8_kernel(code, self.arrays[0], x2, out, _PREFETCH_BYTES[self.kind][1])
      elif b > GEMV_MAX_ROWS and fgemm.runs(code, self.shape[1]) and out.flags.c_contiguous:
        fgemm.gemm_kernel(code, self.arrays[0], x2, out, 0)
      elif b > GEMV_MAX_ROWS:
        kernels.gemm_raw_kernel(code, self.arrays[0], x2, out)
      else:
        kernels.gemv_raw_kernel(code, self.arrays[0], x2, out, _PREFETCH_BYTES[self.kind][0])
      return out[0] if squeeze else out
    if self.kind == Q4_1:
      kernel = qdot.gemv_q4_1 if int8 else (
          kernels.gemm_q4_1_kernel if b > GEMV_MAX_ROWS else kernels.gemv_q4_1_kernel)
    else:
      kernel = qdot.gemv_q8_0 if int8 else (
          kernels.gemm_q8_0_kernel if b > GEMV_MAX_ROWS else kernels.gemv_q8_0_kernel)
    kernel(*self.arrays, x2, out)
    return out[0] if squeeze else out

  def __repr__(self) -> str:
    return f"QMatrix({self.kind}, {self.shape[0]}x{self.shape[1]}, {self.nbytes / 1e6:.2f} MB)"


_COPY_CHUNK_BYTES = 16 << 20


def from_gguf_blocks(kind: str, data: np.ndarray, shape: tuple[int, int],
                     copied: Callable[[int, int], None] | None = None) -> QMatrix:
  """A QMatrix from a GGUF tensor's raw block bytes (no re-quantization: exactly the file's values).

  Args:
    kind: a kind of KINDS or a GGML type name of GGML_KINDS ("Q4_K", "F16", ...).
    data: gguf.GGUFReader's `tensor.data`: u8[n, D / values * block bytes] for a quantized
      matrix (BF16 included), f16[n, D] for F16; any dtype of the right byte count is read as
      its bytes. For the raw kinds the QMatrix keeps a view of it (no copy: a memory map stays
      a memory map); q4_1/q8_0 are split into codes and f16 scales (copies of the bytes).
    shape: (n, D) in NumPy order ([out, in]).
    copied: for q4_1/q8_0, called with (lo, hi) after rows [lo, hi) are copied (~16 MB at a
      time), e.g. to drop those rows' pages of the memory map; for the raw kinds set as the
      QMatrix's `release_source()` (copied (0, n)), for the code that copies the view out.

  Raises:
    HostOpError: an unknown kind, a size that does not match the format, D not a multiple of
      the block (256 for the K-quants, 32 for Q4_0/Q5_0/Q5_1/Q4_1/Q8_0).
  """
  kind = GGML_KINDS.get(kind, kind)
  n, dim = shape
  if kind not in _GEOMETRY:
    raise HostOpError(f"no GGUF block reader for {kind!r}; kept formats: {', '.join(KINDS)} "
                      f"(GGML types {', '.join(GGML_KINDS)})")
  values, nbytes = _GEOMETRY[kind]
  if dim <= 0 or dim % values:
    raise HostOpError(f"{kind} tensor of shape {shape}: D = {dim} must be a positive multiple of "
                      f"{values} (the values of one block)")
  nb = dim // values
  data = np.ascontiguousarray(data)  # A GGUF tensor's memory map is contiguous: no copy.
  raw = data.reshape(-1).view(np.uint8)  # Views of its bytes.
  if raw.size != n * nb * nbytes:
    raise HostOpError(f"{kind} tensor of shape {shape} has {raw.size} bytes, expected "
                      f"{n * nb * nbytes}")
  if kind in RAW_KINDS:
    m = QMatrix(kind, (raw.reshape(n, nb * nbytes),))
    if copied is not None:  # Whoever copies the view out (`host_ops.pool`) calls it.
      m.release_source = lambda: copied(0, n)
    return m
  blocks = raw.reshape(n, nb, nbytes)
  d = np.empty((n, nb), np.uint16)
  if kind == Q4_1:
    arrays = (np.empty((n, nb * 16), np.uint8), d, np.empty((n, nb), np.uint16))
  else:
    arrays = (np.empty((n, dim), np.int8), d)
  step = max(1, _COPY_CHUNK_BYTES // (nb * nbytes))
  for lo in range(0, n, step):  # In row chunks, so a caller can drop each chunk's source pages.
    b = blocks[lo:lo + step]
    d[lo:lo + step] = b[:, :, 0:2].copy().view(np.uint16).reshape(len(b), nb)
    if kind == Q4_1:
      arrays[2][lo:lo + step] = b[:, :, 2:4].copy().view(np.uint16).reshape(len(b), nb)
      arrays[0][lo:lo + step] = b[:, :, 4:20].reshape(len(b), nb * 16)
    else:
      arrays[0][lo:lo + step] = b[:, :, 2:34].reshape(len(b), dim).view(np.int8)
    if copied is not None:
      copied(lo, lo + len(b))
  return QMatrix(kind, arrays)


def stack_rows(mats: list[QMatrix]) -> QMatrix:
  """One matrix with the rows of `mats` in order (same kind and D), e.g. a fused q | k | v."""
  kinds = {w.kind for w in mats}
  dims = {w.shape[1] for w in mats}
  if len(kinds) != 1 or len(dims) != 1:
    raise HostOpError(f"stack_rows needs one kind and one D, got {sorted(kinds)} / {sorted(dims)}")
  return QMatrix(mats[0].kind, tuple(np.concatenate(parts) for parts in
                                     zip(*(w.arrays for w in mats))))


def quantize_q8_0(rows) -> QMatrix:
  """f32[n, D] -> Q8_0 QMatrix (scale max|block| / 127, round to nearest, as ggml's
  `quantize_row_q8_0`: the codes from the f32 scale, the scale stored as f16)."""
  from host_ops import quant
  q8 = quant.quantize_q8(rows)
  return QMatrix(Q8_0, (q8.q, f16_bits(q8.scales)))


def quantize_q4_1(rows, chunk_rows: int = 1024) -> QMatrix:
  """f32[n, D] -> Q4_1 QMatrix, as ggml's `quantize_row_q4_1`: per block of 32, d = (max - min)
  / 15 and m = min, codes min(15, int((x - min) / d + 0.5)) from the f32 d, d and m stored as
  f16. In row chunks (the f32 temporaries of one chunk at a time)."""
  rows = np.asarray(rows, np.float32)
  n, dim = rows.shape
  if dim % BLOCK:
    raise HostOpError(f"quantize_q4_1 needs D a multiple of {BLOCK}, got {rows.shape}")
  nb = dim // BLOCK
  qs = np.empty((n, nb * 16), np.uint8)
  d = np.empty((n, nb), np.uint16)
  m = np.empty((n, nb), np.uint16)
  for lo in range(0, n, chunk_rows):
    b = rows[lo:lo + chunk_rows].reshape(-1, nb, BLOCK)
    mn, mx = b.min(-1), b.max(-1)
    scale = (mx - mn) / np.float32(15.0)
    with np.errstate(divide="ignore"):
      inv = np.where(scale > 0, np.float32(1.0) / scale, np.float32(0.0)).astype(np.float32)
    q = np.minimum(((b - mn[..., None]) * inv[..., None] + np.float32(0.5)).astype(np.int32),
                   15).astype(np.uint8)
    qs[lo:lo + chunk_rows] = (q[..., :16] | (q[..., 16:] << 4)).reshape(len(b), nb * 16)
    d[lo:lo + chunk_rows] = f16_bits(scale)
    m[lo:lo + chunk_rows] = f16_bits(mn)
  return QMatrix(Q4_1, (qs, d, m))


def f16_bits(values) -> np.ndarray:
  """u16 bits of `values` rounded to f16 (the scale arrays of Q4_1/Q8_0 matrices)."""
  return np.ascontiguousarray(np.asarray(values, np.float32).astype(np.float16).view(np.uint16))


def f16_values(bits) -> np.ndarray:
  """f32 values of u16 f16 bits (a Q4_1/Q8_0 scale array, for references)."""
  return np.asarray(bits, np.uint16).view(np.float16).astype(np.float32)


def _f16_reference(b: np.ndarray) -> np.ndarray:
  """u8[..., 2] little-endian f16 bytes -> f64[...] (sign, exponent, mantissa by definition)."""
  bits = b[..., 0].astype(np.int64) | (b[..., 1].astype(np.int64) << 8)
  sign = np.where(bits >> 15, -1.0, 1.0)
  exp = (bits >> 10) & 31
  man = (bits & 1023).astype(np.float64)
  with np.errstate(invalid="ignore"):
    val = np.where(exp == 0, man * 2.0 ** -24, (1024.0 + man) * np.exp2(exp - 25.0))
    val = np.where(exp == 31, np.where(man == 0, np.inf, np.nan), val)
  return sign * val


def _nibbles_reference(qs: np.ndarray) -> np.ndarray:
  """u8[..., m] -> i64[..., 2m]: the low nibbles, then the high nibbles."""
  q = qs.astype(np.int64)
  return np.concatenate([q & 15, q >> 4], axis=-1)


def _k_scale_min_reference(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """u8[N, 12] Q4_K/Q5_K scale bytes -> (scales, mins): i64[N, 8] each (6 bits)."""
  s = s.astype(np.int64)
  sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], axis=1)
  mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
  return sc, mn


def _raw_reference(kind: str, raw: np.ndarray, n: int, dim: int) -> np.ndarray:
  """f64[n, D] of a raw-kind matrix from the format definitions (`qblocks` module docstring)."""
  values, nbytes = _GEOMETRY[kind]
  if kind in (F16, BF16):
    pairs = raw.reshape(n, dim, 2)
    if kind == F16:
      return _f16_reference(pairs)
    bits = (pairs[..., 0].astype(np.uint32) | (pairs[..., 1].astype(np.uint32) << 8)) << 16
    return bits.view(np.float32).astype(np.float64)
  blk = raw.reshape(-1, nbytes)  # [N blocks, bytes]
  count = blk.shape[0]
  if kind in (Q4_0, Q5_0, Q5_1):
    d = _f16_reference(blk[:, 0:2])[:, None]
    if kind == Q4_0:
      vals = d * (_nibbles_reference(blk[:, 2:18]) - 8)
    else:
      at = 4 if kind == Q5_1 else 2
      qh = sum(blk[:, at + k].astype(np.int64) << (8 * k) for k in range(4))
      q = _nibbles_reference(blk[:, at + 4:at + 20]) | (((qh[:, None] >> np.arange(32)) & 1) << 4)
      vals = d * (q - 16) if kind == Q5_0 else d * q + _f16_reference(blk[:, 2:4])[:, None]
  elif kind in (Q4_K, Q5_K):
    d = _f16_reference(blk[:, 0:2])[:, None, None]
    dmin = _f16_reference(blk[:, 2:4])[:, None, None]
    sc, mn = _k_scale_min_reference(blk[:, 4:16])
    qs = blk[:, 48:176] if kind == Q5_K else blk[:, 16:144]
    q = _nibbles_reference(qs.reshape(count, 4, 32)).reshape(count, 8, 32)  # sub-block 2c, 2c+1
    if kind == Q5_K:
      qh = blk[:, 16:48].astype(np.int64)[:, None, :]  # bit j of qh[l]: value l of sub-block j
      q = q | (((qh >> np.arange(8)[None, :, None]) & 1) << 4)
    vals = d * sc[..., None] * q - dmin * mn[..., None]
  else:  # Q6_K
    ql = blk[:, 0:128].astype(np.int64).reshape(count, 2, 2, 32)  # [N, half, 32-byte run, l]
    qh = blk[:, 128:192].astype(np.int64).reshape(count, 2, 1, 32)
    low = np.concatenate([ql & 15, ql >> 4], axis=2)  # [N, half, t, l]: t = 0..3
    q = low | (((qh >> (2 * np.arange(4))[None, None, :, None]) & 3) << 4)
    scales = blk[:, 192:208].view(np.int8).astype(np.float64).reshape(count, 2, 4, 2, 1)
    d = _f16_reference(blk[:, 208:210])[:, None, None, None, None]
    vals = d * scales * (q - 32).reshape(count, 2, 4, 2, 16)
  return vals.reshape(n, dim)


def dequantize_reference(w: QMatrix) -> np.ndarray:
  """NumPy reference dequantizer: f64[n, D] from the format's definition (module docstring)."""
  n, dim = w.shape
  if w.kind in RAW_KINDS:
    return _raw_reference(w.kind, w.arrays[0], n, dim)
  nb = dim // BLOCK
  if w.kind == Q4_1:
    qs, d, m = w.arrays
    codes = qs.reshape(n, nb, 16).astype(np.float64)
    q = np.concatenate([np.mod(codes, 16), np.floor(codes / 16)], axis=2)  # [n, nb, 32]
    vals = q * f16_values(d)[..., None].astype(np.float64) + \
        f16_values(m)[..., None].astype(np.float64)
  else:
    q, d = w.arrays
    vals = q.reshape(n, nb, BLOCK).astype(np.float64) * f16_values(d)[..., None].astype(np.float64)
  return vals.reshape(n, dim)


def matmul_reference(w: QMatrix, x) -> np.ndarray:
  """NumPy reference of `QMatrix.matmul` (float64 inside, f32 result)."""
  return (np.asarray(x, np.float64) @ dequantize_reference(w).T).astype(np.float32)


def matmul_int8_reference(w: QMatrix, x) -> np.ndarray:
  """Float64 NumPy reference of `matmul(x, dot="int8")`: f32[b, n].

  x is replaced by x_hat = dx * xq (`qdot.quantize_x_reference`); every kind with an integer dot
  computes W . x_hat (offset terms against the quantized block sums are the same sums).
  """
  if w.kind in (Q4_1, Q8_0):
    return qdot.matmul_reference(w.kind, w.arrays, x)
  x = np.asarray(x, np.float32)
  if w.kind not in qblocks.INT8_KINDS:
    return matmul_reference(w, x)
  xq, dx, _ = qdot.quantize_x_reference(x)
  b, dim = x.shape
  xhat = (xq.reshape(b, dim // BLOCK, BLOCK).astype(np.float64) * dx[..., None]).reshape(b, dim)
  return (xhat @ dequantize_reference(w).T).astype(np.float32)
