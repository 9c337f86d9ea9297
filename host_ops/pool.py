"""A decoder's weight matrices in one aligned buffer, and the product the layer loop calls on them.

Why (issue 30): the layer loop is one compiled function for every model, so it must reach every
matrix the same way whatever its format. Each matrix is copied once, at load, into one 64-byte
aligned u8 buffer (`WeightPool`): in the packed layout of `host_ops.qpack` (16 rows interleaved)
where an integer product runs and a packed kernel exists, else as the file's own rows
(`host_ops.qblocks`). A matrix is then a row of a small table (`mats`), a layer's role (q | k |
v, ...) up to MAX_PARTS matrix ids whose outputs are side by side: one kernel signature for
Q4_K with Q6_K v, Gemma's per-layer mix, or a uniform Q4_1 file. The file's pages are not
kept (the copy is the only one in memory; `PooledMatrix` gives the file's blocks back).

Products (`pool_matmul`): packed -> `qpack.matmul_kernel` (int8); rows with int8 products ->
`qblocks.row_dot_int8` (activations per 32 values); f32 products -> `qblocks.row_dot` for up to
GEMV_MAX_ROWS activation rows, else F16 / BF16 rows through `fgemm` (register-blocked, on
AVX-512 CPUs) and the other kinds 16 rows dequantized once and dotted with every row
(`qmatmul_kernels.tile_dots`). Each output element is one weight row's dot with one activation
row in an order fixed by the kernel, so results do not depend on the other rows of a batch (int8
at any batch; f32 up to GEMV_MAX_ROWS rows, where the product changes kernel).

The LM head (and a Q8_0 token embedding tied to it) is packed apart, as one `PackedMatrix`
(issue 30: the head is 30 of SmolLM2's 96 MB and 180 of Gemma 3 270M's 250 MB, and every logit
of a perplexity pass goes through it).

Layout per STYLE.md: numba drivers -> WeightPool (builds, validates) -> PooledMatrix (the file's
blocks back, for references and the sparse FFN's own copies) -> PackedMatrix (the head).
"""

from __future__ import annotations

import numba
import numpy as np

from host_ops import common
from host_ops import fgemm
from host_ops import qblocks
from host_ops import qmatmul
from host_ops import qmatmul_kernels
from host_ops import qpack
from host_ops.common import HostOpError

PACKED, ROWS = 0, 1  # Layouts of a matrix in the pool.
MAX_PARTS = 3  # Matrices side by side in one role (q | k | v).
# Columns of the `mats` table.
M_LAYOUT, M_KIND, M_OFFSET, M_ROWS, M_COLS, M_ROW_BYTES = range(6)
GEMV_MAX_ROWS = qmatmul.GEMV_MAX_ROWS


# ----------------------------------------------------------------------------- drivers
@numba.njit(parallel=True, **common.JIT)
def _rows_int8(code, raw, xq8, dx, xsum, out, col):
  """out[r, col + i] = raw row i . x_hat[r] (per-32 activations); the next row prefetched."""
  n = raw.shape[0]
  for i in numba.prange(n):
    if i + 1 < n:
      common.prefetch_row(raw[i + 1])
    for r in range(out.shape[0]):
      out[r, col + i] = qblocks.row_dot_int8(code, raw[i], xq8[r], dx[r], xsum[r])


@numba.njit(parallel=True, **common.JIT)
def _rows_f32(code, raw, x, xsum, out, col):
  """out[r, col + i] = raw row i . x[r] (f32 activations, one row at a time)."""
  n = raw.shape[0]
  for i in numba.prange(n):
    if i + 1 < n:
      common.prefetch_row(raw[i + 1])
    for r in range(out.shape[0]):
      out[r, col + i] = qblocks.row_dot(code, raw[i], x[r], xsum[r])


_TILE = 16


