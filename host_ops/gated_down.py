"""The gate-first FFN's down pass: neuron-major down rows and the kernels that add them (numba).

The down projection is read neuron-major (`down_t`: row i = neuron i's output weights), so a
neuron whose activation is 0 costs nothing. The file's blocks run along the neuron axis, so
either the rows are re-quantized from the file's values to Q8_0 (34 bytes per 32 weights), or a
Q4_1 file's own codes are transposed and its scales kept per block of 32 neurons (`FileDownRows`:
16 bytes per 32 weights of an active neuron plus 4 always, nothing rounded twice). Which is used
is `--gate_down` (file: the default for Q4_1 down projections; q8_0 else) and the dot:

  Q8_0 rows:       f32 products, four rows at a time (`_down_threads`), either dot;
  FileDownRows:    dot "int8": the activations quantized per block of 32 neurons, a block's
                   active rows summed in integers (`_add_block_file_next`); dot "f32": one
                   neuron at a time in f32 (`_down_threads_file`, the exact path).
The int8 kernel needs AVX2 (qdot.AVAILABLE); elsewhere the f32 one runs. BUILD_NOTES.md
("Q4_1 neuron-major down rows", "The file's own down blocks, transposed") has their timings,
with those of re-quantized Q4_1 rows: removed (issue 33), no faster at +5% perplexity.

Each thread takes a contiguous share of a row's nonzero list; per-thread partial sums are added
in thread order: bitwise reproducible for a fixed thread count.

Layout per STYLE.md: kernels -> `down_pass` (numba; `gated_ffn` validates) -> `down_reference`.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import extending as numba_extending
from numba.core import cgutils
from numba.core import types
from numba.extending import intrinsic

from host_ops import common
from host_ops import qblocks
from host_ops import qdot
from host_ops import qmatmul
from host_ops.common import HostOpError
from host_ops.llvm_ir import (F32 as _F32, I8 as _I8, I16 as _I16, I32 as _I32, I64 as _I64,
                              half_to_float as _half_to_float, load as _load, splat as _splat,
                              vec as _vec, x86 as _x86)


# Formats of the neuron-major down rows: re-quantized Q8_0 rows, or the file's own Q4_1 blocks
# transposed without rounding (`FileDownRows`).
DOWN_FILE = "file"
DOWN_KINDS = (qmatmul.Q8_0, DOWN_FILE)
# Bytes per 32 down weights of each format: (read per active neuron, read whatever the sparsity:
# the file layout's d and m of every neuron block).
DOWN_BLOCK_BYTES = {qmatmul.Q8_0: (34, 0), DOWN_FILE: (16, 4)}

# Neurons ahead whose whole rows (codes and scales) a thread prefetches in each pass (up and
# down: `gated_ffn` uses it too).
AHEAD = 3


@numba.njit(inline="always", **common.JIT)
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


@numba.njit(inline="always", **common.JIT)
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


# ---------------------------------------------------------------- the file's blocks, transposed
# A Q4_1 down matrix W[D, F] holds per output o and block of 32 neurons b the scale d[o, b], the
# offset m[o, b] and 4-bit codes q[o, n]. `FileDownRows` keeps exactly these, neuron-major:
# codes u8[F, D/2] (neuron n's codes for every output, packed as Q4_1 packs a block of 32
# outputs: low nibbles outputs 0..15, high 16..31) and dm u16[F/32, 2, D] (d and m of neuron
# block b for every output, f16 bits). Then for the active neurons S_b of block b
#   sum_{n in S_b} a_n W[o, n] = d[o, b] sum_{n in S_b} a_n q[o, n] + m[o, b] sum_{n in S_b} a_n,
# so an inactive neuron's codes (16 of the file's 20 bytes per 32 weights) are never read, and
# nothing is rounded twice. With dot "int8" the activations are quantized per block of 32
# neurons as the dense down matvec quantizes them (`qdot.quantize_x`), so the sum is in integers
# and sparse equals dense with the inactive neurons zeroed up to f32 summation order.


@intrinsic
def _add_block_file_next(typingctx, acc, qs, ids, cq, n_pairs, dm, scale, offset, next_ids,
                         next_n, next_dm):
  """acc[o] += d[o] * scale * sum_k cq[k] * code(qs[ids[k]], o) + m[o] * offset for every
  output o, over the rows k < 2 n_pairs of one neuron block (AVX2 + F16C), prefetching the
  next block meanwhile. acc: f32[D]; qs: u8[F, D/2]; ids: i64[32] (padding: any row, with cq
  0); cq: i8[32]; n_pairs: i64 (1..16); dm: u16[2, D] (the block's d and m, f16 bits); scale,
  offset: f32; next_ids: i64[32], next_n: i64 (0..32), next_dm: u16[2, D]: the next block's
  rows and scales.
  Per 32 outputs, rows 2p and 2p + 1 are interleaved byte by byte, then the low nibbles
  (outputs 0..15) and high nibbles (16..31) each go through one `vpmaddubsw` with the pair
  (cq[2p], cq[2p + 1]); up to 8 pairs add in i16 (at most 8 * 2 * 15 * 127), then in i32,
  and the scales are applied once per block. The prefetches are spread over the block, never
  issued at once: the next d and m a line each per 32 outputs, the line at the same offset of
  each next row per 128 outputs, all into L2 (`prefetcht1`): into L1 (a block ahead of 288-byte
  SmolLM2 rows from DRAM, 50% active) the pass took 1.32x as long (BUILD_NOTES.md, issue 11)."""
  sig = types.void(acc, qs, ids, cq, n_pairs, dm, scale, offset, next_ids, next_n, next_dm)
  return sig, _add_block_file_codegen()


def _add_block_file_codegen():
  """LLVM IR of `_add_block_file_next`."""
  locality = common.LOCALITY_L2

  def codegen(context, builder, signature, args):
    accp, qsp, idp, cqp, dmp = (context.make_array(signature.args[k])(context, builder,
                                                                       args[k]) for k in
                                (0, 1, 2, 3, 5))
    half = builder.extract_value(qsp.shape, 1)
    dim = builder.extract_value(dmp.shape, 1)
    accp, qsp, idp, cqp, dmp = (a.data for a in (accp, qsp, idp, cqp, dmp))
    # The next block's rows and scales, prefetched over this one.
    nidp, ndmp = (context.make_array(signature.args[k])(context, builder, args[k]).data
                  for k in (8, 10))
    next_n = args[9]
    nc = builder.udiv(half, ir.Constant(half.type, 16))
    vec = _vec
    v32, v16 = vec(_I8, 32), vec(_I16, 16)
    maddubs = _x86(builder, "llvm.x86.avx2.pmadd.ub.sw", v16, [v32, v32])
    # Before the loop: the 32 row pointers and the 16 pairs' coefficient vectors.
    rows_p = cgutils.alloca_once(builder, qsp.type, size=ir.Constant(_I32, 32))
    coefs_p = cgutils.alloca_once(builder, v32, size=ir.Constant(_I32, 16))
    for k in range(32):
      row = builder.gep(qsp, [builder.mul(builder.load(builder.gep(idp, [ir.Constant(_I64, k)])),
                                          half)])
      builder.store(row, builder.gep(rows_p, [ir.Constant(_I32, k)]))
    for p in range(16):
      c0, c1 = (builder.zext(builder.load(builder.gep(cqp, [ir.Constant(_I64, k)])), _I16)
                for k in (2 * p, 2 * p + 1))
      builder.store(builder.bitcast(_splat(builder, builder.or_(c0, builder.shl(c1, ir.Constant(
          _I16, 8))), 16), v32), builder.gep(coefs_p, [ir.Constant(_I32, p)]))
    scale_v = _splat(builder, args[6], 16)
    offset_v = _splat(builder, args[7], 16)
    low = ir.Constant(v32, [15] * 32)
    pair_mask = ir.Constant(vec(_I32, 32), [x for j in range(16) for x in (j, 16 + j)])
    i32_p = [cgutils.alloca_once(builder, vec(_I32, 16)) for _ in range(2)]
    i16_p = [cgutils.alloca_once(builder, v16) for _ in range(2)]
    n_pairs = args[4]
    # Pairs [0, min(n, 8)) and then [8, n): at most 8 pairs add in i16 (8 * 2 * 15 * 127).
    spans = [(ir.Constant(n_pairs.type, 0), builder.select(
        builder.icmp_signed("<", n_pairs, ir.Constant(n_pairs.type, 8)), n_pairs,
        ir.Constant(n_pairs.type, 8))),
             (ir.Constant(n_pairs.type, 8), n_pairs)]
    with cgutils.for_range(builder, nc) as loop:
      c = loop.index
      off = builder.mul(c, ir.Constant(c.type, 16))
      # The next block's d and m at these 32 outputs (64 bytes each) ...
      o32 = builder.mul(c, ir.Constant(c.type, 32))
      common.emit_prefetch(builder, builder.gep(ndmp, [o32]), locality)
      common.emit_prefetch(builder, builder.gep(ndmp, [builder.add(dim, o32)]), locality)
      # ... and every 4th chunk (64 code bytes) the line at this offset of each next row.
      first = builder.icmp_unsigned("==", builder.and_(c, ir.Constant(c.type, 3)),
                                    ir.Constant(c.type, 0))
      with builder.if_then(first):
        with cgutils.for_range(builder, next_n) as rows_loop:
          nrow = builder.load(builder.gep(nidp, [rows_loop.index]))
          common.emit_prefetch(builder, builder.gep(qsp, [builder.add(builder.mul(nrow, half),
                                                                       off)]), locality)
      for h in range(2):
        builder.store(ir.Constant(vec(_I32, 16), [0] * 16), i32_p[h])
      for first, stop in spans:
        for h in range(2):
          builder.store(ir.Constant(v16, [0] * 16), i16_p[h])
        with cgutils.for_range_slice(builder, first, stop,
                                     ir.Constant(n_pairs.type, 1)) as (pair, _):
          raw = [_load(builder, builder.load(builder.gep(rows_p, [builder.add(
              builder.mul(pair, ir.Constant(pair.type, 2)), ir.Constant(pair.type, k))])), off,
              vec(_I8, 16)) for k in (0, 1)]
          inter = builder.shuffle_vector(raw[0], raw[1], pair_mask)  # a0 b0 a1 b1 ... a15 b15
          coef = builder.load(builder.gep(coefs_p, [pair]))
          for h, codes in enumerate((builder.and_(inter, low),
                                     builder.and_(builder.lshr(inter, ir.Constant(v32, [4] * 32)),
                                                  low))):
            builder.store(builder.add(builder.load(i16_p[h]), builder.call(maddubs, [codes, coef])),
                          i16_p[h])
        for h in range(2):
          builder.store(builder.add(builder.load(i32_p[h]), builder.sext(
              builder.load(i16_p[h]), vec(_I32, 16))), i32_p[h])
      for h in range(2):
        o = builder.add(builder.mul(c, ir.Constant(c.type, 32)), ir.Constant(c.type, 16 * h))
        d = _half_to_float(builder, _load(builder, dmp, o, vec(_I16, 16)))
        m = _half_to_float(builder, _load(builder, dmp, builder.add(dim, o),
                                                       vec(_I16, 16)))
        isum = builder.sitofp(builder.load(i32_p[h]), vec(_F32, 16))
        part = common.fma(builder, isum, common.fmul(builder, d, scale_v),
                           common.fmul(builder, m, offset_v))
        ptr = builder.bitcast(builder.gep(accp, [o]), vec(_F32, 16).as_pointer())
        builder.store(common.fadd(builder, builder.load(ptr, align=4), part), ptr, align=4)
    return context.get_dummy_value()

  return codegen


@numba.njit(inline="always", **common.JIT)
def _gather_block(ids_r, j, hi, xq_r, out_ids, out_cq):
  """The run of ids_r[j:hi] in ids_r[j]'s block of 32 neurons: copies the ids and their
  activation codes into out_ids, out_cq; returns (count, sum of the codes). (0, 0) at j = hi."""
  if j >= hi:
    return 0, 0
  blk = ids_r[j] // qmatmul.BLOCK
  n = 0
  isum = 0
  while j + n < hi and ids_r[j + n] // qmatmul.BLOCK == blk:
    out_ids[n] = ids_r[j + n]
    out_cq[n] = xq_r[out_ids[n]]
    isum += np.int32(out_cq[n])
    n += 1
  return n, isum


@numba.njit(parallel=True, **common.JIT)
def _down_threads_file_int8(acts, ids, counts, qs, dm, partials, n_threads):
  """The down pass over `FileDownRows` in integers: acts quantized per block of 32 neurons
  (`qdot.quantize_x`), then each thread walks its contiguous share of a row's nonzero list one
  neuron block at a time (`_add_block_file_next`; an odd count is padded with coefficient 0 on
  a row already read), the next block's rows and scales prefetched over the current one (7B
  shapes from DRAM, 25% active: 537 -> 489 us against whole rows prefetched 32 neurons ahead;
  the same layer from L3: 380 us)."""
  xq, dx, _ = qdot.quantize_x(acts)
  blk_n = qmatmul.BLOCK
  for t in numba.prange(n_threads):
    ids_a = np.empty(blk_n, np.int64)
    cq_a = np.empty(blk_n, np.int8)
    ids_b = np.empty(blk_n, np.int64)
    cq_b = np.empty(blk_n, np.int8)
    for r in range(acts.shape[0]):
      lo = t * counts[r] // n_threads
      hi = (t + 1) * counts[r] // n_threads
      n, isum = _gather_block(ids[r], lo, hi, xq[r], ids_a, cq_a)
      for k in range(n):
        common.prefetch_row(qs[ids_a[k]])
      j = lo
      while n > 0:
        blk = ids_a[0] // blk_n
        n2, isum2 = _gather_block(ids[r], j + n, hi, xq[r], ids_b, cq_b)
        if n % 2:
          ids_a[n] = ids_a[0]
          cq_a[n] = 0
        nblk = ids_b[0] // blk_n if n2 > 0 else blk
        _add_block_file_next(partials[t, r], qs, ids_a, cq_a, np.int64((n + 1) // 2), dm[blk],
                             dx[r, blk], dx[r, blk] * np.float32(isum), ids_b, np.int64(n2),
                             dm[nblk])
        j += n
        ids_a, ids_b = ids_b, ids_a
        cq_a, cq_b = cq_b, cq_a
        n, isum = n2, isum2


@numba.njit(parallel=True, **common.JIT)
def _down_threads_file(acts, ids, counts, qs, dm, partials, n_threads):
  """The down pass over `FileDownRows` in f32 (exact activations; the reference path where
  qdot.AVAILABLE is False): acc[o] += a * (d[o, b] q[o, n] + m[o, b]), one neuron at a time."""
  half = qs.shape[1]
  for t in numba.prange(n_threads):
    for r in range(acts.shape[0]):
      lo = t * counts[r] // n_threads
      hi = (t + 1) * counts[r] // n_threads
      acc = partials[t, r]
      for j in range(lo, hi):
        i = ids[r, j]
        a = acts[r, i]
        row = qs[i]
        d = dm[i // qmatmul.BLOCK, 0]
        m = dm[i // qmatmul.BLOCK, 1]
        for c in range(half // 16):
          for k in range(16):
            o = 32 * c + k
            acc[o] += a * (qblocks.f16_to_f32(d[o]) * np.float32(row[16 * c + k] & 15) +
                           qblocks.f16_to_f32(m[o]))
            o += 16
            acc[o] += a * (qblocks.f16_to_f32(d[o]) * np.float32(row[16 * c + k] >> 4) +
                           qblocks.f16_to_f32(m[o]))


class FileDownRows:
  """The file's Q4_1 down matrix [D, F] held neuron-major without re-rounding (the comment
  above `_add_block_file_next`): codes u8[F, D/2] and dm u16[F/32, 2, D] (f16 bits of d and m).

  Bytes: 16 per 32 weights of each active neuron plus 4 per 32 weights always (the scales),
  against 20 per 32 dense: skipping 48% of the neurons saves 38% of the down bytes, where
  re-quantized Q8_0 rows (34 bytes) save 12%.

  Attributes: kind ("file"), arrays ((codes, dm)), shape ((F, D): neurons, outputs).
  """

  kind = DOWN_FILE

  def __init__(self, codes: np.ndarray, dm: np.ndarray):
    codes, dm = np.ascontiguousarray(codes), np.ascontiguousarray(dm)
    if (codes.dtype != np.uint8 or dm.dtype != np.uint16 or codes.ndim != 2 or dm.ndim != 3
        or codes.shape[0] % qmatmul.BLOCK or codes.shape[1] % 16
        or dm.shape != (codes.shape[0] // qmatmul.BLOCK, 2, 2 * codes.shape[1])
        or codes.size == 0):
      raise HostOpError(f"file down rows need codes u8[F, D/2] and dm u16[F/32, 2, D] with F "
                        f"and D multiples of 32, got {codes.dtype}{list(codes.shape)} and "
                        f"{dm.dtype}{list(dm.shape)}")
    self.arrays = (codes, dm)
    self.shape = (codes.shape[0], 2 * codes.shape[1])

  @classmethod
  def from_down(cls, down: qmatmul.QMatrix) -> "FileDownRows":
    """From the file's down projection W: Q4_1 [D, F] (D outputs, F neurons).

    Raises:
      HostOpError: W is not Q4_1, or D is not a multiple of 32.
    """
    if down.kind != qmatmul.Q4_1 or down.shape[0] % qmatmul.BLOCK:
      raise HostOpError(f"--gate_down=file needs a Q4_1 down projection with a multiple of 32 "
                        f"outputs; this one is {down.kind} {list(down.shape)}: use "
                        f"--gate_down=q8_0")
    qs, d, m = down.arrays
    dim, f = down.shape
    raw = qs.reshape(dim, f // qmatmul.BLOCK, 16)
    codes = np.concatenate([raw & 15, raw >> 4], axis=2).reshape(dim, f)  # [D, F], 0..15.
    codes_t = codes.T.reshape(f, dim // qmatmul.BLOCK, 2, 16)  # Per 32 outputs: low, high.
    packed = (codes_t[:, :, 0, :] | (codes_t[:, :, 1, :] << 4)).reshape(f, dim // 2)
    return cls(packed.astype(np.uint8), np.stack([d.T, m.T], axis=1))

  def dequantize(self) -> np.ndarray:
    """f64[F, D]: the weights, neuron-major (W.T of the file's values)."""
    codes, dm = self.arrays
    f, dim = self.shape
    raw = codes.reshape(f, dim // qmatmul.BLOCK, 16).astype(np.float64)
    q = np.concatenate([raw % 16, raw // 16], axis=2).reshape(f, dim)
    dv = qmatmul.f16_values(dm[:, 0]).astype(np.float64)  # [F/32, D]
    mv = qmatmul.f16_values(dm[:, 1]).astype(np.float64)
    return q * np.repeat(dv, qmatmul.BLOCK, axis=0) + np.repeat(mv, qmatmul.BLOCK, axis=0)

  @property
  def nbytes(self) -> int:
    return sum(a.nbytes for a in self.arrays)


def _down_rows(acts, ids, counts, dt, partials, n_threads, block, int8):
  """Adds the down rows of the nonzero activations into partials (numba only; the overload
  picks the kernel of dt's format: (q, d) Q8_0 or FileDownRows' (codes, dm))."""
  raise NotImplementedError("_down_rows runs inside numba-compiled code only")


@numba_extending.overload(_down_rows, jit_options=common.JIT)
def _down_rows_overload(acts, ids, counts, dt, partials, n_threads, block, int8):
  if len(dt) == 2 and dt[1].ndim == 3:  # FileDownRows: (codes, dm u16[F/32, 2, D]).
    if not qdot.AVAILABLE:
      def file_f32(acts, ids, counts, dt, partials, n_threads, block, int8):
        _down_threads_file(acts, ids, counts, dt[0], dt[1], partials, n_threads)
      return file_f32

    def file(acts, ids, counts, dt, partials, n_threads, block, int8):
      if int8:
        _down_threads_file_int8(acts, ids, counts, dt[0], dt[1], partials, n_threads)
      else:
        _down_threads_file(acts, ids, counts, dt[0], dt[1], partials, n_threads)
    return file
  if len(dt) == 2:
    def q8_0(acts, ids, counts, dt, partials, n_threads, block, int8):
      _down_threads(acts, ids, counts, dt[0], dt[1], partials, n_threads, block)
    return q8_0
  raise TypeError("neuron-major down rows are Q8_0 (q, d) or FileDownRows arrays")


def _down_dim(dt, block):
  """D, the outputs of neuron-major down rows dt (numba only)."""
  raise NotImplementedError("_down_dim runs inside numba-compiled code only")


@numba_extending.overload(_down_dim, jit_options=common.JIT)
def _down_dim_overload(dt, block):
  if len(dt) == 2 and dt[1].ndim == 3:
    return lambda dt, block: dt[1].shape[2]
  return lambda dt, block: dt[1].shape[1] * block


@numba.njit(**common.JIT)
def down_pass(acts, dt, n_threads, block, int8):
  """Pass 2: y[r] = sum over i with acts[r, i] != 0 of acts[r, i] * down_t[i]; returns (y, counts).

  dt: neuron-major down rows, (q, d) Q8_0 or FileDownRows' arrays (`_down_rows`). Each thread
  takes a contiguous share of each row's nonzero list, whole rows prefetched ahead; Q8_0 rows are
  added four at a time (`_add_rows4_q8_0`) then the rest one by one."""
  b, f = acts.shape
  dim = _down_dim(dt, block)
  ids = np.empty((b, f), np.int32)
  counts = np.zeros(b, np.int64)
  for r in range(b):
    c = 0
    for i in range(f):  # Branch-free, as `_active_ids`.
      ids[r, c] = i
      c += np.int64(acts[r, i] != 0)
    counts[r] = c
  partials = np.zeros((n_threads, b, dim), np.float32)
  _down_rows(acts, ids, counts, dt, partials, n_threads, block, int8)
  y = partials[0].copy()  # Thread order: y = ((p0 + p1) + p2) ...
  for t in range(1, n_threads):
    y += partials[t]
  return y, counts


@numba.njit(parallel=True, **common.JIT)
def _down_threads(acts, ids, counts, dt_q, dt_d, partials, n_threads, block):
  for t in numba.prange(n_threads):
    four = np.empty(4, np.int64)
    a4 = np.empty(4, np.float32)
    for r in range(acts.shape[0]):
      lo = t * counts[r] // n_threads
      hi = (t + 1) * counts[r] // n_threads
      for j in range(lo, min(lo + AHEAD, hi)):
        common.prefetch_at(ids[r], j, hi, dt_q)
        common.prefetch_at(ids[r], j, hi, dt_d)
      j = lo
      while j < hi:
        if j + 4 <= hi:
          for k in range(4):
            common.prefetch_at(ids[r], j + AHEAD + k, hi, dt_q)
            common.prefetch_at(ids[r], j + AHEAD + k, hi, dt_d)
            four[k] = ids[r, j + k]
            a4[k] = acts[r, four[k]]
          _add_rows4_q8_0(partials[t, r], a4, four, dt_q, dt_d, block)
          j += 4
        else:
          i = ids[r, j]
          _add_row_q8_0(partials[t, r], acts[r, i], dt_q[i], dt_d[i], block)
          j += 1


def down_reference(acts, down_t: qmatmul.QMatrix, *, dot: str = qmatmul.DOT_F32) -> np.ndarray:
  """Float64 NumPy reference of the down pass: f32[b, D] = acts @ dequant(down_t).

  acts: f32[b, F]. For `FileDownRows` with dot "int8" the activations are quantized per block
  of 32 neurons (`qdot.quantize_x_reference`), as the dense down matvec does.
  """
  acts = np.asarray(acts, np.float32)
  if down_t.kind == DOWN_FILE:
    if dot == qmatmul.DOT_INT8 and qdot.AVAILABLE:
      xq, dx, _ = qdot.quantize_x_reference(acts)
      b, f = acts.shape
      x = (xq.reshape(b, f // qmatmul.BLOCK, qmatmul.BLOCK).astype(np.float64) *
           dx[..., None]).reshape(b, f)
    else:
      x = acts.astype(np.float64)
    return (x @ down_t.dequantize()).astype(np.float32)
  return (acts.astype(np.float64) @ qmatmul.dequantize_reference(down_t)).astype(np.float32)
