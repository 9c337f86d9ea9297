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

Needs AVX2 (every x86-64 CPU since 2013); `AVAILABLE` is False elsewhere and callers keep the
f32 kernels of `host_ops.qmatmul`. Layout per STYLE.md: intrinsics -> numba kernels ->
NumPy references (`quantize_x_reference`, `matmul_reference`).
"""

from __future__ import annotations

import platform

import llvmlite.binding
import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils
from numba.core import types
from numba.extending import intrinsic

from host_ops import _common
from host_ops import qblocks

BLOCK = 32
Q4_1 = "q4_1"
Q8_0 = "q8_0"


def _host_has_avx2() -> bool:
  if platform.machine().lower() not in ("x86_64", "amd64"):
    return False
  try:
    return bool(llvmlite.binding.get_host_cpu_features().get("avx2"))
  except RuntimeError:  # No feature list on this host: do not guess.
    return False


# Whether the integer kernels can run here. numba compiles for the host CPU, so an intrinsic is
# only ever emitted where the CPU has it.
AVAILABLE = _host_has_avx2()

_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()


def _vec(t, n):
  return ir.VectorType(t, n)


def _x86(builder, name, ret, args):
  return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _load(builder, base, offset, ty):
  """An unaligned load of vector type `ty` at base + offset (elements of base's type)."""
  return builder.load(builder.bitcast(builder.gep(base, [offset]), ty.as_pointer()), align=1)


def _row_dot_codegen(q4, prefetch=False):
  """LLVM IR of sum_b d[b] dx[b] <w_b, xq_b> over one row (see the module docstring). With
  `prefetch`, a fifth argument is the next row's codes, one cache line of which is prefetched
  per 64 code bytes read here: spread over the row, so the prefetches never fill the core's
  miss buffers at once as a whole-row prefetch does."""

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
    bytes_per_block = 16 if q4 else 32
    with cgutils.for_range(builder, nb) as loop:
      b = loop.index
      if prefetch:  # The next row's line at this block's offset, once per 64 bytes.
        per_line = ir.Constant(b.type, 64 // bytes_per_block - 1)
        first = builder.icmp_unsigned("==", builder.and_(b, per_line), ir.Constant(b.type, 0))
        with builder.if_then(first):
          _common.emit_prefetch(builder, builder.gep(
              np_, [builder.mul(b, ir.Constant(b.type, bytes_per_block))]))
      x = _load(builder, xp, builder.mul(b, ir.Constant(b.type, 32)), _vec(_I8, 32))
      if q4:  # 16 bytes: low nibbles are values 0..15 of the block, high nibbles 16..31.
        raw = _load(builder, wp, builder.mul(b, ir.Constant(b.type, 16)), _vec(_I8, 16))
        lo = builder.and_(raw, ir.Constant(_vec(_I8, 16), [15] * 16))
        hi = builder.lshr(raw, ir.Constant(_vec(_I8, 16), [4] * 16))
        w = builder.shuffle_vector(lo, hi, ir.Constant(_vec(_I32, 32), list(range(32))))
      else:  # s8 x s8: vpmaddubsw wants one unsigned side, so |w| and x with w's sign.
        w = _load(builder, wp, builder.mul(b, ir.Constant(b.type, 32)), _vec(_I8, 32))
        w, x = builder.call(psign, [w, w]), builder.call(psign, [x, w])
      isum = builder.call(maddwd, [builder.call(maddubs, [w, x]), ones])
      # d holds f16 bits (as the file): widened here, one vcvtph2ps per block with F16C.
      d_b = qblocks._half_to_float(builder, builder.load(builder.gep(dp, [b])))
      scale = builder.fmul(d_b, builder.load(builder.gep(sp, [b])))
      splat = builder.shuffle_vector(
          builder.insert_element(ir.Constant(_vec(_F32, 8), ir.Undefined), scale,
                                 ir.Constant(_I32, 0)),
          ir.Constant(_vec(_F32, 8), ir.Undefined), lanes)
      acc = builder.load(acc_p)
      builder.store(builder.fadd(acc, builder.fmul(builder.sitofp(isum, _vec(_F32, 8)), splat)),
                    acc_p)
    acc = builder.load(acc_p)
    parts = [builder.extract_element(acc, ir.Constant(_I32, k)) for k in range(8)]
    while len(parts) > 1:  # Pairwise: a fixed order, so results are reproducible.
      parts = [builder.fadd(parts[k], parts[k + 1]) for k in range(0, len(parts), 2)]
    return parts[0]

  return codegen


@intrinsic
def _row_dot_q4_1(typingctx, qs, d, xq, dx):
  """f32: sum_b d[b] dx[b] <nibbles of qs[16 b:16 b + 16], xq[32 b:32 b + 32]>.
  qs: u8[D/2]; d: u16[D/32] (f16 bits); xq: i8[D]; dx: f32[D/32] (all contiguous)."""
  return types.float32(qs, d, xq, dx), _row_dot_codegen(q4=True)


@intrinsic
def _row_dot_q4_1_next(typingctx, qs, d, xq, dx, next_qs):
  """`_row_dot_q4_1`, prefetching next_qs (u8[D/2], the row read next) over the row."""
  return types.float32(qs, d, xq, dx, next_qs), _row_dot_codegen(q4=True, prefetch=True)


@intrinsic
def _row_dot_q8_0_next(typingctx, q, d, xq, dx, next_q):
  """`_row_dot_q8_0`, prefetching next_q (i8[D], the row read next) over the row."""
  return types.float32(q, d, xq, dx, next_q), _row_dot_codegen(q4=False, prefetch=True)


@intrinsic
def _row_dot_q8_0(typingctx, q, d, xq, dx):
  """f32: sum_b d[b] dx[b] <q[32 b:32 b + 32], xq[32 b:32 b + 32]>. q, xq: i8[D]; d: u16[D/32]
  (f16 bits); dx: f32[D/32]."""
  return types.float32(q, d, xq, dx), _row_dot_codegen(q4=False)


@numba.njit(**_common._JIT)
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


@numba.njit(inline="always", **_common._JIT)
def offset_dot(m_row, xsum_row):
  """sum_b m_row[b] * xsum_row[b]: Q4_1's offset term against the quantized block sums (m_row:
  u16 f16 bits; one loop; fastmath lets LLVM vectorize the reduction: four hand-split partial
  sums ran SmolLM2 decode ~12% slower)."""
  s = np.float32(0.0)
  for b in range(m_row.shape[0]):
    s += qblocks.f16_to_f32(m_row[b]) * xsum_row[b]
  return s


# Rows of at least this many code bytes prefetch the next row spread over the current one
# (`_row_dot_*_next`); shorter rows prefetch the next row whole at its start. From DRAM, 2
# threads: 7B shapes (Q4_1 11008 x 4096 and 4096 x 4096) 1.12-1.20x faster; SmolLM2's
# 288-byte rows 0.86-0.95x (BUILD_NOTES.md, issue 11).
SPREAD_MIN_BYTES = 1024


@numba.njit(parallel=True, **_common._JIT)
def gemv_q4_1(qs, d, m, x, out):
  """out[r, i] = W[i] . x[r] with x quantized per block. qs: u8[n, D/2]; d, m: u16[n, D/32]
  (f16 bits); x: f32[b, D]; out: f32[b, n]."""
  xq, dx, xsum = quantize_x(x)
  n = qs.shape[0]
  spread = qs.shape[1] >= SPREAD_MIN_BYTES
  for i in numba.prange(n):
    if spread:
      if i + 2 < n:
        _common.prefetch_row(d[i + 2])
        _common.prefetch_row(m[i + 2])
      nxt = min(i + 1, n - 1)
      for r in range(x.shape[0]):
        out[r, i] = _row_dot_q4_1_next(qs[i], d[i], xq[r], dx[r], qs[nxt]) + offset_dot(
            m[i], xsum[r])
    else:
      if i + 1 < n:
        _common.prefetch_row(qs[i + 1])
      for r in range(x.shape[0]):
        out[r, i] = _row_dot_q4_1(qs[i], d[i], xq[r], dx[r]) + offset_dot(m[i], xsum[r])


@numba.njit(parallel=True, **_common._JIT)
def gemv_q8_0(q, d, x, out):
  """out[r, i] = W[i] . x[r] with x quantized per block. q: i8[n, D]; d: u16[n, D/32] (f16
  bits); x: f32[b, D]; out: f32[b, n]."""
  xq, dx, _ = quantize_x(x)
  n = q.shape[0]
  spread = q.shape[1] >= SPREAD_MIN_BYTES
  for i in numba.prange(n):
    if spread:
      if i + 2 < n:
        _common.prefetch_row(d[i + 2])
      nxt = min(i + 1, n - 1)
      for r in range(x.shape[0]):
        out[r, i] = _row_dot_q8_0_next(q[i], d[i], xq[r], dx[r], q[nxt])
    else:
      if i + 1 < n:
        _common.prefetch_row(q[i + 1])
      for r in range(x.shape[0]):
        out[r, i] = _row_dot_q8_0(q[i], d[i], xq[r], dx[r])


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
