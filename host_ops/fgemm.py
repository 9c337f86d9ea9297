"""F16 / BF16 weight rows times many f32 activation rows (prefill): a register-blocked GEMM.

Why (issue 30, item 1's f16/bf16 path): the tile GEMM of `pool` (16 rows widened to f32 in a
buffer, then `tile_dots`) ran 55-64 G MAC/s on SmolLM2's F16 shapes at b = 512, and SmolLM2 F16
prefill 0.52-0.57x llama.cpp's (BUILD_NOTES). Here each call of the micro-kernel keeps
I x R sums of 16 lanes in registers (I weight rows, R activation rows; 4 x 6 = 24 of AVX-512's
32 vector registers): per 16 values it widens I weight rows (F16: `vcvtph2ps`; BF16: a 16-bit
shift), loads R activation rows and issues I * R FMAs, so the loads and conversions stay below
the FMA ports' rate. The file's rows are read as they are (no repacking).

Arithmetic: the weights are exact in f32 and x stays f32 (no activation rounding, unlike the
integer kinds): out[r, i] = sum over 16 lanes of fma chains along D, then the lanes summed in a
fixed tree; the order is per output and does not depend on b, R or the tile. It differs in the
last bits from the row kernels (`qblocks.row_dot`), which keep decode (b <= GEMV_MAX_ROWS).

`gemm(kind, raw, x, out, col)` needs D % 16 == 0 (`supported`); the caller keeps the old path
otherwise. The <16 x float> IR is legal on any target (LLVM splits it without AVX-512), but
only AVX-512's 32 registers hold the 24 sums: `FAST` says whether this CPU has them.
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
from host_ops import qblocks
from host_ops.llvm_ir import (F32 as _F32, I16 as _I16, I64 as _I64,
                              bf16_to_float as _bf16_to_float, const as _const,
                              half_to_float as _half_to_float, switch_codegen, vec as _vec)

LANES = 16  # f32 lanes per vector (one zmm).
MAX_I, MAX_R = 4, 6  # Weight rows x activation rows per micro-kernel call (24 sums).
TILE_ROWS = 64  # Weight rows per parallel tile (64 x 1536 x 2 bytes: 192 KB, in L2).


def _host_has_avx512() -> bool:
  if not common.IS_X86 or numba.config.CPU_NAME:
    return False
  try:
    return bool(llvmlite.binding.get_host_cpu_features().get("avx512f"))
  except RuntimeError:
    return False


FAST = _host_has_avx512()


@numba.njit(**common.JIT)
def supported(dim):
  """Whether `gemm` takes rows of `dim` values (whole vectors of LANES)."""
  return dim > 0 and dim % LANES == 0


@numba.njit(**common.JIT)
def runs(code, dim):
  """Whether many activation rows (prefill) of a matrix of kind `code` (qblocks codes) with
  `dim` values per row go through `gemm_kernel` here: F16 / BF16 on an AVX-512 CPU. Callable
  from numba and Python, so the pool and QMatrix choose alike."""
  return FAST and (code == qblocks.F16 or code == qblocks.BF16) and supported(dim)


def _codegen(bf16: bool, I: int, R: int):
  """IR of out[r0 + r, col + i0 + i] = W[i0 + i] . x[r0 + r] for i < I, r < R. Args: raw
  u8[n, 2 D] (F16 / BF16 rows), x f32[b, D], out f32[b, ncol], i0, r0, col (i64)."""

  def codegen(context, bd, sig, args):
    raw, x, out = (context.make_array(t)(context, bd, a) for t, a in zip(sig.args[:3], args[:3]))
    i0, r0, col = args[3:6]
    dim = bd.extract_value(x.shape, 1)
    ncol = bd.extract_value(out.shape, 1)
    wbase = bd.bitcast(raw.data, _I16.as_pointer())
    w = [bd.gep(wbase, [bd.mul(bd.add(i0, _const(_I64, i)), dim)]) for i in range(I)]
    xs = [bd.gep(x.data, [bd.mul(bd.add(r0, _const(_I64, r)), dim)]) for r in range(R)]
    zero = ir.Constant(_vec(_F32, LANES), [0.0] * LANES)
    acc = [[cgutils.alloca_once_value(bd, zero) for _ in range(R)] for _ in range(I)]
    steps = bd.udiv(dim, _const(_I64, LANES))
    with cgutils.for_range(bd, steps) as loop:
      k = bd.mul(loop.index, _const(_I64, LANES))
      wv = []
      for i in range(I):
        h = bd.load(bd.bitcast(bd.gep(w[i], [k]), _vec(_I16, LANES).as_pointer()), align=2)
        wv.append(_bf16_to_float(bd, h) if bf16 else _half_to_float(bd, h))
      for r in range(R):
        xv = bd.load(bd.bitcast(bd.gep(xs[r], [k]), _vec(_F32, LANES).as_pointer()), align=4)
        for i in range(I):
          bd.store(common.fma(bd, wv[i], xv, bd.load(acc[i][r])), acc[i][r])
    for r in range(R):
      row = bd.gep(out.data, [bd.add(bd.mul(bd.add(r0, _const(_I64, r)), ncol), col)])
      for i in range(I):
        bd.store(common.hsum(bd, bd.load(acc[i][r])), bd.gep(row, [bd.add(i0, _const(_I64, i))]))
    return context.get_dummy_value()

  return codegen


def _make(bf16: bool):
  """The kind's micro-kernels in one intrinsic: key I * 8 + R for I in {1, MAX_I}, R <= MAX_R."""
  variants = {i * 8 + r: _codegen(bf16, i, r) for i in (1, MAX_I) for r in range(1, MAX_R + 1)}

  def impl(typingctx, raw, x, out, i0, r0, col, key):
    return types.void(raw, x, out, i0, r0, col, key), switch_codegen(variants)

  impl.__name__ = f"_{'bf16' if bf16 else 'f16'}_tile"
  return intrinsic(impl)