@numba.njit(parallel=True, **common.JIT)
def _tiles_f32(code, raw, x, out, col):
  """out[:, col:col + n] = x @ W.T for many rows: 16 weight rows dequantized at a time."""
  n = raw.shape[0]
  b = x.shape[0]
  for tile in numba.prange((n + _TILE - 1) // _TILE):
    lo = tile * _TILE
    rows = min(_TILE, n - lo)
    w = np.empty((_TILE, x.shape[1]), np.float32)
    part = np.empty((b, _TILE), np.float32)
    for k in range(rows):
      qblocks.row_dequant(code, raw[lo + k], w[k])
    qmatmul_kernels.tile_dots(w, rows, x, part, 0)
    for r in range(b):
      for k in range(rows):
        out[r, col + lo + k] = part[r, k]


_Q8_0_UNIT = qpack.UNIT_BYTES["q8_0"]  # Bytes of a packed Q8_0 unit (16 rows x 32 values).


@numba.njit(parallel=True, **common.JIT)
def rows_q8_0_kernel(packed, ids, out):
  """out[j] = row ids[j] of a packed Q8_0 matrix as f32 (d * q, exact): packed u8[n / G,
  units * 544], ids i64[k] (in range), out f32[k, units * 32]. The token embedding's lookup
  when a tied LM head is packed."""
  ub = _Q8_0_UNIT
  units = packed.shape[1] // ub
  for j in numba.prange(ids.shape[0]):
    grp = packed[ids[j] // qpack.G]
    k = ids[j] % qpack.G
    for u in range(units):
      o = u * ub
      d = qblocks.f16_to_f32(np.int64(grp[o + 2 * k]) | (np.int64(grp[o + 2 * k + 1]) << 8))
      for e in range(32):
        q = np.int8(grp[o + 32 + 64 * (e // 4) + 4 * k + e % 4])
        out[j, 32 * u + e] = d * np.float32(q)


@numba.njit(**common.JIT)
def pool_matmul(pool, mats, ids, xa, x, xsum, out, int8):
  """out[:, :] = x @ W.T for the role whose matrix ids (-1 padded) are `ids`, their outputs side
  by side (the first part's rows first).

  pool: u8[total]; mats: i64[M, 6] (`M_*` columns); xa: the activations of x
  (`act_quant.ACTIVATIONS`, per-32 half needed by row matrices with int8 products); x: f32[b, D];
  xsum: f32[b, D/32] block sums of x (f32 row products); out: f32[b, sum of rows]; int8: integer
  products where a kind has them (else f32)."""
  col = 0
  for p in range(ids.shape[0]):
    m = ids[p]
    if m < 0:
      break
    n = mats[m, M_ROWS]
    rb = mats[m, M_ROW_BYTES]
    off = mats[m, M_OFFSET]
    kind = mats[m, M_KIND]
    if mats[m, M_LAYOUT] == PACKED:
      packed = pool[off:off + (n // qpack.G) * rb].reshape((n // qpack.G, rb))
      qpack.matmul_kernel(kind, packed, xa, out, col)
    else:
      raw = pool[off:off + n * rb].reshape((n, rb))
      if int8 and kind != qblocks.F16 and kind != qblocks.BF16:
        _rows_int8(kind, raw, xa[0], xa[1], xa[2], out, col)
      elif x.shape[0] <= GEMV_MAX_ROWS:
        _rows_f32(kind, raw, x, xsum, out, col)
      elif fgemm.runs(kind, x.shape[1]):
        fgemm.gemm_kernel(kind, raw, x, out, col)
      else:
        _tiles_f32(kind, raw, x, out, col)
    col += n


# ----------------------------------------------------------------------------- the pool
def file_rows(w, lo: int = 0, hi: int | None = None) -> np.ndarray:
  """Rows [lo, hi) of a QMatrix (or PooledMatrix, all rows) in the file's block layout: u8[hi -
  lo, row bytes] (a view for the raw kinds; Q4_1 / Q8_0 interleaved back from their codes and
  scales)."""
  if isinstance(w, PooledMatrix):
    return w.file_rows()
  hi = w.shape[0] if hi is None else hi
  n, nb = hi - lo, w.shape[1] // qmatmul.BLOCK
  if w.kind == qmatmul.Q4_1:
    qs, d, m = (a[lo:hi] for a in w.arrays)
    out = np.empty((n, nb, 20), np.uint8)
    out[:, :, 0:2] = d.view(np.uint8).reshape(n, nb, 2)
    out[:, :, 2:4] = m.view(np.uint8).reshape(n, nb, 2)
    out[:, :, 4:] = qs.reshape(n, nb, 16)
    return out.reshape(n, nb * 20)
  if w.kind == qmatmul.Q8_0:
    q, d = (a[lo:hi] for a in w.arrays)
    out = np.empty((n, nb, 34), np.uint8)
    out[:, :, 0:2] = d.view(np.uint8).reshape(n, nb, 2)
    out[:, :, 2:] = q.view(np.uint8).reshape(n, nb, 32)
    return out.reshape(n, nb * 34)
  return w.arrays[0][lo:hi]


class PooledMatrix:
  """One matrix of a WeightPool: QMatrix's accounting (kind, shape, file_bytes, nbytes) and the
  file's blocks back (`qmatrix`: a QMatrix, copied out of the pool, for references and the
  sparse FFN's own layouts)."""

  def __init__(self, pool: "WeightPool", index: int, kind: str, shape: tuple[int, int]):
    self._pool, self.index, self.kind, self.shape = pool, index, kind, tuple(shape)

  @property
  def packed(self) -> bool:
    return int(self._pool.mats[self.index, M_LAYOUT]) == PACKED

  @property
  def nbytes(self) -> int:
    """Bytes this matrix takes in the pool."""
    m = self._pool.mats[self.index]
    groups = m[M_ROWS] // qpack.G if m[M_LAYOUT] == PACKED else m[M_ROWS]
    return int(groups * m[M_ROW_BYTES])

  def file_bytes(self) -> int:
    values, nbytes = qblocks.GEOMETRY[self.kind]
    return self.shape[0] * (self.shape[1] // values) * nbytes

  def stored(self) -> np.ndarray:
    """The pool's bytes of this matrix (a view): u8[n / G, row bytes] packed, u8[n, row bytes]
    rows."""
    m = self._pool.mats[self.index]
    groups = m[M_ROWS] // qpack.G if m[M_LAYOUT] == PACKED else m[M_ROWS]
    off = int(m[M_OFFSET])
    return self._pool.pool[off:off + groups * m[M_ROW_BYTES]].reshape(groups, m[M_ROW_BYTES])

  def file_rows(self) -> np.ndarray:
    """u8[n, row bytes]: the file's blocks (unpacked, or a view of the rows)."""
    data = self.stored()
    return qpack.unpack_reference(self.kind, data) if self.packed else data

  def qmatrix(self) -> qmatmul.QMatrix:
    """A QMatrix of the same values (Q4_1 / Q8_0 split into codes and scales: a copy)."""
    return qmatmul.from_gguf_blocks(self.kind, self.file_rows().copy(), self.shape)

  def dequantize(self) -> np.ndarray:
    return self.qmatrix().dequantize()

  def __repr__(self) -> str:
    return (f"PooledMatrix({self.kind}, {self.shape[0]}x{self.shape[1]}, "
            f"{'packed' if self.packed else 'rows'})")


class PooledRole:
  """A role's matrices side by side (q | k | v): `parts` PooledMatrix, the role's `ids` row."""

  def __init__(self, parts: list[PooledMatrix], ids: np.ndarray):
    self.parts, self.ids = parts, ids
    self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
    kinds = {p.kind for p in parts}
    self.kind = parts[0].kind if len(kinds) == 1 else "mixed"

  @property
  def nbytes(self) -> int:
    return sum(p.nbytes for p in self.parts)

  def file_bytes(self) -> int:
    return sum(p.file_bytes() for p in self.parts)

  @property
  def needs(self) -> tuple[bool, bool]:
    """(per-32 activations, per-256 activations) this role's int8 products read."""
    per32 = any(not p.packed or p.kind not in qpack.K_KINDS for p in self.parts)
    return per32, any(p.packed and p.kind in qpack.K_KINDS for p in self.parts)

  def dequantize(self) -> np.ndarray:
    return np.concatenate([p.dequantize() for p in self.parts])


def _parts(w) -> list:
  return list(getattr(w, "parts", [w]))


class WeightPool:
  """Matrices (QMatrix or `qconcat.RowConcat`) copied into one buffer (module docstring).

  Args:
    roles: the matrices, one entry per role; a RowConcat's parts are kept side by side.
    int8: integer products: pack what `qpack.packable` allows; False keeps every matrix in rows
      (the f32 kernels read rows).
    on_copied: called with i once roles[i] is copied, for the caller to drop its references
      (the peak is then the pool plus one role's source, not the pool plus every source).

  Attributes:
    pool: u8[total] (64-byte aligned; each matrix starts on a cache line); mats: i64[M, 6];
    roles: PooledRole per entry of `roles`.

  Raises:
    HostOpError: a role of more than MAX_PARTS parts or a kind without a host kernel.
  """

  def __init__(self, roles: list, int8: bool, on_copied=None):
    plan, total = [], 0
    for w in roles:
      parts = _parts(w)
      if len(parts) > MAX_PARTS:
        raise HostOpError(f"a role of {len(parts)} matrices; at most {MAX_PARTS} side by side")
      entry = []
      for part in parts:
        if part.kind not in qblocks.KIND_CODES:
          raise HostOpError(f"no host kernel for {part.kind!r} matrices")
        packed = int8 and qpack.packable(part.kind, part.shape)
        n, dim = part.shape
        if packed:
          groups, row_bytes = n // qpack.G, dim // qpack.UNIT_VALUES[part.kind] * \
              qpack.UNIT_BYTES[part.kind]
        else:
          values, block = qblocks.GEOMETRY[part.kind]
          groups, row_bytes = n, dim // values * block
        entry.append((part, packed, total, row_bytes))
        total += -(-groups * row_bytes // 64) * 64
      plan.append(entry)
    self.pool = common.empty_aligned((max(total, 64),), np.uint8)
    mats = []
    self.roles = []
    for i in range(len(plan)):
      entry, plan[i] = plan[i], None  # Its sources go once copied (on_copied drops the rest).
      pooled = []
      for part, packed, off, row_bytes in entry:
        n, dim = part.shape
        raw = file_rows(part)
        if packed:
          size = n // qpack.G * row_bytes
          qpack.pack(part.kind, raw, self.pool[off:off + size].reshape(n // qpack.G, row_bytes))
          code = qpack.KIND_CODES[part.kind]
        else:
          size = n * row_bytes
          self.pool[off:off + size].reshape(n, row_bytes)[...] = raw.view(np.uint8)
          code = qblocks.KIND_CODES[part.kind]
        release = getattr(part, "release_source", None)
        if release is not None:  # A view of a memory map: its pages may go now.
          release()
        mats.append([PACKED if packed else ROWS, code, off, n, dim, row_bytes])
        pooled.append(PooledMatrix(self, len(mats) - 1, part.kind, part.shape))
      ids = np.full(MAX_PARTS, -1, np.int64)
      ids[:len(pooled)] = [p.index for p in pooled]
      self.roles.append(PooledRole(pooled, ids))
      entry = part = raw = None
      if on_copied is not None:
        on_copied(i)
    self.mats = np.asarray(mats, np.int64).reshape(-1, 6)
    for role in self.roles:  # `mats` was built after the first PooledMatrix objects.
      for p in role.parts:
        p._pool = self

  @property
  def nbytes(self) -> int:
    return int(self.pool.nbytes)


# ----------------------------------------------------------------------------- the LM head
_PACK_CHUNK_BYTES = 16 << 20  # File bytes packed per step (a step's source pages may then go).


def head_packable(kind: str, shape: tuple[int, int], tied: bool) -> bool:
  """Whether an LM head of `kind` and shape (n, D) runs packed with int8 products: a kind qpack
  packs, n a multiple of G; a head tied to the token embedding only as Q8_0 (the one kind whose
  rows `PackedMatrix.rows_f32` reads back)."""
  return qpack.packable(kind, shape) and (not tied or kind == qmatmul.Q8_0)


class PackedMatrix:
  """A whole [n, D] matrix in `qpack`'s packed layout, for the LM head (and the token embedding
  tied to it): QMatrix's API where the decoder uses them (kind, shape, nbytes, file_bytes,
  all_finite, matmul with int8 products, rows_f32 for Q8_0, dequantize, qmatrix).

  Attributes:
    kind: a kind of `qpack.KINDS`; shape: (n, D); packed: u8[n / G, units * UNIT_BYTES[kind]].
  """

  def __init__(self, kind: str, shape: tuple[int, int], packed: np.ndarray):
    want = (shape[0] // qpack.G, shape[1] // qpack.UNIT_VALUES[kind] * qpack.UNIT_BYTES[kind])
    if not qpack.packable(kind, shape) or packed.shape != want or packed.dtype != np.uint8:
      raise HostOpError(f"PackedMatrix({kind}, {shape}): packed must be u8{list(want)}, got "
                        f"{packed.dtype}{list(packed.shape)}")
    self.kind, self.shape, self.packed = kind, (int(shape[0]), int(shape[1])), packed

  @classmethod
  def from_rows(cls, kind: str, rows, shape: tuple[int, int], copied=None) -> "PackedMatrix":
    """Packs a matrix in row chunks of ~16 MB of file bytes: rows(lo, hi) -> u8[hi - lo, row
    bytes] the file's blocks (a view of the memory map, or a copy from a QMatrix); copied(lo,
    hi), if given, is called after each chunk (its source pages may go), so the peak is the
    packed copy plus one chunk."""
    n, dim = shape
    row_bytes = dim // qpack.UNIT_VALUES[kind] * qpack.FILE_BYTES[kind]
    out = common.empty_aligned((n // qpack.G, dim // qpack.UNIT_VALUES[kind] *
                                qpack.UNIT_BYTES[kind]), np.uint8)
    step = max(1, _PACK_CHUNK_BYTES // (row_bytes * qpack.G)) * qpack.G
    for lo in range(0, n, step):
      hi = min(n, lo + step)
      qpack.pack(kind, rows(lo, hi), out[lo // qpack.G:hi // qpack.G])
      if copied is not None:
        copied(lo, hi)
    return cls(kind, shape, out)

  @classmethod
  def from_qmatrix(cls, w: qmatmul.QMatrix) -> "PackedMatrix":
    """Packs a QMatrix (a raw kind's memory-map view then gives its pages back:
    `release_source`)."""
    release = getattr(w, "release_source", None)
    m = cls.from_rows(w.kind, lambda lo, hi: file_rows(w, lo, hi), w.shape)
    if release is not None:
      release()
    return m

  @property
  def nbytes(self) -> int:
    return int(self.packed.nbytes)

  def file_bytes(self) -> int:
    values, nbytes = qblocks.GEOMETRY[self.kind]
    return self.shape[0] * (self.shape[1] // values) * nbytes

  def all_finite(self) -> bool:
    """Whether no f16 scale (d, and m / dmin where the kind has one) is NaN or inf."""
    units = self.packed.reshape(self.packed.shape[0], -1, qpack.UNIT_BYTES[self.kind])
    halves = 32 if self.kind in ("q4_0", "q5_0", "q6_k", "q8_0") else 64
    return bool(np.isfinite(units[:, :, :halves].copy().view(np.float16)).all())

  def matmul(self, x, out: np.ndarray | None = None, dot: str = qmatmul.DOT_INT8) -> np.ndarray:
    """x_hat @ W.T: x f32[b, D] -> f32[b, n] (f32[D] -> f32[n]); `qpack.matmul`.

    Raises:
      HostOpError: dot "f32" (a packed matrix has integer products only: `qmatrix()` first),
        x of the wrong shape.
    """
    if dot != qmatmul.DOT_INT8:
      raise HostOpError(f"a packed {self.kind} matrix multiplies with dot='int8' only, got "
                        f"{dot!r}; use .qmatrix() for f32 products")
    return qpack.matmul(self.kind, self.packed, x, out)

  def rows_f32(self, ids) -> np.ndarray:
    """Rows `ids` (int[k]) dequantized: f32[k, D] (Q8_0 only: the token embedding)."""
    if self.kind != qmatmul.Q8_0:
      raise HostOpError(f"rows_f32 of a packed {self.kind} matrix: only q8_0 rows are read back")
    ids = np.asarray(ids, np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= self.shape[0]):
      raise HostOpError(f"row id out of range [0, {self.shape[0]}): {ids.min()}..{ids.max()}")
    out = np.empty((ids.size, self.shape[1]), np.float32)
    common.ensure_host_threads()
    rows_q8_0_kernel(self.packed, ids, out)
    return out

  def qmatrix(self) -> qmatmul.QMatrix:
    """A QMatrix of the same values (unpacked: a copy)."""
    return qmatmul.from_gguf_blocks(self.kind, qpack.unpack_reference(self.kind, self.packed),
                                    self.shape)

  def dequantize(self) -> np.ndarray:
    return self.qmatrix().dequantize()

  def __repr__(self) -> str:
    return f"PackedMatrix({self.kind}, {self.shape[0]}x{self.shape[1]}, {self.nbytes / 1e6:.2f} MB)"
