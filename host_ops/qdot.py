"""Integer dot products of GGUF weight blocks with 8-bit quantized activations (numba + x86 SIMD).

Why (issue 11): a decode matvec turning each 4-bit weight into a float ran at ~13 G weights/s
on 2 cores, about half llama.cpp's speed. Here the activation row is quantized once per matmul
to 8 bits per block of 32 (scale dx = max|x_block| / 127, xq = round(x / dx), the Q8 scheme of
llama.cpp's `vec_dot_q4_1_q8_1`), and each weight block is multiplied with it in integers:
`vpmaddubsw` (u8 x s8 -> pairs summed in i16) then `vpmaddwd` with ones (-> i32), eight i32 lanes
per block, converted to float, scaled by d_w * dx and added into an eight-lane float accumulator,
so the one horizontal sum comes at the end of the row, not after every block (a per-block
horizontal sum made a block loop 10x slower, BUILD_NOTES.md). numba's LLVM does not find these
instructions itself; `_row_dot_*` emit them as LLVM IR through `numba.extending.intrinsic`.

Per row, with w = d_w * q (+ m_w for Q4_1) and x ~ dx * xq:
  Q4_1: sum_b d_w[b] dx[b] sum_k q[b, k] xq[b, k] + sum_b m_w[b] xsum[b]
        (xsum = dx * sum_k xq: the sum of the *quantized* block, as llama.cpp's q8_1, so the
        whole product is W . x_hat. Q4_1 codes are all >= 0, so d_w q carries an offset that
        m_w cancels; with the exact sum of x the offset's rounding error stayed: mean KL
        against f32 activations 0.0235 instead of 0.0045, found by a tester.)
  Q8_0: sum_b d_w[b] dx[b] sum_k q[b, k] xq[b, k]   (s8 x s8 via vpsignb: |q| * sign(q) xq)
Integer sums are exact (|15 * 127 * 2| and |128 * 127 * 2| fit i16), so the only difference
from the f32 product is the activation rounding (relative error ~1/254 per block).

Q4_1 rows take two blocks per 32-byte vector (`row_dot_q4_1_pairs`): the 32 code bytes of
blocks b and b+1 split into low nibbles (both blocks' values 0..15) and high nibbles (16..31),
against x laid out to match (`pair_blocks`), so one vpmaddwd sums both blocks, lanes 0-3 block b
and 4-7 block b+1; the scales of eight blocks are widened and multiplied in one vector each.
About 2.5x fewer instructions per block than one block per step: the 7B-shaped gate matvec
from L3 1090 -> 650 us, from DRAM 1090 -> 820-880 us (BUILD_NOTES.md, issue 11).

Needs AVX2 and FMA (every x86-64 CPU since 2013); `AVAILABLE` is False elsewhere and callers
keep the f32 kernels of `host_ops.qmatmul`. Layout per STYLE.md: intrinsics -> numba kernels ->
NumPy references (`quantize_x_reference`, `matmul_reference`).
"""

from __future__ import annotations

import llvmlite.binding
import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils
from numba.core import types
from numba.extending import intrinsic

from host_ops import common
from host_ops.llvm_ir import (F32 as _F32, I8 as _I8, I16 as _I16, I32 as _I32,
                              half_to_float as _half_to_float, load as _load, vec as _vec,
                              x86 as _x86)

BLOCK = 32
Q4_1 = "q4_1"
Q8_0 = "q8_0"


def _host_has_avx2() -> bool:
  if not common.IS_X86:
    return False
  try:
    features = llvmlite.binding.get_host_cpu_features()
  except RuntimeError:  # No feature list on this host: do not guess.
    return False
  return bool(features.get("avx2") and features.get("fma"))  # The sums use llvm.fma.


# Whether the integer kernels can run here. numba compiles for the host CPU, so an intrinsic is
# only ever emitted where the CPU has it.
AVAILABLE = _host_has_avx2()