def _driver(bf16: bool):
  """A parallel GEMM over tiles of TILE_ROWS weight rows for one kind (one kind's code per
  parallel region, as `qpack`'s drivers)."""
  tile_kernel = _make(bf16)

  @numba.njit(parallel=True, **common.JIT)
  def run(raw, x, out, col):
    n = raw.shape[0]
    b = x.shape[0]
    for t in numba.prange((n + TILE_ROWS - 1) // TILE_ROWS):
      lo = t * TILE_ROWS
      hi = min(lo + TILE_ROWS, n)
      r = 0
      while r < b:  # A block of R activation rows (in L1) over the tile's rows (in L2).
        R = min(MAX_R, b - r)
        i = lo
        while i < hi:
          I = MAX_I if i + MAX_I <= hi else 1
          tile_kernel(raw, x, out, i, r, col, I * 8 + R)
          i += I
        r += R

  return run


_gemm_f16 = _driver(False)
_gemm_bf16 = _driver(True)


@numba.njit(**common.JIT)
def gemm_kernel(code, raw, x, out, col):
  """out[:, col:col + n] = x @ W.T. code: qblocks.F16 or qblocks.BF16; raw: u8[n, 2 D] (the
  file's rows); x: f32[b, D] (C-contiguous, D % LANES == 0); out: f32[b, >= col + n]."""
  if code == qblocks.BF16:
    _gemm_bf16(raw, x, out, col)
  else:
    _gemm_f16(raw, x, out, col)


def gemm(kind: str, raw: np.ndarray, x, out: np.ndarray | None = None) -> np.ndarray:
  """x @ W.T for F16 / BF16 rows: raw u8[n, 2 D] (or f16 / u16[n, D]), x f32[b, D] -> f32[b, n].

  out: f32[b, n], C-contiguous and writable, or None (a new array).

  Raises:
    common.HostOpError: a kind other than "f16" / "bf16", raw not 2-D 8/16-bit rows, D not a
      multiple of LANES, x or out of shapes or types that do not match.
  """
  if kind not in ("f16", "bf16"):
    raise common.HostOpError(f"fgemm multiplies f16 or bf16 rows, got {kind!r}")
  raw = np.asarray(raw)
  if raw.ndim != 2 or raw.dtype.itemsize not in (1, 2):
    raise common.HostOpError(f"fgemm needs raw rows as u8[n, 2 D] or 16-bit [n, D], got "
                             f"{raw.dtype}{list(raw.shape)}")
  raw = np.ascontiguousarray(raw).view(np.uint8).reshape(raw.shape[0],
                                                         raw.shape[1] * raw.dtype.itemsize)
  dim = raw.shape[1] // 2
  if not supported(dim):
    raise common.HostOpError(f"fgemm needs rows of a multiple of {LANES} values, got {dim}")
  x, squeeze = common.prepare_x(x, dim)
  want = (x.shape[0], raw.shape[0])
  if out is None:
    out = np.empty(want, np.float32)
  elif not (isinstance(out, np.ndarray) and out.shape == want and out.dtype == np.float32
            and out.flags.c_contiguous and out.flags.writeable):
    raise common.HostOpError(f"out must be a writable C-contiguous f32{list(want)}, got "
                             f"{getattr(out, 'dtype', type(out).__name__)}"
                             f"{list(getattr(out, 'shape', ()))}")
  if x.shape[0] and raw.shape[0]:
    common.ensure_host_threads()
    gemm_kernel(qblocks.KIND_CODES[kind], raw, x, out, 0)
  return out[0] if squeeze else out


def gemm_reference(kind: str, raw: np.ndarray, x) -> np.ndarray:
  """Float64 NumPy reference of `gemm`: the rows' exact values @ x.T, as f32[b, n]."""
  raw = np.ascontiguousarray(raw).view(np.uint8)
  bits = raw.reshape(raw.shape[0], -1).view(np.uint16)
  if kind == "f16":
    w = bits.view(np.float16).astype(np.float64)
  else:
    w = (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
  return (np.asarray(x, np.float64) @ w.T).astype(np.float32)
