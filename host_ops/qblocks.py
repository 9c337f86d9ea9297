"""ggml's block formats read in place: a row's dot product and dequantization (numba + LLVM IR).

Why: a GGUF's Q4_0 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K / F16 / BF16 matrices are used from the
file's own bytes (a view of its memory map: no re-quantization, no f32 copy, RSS near the file
size); f16 scales are decoded inside the loop, per block. numba's own vectorizer finds no good
shape for these loops (numba widens every integer to int64, and it cannot prove that a block's
bytes and the output do not alias, so unrolled block loops stay scalar. Q4_0 f32 gemv,
[1536, 576], one thread (CPU time), throwaway A/B: a numba loop per block 3.5 G weights/s,
eight blocks fused 5.7, dequantize-then-dot 3.0, the IR below 14.9); so the row loops are
LLVM vector IR (portable vector types and llvm.fmuladd; the integer dot uses x86 AVX2
intrinsics, as `host_ops.qdot`).

Formats (ggml's `block_*` structs, little-endian; gguf-py's `gguf.quants` is the reference; a row
of D values is D / values-per-block consecutive blocks):
  Q4_0  32 values, 18 bytes: f16 d, 16 bytes qs.  v[k] = d * (nib[k] - 8), nib[k] = qs[k] & 15
        for k < 16, qs[k - 16] >> 4 for k >= 16 (the nibble order of every 32-value format).
  Q4_1  32 values, 20 bytes: f16 d, f16 m, 16 bytes qs.  v[k] = d * nib[k] + m.
  Q8_0  32 values, 34 bytes: f16 d, 32 int8 q.  v[k] = d * q[k].
  (Q4_1 and Q8_0 rows are read here in the file's layout for the host decoder's weight pool;
  `qmatmul.QMatrix` keeps them split into codes and scales, `host_ops.qdot`.)
  Q5_0  32 values, 22 bytes: f16 d, u32 qh, 16 bytes qs.  v[k] = d * ((nib[k] | qh_k << 4) - 16),
        qh_k = bit k of qh.
  Q5_1  32 values, 24 bytes: f16 d, f16 m, u32 qh, qs.  v[k] = d * (nib[k] | qh_k << 4) + m.
  Q4_K  256 values, 144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) pairs for the 8
        sub-blocks of 32 (`_k_scale_min`), 128 bytes qs.  Sub-block 2c (2c + 1) takes the low
        (high) nibbles of qs[32 c:32 c + 32]; v = d * sc_j * q - dmin * m_j.
  Q5_K  256 values, 176 bytes: d, dmin, 12 scale bytes, 32 bytes qh, 128 bytes qs: as Q4_K with
        bit j of qh[l] as bit 4 of value l of sub-block j.
  Q6_K  256 values, 210 bytes: 128 bytes ql, 64 bytes qh, 16 int8 scales (one per 16 values),
        f16 d (last).  Per half h (128 values): value 32 t + l (t < 4, l < 32) has low 4 bits
        from ql[64 h + 32 (t & 1) + l] (low nibble for t < 2, high for t >= 2) and high 2 bits
        (qh[32 h + l] >> 2 t) & 3; v = d * scales[8 h + 2 t + l // 16] * (q - 32).
  F16, BF16  one value per 2 bytes (BF16: the top half of an f32).

Every format is emitted as units (a block, a super-block, or 32 values of F16/BF16) of 32-value
groups: integer codes (<32 x i8>), a scale (per group, or per 16 values for Q6_K) and, for Q5_1
/ Q4_K / Q5_K, an offset.
  f32 dot (`_row_dot_*`): per group t = codes . x in 16 lanes, then acc += t * scale (one
    multiply by the scale per 32 values), even and odd groups in two accumulators; the offsets
    go against the block sums of x (`block_sums`) in a separate sum. One horizontal sum per row
    in a fixed order: reproducible results.
  int8 dot (`_row_dot_int8_*`, `row_dot_int8`): x quantized per 32 values as
    `qdot.quantize_x`, integer block dots (vpmaddubsw / vpmaddwd), the product W . x_hat.
  dequantization (`_row_dequant_*`): codes * scale + offset, the order of gguf's dequantizer;
    every product before the last rounding is exact in f32, so the values are gguf's f32
    values bit for bit.
Throughput (b = 1, `QMatrix.matmul`, G weights/s f32 / int8, 2 threads on a shared 2-core
Xeon with AVX-512 (dev machine), [1536, 576] (K-quants [1536, 512]) in cache; [4096, 11008]
copies cycled from DRAM): Q4_0 23/36, 20/24; Q5_0 22/31, 16/18; Q5_1 20/31, 14/17; Q4_K
23/41, 26/27; Q5_K 22/37, 22/22; Q6_K 21/29, 18/21; F16 30, 14; BF16 29, 14; the existing Q4_1
kernels 18/37, 16/23. One thread (CPU time, in cache): about half of the in-cache figures.

f16 -> f32: `fpext half` (vcvtph2ps) where the CPU has F16C, else integer bit manipulation
(`llvm_ir.half_to_float(hw=False)`, exact for zeros, subnormals, inf and NaN); both are tested
on all 65536 halves.

The kernels in `host_ops.qmatmul` inline this module's IR; numba's on-disk cache keys them on
every host_ops source (`host_ops._cache`), so an edit here recompiles them.

Layout per STYLE.md: IR helpers (the shared ones in `host_ops.llvm_ir`) -> per-format unit
emitters -> intrinsics (`_row_dot_*`, `_row_dot_int8_*`, `_row_dequant_*`, one table) ->
`row_dot` / `row_dot_int8` / `row_dequant` (dispatch on a kind code; the parallel kernels are in
`host_ops.qmatmul_kernels`, the NumPy references in `host_ops.qmatmul`).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils
from numba.core import types
from numba.extending import intrinsic

from host_ops import common
from host_ops.llvm_ir import HAS_F16C  # noqa: F401 (API: whether f16 converts in hardware)
from host_ops.llvm_ir import (F32 as _F32, I8 as _I8, I16 as _I16, I32 as _I32, I64 as _I64,
                              add as _add, bf16_to_float as _bf16_to_float, const as _const,
                              fmuladd as _fmuladd, half_to_float as _half_to_float,
                              load as _load, splat as _splat, vec as _vec, x86 as _x86)

# Kind codes for the numba dispatch (strings cannot select a branch cheaply inside a kernel).
Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, F16, BF16, Q4_1, Q8_0 = range(10)
KIND_CODES = {"q4_0": Q4_0, "q5_0": Q5_0, "q5_1": Q5_1, "q4_k": Q4_K, "q5_k": Q5_K, "q4_1": Q4_1,
              "q8_0": Q8_0,
              "q6_k": Q6_K, "f16": F16, "bf16": BF16}
# (values per block, bytes per block) as stored in GGUF; F16/BF16 rows are read FLOAT_UNIT
# values at a time by the vector loop and the remainder (D % FLOAT_UNIT) in numba.
GEOMETRY = {"q4_0": (32, 18), "q4_1": (32, 20), "q8_0": (32, 34), "q5_0": (32, 22),
            "q5_1": (32, 24), "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210),
            "f16": (1, 2), "bf16": (1, 2)}
GROUP = 32  # Values per group: the lanes of one accumulator, and the block of `block_sums`.
FLOAT_UNIT = 64


def _f16_at(bd, p, off):
  return _half_to_float(bd, _load(bd, p, off, _I16))


def _nibbles(bd, raw):
  """<m x i8> bytes -> (low nibbles, high nibbles), each <m x i8>."""
  m = raw.type.count
  return (bd.and_(raw, _const(_I8, [15] * m)), bd.lshr(raw, _const(_I8, [4] * m)))


def _concat(bd, a, b):
  m = a.type.count
  return bd.shuffle_vector(a, b, _const(_I32, list(range(2 * m))))


def _bits_to_16(bd, qh32):
  """u32 qh -> <32 x i8>: 16 in lane k where bit k of qh is set, else 0 (Q5_0 / Q5_1)."""
  rep = bd.shuffle_vector(bd.bitcast(qh32, _vec(_I8, 4)), ir.Constant(_vec(_I8, 4), ir.Undefined),
                          _const(_I32, [k // 8 for k in range(32)]))
  hit = bd.and_(rep, _const(_I8, [(1 << (k % 8)) - (256 if k % 8 == 7 else 0)
                                  for k in range(32)]))
  return bd.select(bd.icmp_unsigned("!=", hit, _const(_I8, [0] * 32)), _const(_I8, [16] * 32),
                   _const(_I8, [0] * 32))


def _bit_field(bd, v, lo, width, to):
  """Bits [lo, lo + width) of each byte of v moved to bit `to` (<32 x i8>)."""
  if lo > to:
    v = bd.lshr(v, _const(_I8, [lo - to] * 32))
  elif lo < to:
    v = bd.shl(v, _const(_I8, [to - lo] * 32))
  mask = ((1 << width) - 1) << to
  return bd.and_(v, _const(_I8, [mask - 256 if mask > 127 else mask] * 32))


class _Lane:
  """Lane `lane` of a float vector (a scale or offset shared by a group's 32 values)."""

  def __init__(self, vec, lane):
    self.vec, self.lane = vec, lane


class _Group:
  """32 values of a unit.

  codes: <32 x i8> integers (or <32 x float> values for F16/BF16). scale: None (1), a float, a
  _Lane, or a pair of them (values 0-15, 16-31: Q6_K's scales of 16). offset: None, a float or a
  _Lane (added after the scale). start: the index of the group's first value in its unit.
  """

  def __init__(self, codes, scale, offset, start):
    self.codes, self.scale, self.offset, self.start = codes, scale, offset, start


class _Unit:
  """The groups of one unit; offsets8: <8 x float>, the offsets of its 8 groups as one vector
  (Q4_K/Q5_K: the dot sums them against 8 block sums of x at once), or None."""

  def __init__(self, groups, offsets8=None):
    self.groups, self.offsets8 = groups, offsets8


def _bcast(bd, s, n):
  """A float, _Lane or vector (returned as is) as <n x float>."""
  if isinstance(s, _Lane):
    return bd.shuffle_vector(s.vec, s.vec, _const(_I32, [s.lane] * n))
  if isinstance(s.type, ir.VectorType):
    return s
  return _splat(bd, s, n)


def _centered(bd, codes, d, center, unsigned):
  """A group of codes - center (Q4_0, Q5_0) with scale d; unsigned: the codes as they are and
  the offset -center * d instead (the same values, exactly: d * code and center * d are exact
  in f32), which lets the integer dot skip the sign transfer."""
  if unsigned:
    return _Group(codes, d, common.fmul(bd, d, ir.Constant(_F32, -float(center))), 0)
  return _Group(bd.sub(codes, _const(_I8, [center] * 32)), d, None, 0)


def _q4_0_unit(bd, p, o, unsigned=False):
  lo, hi = _nibbles(bd, _load(bd, p, _add(bd, o, 2), _vec(_I8, 16)))
  return _Unit([_centered(bd, _concat(bd, lo, hi), _f16_at(bd, p, o), 8, unsigned)])


def _q4_1_unit(bd, p, o, unsigned=False):
  """Q4_1 as the file stores it (f16 d, f16 m, 16 bytes qs): v = d * nib + m."""
  lo, hi = _nibbles(bd, _load(bd, p, _add(bd, o, 4), _vec(_I8, 16)))
  return _Unit([_Group(_concat(bd, lo, hi), _f16_at(bd, p, o), _f16_at(bd, p, _add(bd, o, 2)),
                       0)])


def _q8_0_unit(bd, p, o, unsigned=False):
  """Q8_0 as the file stores it (f16 d, 32 signed codes): v = d * q."""
  return _Unit([_Group(_load(bd, p, _add(bd, o, 2), _vec(_I8, 32)), _f16_at(bd, p, o), None, 0)])


def _q5_unit(bd, p, o, with_min, unsigned=False):
  """Q5_0 (with_min False) or Q5_1."""
  head = 4 if with_min else 2
  qh = _load(bd, p, _add(bd, o, head), _I32)
  lo, hi = _nibbles(bd, _load(bd, p, _add(bd, o, head + 4), _vec(_I8, 16)))
  codes = bd.or_(_concat(bd, lo, hi), _bits_to_16(bd, qh))
  if not with_min:
    return _Unit([_centered(bd, codes, _f16_at(bd, p, o), 16, unsigned)])
  return _Unit([_Group(codes, _f16_at(bd, p, o), _f16_at(bd, p, _add(bd, o, 2)), 0)])


def _k_scale_min(bd, p, o):
  """The 8 (scale, min) 6-bit pairs of a Q4_K/Q5_K super-block at o (12 bytes from o + 4) as two
  <8 x i8>: j < 4: s[j] & 63, s[j + 4] & 63; j >= 4: (s[j + 4] & 15) | (s[j - 4] >> 6) << 4,
  (s[j + 4] >> 4) | (s[j] >> 6) << 4 (ggml's `get_scale_min_k4`). Reads 16 bytes (the last 4
  are codes of the same block, unused)."""
  s = _load(bd, p, _add(bd, o, 4), _vec(_I8, 16))

  def pick(idx):
    return bd.shuffle_vector(s, s, _const(_I32, idx))

  def c(v):
    return _const(_I8, [v] * 8)

  first = bd.icmp_unsigned("<", _const(_I8, list(range(8))), c(4))
  a = pick([0, 1, 2, 3, 8, 9, 10, 11])
  b = pick([4, 5, 6, 7, 8, 9, 10, 11])
  sc_hi = bd.shl(bd.lshr(pick([0, 1, 2, 3, 0, 1, 2, 3]), c(6)), c(4))
  mn_hi = bd.shl(bd.lshr(pick([4, 5, 6, 7, 4, 5, 6, 7]), c(6)), c(4))
  sc = bd.select(first, bd.and_(a, c(63)), bd.or_(bd.and_(a, c(15)), sc_hi))
  mn = bd.select(first, bd.and_(b, c(63)), bd.or_(bd.lshr(b, c(4)), mn_hi))
  return sc, mn


def _k_unit(bd, p, o, five, unsigned=False):
  """Q4_K (five False) or Q5_K super-block: 8 groups, scale d * sc_j, offset -dmin * m_j."""
  sc, mn = _k_scale_min(bd, p, o)
  scales = common.fmul(bd, bd.uitofp(sc, _vec(_F32, 8)), _splat(bd, _f16_at(bd, p, o), 8))
  offsets = bd.fneg(common.fmul(bd, bd.uitofp(mn, _vec(_F32, 8)),
                            _splat(bd, _f16_at(bd, p, _add(bd, o, 2)), 8)))
  qs_at = 48 if five else 16
  qh = _load(bd, p, _add(bd, o, 16), _vec(_I8, 32)) if five else None
  groups = []
  for c in range(4):
    lo, hi = _nibbles(bd, _load(bd, p, _add(bd, o, qs_at + 32 * c), _vec(_I8, 32)))
    for half, codes in enumerate((lo, hi)):
      j = 2 * c + half
      if five:
        codes = bd.or_(codes, _bit_field(bd, qh, j, 1, 4))
      groups.append(_Group(codes, _Lane(scales, j), _Lane(offsets, j), 32 * j))
  return _Unit(groups, offsets)


def _q6_k_unit(bd, p, o, unsigned=False):
  d = _f16_at(bd, p, _add(bd, o, 208))
  # <16 x float>: d * the scale of each 16 values.
  scales = common.fmul(bd, bd.sitofp(_load(bd, p, _add(bd, o, 192), _vec(_I8, 16)),
                                      _vec(_F32, 16)), _splat(bd, d, 16))
  groups = []
  for h in range(2):
    ql = [_load(bd, p, _add(bd, o, 64 * h + 32 * k), _vec(_I8, 32)) for k in range(2)]
    qh = _load(bd, p, _add(bd, o, 128 + 32 * h), _vec(_I8, 32))
    for t in range(4):
      low = _nibbles(bd, ql[t & 1])[t >> 1]
      codes = bd.sub(bd.or_(low, _bit_field(bd, qh, 2 * t, 2, 4)), _const(_I8, [32] * 32))
      first = 8 * h + 2 * t
      groups.append(_Group(codes, (_Lane(scales, first), _Lane(scales, first + 1)), None,
                           128 * h + 32 * t))
  return _Unit(groups)


def _float16_unit(bd, p, o, convert):
  """F16 / BF16: 64 values (two groups, so the dot has two accumulator chains)."""
  return _Unit([_Group(convert(bd, _load(bd, p, _add(bd, o, 64 * k), _vec(_I16, 32))), None,
                       None, 32 * k) for k in range(2)])


# kind -> (values per unit, bytes per unit, unit emitter(builder, row i8*, unit byte offset,
# unsigned: Q4_0/Q5_0 codes without their center, see `_centered`)).
_UNITS = {
    "q4_0": (32, 18, _q4_0_unit),
    "q5_0": (32, 22, lambda bd, p, o, unsigned=False: _q5_unit(bd, p, o, False, unsigned)),
    "q5_1": (32, 24, lambda bd, p, o, unsigned=False: _q5_unit(bd, p, o, True)),
    "q4_1": (32, 20, _q4_1_unit),
    "q8_0": (32, 34, _q8_0_unit),
    "q4_k": (256, 144, lambda bd, p, o, unsigned=False: _k_unit(bd, p, o, five=False)),
    "q5_k": (256, 176, lambda bd, p, o, unsigned=False: _k_unit(bd, p, o, five=True)),
    "q6_k": (256, 210, _q6_k_unit),
    "f16": (FLOAT_UNIT, 2 * FLOAT_UNIT,
            lambda bd, p, o, unsigned=False: _float16_unit(bd, p, o, _half_to_float)),
    "bf16": (FLOAT_UNIT, 2 * FLOAT_UNIT,
             lambda bd, p, o, unsigned=False: _float16_unit(bd, p, o, _bf16_to_float)),
}


def _halves(bd, v):
  """<2m x T> -> (first m lanes, last m lanes)."""
  m = v.type.count // 2
  return (bd.shuffle_vector(v, v, _const(_I32, list(range(m)))),
          bd.shuffle_vector(v, v, _const(_I32, list(range(m, 2 * m)))))


def _float_codes(bd, g):
  """A group's codes as <32 x float>."""
  if isinstance(g.codes.type.element, ir.FloatType):
    return g.codes
  return bd.sitofp(g.codes, _vec(_F32))


def _row_dot_codegen(kind):
  """IR of a row's dot with x. Per group: t = codes[:16] * x[:16] + codes[16:] * x[16:] (16
  lanes), acc += t * scale (one multiply by the scale per 32 values, not per value); offsets
  add offset * xsum[group] into a second sum. Units: len(x) // values per unit."""
  values, nbytes, emit = _UNITS[kind]

  def codegen(context, builder, signature, args):
    bd = builder
    row, x, xsum = (context.make_array(t)(context, bd, a) for t, a in zip(signature.args, args))
    units = bd.udiv(bd.extract_value(x.shape, 0), _const(_I64, values))
    # Two accumulators, even and odd groups: a super-block's 8 groups are two dependency chains.
    acc_ps = [cgutils.alloca_once_value(bd, ir.Constant(_vec(_F32, 16), [0.0] * 16))
              for _ in range(2)]
    bias_p = cgutils.alloca_once_value(bd, ir.Constant(_vec(_F32, 8), [0.0] * 8))
    bias1_p = cgutils.alloca_once_value(bd, ir.Constant(_F32, 0.0))
    with cgutils.for_range(bd, units) as loop:
      base = bd.mul(loop.index, _const(_I64, values))
      unit = emit(bd, row.data, bd.mul(loop.index, _const(_I64, nbytes)))
      accs = [bd.load(acc_p) for acc_p in acc_ps]
      for k, g in enumerate(unit.groups):
        acc = accs[k % 2]
        q_lo, q_hi = _halves(bd, _float_codes(bd, g))
        at = _add(bd, base, g.start)
        x_lo = _load(bd, x.data, at, _vec(_F32, 16))
        x_hi = _load(bd, x.data, _add(bd, at, 16), _vec(_F32, 16))
        if isinstance(g.scale, tuple):  # One scale per 16 values.
          acc = _fmuladd(bd, common.fmul(bd, q_lo, x_lo), _bcast(bd, g.scale[0], 16), acc)
          acc = _fmuladd(bd, common.fmul(bd, q_hi, x_hi), _bcast(bd, g.scale[1], 16), acc)
        elif g.scale is None:
          acc = _fmuladd(bd, q_hi, x_hi, _fmuladd(bd, q_lo, x_lo, acc))
        else:
          t = _fmuladd(bd, q_hi, x_hi, common.fmul(bd, q_lo, x_lo))
          acc = _fmuladd(bd, t, _bcast(bd, g.scale, 16), acc)
        accs[k % 2] = acc
      for acc_p, acc in zip(acc_ps, accs):
        bd.store(acc, acc_p)
      sums_at = bd.udiv(base, _const(_I64, GROUP))
      if unit.offsets8 is not None:  # 8 groups' offsets against 8 block sums of x.
        sums = _load(bd, xsum.data, sums_at, _vec(_F32, 8))
        bd.store(_fmuladd(bd, unit.offsets8, sums, bd.load(bias_p)), bias_p)
      elif any(g.offset is not None for g in unit.groups):  # One group per unit (Q5_1).
        (g,) = unit.groups
        s = bd.load(bd.gep(xsum.data, [sums_at]))
        bd.store(_fmuladd(bd, g.offset, s, bd.load(bias1_p)), bias1_p)
    acc = common.fadd(bd, bd.load(acc_ps[0]), bd.load(acc_ps[1]))
    total = common.fadd(bd, common.hsum(bd, acc), common.hsum(bd, bd.load(bias_p)))
    return common.fadd(bd, total, bd.load(bias1_p))

  return codegen


def _row_dequant_codegen(kind):
  """IR of out[v] = codes * scale + offset for the len(out) // values-per-unit units of a row."""
  values, nbytes, emit = _UNITS[kind]

  def codegen(context, builder, signature, args):
    bd = builder
    row, out = (context.make_array(t)(context, bd, a) for t, a in zip(signature.args, args))
    units = bd.udiv(bd.extract_value(out.shape, 0), _const(_I64, values))
    with cgutils.for_range(bd, units) as loop:
      base = bd.mul(loop.index, _const(_I64, values))
      for g in emit(bd, row.data, bd.mul(loop.index, _const(_I64, nbytes))).groups:
        vals = _float_codes(bd, g)
        if isinstance(g.scale, tuple):
          lo, hi = _halves(bd, vals)
          vals = _concat(bd, common.fmul(bd, lo, _bcast(bd, g.scale[0], 16)),
                         common.fmul(bd, hi, _bcast(bd, g.scale[1], 16)))
        elif g.scale is not None:
          vals = common.fmul(bd, vals, _bcast(bd, g.scale, 32))
        if g.offset is not None:
          vals = common.fadd(bd, vals, _bcast(bd, g.offset, 32))
        ptr = bd.gep(out.data, [_add(bd, base, g.start)])
        bd.store(vals, bd.bitcast(ptr, _vec(_F32).as_pointer()), align=1)
    return context.get_dummy_value()

  return codegen


# Kinds whose codes are signed in the integer dot (Q6_K, -32..31; the others' are 0..31, Q4_0
# and Q5_0 with their center as an offset): the integer dot moves their sign to x.
_SIGNED_CODES = ("q6_k", "q8_0")
INT8_KINDS = ("q4_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "q4_1", "q8_0")


def _row_dot_int8_codegen(kind):
  """IR of a row's dot with x quantized per 32 values (`qdot.quantize_x`: xq, dx, xsum).

  Per group: isum = sum codes * xq in integers (vpmaddubsw: u8 x s8 pairs -> i16, then
  vpmaddwd with ones -> 8 x i32; signed codes give their sign to xq with vpsignb, as
  `qdot.row_dot_q8_0`), acc += float(isum) * scale * dx[group] in 8 lanes; offsets as the f32
  dot, against xsum (the quantized block sums: the product is W . x_hat exactly, up to f32
  rounding). |code| <= 32 and |xq| <= 127, so a pair sum fits i16 (2 * 32 * 127 = 8128).
  """
  values, nbytes, emit = _UNITS[kind]
  signed = kind in _SIGNED_CODES

  def codegen(context, builder, signature, args):
    bd = builder
    row, xq, dx, xsum = (context.make_array(t)(context, bd, a)
                         for t, a in zip(signature.args, args))
    units = bd.udiv(bd.extract_value(xq.shape, 0), _const(_I64, values))
    maddubs = _x86(bd, "llvm.x86.avx2.pmadd.ub.sw", _vec(_I16, 16), [_vec(_I8, 32)] * 2)
    maddwd = _x86(bd, "llvm.x86.avx2.pmadd.wd", _vec(_I32, 8), [_vec(_I16, 16)] * 2)
    psign = _x86(bd, "llvm.x86.avx2.psign.b", _vec(_I8, 32), [_vec(_I8, 32)] * 2)
    ones = _const(_I16, [1] * 16)
    acc_ps = [cgutils.alloca_once_value(bd, ir.Constant(_vec(_F32, 8), [0.0] * 8))
              for _ in range(2)]
    bias_p = cgutils.alloca_once_value(bd, ir.Constant(_vec(_F32, 8), [0.0] * 8))
    bias1_p = cgutils.alloca_once_value(bd, ir.Constant(_F32, 0.0))
    with cgutils.for_range(bd, units) as loop:
      base = bd.mul(loop.index, _const(_I64, values))
      sums_at = bd.udiv(base, _const(_I64, GROUP))
      unit = emit(bd, row.data, bd.mul(loop.index, _const(_I64, nbytes)), unsigned=True)
      dx8 = _load(bd, dx.data, sums_at, _vec(_F32, 8)) if len(unit.groups) == 8 else None
      scaled = {}  # A unit's <8 x float> scale vector times its 8 dx, made once.
      accs = [bd.load(acc_p) for acc_p in acc_ps]
      for k, g in enumerate(unit.groups):
        xv = _load(bd, xq.data, _add(bd, base, g.start), _vec(_I8, 32))
        w = g.codes
        if signed:
          w, xv = bd.call(psign, [w, w]), bd.call(psign, [xv, w])
        isum = bd.sitofp(bd.call(maddwd, [bd.call(maddubs, [w, xv]), ones]), _vec(_F32, 8))
        if isinstance(g.scale, _Lane) and dx8 is not None:  # Q4_K/Q5_K: lane j, group j.
          vec = scaled.setdefault(id(g.scale.vec), common.fmul(bd, g.scale.vec, dx8))
          scale = _bcast(bd, _Lane(vec, g.scale.lane), 8)
        elif isinstance(g.scale, tuple) and dx8 is not None:  # Q6_K: lanes 2j, 2j + 1, group j.
          first, second = g.scale
          if id(first.vec) not in scaled:
            dx16 = bd.shuffle_vector(dx8, dx8, _const(_I32, [lane // 2 for lane in range(16)]))
            scaled[id(first.vec)] = common.fmul(bd, first.vec, dx16)
          vec = scaled[id(first.vec)]
          scale = bd.shuffle_vector(vec, vec, _const(_I32, [first.lane] * 4 + [second.lane] * 4))
        else:
          dxg = bd.load(bd.gep(dx.data, [_add(bd, sums_at, g.start // GROUP)]))
          if isinstance(g.scale, tuple):  # i32 lanes 0-3: values 0-15; 4-7: values 16-31.
            first, second = g.scale
            pair = bd.shuffle_vector(first.vec, first.vec,
                                     _const(_I32, [first.lane] * 4 + [second.lane] * 4))
            scale = common.fmul(bd, pair, _splat(bd, dxg, 8))
          else:
            scale = _splat(bd, common.fmul(bd, g.scale, dxg), 8)
        accs[k % 2] = _fmuladd(bd, isum, scale, accs[k % 2])
      for acc_p, acc in zip(acc_ps, accs):
        bd.store(acc, acc_p)
      if unit.offsets8 is not None:
        sums = _load(bd, xsum.data, sums_at, _vec(_F32, 8))
        bd.store(_fmuladd(bd, unit.offsets8, sums, bd.load(bias_p)), bias_p)
      elif any(g.offset is not None for g in unit.groups):
        (g,) = unit.groups
        s = bd.load(bd.gep(xsum.data, [sums_at]))
        bd.store(_fmuladd(bd, g.offset, s, bd.load(bias1_p)), bias1_p)
    acc = common.fadd(bd, bd.load(acc_ps[0]), bd.load(acc_ps[1]))
    total = common.fadd(bd, common.hsum(bd, acc), common.hsum(bd, bd.load(bias_p)))
    return common.fadd(bd, total, bd.load(bias1_p))

  return codegen


def _typed(ret, make_codegen, kind, *arrays):
  """(ret(*arrays), make_codegen(kind)) when every array is contiguous 1-D, else None."""
  if not all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in arrays):
    return None
  return ret(*arrays), make_codegen(kind)


def _row_intrinsic(name, kind, make_codegen, ret, n_args):
  """The intrinsic `name` over n_args contiguous 1-D arrays (2: row, out; 3: row, x, xsum; 4:
  row, xq, dx, xsum): ret(*arrays), the IR make_codegen(kind). numba lowers a typing function's
  *args as one tuple argument, so each arity is spelled out."""
  if n_args == 2:
    def typer(typingctx, a, b):
      return _typed(ret, make_codegen, kind, a, b)
  elif n_args == 3:
    def typer(typingctx, a, b, c):
      return _typed(ret, make_codegen, kind, a, b, c)
  else:
    def typer(typingctx, a, b, c, d):
      return _typed(ret, make_codegen, kind, a, b, c, d)
  typer.__name__ = name
  return intrinsic(typer)


# _row_dot_<kind>(row, x, xsum) -> f32: row u8[row bytes]; x f32[D]; xsum f32[D / 32]
# (`block_sums`): the dot of the row's first D // values-per-unit units with x.
(_row_dot_q4_0, _row_dot_q5_0, _row_dot_q5_1, _row_dot_q4_k, _row_dot_q5_k, _row_dot_q6_k,
 _row_dot_q4_1, _row_dot_q8_0, _row_dot_f16, _row_dot_bf16) = (
     _row_intrinsic(f"_row_dot_{k}", k, _row_dot_codegen, types.float32, 3)
     for k in ("q4_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "q4_1", "q8_0", "f16", "bf16"))
# _row_dequant_<kind>(row, out): out f32[D] (contiguous) gets the first D // values-per-unit units.
(_row_dequant_q4_0, _row_dequant_q5_0, _row_dequant_q5_1, _row_dequant_q4_k, _row_dequant_q5_k,
 _row_dequant_q6_k, _row_dequant_q4_1, _row_dequant_q8_0, _row_dequant_f16,
 _row_dequant_bf16) = (
     _row_intrinsic(f"_row_dequant_{k}", k, _row_dequant_codegen, types.void, 2)
     for k in ("q4_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "q4_1", "q8_0", "f16", "bf16"))
# _row_dot_int8_<kind>(row, xq, dx, xsum) -> f32: xq i8[D], dx, xsum f32[D / 32]
# (`qdot.quantize_x` of one row of x). x86 AVX2 only (qdot.AVAILABLE): compiled only when a
# kernel that calls them is.
(_row_dot_int8_q4_0, _row_dot_int8_q5_0, _row_dot_int8_q5_1, _row_dot_int8_q4_k,
 _row_dot_int8_q5_k, _row_dot_int8_q6_k, _row_dot_int8_q4_1, _row_dot_int8_q8_0) = (
     _row_intrinsic(f"_row_dot_int8_{k}", k, _row_dot_int8_codegen, types.float32, 4)
     for k in INT8_KINDS)


def _scalar_sig(hw):
  def make(typingctx, bits):
    if not isinstance(bits, types.Integer):
      return None

    def codegen(context, builder, signature, args):
      v = args[0]
      v = builder.trunc(v, _I16) if v.type.width > 16 else (
          builder.zext(v, _I16) if v.type.width < 16 else v)
      return _half_to_float(builder, v, hw) if hw is not None else _bf16_to_float(builder, v)

    return types.float32(bits), codegen

  return make


@intrinsic
def f16_to_f32(typingctx, bits):
  """f32 value of the f16 with these bits (the low 16 bits of any integer)."""
  return _scalar_sig(HAS_F16C)(typingctx, bits)


@intrinsic
def f16_to_f32_soft(typingctx, bits):
  """`f16_to_f32` by integer bit manipulation (the path of CPUs without F16C; tested here)."""
  return _scalar_sig(False)(typingctx, bits)


@intrinsic
def bf16_to_f32(typingctx, bits):
  """f32 value of the bf16 with these bits (the low 16 bits of any integer)."""
  return _scalar_sig(None)(typingctx, bits)


@numba.njit(inline="always", **common.JIT)
def _u16_at(row, j):
  """Element j of a row of 16-bit values stored as bytes (little-endian)."""
  return np.int64(row[2 * j]) | (np.int64(row[2 * j + 1]) << 8)


@numba.njit(**common.JIT)
def block_sums(x):
  """x: f32[b, D] -> f32[b, D // 32]: the sum of each 32-value group (the offset terms)."""
  b, dim = x.shape
  sums = np.empty((b, dim // GROUP), np.float32)
  for r in range(b):
    for g in range(dim // GROUP):
      s = np.float32(0.0)
      for k in range(GROUP):
        s += x[r, GROUP * g + k]
      sums[r, g] = s
  return sums


@numba.njit(inline="always", **common.JIT)
def row_dot(code, row, x, xsum):
  """f32: row . x for a row of kind `code` (u8[row bytes]); x: f32[D]; xsum: f32[D // 32]."""
  if code == Q4_0:
    return _row_dot_q4_0(row, x, xsum)
  if code == Q5_0:
    return _row_dot_q5_0(row, x, xsum)
  if code == Q5_1:
    return _row_dot_q5_1(row, x, xsum)
  if code == Q4_K:
    return _row_dot_q4_k(row, x, xsum)
  if code == Q5_K:
    return _row_dot_q5_k(row, x, xsum)
  if code == Q6_K:
    return _row_dot_q6_k(row, x, xsum)
  if code == Q4_1:
    return _row_dot_q4_1(row, x, xsum)
  if code == Q8_0:
    return _row_dot_q8_0(row, x, xsum)
  acc = _row_dot_f16(row, x, xsum) if code == F16 else _row_dot_bf16(row, x, xsum)
  for j in range(x.shape[0] // FLOAT_UNIT * FLOAT_UNIT, x.shape[0]):  # F16/BF16: any D.
    v = f16_to_f32(_u16_at(row, j)) if code == F16 else bf16_to_f32(_u16_at(row, j))
    acc += v * x[j]
  return acc


@numba.njit(inline="always", **common.JIT)
def row_dequant(code, row, out):
  """out: f32[D] = the row of kind `code` (u8[row bytes]) as f32."""
  if code == Q4_0:
    _row_dequant_q4_0(row, out)
  elif code == Q5_0:
    _row_dequant_q5_0(row, out)
  elif code == Q5_1:
    _row_dequant_q5_1(row, out)
  elif code == Q4_K:
    _row_dequant_q4_k(row, out)
  elif code == Q5_K:
    _row_dequant_q5_k(row, out)
  elif code == Q6_K:
    _row_dequant_q6_k(row, out)
  elif code == Q4_1:
    _row_dequant_q4_1(row, out)
  elif code == Q8_0:
    _row_dequant_q8_0(row, out)
  else:
    if code == F16:
      _row_dequant_f16(row, out)
    else:
      _row_dequant_bf16(row, out)
    for j in range(out.shape[0] // FLOAT_UNIT * FLOAT_UNIT, out.shape[0]):
      out[j] = f16_to_f32(_u16_at(row, j)) if code == F16 else bf16_to_f32(_u16_at(row, j))


@numba.njit(inline="always", **common.JIT)
def row_dot_int8(code, row, xq, dx, xsum):
  """f32: row . x_hat for a row of a kind of INT8_KINDS (`code`); x_hat = dx * xq per 32 values
  (`qdot.quantize_x`: xq i8[D], dx and xsum f32[D // 32])."""
  if code == Q4_0:
    return _row_dot_int8_q4_0(row, xq, dx, xsum)
  if code == Q5_0:
    return _row_dot_int8_q5_0(row, xq, dx, xsum)
  if code == Q5_1:
    return _row_dot_int8_q5_1(row, xq, dx, xsum)
  if code == Q4_K:
    return _row_dot_int8_q4_k(row, xq, dx, xsum)
  if code == Q5_K:
    return _row_dot_int8_q5_k(row, xq, dx, xsum)
  if code == Q4_1:
    return _row_dot_int8_q4_1(row, xq, dx, xsum)
  if code == Q8_0:
    return _row_dot_int8_q8_0(row, xq, dx, xsum)
  return _row_dot_int8_q6_k(row, xq, dx, xsum)