def _row_dot_codegen(prefetch=False, locality=common.LOCALITY_L1):
  """LLVM IR of a Q8_0 row's sum_b d[b] dx[b] <w_b, xq_b> (see the module docstring). With
  `prefetch`, a fifth argument is the next row's codes, one cache line of which is prefetched
  (at `locality`) per 64 code bytes read here: spread over the row, so the prefetches never fill
  the core's miss buffers at once as a whole-row prefetch does."""

  def codegen(context, builder, signature, args):
    arrays = [context.make_array(t)(context, builder, a) for t, a in zip(signature.args, args)]
    wp, dp, xp, sp = (a.data for a in arrays[:4])
    if prefetch:
      np_ = builder.bitcast(arrays[4].data, cgutils.voidptr_t)
    nb = builder.extract_value(arrays[1].shape, 0)
    acc_p = cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, 8), [0.0] * 8))
    ones = ir.Constant(_vec(_I16, 16), [1] * 16)
    maddubs = _x86(builder, "llvm.x86.avx2.pmadd.ub.sw", _vec(_I16, 16),
                   [_vec(_I8, 32), _vec(_I8, 32)])
    maddwd = _x86(builder, "llvm.x86.avx2.pmadd.wd", _vec(_I32, 8), [_vec(_I16, 16)] * 2)
    psign = _x86(builder, "llvm.x86.avx2.psign.b", _vec(_I8, 32), [_vec(_I8, 32)] * 2)
    lanes = ir.Constant(_vec(_I32, 8), [0] * 8)
    with cgutils.for_range(builder, nb) as loop:
      b = loop.index
      if prefetch:  # The next row's line at this block's offset, once per 64 bytes.
        first = builder.icmp_unsigned("==", builder.and_(b, ir.Constant(b.type, 1)),
                                      ir.Constant(b.type, 0))
        with builder.if_then(first):
          common.emit_prefetch(builder, builder.gep(
              np_, [builder.mul(b, ir.Constant(b.type, 32))]), locality)
      x = _load(builder, xp, builder.mul(b, ir.Constant(b.type, 32)), _vec(_I8, 32))
      # s8 x s8: vpmaddubsw wants one unsigned side, so |w| and x with w's sign.
      w = _load(builder, wp, builder.mul(b, ir.Constant(b.type, 32)), _vec(_I8, 32))
      w, x = builder.call(psign, [w, w]), builder.call(psign, [x, w])
      isum = builder.call(maddwd, [builder.call(maddubs, [w, x]), ones])
      # d holds f16 bits (as the file): widened here, one vcvtph2ps per block with F16C.
      d_b = _half_to_float(builder, builder.load(builder.gep(dp, [b])))
      scale = common.fmul(builder, d_b, builder.load(builder.gep(sp, [b])))
      splat = builder.shuffle_vector(
          builder.insert_element(ir.Constant(_vec(_F32, 8), ir.Undefined), scale,
                                 ir.Constant(_I32, 0)),
          ir.Constant(_vec(_F32, 8), ir.Undefined), lanes)
      acc = builder.load(acc_p)
      builder.store(common.fma(builder, builder.sitofp(isum, _vec(_F32, 8)), splat, acc), acc_p)
    acc = builder.load(acc_p)
    parts = [builder.extract_element(acc, ir.Constant(_I32, k)) for k in range(8)]
    while len(parts) > 1:  # Pairwise: a fixed order, so results are reproducible.
      parts = [common.fadd(builder, parts[k], parts[k + 1]) for k in range(0, len(parts), 2)]
    return parts[0]

  return codegen


