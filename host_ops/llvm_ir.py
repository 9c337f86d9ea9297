"""LLVM IR building blocks shared by the host intrinsics (`qblocks`, `qpack`, `qdot`, `gated_down`).

Types, vector constants, unaligned loads, x86 intrinsic declarations and the f16/bf16 -> f32
conversions every block kernel emits. IEEE-ordered float ops (`fadd`, `fmul`, `fma`, `hsum`) and
prefetches are in `host_ops.common`.
"""

from __future__ import annotations

import llvmlite.binding
import numba
from llvmlite import ir
from numba.core import cgutils

from host_ops import common

I8, I16, I32, I64, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), \
    ir.FloatType()
LANES = 32  # Default vector width of `vec` and `splat`: one 32-value group.


def _host_has_f16c() -> bool:
  if not common.IS_X86 or numba.config.CPU_NAME:
    return False  # Elsewhere (or compiling for another CPU) `fpext half` may become a libcall.
  try:
    return bool(llvmlite.binding.get_host_cpu_features().get("f16c"))
  except RuntimeError:
    return False


# Whether f16 scales and F16 weights convert with the CPU's instruction (vcvtph2ps).
HAS_F16C = _host_has_f16c()


def vec(t, n=LANES):
  """<n x t>."""
  return ir.VectorType(t, n)


def const(t, values):
  """A vector constant of element type t (`values` a list), or a scalar one (an int/float)."""
  if isinstance(values, (list, tuple)):
    return ir.Constant(vec(t, len(values)), list(values))
  return ir.Constant(t, values)


def splat(bd, v, n=LANES):
  """A scalar repeated in n lanes."""
  vt = vec(v.type, n)
  first = bd.insert_element(ir.Constant(vt, ir.Undefined), v, const(I32, 0))
  return bd.shuffle_vector(first, ir.Constant(vt, ir.Undefined), const(I32, [0] * n))


def load(bd, base, offset, ty):
  """An unaligned load of `ty` at byte (element, for a typed base) `offset` of `base`."""
  return bd.load(bd.bitcast(bd.gep(base, [offset]), ty.as_pointer()), align=1)


def add(bd, v, k):
  """v + k for an integer value v and a Python int k."""
  return bd.add(v, const(v.type, k))


def x86(bd, name, ret, args):
  """The declaration of the LLVM intrinsic `name` (e.g. "llvm.x86.avx2.pmadd.ub.sw")."""
  return cgutils.get_or_insert_function(bd.module, ir.FunctionType(ret, args), name)


def fmuladd(bd, a, b, c):
  """a * b + c as llvm.fmuladd (scalar or vector of f32): fused or not, as LLVM chooses."""
  name = f"llvm.fmuladd.v{a.type.count}f32" if isinstance(a.type, ir.VectorType) else \
      "llvm.fmuladd.f32"
  fn = cgutils.get_or_insert_function(bd.module, ir.FunctionType(a.type, [a.type] * 3), name)
  return bd.call(fn, [a, b, c])


def half_to_float(bd, h, hw=None):
  """i16 (or <n x i16>) half bits -> float (or <n x float>), exact (subnormals, inf, NaN).

  hw: `fpext half` (default where the CPU has F16C); else the integer method of ggml's
  `ggml_compute_fp16_to_fp32` fallback: shift the exponent and mantissa into place, rebias,
  and renormalize zeros/subnormals with one exact subtraction of 2^-14.
  """
  hw = HAS_F16C if hw is None else hw
  vector = isinstance(h.type, ir.VectorType)
  n = h.type.count if vector else None
  ft = vec(F32, n) if vector else F32
  if hw:
    return bd.fpext(bd.bitcast(h, vec(ir.HalfType(), n) if vector else ir.HalfType()), ft)
  it = vec(I32, n) if vector else I32

  def c(v):
    return const(it.element if vector else it, [v] * n if vector else v)

  u = bd.zext(h, it)
  o = bd.shl(bd.and_(u, c(0x7FFF)), c(13))
  exp = bd.and_(o, c(0x7C00 << 13))
  o = bd.add(o, c((127 - 15) << 23))
  o_inf = bd.add(o, c((128 - 16) << 23))  # Inf/NaN: exponent all ones, mantissa kept.
  magic = ir.Constant(ft, [2.0 ** -14] * n) if vector else ir.Constant(ft, 2.0 ** -14)
  o_sub = bd.bitcast(common.fsub(bd, bd.bitcast(bd.add(o, c(1 << 23)), ft), magic), it)
  o = bd.select(bd.icmp_unsigned("==", exp, c(0x7C00 << 13)), o_inf,
                bd.select(bd.icmp_unsigned("==", exp, c(0)), o_sub, o))
  o = bd.or_(o, bd.shl(bd.and_(u, c(0x8000)), c(16)))
  return bd.bitcast(o, ft)


def bf16_to_float(bd, h):
  """i16 / <n x i16> bf16 bits -> float: the top half of an f32."""
  vector = isinstance(h.type, ir.VectorType)
  it = vec(I32, h.type.count) if vector else I32
  ft = vec(F32, h.type.count) if vector else F32
  shift = const(I32, [16] * h.type.count) if vector else const(I32, 16)
  return bd.bitcast(bd.shl(bd.zext(h, it), shift), ft)


def switch_codegen(variants):
  """One intrinsic's codegen for kernels generated per compile-time count: variants maps an int
  key to a codegen, and the call's last argument (i64) picks the one that runs (an LLVM switch;
  every variant is compiled in). Callers pass only keys of `variants` (others are unreachable).
  Each variant sees the whole argument list and ignores the key."""

  def codegen(context, bd, sig, args):
    key = args[-1]
    done = bd.append_basic_block("variant.done")
    other = bd.append_basic_block("variant.none")
    sw = bd.switch(key, other)
    for k, gen in sorted(variants.items()):
      blk = bd.append_basic_block(f"variant.{k}")
      sw.add_case(ir.Constant(key.type, k), blk)
      bd.position_at_end(blk)
      gen(context, bd, sig, args)
      bd.branch(done)
    bd.position_at_end(other)
    bd.unreachable()
    bd.position_at_end(done)
    return context.get_dummy_value()

  return codegen
