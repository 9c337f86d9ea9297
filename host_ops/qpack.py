"""Weights repacked 16 rows at a time, and the integer kernels that read them (numba + LLVM IR).

Why (issue 30): a row-at-a-time integer dot spends a multiply (`vpmaddwd`) per 32 weights to
widen or scale each `vpmaddubsw` result, and the AVX2 multiply ports are what bound prefill:
K-quant rows in their file layout ran at 90 G MAC/s on the 2-core EPYC, llama.cpp's repacked
kernels at ~100. Here G = 16 rows are interleaved in 4-byte chunks, so one 32-byte vector holds
4 values of 8 rows, one 4-byte chunk of the activation row is broadcast against it, and the
`vpmaddubsw` results of a whole sub-block (32 values) add up in 16-bit lanes before one
`vpmaddwd` applies the 8 rows' scales: 9 multiplies per 256 MACs instead of 16. Two 8-row
vectors share each broadcast (16 rows), and R <= 4 activation rows share each unpacked weight
vector. Q4_K [11008, 4096] x 128 rows: 188 G MAC/s against 90 in rows and 34 for the f32 tiles
(BUILD_NOTES.md, issue 30). The same layout decodes (R = 1) at the machine's read bandwidth with
the next unit prefetched spread over the current one (31.5 GB/s of file bytes).

Layout (`pack`): a matrix [n, D] (n a multiple of G) becomes u8[n / G, units * UNIT_BYTES[kind]],
row g = rows 16 g .. 16 g + 15, unit after unit (a unit: a K-quant super-block of 256 values or a
block of 32). Inside a unit, fields of the 16 rows side by side (f16 scales as f16[16], 6-bit
scales as u8[8 sub-blocks][16]) and the codes as chunk planes: plane[...][q][row][4 bytes], the
file's code bytes 4q..4q+3 of each row, so a 32-byte load is 4 bytes of rows 0-7 or 8-15.
Exactly the file's bits (nothing rounded again); `unpack_reference` inverts it.
  Q4_K 2368 B: d f16[16], dmin f16[16], sc u8[8][16], mins u8[4 pairs][16][2], qs [4 c][8 q][16][4]
  Q5_K 2880 B: Q4_K's fields, then qh [8 q][16][4] (bit j of byte l: value l of sub-block j)
  Q6_K 3360 B: d f16[16], sc i8[16][16], ql [2 h][2 s][8 q][16][4], qh [2 h][8 q][16][4]
  Q4_0 288 B: d f16[16], qs [4 q][16][4]       Q4_1 320 B: d, m f16[16], qs
  Q5_0 352 B: d, qh u8[4 q][16], qs            Q5_1 384 B: d, m, qh, qs
  Q8_0 544 B: d f16[16], qs [8 q][16][4] (signed codes, byte 4q + e of the row = value 4q + e)
(qh of the 32-value kinds: per chunk q one byte per row, bits 0-3 the 5th bits of values 4q..4q+3,
bits 4-7 of values 16 + 4q ...; the codes' low nibbles are values 0-15, high nibbles 16-31.)

Arithmetic: llama.cpp's pairings. K-quants against x quantized per 256 values (Q8_K: one scale
dk, codes xq, and the sums of xq per 32 and per 16 for the mins and Q6_K's -32 offset), summed
in integers per super-block, then acc += float(isum) * d * dk (and the mins' term); the 32-value
kinds against x quantized per 32 (`qdot.quantize_x`: dx, xq, xsum), acc += float(isum) * d * dx
+ offset * xsum per block. Q8_0's codes are signed: |w| against x with w's sign (`vpsignb`), each
chunk's pair sums widened at once (`vpmaddwd` by ones; two 8-bit products fill a 16-bit lane).
Integer sums are exact (16-bit lanes stay below 2^15: at most 8 4-bit, 4 5-bit or 2 6-bit
products of 2 per lane before `vpmaddwd`), so each output is
W . x_hat up to the order of f32 adds, and that order is per output row and fixed: the same
bits whatever R, the group, the batch or the thread count (batched decode equals one sequence).

Layout per STYLE.md: repack (numba) -> IR emitters -> intrinsics -> drivers (`matmul`) ->
NumPy references (`x_hat_reference`, `matmul_reference`, `unpack_reference`). The activations'
two quantizations are `host_ops.act_quant`'s.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils
from numba.core import types
from numba.extending import intrinsic

from host_ops import common
from host_ops import act_quant
from host_ops import qdot
from host_ops.common import HostOpError
from host_ops.llvm_ir import (F32 as _F32, I8 as _I8, I16 as _I16, I32 as _I32, I64 as _I64,
                              add as _add, const as _const, half_to_float as _half_to_float,
                              load as _load, splat as _splat, vec as _vec, x86 as _x86)

G = 16  # Rows interleaved per group.
Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, Q8_0 = range(8)
KIND_CODES = {"q4_0": Q4_0, "q4_1": Q4_1, "q5_0": Q5_0, "q5_1": Q5_1, "q4_k": Q4_K,
              "q5_k": Q5_K, "q6_k": Q6_K, "q8_0": Q8_0}
KINDS = tuple(KIND_CODES)
K_KINDS = ("q4_k", "q5_k", "q6_k")
# Values per unit, bytes of one row's unit in the file, bytes of a packed unit of G rows.
UNIT_VALUES = {"q4_0": 32, "q4_1": 32, "q5_0": 32, "q5_1": 32, "q4_k": 256, "q5_k": 256,
               "q6_k": 256, "q8_0": 32}
FILE_BYTES = {"q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "q4_k": 144, "q5_k": 176,
              "q6_k": 210, "q8_0": 34}
UNIT_BYTES = {"q4_0": 288, "q4_1": 320, "q5_0": 352, "q5_1": 384, "q4_k": 2368,
              "q5_k": 2880, "q6_k": 3360, "q8_0": 544}
MAX_R = 4  # Activation rows per kernel call.


def packable(kind: str, shape: tuple[int, int]) -> bool:
  """Whether a [n, D] matrix of `kind` ("q4_k", ...) can be packed: a kind of KINDS, n a
  multiple of G, D of the unit."""
  return kind in KIND_CODES and shape[0] % G == 0 and shape[1] % UNIT_VALUES[kind] == 0


# ----------------------------------------------------------------------------- repacking
@numba.njit(inline="always", **common.JIT)
def _put(dst, at, src, lo, n):
  for e in range(n):
    dst[at + e] = src[lo + e]


@numba.njit(inline="always", **common.JIT)
def _k_scale_min(s, j):
  """(scale, min) 6-bit pair j of a Q4_K/Q5_K super-block's 12 scale bytes s (ggml's
  get_scale_min_k4)."""
  if j < 4:
    return s[j] & 63, s[j + 4] & 63
  return (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)


@numba.njit(parallel=True, **common.JIT)
def _pack_kernel(code, raw, out, ub):
  """raw: u8[n, units * FILE_BYTES] -> out: u8[n / G, units * ub] (module docstring); ub:
  UNIT_BYTES of the kind."""
  ng = out.shape[0]
  fb = raw.shape[1] // (out.shape[1] // ub)
  units = raw.shape[1] // fb
  for g in numba.prange(ng):
    dst = out[g]
    for u in range(units):
      o = u * ub
      for k in range(G):
        src = raw[g * G + k]
        s = u * fb
        if code == Q4_K or code == Q5_K:
          _put(dst, o + 2 * k, src, s, 2)
          _put(dst, o + 32 + 2 * k, src, s + 2, 2)
          for j in range(8):
            sc, mn = _k_scale_min(src[s + 4:s + 16], j)
            dst[o + 64 + G * j + k] = sc
            dst[o + 192 + 2 * G * (j // 2) + 2 * k + j % 2] = mn
          qs = s + (48 if code == Q5_K else 16)
          for c in range(4):
            for q in range(8):
              _put(dst, o + 320 + 512 * c + 64 * q + 4 * k, src, qs + 32 * c + 4 * q, 4)
          if code == Q5_K:
            for q in range(8):
              _put(dst, o + 2368 + 64 * q + 4 * k, src, s + 16 + 4 * q, 4)
        elif code == Q6_K:
          _put(dst, o + 2 * k, src, s + 208, 2)
          for m in range(16):
            dst[o + 32 + G * m + k] = src[s + 192 + m]
          for h in range(2):
            for half in range(2):
              for q in range(8):
                _put(dst, o + 288 + 1024 * h + 512 * half + 64 * q + 4 * k, src,
                     s + 64 * h + 32 * half + 4 * q, 4)
            for q in range(8):
              _put(dst, o + 2336 + 512 * h + 64 * q + 4 * k, src, s + 128 + 32 * h + 4 * q, 4)
        elif code == Q8_0:
          _put(dst, o + 2 * k, src, s, 2)
          for q in range(8):
            _put(dst, o + 32 + 64 * q + 4 * k, src, s + 2 + 4 * q, 4)
        else:  # The 32-value kinds: d [m] [qh] qs.
          _put(dst, o + 2 * k, src, s, 2)
          at = 32
          if code == Q4_1 or code == Q5_1:
            _put(dst, o + 32 + 2 * k, src, s + 2, 2)
            at = 64
          head = 2 if code == Q4_0 else (4 if code == Q4_1 else (6 if code == Q5_0 else 8))
          if code == Q5_0 or code == Q5_1:
            qh = s + head - 4
            for q in range(4):
              lo = (src[qh + q // 2] >> (4 * (q % 2))) & 15  # bits 4q..4q+3
              hi = (src[qh + 2 + q // 2] >> (4 * (q % 2))) & 15  # bits 16+4q..
              dst[o + at + G * q + k] = lo | (hi << 4)
            at += 64
          for q in range(4):
            _put(dst, o + at + 64 * q + 4 * k, src, s + head + 4 * q, 4)


def pack(kind: str, raw: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
  """A [n, D] matrix of the file's blocks (raw: u8[n, row bytes]) in the packed layout:
  u8[n / G, units * UNIT_BYTES[kind]], 64-byte aligned (or written into `out`).

  Raises:
    HostOpError: a kind without a packed layout, n not a multiple of G, a bad row size.
  """
  if kind not in KIND_CODES:
    raise HostOpError(f"no packed layout for {kind!r}; packed kinds: {', '.join(KINDS)}")
  raw = np.ascontiguousarray(raw).view(np.uint8)
  n, row_bytes = raw.shape
  if n % G or row_bytes % FILE_BYTES[kind]:
    raise HostOpError(f"pack({kind}): {n} rows of {row_bytes} bytes; need rows a multiple of "
                      f"{G} and whole {FILE_BYTES[kind]}-byte blocks")
  units = row_bytes // FILE_BYTES[kind]
  shape = (n // G, units * UNIT_BYTES[kind])
  if out is None:
    out = common.empty_aligned(shape, np.uint8)
  elif out.shape != shape or out.dtype != np.uint8 or not out.flags.c_contiguous:
    raise HostOpError(f"pack: out must be a C-contiguous u8{list(shape)}")
  common.ensure_host_threads()
  _pack_kernel(KIND_CODES[kind], raw, out, UNIT_BYTES[kind])
  return out


# ----------------------------------------------------------------------------- IR
def _bcast4(bd, p, off):
  """The 4 bytes at p + off (i8*) repeated in <32 x i8>."""
  v = bd.load(bd.bitcast(bd.gep(p, [off]), _I32.as_pointer()), align=4)
  return bd.bitcast(_splat(bd, v, 8), _vec(_I8, 32))


def _pairs16(bd, v8, signed=False):
  """<8 x i8> (one per row) -> <16 x i16> with each value in lanes 2i and 2i + 1."""
  w = bd.sext(v8, _vec(_I16, 8)) if signed else bd.zext(v8, _vec(_I16, 8))
  return bd.shuffle_vector(w, w, _const(_I32, [i // 2 for i in range(16)]))


def _vshift(bd, v, amount, left=False):
  """<32 x i8> shifted per 16-bit lane by a runtime i64 amount (vpsrlw / vpsllw)."""
  v16 = bd.bitcast(v, _vec(_I16, 16))
  n = _splat(bd, bd.trunc(amount, _I16), 16)
  return bd.bitcast(bd.shl(v16, n) if left else bd.lshr(v16, n), _vec(_I8, 32))


class _Ctx:
  """Per-call values shared by the emitters: intrinsics, pointers to the R activation rows of
  this kind's quantization (args: grp, then `act_quant.ACTIVATIONS`, then out, r0, col)."""

  def __init__(self, context, bd, sig, args, R, k_kind):
    self.bd = bd
    arrays = [context.make_array(t)(context, bd, a) for t, a in zip(sig.args[:9], args[:9])]
    grp, xq8, dx, xsum, xqk, dk, bs32, bs16, out = arrays
    self.p = grp.data
    self.r0, self.col = args[9], args[10]
    xq, scales = (xqk, (dk, bs32, bs16)) if k_kind else (xq8, (dx, xsum, xsum))
    self.dim = bd.extract_value(xq.shape, 1)
    self.ncol = bd.extract_value(out.shape, 1)
    self.out = out.data
    self.maddubs = _x86(bd, "llvm.x86.avx2.pmadd.ub.sw", _vec(_I16, 16), [_vec(_I8, 32)] * 2)
    self.maddwd = _x86(bd, "llvm.x86.avx2.pmadd.wd", _vec(_I32, 8), [_vec(_I16, 16)] * 2)
    self.pshufb = _x86(bd, "llvm.x86.avx2.pshuf.b", _vec(_I8, 32), [_vec(_I8, 32)] * 2)
    self.x, self.s1, self.s2, self.s3 = [], [], [], []
    for k in range(R):
      r = bd.add(self.r0, _const(_I64, k))
      self.x.append(bd.gep(xq.data, [bd.mul(r, self.dim)]))
      for lst, a in zip((self.s1, self.s2, self.s3), scales):
        lst.append(bd.gep(a.data, [bd.mul(r, bd.extract_value(a.shape, 1))]))
    # The row's units (256 or 32 values) and the f32 sums of 8 outputs: [R][G // 8].
    self.units = bd.udiv(self.dim, _const(_I64, 256 if k_kind else 32))
    self.acc_f = [[cgutils.alloca_once_value(bd, ir.Constant(_vec(_F32, 8), [0.0] * 8))
                   for _ in range(G // 8)] for _ in range(R)]

  def madd(self, codes, xb):
    return self.bd.call(self.maddubs, [codes, xb])

  def wd(self, a, b):
    return self.bd.call(self.maddwd, [a, b])


_M15 = [15] * 32
_M15V = _const(_I8, _M15)
_ZI16 = ir.Constant(_vec(_I16, 16), [0] * 16)


def _prefetch_spread(bd, p, at, nbytes, ahead):
  """Prefetches nbytes (a multiple of 64) at p + at + ahead: one slice of the next unit per step
  of the current one, so the prefetches never fill the miss buffers at once (the groups of a
  matrix are contiguous; a prefetch past its end does not fault)."""
  for off in range(0, nbytes, 64):
    common.emit_prefetch(bd, bd.gep(p, [_add(bd, at, off + ahead)]), PREFETCH_LOCALITY)


# How many units ahead decode prefetches (a unit is 16 rows x 256 or 32 values): 1 read
# 21.5-25.5 GB/s from DRAM on the 2-core Xeon VM, 2/4/8 read 17.2/15.9/19.4 (BUILD_NOTES).
PREFETCH_UNITS = 1
PREFETCH_LOCALITY = common.LOCALITY_L1  # L2 (prefetcht1), 4 or 8 units ahead: no steady gain.
# Bytes of the next unit each sub-block prefetches: an eighth of a unit in whole lines.
_SLICE = {kind: -(-UNIT_BYTES[kind] // 8 // 64) * 64 for kind in K_KINDS}


def _k_codegen(kind, R, prefetch):
  """IR of out[r0 + k, col:col + 16] = the group's 16 rows . x_hat[r0 + k] for k < R, K-quant
  `kind` against Q8_K activations (args: grp u8[unit bytes * units], xq i8[b, D], dk f32[b,
  D/256], bs32 i16[b, D/32], bs16 i16[b, D/16], out f32[b, n], r0, col)."""
  ub = UNIT_BYTES[kind]
  W = G // 8

  def codegen(context, builder, sig, args):
    bd = builder
    cx = _Ctx(context, bd, sig, args, R, True)
    p, units, acc_f, zi16, m15 = cx.p, cx.units, cx.acc_f, _ZI16, _M15V
    zi32 = ir.Constant(_vec(_I32, 8), [0] * 8)
    sumi_p = [[cgutils.alloca_once_value(bd, zi32) for _ in range(W)] for _ in range(R)]
    with cgutils.for_range(bd, units) as loop:
      u = loop.index
      o = bd.mul(u, _const(_I64, ub))
      xo = bd.mul(u, _const(_I64, 256))
      for k in range(R):
        for w in range(W):
          bd.store(zi32, sumi_p[k][w])
      # Sub-blocks j = 0..7 as an IR loop: one sub-block's accumulators live at a time.
      with cgutils.for_range(bd, _const(_I64, 8)) as jl:
        j = jl.index
        if prefetch:  # One eighth of the next unit per sub-block.
          _prefetch_spread(bd, p, bd.add(o, bd.mul(j, _const(_I64, _SLICE[kind]))),
                           _SLICE[kind], PREFETCH_UNITS * ub)
        xj = bd.add(xo, bd.mul(j, _const(_I64, 32)))
        if kind == "q6_k":
          h = bd.lshr(j, _const(_I64, 2))
          t = bd.and_(j, _const(_I64, 3))
          lo_at = bd.add(o, _add(bd, bd.add(bd.mul(h, _const(_I64, 1024)),
                                             bd.mul(bd.and_(t, _const(_I64, 1)),
                                                    _const(_I64, 512))), 288))
          hi_at = bd.add(o, _add(bd, bd.mul(h, _const(_I64, 512)), 2336))
          lo_shift = bd.mul(bd.lshr(t, _const(_I64, 1)), _const(_I64, 4))
          hi_shift = bd.mul(t, _const(_I64, 2))
          scales = [[_pairs16(bd, _load(bd, p, bd.add(o, bd.add(
              _const(_I64, 32 + 8 * w), bd.mul(bd.add(bd.mul(j, _const(_I64, 2)),
                                                   _const(_I64, m)), _const(_I64, G)))),
              _vec(_I8, 8)), signed=True) for w in range(W)] for m in range(2)]
        else:
          c = bd.lshr(j, _const(_I64, 1))
          lo_at = bd.add(o, _add(bd, bd.mul(c, _const(_I64, 512)), 320))
          lo_shift = bd.mul(bd.and_(j, _const(_I64, 1)), _const(_I64, 4))
          scales = [[_pairs16(bd, _load(bd, p, bd.add(o, _add(bd, bd.mul(j, _const(_I64, G)),
                                                              64 + 8 * w)), _vec(_I8, 8)))
                     for w in range(W)]] * 2
        limit = {"q4_k": 8, "q5_k": 4, "q6_k": 2}[kind]  # maddubs per 16-bit lane sum.
        acc16 = [[zi16] * W for _ in range(R)]
        for q in range(8):
          codes = []
          for w in range(W):
            raw = _load(bd, p, _add(bd, lo_at, 64 * q + 32 * w), _vec(_I8, 32))
            v = bd.and_(_vshift(bd, raw, lo_shift), m15)
            if kind == "q5_k":
              qh = _load(bd, p, bd.add(o, _const(_I64, 2368 + 64 * q + 32 * w)), _vec(_I8, 32))
              bit = bd.and_(_vshift(bd, qh, j), _const(_I8, [1] * 32))
              v = bd.or_(v, _vshift(bd, bit, _const(_I64, 4), left=True))
            elif kind == "q6_k":
              qh = _load(bd, p, _add(bd, hi_at, 64 * q + 32 * w), _vec(_I8, 32))
              two = bd.and_(_vshift(bd, qh, hi_shift), _const(_I8, [3] * 32))
              v = bd.or_(v, _vshift(bd, two, _const(_I64, 4), left=True))
            codes.append(v)
          for k in range(R):
            xb = _bcast4(bd, cx.x[k], _add(bd, xj, 4 * q))
            for w in range(W):
              acc16[k][w] = bd.add(acc16[k][w], cx.madd(codes[w], xb))
          if (q + 1) % limit == 0:  # Flush the 16-bit sums through the scales.
            for w in range(W):
              s16 = scales[q // 4][w]
              for k in range(R):
                bd.store(bd.add(bd.load(sumi_p[k][w]), cx.wd(acc16[k][w], s16)), sumi_p[k][w])
                acc16[k][w] = zi16
      # Per super-block: the mins (Q4_K/Q5_K) or Q6_K's -32 offset, then the f32 scale.
      for w in range(W):
        if kind == "q6_k":
          d8 = _half_to_float(bd, _load(bd, p, _add(bd, o, 16 * w), _vec(_I16, 8)))
          pairs = []
          for pp in range(8):
            a = _load(bd, p, _add(bd, o, 32 + G * 2 * pp + 8 * w), _vec(_I8, 8))
            b = _load(bd, p, _add(bd, o, 32 + G * (2 * pp + 1) + 8 * w), _vec(_I8, 8))
            ab = bd.shuffle_vector(a, b, _const(_I32, [i // 2 + 8 * (i % 2) for i in range(16)]))
            pairs.append(bd.sext(ab, _vec(_I16, 16)))
        else:
          d8 = _half_to_float(bd, _load(bd, p, _add(bd, o, 16 * w), _vec(_I16, 8)))
          dmin8 = _half_to_float(bd, _load(bd, p, _add(bd, o, 32 + 16 * w), _vec(_I16, 8)))
          pairs = [bd.zext(_load(bd, p, _add(bd, o, 192 + 2 * G * pp + 16 * w), _vec(_I8, 16)),
                           _vec(_I16, 16)) for pp in range(4)]
        for k in range(R):
          dk = _splat(bd, bd.load(bd.gep(cx.s1[k], [u])), 8)
          off = zi32
          sums = cx.s3[k] if kind == "q6_k" else cx.s2[k]  # i16 sums per 16 / per 32
          per = 8 if kind == "q6_k" else 4
          for pp in range(per):
            at = bd.add(bd.mul(u, _const(_I64, 2 * per)), _const(_I64, 2 * pp))
            two = bd.load(bd.bitcast(bd.gep(sums, [at]), _I32.as_pointer()), align=4)
            off = bd.add(off, cx.wd(pairs[pp], bd.bitcast(_splat(bd, two, 8), _vec(_I16, 16))))
          sumi = bd.load(sumi_p[k][w])
          acc = bd.load(acc_f[k][w])
          if kind == "q6_k":
            sumi = bd.sub(sumi, bd.shl(off, ir.Constant(_vec(_I32, 8), [5] * 8)))
            acc = common.fma(bd, bd.sitofp(sumi, _vec(_F32, 8)), common.fmul(bd, d8, dk), acc)
          else:
            acc = common.fma(bd, bd.sitofp(sumi, _vec(_F32, 8)), common.fmul(bd, d8, dk), acc)
            acc = common.fma(bd, bd.sitofp(off, _vec(_F32, 8)),
                              bd.fneg(common.fmul(bd, dmin8, dk)), acc)
          bd.store(acc, acc_f[k][w])
    _store_rows(bd, cx, acc_f, R, W)
    return context.get_dummy_value()

  return codegen


def _store_rows(bd, cx, acc_f, R, W):
  for k in range(R):
    row = bd.mul(bd.add(cx.r0, _const(_I64, k)), cx.ncol)
    for w in range(W):
      dst = bd.gep(cx.out, [bd.add(row, _add(bd, cx.col, 8 * w))])
      bd.store(bd.load(acc_f[k][w]), bd.bitcast(dst, _vec(_F32, 8).as_pointer()), align=4)


_HI_BITS = [1 << (i % 4) for i in range(32)]
# vpshufb indices: byte i of a code vector is row i // 4's (lane-local: the qh bytes of rows
# 0-7 sit in both 128-bit halves).
_ROW_OF_BYTE = [i // 4 for i in range(32)]


def _b32_codegen(kind, R, prefetch):
  """IR of the 32-value kinds (Q4_0, Q4_1, Q5_0, Q5_1) against per-32 activations: args grp,
  xq i8[b, D], dx f32[b, D/32], xsum f32[b, D/32], (unused) f32[b, *], out, r0, col."""
  ub = UNIT_BYTES[kind]
  W = G // 8
  five = kind in ("q5_0", "q5_1")
  with_min = kind in ("q4_1", "q5_1")
  qs_at = {"q4_0": 32, "q4_1": 64, "q5_0": 96, "q5_1": 128}[kind]
  qh_at = {"q5_0": 32, "q5_1": 64}.get(kind)
  center = {"q4_0": 8.0, "q5_0": 16.0}.get(kind)

  def codegen(context, builder, sig, args):
    bd = builder
    cx = _Ctx(context, bd, sig, args, R, False)
    p, units, acc_f, zi16, m15 = cx.p, cx.units, cx.acc_f, _ZI16, _M15V
    ones = ir.Constant(_vec(_I16, 16), [1] * 16)
    with cgutils.for_range(bd, units) as loop:
      u = loop.index
      o = bd.mul(u, _const(_I64, ub))
      if prefetch:
        _prefetch_spread(bd, p, o, -(-ub // 64) * 64, PREFETCH_UNITS * ub)
      xo = bd.mul(u, _const(_I64, 32))
      acc16 = [[zi16] * W for _ in range(R)]
      isum = [[None] * W for _ in range(R)]
      for q in range(4):
        halves = []
        for w in range(W):
          raw = _load(bd, p, _add(bd, o, qs_at + 64 * q + 32 * w), _vec(_I8, 32))
          lo = bd.and_(raw, m15)
          hi = bd.and_(bd.lshr(raw, _const(_I8, [4] * 32)), m15)
          if five:  # The row's qh byte of this chunk to its 4 lanes, then bit -> 16.
            qb = bd.load(bd.bitcast(bd.gep(p, [_add(bd, o, qh_at + G * q + 8 * w)]),
                                    _I64.as_pointer()), align=1)
            qv = bd.bitcast(_splat(bd, qb, 4), _vec(_I8, 32))
            qv = bd.call(cx.pshufb, [qv, _const(_I8, _ROW_OF_BYTE)])
            for i, m in enumerate((_HI_BITS, [b << 4 for b in _HI_BITS])):
              mv = _const(_I8, [v - 256 if v > 127 else v for v in m])
              hit = bd.icmp_unsigned("==", bd.and_(qv, mv), mv)
              bit = bd.select(hit, _const(_I8, [16] * 32), _const(_I8, [0] * 32))
              if i == 0:
                lo = bd.or_(lo, bit)
              else:
                hi = bd.or_(hi, bit)
          halves.append((lo, hi))
        for k in range(R):
          xlo = _bcast4(bd, cx.x[k], _add(bd, xo, 4 * q))
          xhi = _bcast4(bd, cx.x[k], _add(bd, xo, 16 + 4 * q))
          for w in range(W):
            lo, hi = halves[w]
            acc16[k][w] = bd.add(acc16[k][w], bd.add(cx.madd(lo, xlo), cx.madd(hi, xhi)))
        if (five and q % 2 == 1) or q == 3:  # 4 products of 5-bit codes per lane at most.
          for k in range(R):
            for w in range(W):
              part = cx.wd(acc16[k][w], ones)
              isum[k][w] = part if isum[k][w] is None else bd.add(isum[k][w], part)
              acc16[k][w] = zi16
      for w in range(W):
        d8 = _half_to_float(bd, _load(bd, p, _add(bd, o, 16 * w), _vec(_I16, 8)))
        if with_min:
          off8 = _half_to_float(bd, _load(bd, p, _add(bd, o, 32 + 16 * w), _vec(_I16, 8)))
        else:
          off8 = common.fmul(bd, d8, ir.Constant(_vec(_F32, 8), [-center] * 8))
        for k in range(R):
          dx = _splat(bd, bd.load(bd.gep(cx.s1[k], [u])), 8)
          xs = _splat(bd, bd.load(bd.gep(cx.s2[k], [u])), 8)
          acc = bd.load(acc_f[k][w])
          acc = common.fma(bd, bd.sitofp(isum[k][w], _vec(_F32, 8)), common.fmul(bd, d8, dx),
                            acc)
          acc = common.fma(bd, off8, xs, acc)
          bd.store(acc, acc_f[k][w])
    _store_rows(bd, cx, acc_f, R, W)
    return context.get_dummy_value()

  return codegen


def _q8_codegen(kind, R, prefetch):
  """IR of Q8_0 against per-32 activations (args as `_b32_codegen`). Signed codes: vpmaddubsw
  takes |w| (unsigned) against x with w's sign (vpsignb), and each chunk's 16-bit pair sums
  (up to 2 x 128 x 127) go straight through `vpmaddwd` by ones: 16 multiplies per 256 MACs."""
  del kind
  ub = UNIT_BYTES["q8_0"]
  W = G // 8

  def codegen(context, builder, sig, args):
    bd = builder
    cx = _Ctx(context, bd, sig, args, R, False)
    p, units, acc_f = cx.p, cx.units, cx.acc_f
    ones = ir.Constant(_vec(_I16, 16), [1] * 16)
    zero = ir.Constant(_vec(_I8, 32), [0] * 32)
    psign = _x86(bd, "llvm.x86.avx2.psign.b", _vec(_I8, 32), [_vec(_I8, 32)] * 2)
    with cgutils.for_range(bd, units) as loop:
      u = loop.index
      o = bd.mul(u, _const(_I64, ub))
      if prefetch:
        _prefetch_spread(bd, p, o, -(-ub // 64) * 64, PREFETCH_UNITS * ub)
      xo = bd.mul(u, _const(_I64, 32))
      isum = [[None] * W for _ in range(R)]
      for q in range(8):
        codes = []
        for w in range(W):
          v = _load(bd, p, _add(bd, o, 32 + 64 * q + 32 * w), _vec(_I8, 32))
          codes.append((bd.select(bd.icmp_signed("<", v, zero), bd.neg(v), v), v))
        for k in range(R):
          xb = _bcast4(bd, cx.x[k], _add(bd, xo, 4 * q))
          for w in range(W):
            mag, sgn = codes[w]
            part = cx.wd(cx.madd(mag, bd.call(psign, [xb, sgn])), ones)
            isum[k][w] = part if isum[k][w] is None else bd.add(isum[k][w], part)
      for w in range(W):
        d8 = _half_to_float(bd, _load(bd, p, _add(bd, o, 16 * w), _vec(_I16, 8)))
        for k in range(R):
          dx = _splat(bd, bd.load(bd.gep(cx.s1[k], [u])), 8)
          acc = bd.load(acc_f[k][w])
          acc = common.fma(bd, bd.sitofp(isum[k][w], _vec(_F32, 8)), common.fmul(bd, d8, dx),
                            acc)
          bd.store(acc, acc_f[k][w])
    _store_rows(bd, cx, acc_f, R, W)
    return context.get_dummy_value()

  return codegen


def _make(kind, R, prefetch):
  gen = _k_codegen if kind in K_KINDS else (_q8_codegen if kind == "q8_0" else _b32_codegen)

  def impl(typingctx, grp, xq8, dx, xsum, xqk, dk, bs32, bs16, out, r0, col):
    sig = types.void(grp, xq8, dx, xsum, xqk, dk, bs32, bs16, out, r0, col)
    return sig, gen(kind, R, prefetch)

  impl.__name__ = f"_group_{kind}_r{R}{'_pf' if prefetch else ''}"
  return intrinsic(impl)


# One intrinsic per kind and row count R (1..MAX_R); each reads one group and R activation rows
# and prefetches the next unit (spread; it costs nothing measurable in the tiled product).
_q4_0_1, _q4_0_2, _q4_0_3, _q4_0_4 = (_make("q4_0", r, True) for r in range(1, 5))
_q4_1_1, _q4_1_2, _q4_1_3, _q4_1_4 = (_make("q4_1", r, True) for r in range(1, 5))
_q5_0_1, _q5_0_2, _q5_0_3, _q5_0_4 = (_make("q5_0", r, True) for r in range(1, 5))
_q5_1_1, _q5_1_2, _q5_1_3, _q5_1_4 = (_make("q5_1", r, True) for r in range(1, 5))
_q4_k_1, _q4_k_2, _q4_k_3, _q4_k_4 = (_make("q4_k", r, True) for r in range(1, 5))
_q5_k_1, _q5_k_2, _q5_k_3, _q5_k_4 = (_make("q5_k", r, True) for r in range(1, 5))
_q6_k_1, _q6_k_2, _q6_k_3, _q6_k_4 = (_make("q6_k", r, True) for r in range(1, 5))
_q8_0_1, _q8_0_2, _q8_0_3, _q8_0_4 = (_make("q8_0", r, True) for r in range(1, 5))


# Groups per parallel tile when many activation rows are multiplied: a tile's weights (8 groups
# of a 7B Q4_K row: 8 x 38 KB) stay in L2 while each block of R rows (in L1) passes over them.
GEMM_TILE = 8
# Up to this many activation rows each group is read once and multiplied with all of them in
# blocks of R (decode, batched decode); above it, tiles (prefill).
STREAM_MAX_ROWS = 8


def _driver(k1, k2, k3, k4):
  """A parallel matmul over one kind's groups with its four R-row kernels."""

  @numba.njit(parallel=True, **common.JIT)
  def run(packed, xa, out, col0):
    ng = packed.shape[0]
    b = out.shape[0]
    tile = 1 if b <= STREAM_MAX_ROWS else GEMM_TILE
    for t in numba.prange((ng + tile - 1) // tile):
      lo = t * tile
      hi = min(lo + tile, ng)
      r = 0
      while r < b:
        R = min(MAX_R, b - r)
        for g in range(lo, hi):
          a = (packed[g],) + xa + (out, r, col0 + G * g)
          if R == 4:
            k4(*a)
          elif R == 3:
            k3(*a)
          elif R == 2:
            k2(*a)
          else:
            k1(*a)
        r += R

  return run


# One driver per kind (one kind's code per parallel region: a dispatch over all kinds inside
# the loop body ran Q4_K at 103 instead of 180 G MAC/s).
_matmul_q4_0 = _driver(_q4_0_1, _q4_0_2, _q4_0_3, _q4_0_4)
_matmul_q4_1 = _driver(_q4_1_1, _q4_1_2, _q4_1_3, _q4_1_4)
_matmul_q5_0 = _driver(_q5_0_1, _q5_0_2, _q5_0_3, _q5_0_4)
_matmul_q5_1 = _driver(_q5_1_1, _q5_1_2, _q5_1_3, _q5_1_4)
_matmul_q4_k = _driver(_q4_k_1, _q4_k_2, _q4_k_3, _q4_k_4)
_matmul_q5_k = _driver(_q5_k_1, _q5_k_2, _q5_k_3, _q5_k_4)
_matmul_q6_k = _driver(_q6_k_1, _q6_k_2, _q6_k_3, _q6_k_4)
_matmul_q8_0 = _driver(_q8_0_1, _q8_0_2, _q8_0_3, _q8_0_4)


@numba.njit(**common.JIT)
def matmul_kernel(code, packed, xa, out, col0):
  """out[:, col0 + G g + i] = row G g + i of the packed matrix (kind `code`) . x_hat, every group
  g. packed: u8[n / G, units * unit bytes]; xa: `act_quant.ACTIVATIONS`; out: f32[b,
  >= col0 + n]. Parallel over groups, each read once for up to STREAM_MAX_ROWS activation rows
  (blocks of R <= MAX_R); above that, tiles of GEMM_TILE groups."""
  if code == Q4_K:
    _matmul_q4_k(packed, xa, out, col0)
  elif code == Q6_K:
    _matmul_q6_k(packed, xa, out, col0)
  elif code == Q5_K:
    _matmul_q5_k(packed, xa, out, col0)
  elif code == Q4_0:
    _matmul_q4_0(packed, xa, out, col0)
  elif code == Q4_1:
    _matmul_q4_1(packed, xa, out, col0)
  elif code == Q5_0:
    _matmul_q5_0(packed, xa, out, col0)
  elif code == Q8_0:
    _matmul_q8_0(packed, xa, out, col0)
  else:
    _matmul_q5_1(packed, xa, out, col0)


# The K-quant half of the activations, never read by the 32-value kinds' kernels (one set, not
# four arrays per call: the LM head calls `matmul` once per decoded token).
_NO_K_ACTIVATIONS = (np.zeros((1, 1), np.int8), np.zeros((1, 1), np.float32),
                     np.zeros((1, 1), np.int16), np.zeros((1, 1), np.int16))


def matmul(kind: str, packed: np.ndarray, x, out: np.ndarray | None = None) -> np.ndarray:
  """x_hat @ W.T for a packed [n, D] matrix: x f32[b, D] -> f32[b, n] (x quantized as the kind
  reads it: `act_quant.quantize_k` for the K-quants, `quantize_32` else).

  Raises:
    HostOpError: an unknown kind, or x / packed of sizes that do not match.
  """
  if kind not in KIND_CODES:
    raise HostOpError(f"no packed layout for {kind!r}; packed kinds: {', '.join(KINDS)}")
  if packed.ndim != 2 or packed.shape[1] % UNIT_BYTES[kind]:
    raise HostOpError(f"packed {kind} matrix of shape {packed.shape}: rows must be whole "
                      f"{UNIT_BYTES[kind]}-byte units")
  x, squeeze = common.prepare_x(x, packed.shape[1] // UNIT_BYTES[kind] * UNIT_VALUES[kind])
  n = packed.shape[0] * G
  if out is None:
    out = np.empty((x.shape[0], n), np.float32)
  common.ensure_host_threads()
  b = x.shape[0]
  if kind not in K_KINDS and b <= STREAM_MAX_ROWS:
    # Few rows (decode's LM head): x quantized serially, the same bits as `quantize_32`, so a
    # call is one parallel region, not two. On a busy 2-core machine each region waits for a
    # descheduled thread: Q8_0 [11008, 4096] at b = 1 ran 1.4 against the row kernel's 10.3.
    xa = qdot.quantize_x(x) + _NO_K_ACTIVATIONS
  else:
    xa = act_quant.activations(x, kind not in K_KINDS, kind in K_KINDS)
  matmul_kernel(KIND_CODES[kind], packed, xa, out, 0)
  return out[0] if squeeze else out


# ----------------------------------------------------------------------------- references
def unpack_reference(kind: str, packed: np.ndarray) -> np.ndarray:
  """The file's blocks u8[n, units * FILE_BYTES] back from a packed matrix (NumPy, from the
  layout in the module docstring; `pack`'s inverse)."""
  ub, fb = UNIT_BYTES[kind], FILE_BYTES[kind]
  ng = packed.shape[0]
  units = packed.shape[1] // ub
  pk = packed.reshape(ng, units, ub)
  out = np.zeros((ng, G, units, fb), np.uint8)

  def plane(at, *dims):  # [ng, units, *dims, G, 4] -> [ng, G, units, *dims, 4]
    size = int(np.prod(dims)) * G * 4
    a = pk[:, :, at:at + size].reshape(ng, units, *dims, G, 4)
    return np.moveaxis(a, -2, 1)

  def per_row(at, nbytes):  # f16[G] fields: [ng, units, G, nbytes] -> [ng, G, units, nbytes]
    return np.moveaxis(pk[:, :, at:at + G * nbytes].reshape(ng, units, G, nbytes), 2, 1)

  if kind in ("q4_k", "q5_k"):
    out[..., 0:2] = per_row(0, 2)
    out[..., 2:4] = per_row(32, 2)
    sc = np.moveaxis(pk[:, :, 64:192].reshape(ng, units, 8, G), 3, 1)  # [ng, G, units, 8]
    mn = np.moveaxis(pk[:, :, 192:320].reshape(ng, units, 4, G, 2), 3, 1).reshape(
        ng, G, units, 8)
    s = np.zeros(sc.shape[:-1] + (12,), np.uint8)  # ggml's 12-byte 6-bit packing.
    s[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    s[..., 4:8] = (mn[..., 0:4] & 63) | ((mn[..., 4:8] >> 4) << 6)
    s[..., 8:12] = (sc[..., 4:8] & 15) | ((mn[..., 4:8] & 15) << 4)
    out[..., 4:16] = s
    qs_at = 48 if kind == "q5_k" else 16
    out[..., qs_at:qs_at + 128] = plane(320, 4, 8).reshape(ng, G, units, 128)
    if kind == "q5_k":
      out[..., 16:48] = plane(2368, 8).reshape(ng, G, units, 32)
  elif kind == "q6_k":
    out[..., 208:210] = per_row(0, 2)
    out[..., 192:208] = np.moveaxis(pk[:, :, 32:288].reshape(ng, units, 16, G), 3, 1)
    out[..., 0:128] = plane(288, 2, 2, 8).reshape(ng, G, units, 128)
    out[..., 128:192] = plane(2336, 2, 8).reshape(ng, G, units, 64)
  elif kind == "q8_0":
    out[..., 0:2] = per_row(0, 2)
    out[..., 2:34] = plane(32, 8).reshape(ng, G, units, 32)
  else:
    out[..., 0:2] = per_row(0, 2)
    at, head = 32, {"q4_0": 2, "q4_1": 4, "q5_0": 6, "q5_1": 8}[kind]
    if kind in ("q4_1", "q5_1"):
      out[..., 2:4] = per_row(32, 2)
      at = 64
    if kind in ("q5_0", "q5_1"):
      b = np.moveaxis(pk[:, :, at:at + 4 * G].reshape(ng, units, 4, G), 3, 1).astype(np.uint32)
      lo = sum((b[..., q] & 15) << (4 * q) for q in range(4))
      hi = sum((b[..., q] >> 4) << (16 + 4 * q) for q in range(4))
      out[..., head - 4:head] = (lo | hi).astype("<u4")[..., None].view(np.uint8)
      at += 4 * G
    out[..., head:head + 16] = plane(at, 4).reshape(ng, G, units, 16)
  return out.reshape(ng * G, units * fb)