def _q4_1_pairs_codegen(prefetch=False, locality=common.LOCALITY_L1, q4_0=False):
  """LLVM IR of a Q4_1 row's dot with x in the pair layout (`pair_blocks`), offsets included:
  sum_b d[b] dx[b] <w_b, xq_b> + sum_b m[b] xsum[b] (see the module docstring).

  q4_0: a Q4_0 row (w = d (q - 8)) as Q4_1 with m = -8 d, computed here in f32 (exact) from d:
  no m argument, so the arguments are (qs, d, xqp, dx, xsum[, next_qs]).

  Per group of 8 blocks: d and m widened eight at a time (S = d * dx, and m . xsum into its
  own accumulator); per pair of blocks one 32-byte code load, both nibble halves against the
  two 32-byte halves of the pair's x, one vpmaddwd, acc += float(isum) * S[2k, 2k + 1 lanes]
  (two accumulators, alternating, so the adds do not wait on each other). Left-over pairs
  (< 4) take scalar scales; the last block of an odd count the one-block step. `prefetch`: as
  `_row_dot_codegen`, the seventh argument the next row's codes."""

  def codegen(context, builder, signature, args):
    arrays = [context.make_array(t)(context, builder, a) for t, a in zip(signature.args, args)]
    if q4_0:  # No offsets array: m = -8 d (`half_m`).
      arrays.insert(2, None)
    wp, dp, xp, dxp, sump = (arrays[k].data for k in (0, 1, 3, 4, 5))
    mp = None if q4_0 else arrays[2].data
    nb = builder.extract_value(arrays[1].shape, 0)
    it = nb.type

    def c(v):
      return ir.Constant(it, v)

    v8 = _vec(_F32, 8)
    zero8 = ir.Constant(v8, [0.0] * 8)
    accs = [cgutils.alloca_once_value(builder, zero8) for _ in range(2)]
    acc_m = cgutils.alloca_once_value(builder, zero8)
    tail = cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0))
    ones = ir.Constant(_vec(_I16, 16), [1] * 16)
    m15 = ir.Constant(_vec(_I8, 32), [15] * 32)
    maddubs = _x86(builder, "llvm.x86.avx2.pmadd.ub.sw", _vec(_I16, 16), [_vec(_I8, 32)] * 2)
    maddwd = _x86(builder, "llvm.x86.avx2.pmadd.wd", _vec(_I32, 8), [_vec(_I16, 16)] * 2)

    def pair_sums(blk):
      """<8 x float>: block blk's integer dot in lanes 0-3, blk + 1's in lanes 4-7."""
      w = _load(builder, wp, builder.mul(blk, c(16)), _vec(_I8, 32))
      lo = builder.and_(w, m15)
      hi = builder.and_(builder.lshr(w, ir.Constant(_vec(_I8, 32), [4] * 32)), m15)
      xo = builder.mul(blk, c(32))
      x0 = _load(builder, xp, xo, _vec(_I8, 32))
      x1 = _load(builder, xp, builder.add(xo, c(32)), _vec(_I8, 32))
      pairs = builder.add(builder.call(maddubs, [lo, x0]), builder.call(maddubs, [hi, x1]))
      return builder.sitofp(builder.call(maddwd, [pairs, ones]), v8)

    def accumulate(acc_p, f, scale):
      builder.store(common.fma(builder, f, scale, builder.load(acc_p)), acc_p)

    def half_m(d_f, n):
      """Q4_0's offsets as f32 (n lanes, or a scalar for n 0): -8 d (d_f the scales as f32;
      times a power of two, so exact)."""
      minus8 = ir.Constant(_F32, -8.0) if n == 0 else ir.Constant(_vec(_F32, n), [-8.0] * n)
      return common.fmul(builder, d_f, minus8)

    def scalars(b):  # (d[b] dx[b], m[b] xsum[b]) of one block.
      d_b = _half_to_float(builder, builder.load(builder.gep(dp, [b])))
      m_b = half_m(d_b, 0) if q4_0 else _half_to_float(builder,
                                                         builder.load(builder.gep(mp, [b])))
      return (common.fmul(builder, d_b, builder.load(builder.gep(dxp, [b]))),
              common.fmul(builder, m_b, builder.load(builder.gep(sump, [b]))))

    groups = builder.lshr(nb, c(3))
    with cgutils.for_range(builder, groups) as loop:
      base = builder.shl(loop.index, c(3))
      d8 = _half_to_float(builder, _load(builder, dp, base, _vec(_I16, 8)))
      scale8 = common.fmul(builder, d8, _load(builder, dxp, base, v8))
      m8 = half_m(d8, 8) if q4_0 else _half_to_float(builder, _load(builder, mp, base,
                                                                     _vec(_I16, 8)))
      accumulate(acc_m, m8, _load(builder, sump, base, v8))
      for k in range(4):
        blk = builder.add(base, c(2 * k))
        if prefetch and k % 2 == 0:  # One line of the next row per 64 code bytes read.
          common.emit_prefetch(builder, builder.gep(
              builder.bitcast(arrays[6].data, cgutils.voidptr_t), [builder.mul(blk, c(16))]),
              locality)
        lanes = ir.Constant(_vec(_I32, 8), [2 * k] * 4 + [2 * k + 1] * 4)
        accumulate(accs[k % 2], pair_sums(blk),
                   builder.shuffle_vector(scale8, ir.Constant(v8, ir.Undefined), lanes))
    with cgutils.for_range_slice(builder, builder.shl(groups, c(2)), builder.lshr(nb, c(1)), c(1),
                                 inc=True) as (p, _):
      blk = builder.shl(p, c(1))
      s0, o0 = scalars(blk)
      s1, o1 = scalars(builder.add(blk, c(1)))
      two = builder.insert_element(builder.insert_element(
          ir.Constant(v8, ir.Undefined), s0, ir.Constant(_I32, 0)), s1, ir.Constant(_I32, 1))
      accumulate(accs[0], pair_sums(blk), builder.shuffle_vector(
          two, ir.Constant(v8, ir.Undefined), ir.Constant(_vec(_I32, 8), [0] * 4 + [1] * 4)))
      builder.store(common.fadd(builder, builder.load(tail), common.fadd(builder, o0, o1)), tail)
    with cgutils.for_range_slice(builder, builder.shl(builder.lshr(nb, c(1)), c(1)), nb, c(1),
                                 inc=True) as (b, _):  # The last block of an odd count.
      raw = _load(builder, wp, builder.mul(b, c(16)), _vec(_I8, 16))
      lo = builder.and_(raw, ir.Constant(_vec(_I8, 16), [15] * 16))
      hi = builder.lshr(raw, ir.Constant(_vec(_I8, 16), [4] * 16))
      w = builder.shuffle_vector(lo, hi, ir.Constant(_vec(_I32, 32), list(range(32))))
      x = _load(builder, xp, builder.mul(b, c(32)), _vec(_I8, 32))
      isum = builder.call(maddwd, [builder.call(maddubs, [w, x]), ones])
      parts = [builder.extract_element(isum, ir.Constant(_I32, k)) for k in range(8)]
      while len(parts) > 1:
        parts = [builder.add(parts[k], parts[k + 1]) for k in range(0, len(parts), 2)]
      s0, o0 = scalars(b)
      builder.store(common.fadd(builder, builder.load(tail), common.fadd(builder, 
          common.fmul(builder, builder.sitofp(parts[0], _F32), s0), o0)), tail)
    acc = common.fadd(builder, common.fadd(builder, builder.load(accs[0]), builder.load(accs[1])),
                       builder.load(acc_m))
    return common.fadd(builder, common.hsum(builder, acc), builder.load(tail))

  return codegen


@intrinsic
def row_dot_q4_1_pairs(typingctx, qs, d, m, xqp, dx, xsum):
  """f32: W_row . x_hat of a Q4_1 row, offsets included. qs: u8[D/2]; d, m: u16[D/32] (f16
  bits); xqp: i8[D] in the pair layout (`pair_blocks`); dx, xsum: f32[D/32] (`quantize_x`)."""
  return types.float32(qs, d, m, xqp, dx, xsum), _q4_1_pairs_codegen()


@intrinsic
def row_dot_q4_1_pairs_next(typingctx, qs, d, m, xqp, dx, xsum, next_qs):
  """`row_dot_q4_1_pairs`, prefetching next_qs (u8[D/2], the row read next) over the row."""
  return types.float32(qs, d, m, xqp, dx, xsum, next_qs), _q4_1_pairs_codegen(prefetch=True)


@intrinsic
def row_dot_q4_1_pairs_far(typingctx, qs, d, m, xqp, dx, xsum, next_qs):
  """`row_dot_q4_1_pairs_next` prefetching into L2 (`common.far_rows`)."""
  return (types.float32(qs, d, m, xqp, dx, xsum, next_qs),
          _q4_1_pairs_codegen(prefetch=True, locality=common.LOCALITY_L2))


@intrinsic
def row_dot_q4_0_pairs(typingctx, qs, d, xqp, dx, xsum):
  """f32: W_row . x_hat of a Q4_0 row (w = d (q - 8)) with `row_dot_q4_1_pairs`' kernel, the
  offsets -8 d. qs: u8[D/2] (the blocks' 16 code bytes each, back to back); d: u16[D/32]."""
  return types.float32(qs, d, xqp, dx, xsum), _q4_1_pairs_codegen(q4_0=True)


@intrinsic
def row_dot_q4_0_pairs_far(typingctx, qs, d, xqp, dx, xsum, next_qs):
  """`row_dot_q4_0_pairs`, prefetching next_qs (u8[D/2], the row read next) into L2."""
  return (types.float32(qs, d, xqp, dx, xsum, next_qs),
          _q4_1_pairs_codegen(prefetch=True, locality=common.LOCALITY_L2, q4_0=True))


@intrinsic
def row_dot_q4_0_pairs_next(typingctx, qs, d, xqp, dx, xsum, next_qs):
  """`row_dot_q4_0_pairs`, prefetching next_qs into L1 (rows under `common.far_gather`'s)."""
  return (types.float32(qs, d, xqp, dx, xsum, next_qs),
          _q4_1_pairs_codegen(prefetch=True, q4_0=True))


@intrinsic
def row_dot_q8_0_far(typingctx, q, d, xq, dx, next_q):
  """`row_dot_q8_0_next` prefetching into L2 (`common.far_rows`)."""
  return types.float32(q, d, xq, dx, next_q), _row_dot_codegen(prefetch=True,
                                                                locality=common.LOCALITY_L2)


@intrinsic
def row_dot_q8_0_next(typingctx, q, d, xq, dx, next_q):
  """`row_dot_q8_0`, prefetching next_q (i8[D], the row read next) over the row."""
  return types.float32(q, d, xq, dx, next_q), _row_dot_codegen(prefetch=True)


@intrinsic
def row_dot_q8_0(typingctx, q, d, xq, dx):
  """f32: sum_b d[b] dx[b] <q[32 b:32 b + 32], xq[32 b:32 b + 32]>. q, xq: i8[D]; d: u16[D/32]
  (f16 bits); dx: f32[D/32]."""
  return types.float32(q, d, xq, dx), _row_dot_codegen()


@numba.njit(**common.JIT)
def quantize_x(x):
  """x: f32[b, D] -> (xq: i8[b, D], dx: f32[b, D/32], xsum: f32[b, D/32]).

  Per block of 32: dx = max|x| / 127, xq = rint(x * (1 / dx)) (0 for an all-zero block),
  xsum = dx * sum(xq) (the quantized block's sum, for Q4_1's offset term).
  """
  b, dim = x.shape
  nb = dim // BLOCK
  xq = np.empty((b, dim), np.int8)
  dx = np.empty((b, nb), np.float32)
  xsum = np.empty((b, nb), np.float32)
  for r in range(b):
    for blk in range(nb):
      amax = np.float32(0.0)
      for k in range(BLOCK):
        amax = max(amax, abs(x[r, BLOCK * blk + k]))
      d = amax / np.float32(127.0)
      inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
      isum = 0
      for k in range(BLOCK):
        q = np.int32(np.rint(x[r, BLOCK * blk + k] * inv))
        xq[r, BLOCK * blk + k] = np.int8(q)
        isum += q
      dx[r, blk] = d
      xsum[r, blk] = d * np.float32(isum)
  return xq, dx, xsum


@numba.njit(**common.JIT)
def pair_blocks(xq):
  """xq: i8[b, D] (`quantize_x`) -> i8[b, D] in the layout `row_dot_q4_1_pairs` reads: per
  pair of blocks (p, p + 1), [xq_p[0:16], xq_p+1[0:16], xq_p[16:32], xq_p+1[16:32]], the order
  of a 32-byte Q4_1 code load's low then high nibbles; the last block of an odd count as is."""
  b, dim = xq.shape
  out = xq.copy()
  for r in range(b):
    for o in range(0, (dim // (2 * BLOCK)) * 2 * BLOCK, 2 * BLOCK):
      for k in range(16):
        out[r, o + 16 + k] = xq[r, o + 32 + k]
        out[r, o + 32 + k] = xq[r, o + 16 + k]
  return out


# Rows of at least this many code bytes prefetch the next row spread over the current one
# (`_row_dot_*_next`); shorter rows prefetch a row whole (SHORT_AHEAD). From DRAM, 2
# threads: 7B shapes (Q4_1 11008 x 4096 and 4096 x 4096) 1.12-1.20x faster; SmolLM2's
# 288-byte rows 0.86-0.95x (BUILD_NOTES.md, issue 11).
SPREAD_MIN_BYTES = 1024
# Shorter rows prefetch the codes of the row this many ahead, whole (not their scales). With the
# pair dot (`row_dot_q4_1_pairs`), SmolLM2's [1536, 576] and [960, 576] Q4_1 matvecs from DRAM
# ran 1.25-1.3x faster with 4 rows ahead than with the next row's codes, scales and offsets
# (8 ahead: the same as 4; the scales too: slower; BUILD_NOTES.md, issue 11).
SHORT_AHEAD = 4


@numba.njit(parallel=True, **common.JIT)
def gemv_q4_1(qs, d, m, x, out):
  """out[r, i] = W[i] . x[r] with x quantized per block. qs: u8[n, D/2]; d, m: u16[n, D/32]
  (f16 bits); x: f32[b, D]; out: f32[b, n]."""
  xq, dx, xsum = quantize_x(x)
  xqp = pair_blocks(xq)
  n = qs.shape[0]
  spread = qs.shape[1] >= SPREAD_MIN_BYTES
  far = common.far_rows(x.shape[1], qs.shape[1])
  for i in numba.prange(n):
    if far:  # Long rows: the next row prefetched into L2 (`common.FAR_BYTES`).
      if i + 2 < n:
        common.prefetch_row_l2(d[i + 2])
        common.prefetch_row_l2(m[i + 2])
      nxt = min(i + 1, n - 1)
      for r in range(x.shape[0]):
        out[r, i] = row_dot_q4_1_pairs_far(qs[i], d[i], m[i], xqp[r], dx[r], xsum[r], qs[nxt])
    elif spread:
      if i + 2 < n:
        common.prefetch_row(d[i + 2])
        common.prefetch_row(m[i + 2])
      nxt = min(i + 1, n - 1)
      for r in range(x.shape[0]):
        out[r, i] = row_dot_q4_1_pairs_next(qs[i], d[i], m[i], xqp[r], dx[r], xsum[r], qs[nxt])
    else:
      if i + SHORT_AHEAD < n:
        common.prefetch_row(qs[i + SHORT_AHEAD])
      for r in range(x.shape[0]):
        out[r, i] = row_dot_q4_1_pairs(qs[i], d[i], m[i], xqp[r], dx[r], xsum[r])


@numba.njit(parallel=True, **common.JIT)
def gemv_q8_0(q, d, x, out):
  """out[r, i] = W[i] . x[r] with x quantized per block. q: i8[n, D]; d: u16[n, D/32] (f16
  bits); x: f32[b, D]; out: f32[b, n]."""
  xq, dx, _ = quantize_x(x)
  n = q.shape[0]
  spread = q.shape[1] >= SPREAD_MIN_BYTES
  far = common.far_rows(x.shape[1], q.shape[1])
  for i in numba.prange(n):
    if far:  # As gemv_q4_1.
      if i + 2 < n:
        common.prefetch_row_l2(d[i + 2])
      nxt = min(i + 1, n - 1)
      for r in range(x.shape[0]):
        out[r, i] = row_dot_q8_0_far(q[i], d[i], xq[r], dx[r], q[nxt])
    elif spread:
      if i + 2 < n:
        common.prefetch_row(d[i + 2])
      nxt = min(i + 1, n - 1)
      for r in range(x.shape[0]):
        out[r, i] = row_dot_q8_0_next(q[i], d[i], xq[r], dx[r], q[nxt])
    else:
      if i + SHORT_AHEAD < n:
        common.prefetch_row(q[i + SHORT_AHEAD])
      for r in range(x.shape[0]):
        out[r, i] = row_dot_q8_0(q[i], d[i], xq[r], dx[r])


def quantize_x_reference(x) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """NumPy reference of `quantize_x` (f32 arithmetic as the kernel; round half to even)."""
  x = np.asarray(x, np.float32)
  b, dim = x.shape
  blocks = x.reshape(b, dim // BLOCK, BLOCK)
  dx = (np.abs(blocks).max(-1) / np.float32(127.0)).astype(np.float32)
  with np.errstate(divide="ignore"):
    inv = np.where(dx > 0, np.float32(1.0) / dx, np.float32(0.0)).astype(np.float32)
  xq = np.rint(blocks * inv[..., None]).astype(np.int8)
  xsum = (dx * xq.astype(np.int64).sum(-1).astype(np.float32)).astype(np.float32)
  return xq.reshape(b, dim), dx, xsum


def matmul_reference(kind: str, arrays, x) -> np.ndarray:
  """Float64 NumPy reference of `gemv_q4_1` / `gemv_q8_0`: f32[b, n].

  Weights dequantized by definition (`qmatmul` formats); x replaced by dx * xq from
  `quantize_x_reference` (Q4_1's offset term by its xsum, the same quantized block sums).
  """
  x = np.asarray(x, np.float32)
  xq, dx, xsum = quantize_x_reference(x)
  b, dim = x.shape
  nb = dim // BLOCK
  xhat = (xq.reshape(b, nb, BLOCK).astype(np.float64) * dx[..., None]).reshape(b, dim)
  def widen(bits):  # f16 bits -> f64 values.
    return np.asarray(bits, np.uint16).view(np.float16).astype(np.float64)

  if kind == Q4_1:
    qs, d, m = arrays
    n = qs.shape[0]
    codes = qs.reshape(n, nb, 16).astype(np.int64)
    q = np.concatenate([codes & 15, codes >> 4], axis=2).astype(np.float64)  # [n, nb, 32]
    scaled = (q * widen(d)[..., None]).reshape(n, dim)
    return (xhat @ scaled.T + xsum.astype(np.float64) @ widen(m).T).astype(np.float32)
  q, d = arrays
  n = q.shape[0]
  w = (q.reshape(n, nb, BLOCK).astype(np.float64) * widen(d)[..., None]).reshape(n, dim)
  return (xhat @ w.T).astype(np.float32)
