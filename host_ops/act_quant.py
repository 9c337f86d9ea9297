"""Activation rows quantized for the packed integer kernels (`host_ops.qpack`), both ways (numba).

The K-quant kernels read x as ggml's Q8_K (per 256 values: one scale dk, codes xq, and the sums of
xq per 32 and per 16 for the mins and Q6_K's -32 offset: `quantize_k`); the 32-value kinds read
it per 32 values (`quantize_32`, as `qdot.quantize_x`, parallel over blocks). `activations` makes
the halves a product needs, as the tuple `ACTIVATIONS` every packed kernel takes.

Layout per STYLE.md: numba kernels -> NumPy reference (`quantize_k_reference`; the per-32 one
is `qdot.quantize_x_reference`).
"""

from __future__ import annotations

import numba
import numpy as np

from host_ops import common


@numba.njit(**common.JIT)
def _q8_scale(x, r, lo, n):
  """(d, 1 / d or 0) of the values x[r, lo:lo + n]: d = max|x| / 127, ggml's 8-bit scale."""
  amax = np.float32(0.0)
  for e in range(n):
    amax = max(amax, abs(x[r, lo + e]))
  d = amax / np.float32(127.0)
  return d, np.float32(1.0) / d if d > 0 else np.float32(0.0)


@numba.njit(parallel=True, **common.JIT)
def quantize_k(x):
  """x: f32[b, D] (D % 256 == 0) -> Q8_K activations for the K-quant kernels:
  (xq: i8[b, D], dk: f32[b, D/256], bs32: i16[b, D/32], bs16: i16[b, D/16]).

  Per 256 values: dk = max|x| / 127, xq = rint(x / dk) (0 for a zero block); bs32, bs16: sums
  of xq over each 32 and 16 values (ggml's `quantize_row_q8_K`, whose bsums are per 16).
  """
  b, dim = x.shape
  nsb = dim // 256
  xq = np.empty((b, dim), np.int8)
  dk = np.empty((b, nsb), np.float32)
  bs32 = np.empty((b, dim // 32), np.int16)
  bs16 = np.empty((b, dim // 16), np.int16)
  for job in numba.prange(b * nsb):
    r = job // nsb
    u = job % nsb
    d, inv = _q8_scale(x, r, 256 * u, 256)
    for m in range(16):
      s = 0
      for e in range(16):
        q = np.int32(np.rint(x[r, 256 * u + 16 * m + e] * inv))
        xq[r, 256 * u + 16 * m + e] = np.int8(q)
        s += q
      bs16[r, 16 * u + m] = np.int16(s)
    for m in range(8):
      bs32[r, 8 * u + m] = bs16[r, 16 * u + 2 * m] + bs16[r, 16 * u + 2 * m + 1]
    dk[r, u] = d
  return xq, dk, bs32, bs16


@numba.njit(parallel=True, **common.JIT)
def quantize_32(x):
  """x: f32[b, D] (D % 32 == 0) -> (xq: i8[b, D], dx: f32[b, D/32], xsum: f32[b, D/32]) as
  `qdot.quantize_x` (per 32 values: dx = max|x| / 127, xq = rint(x / dx), xsum = dx * sum(xq)),
  parallel over blocks."""
  b, dim = x.shape
  nb = dim // 32
  xq = np.empty((b, dim), np.int8)
  dx = np.empty((b, nb), np.float32)
  xsum = np.empty((b, nb), np.float32)
  for job in numba.prange(b * nb):
    r = job // nb
    blk = job % nb
    d, inv = _q8_scale(x, r, 32 * blk, 32)
    s = 0
    for e in range(32):
      q = np.int32(np.rint(x[r, 32 * blk + e] * inv))
      xq[r, 32 * blk + e] = np.int8(q)
      s += q
    dx[r, blk] = d
    xsum[r, blk] = d * np.float32(s)
  return xq, dx, xsum


# The activations every packed kernel takes, quantized both ways (each kind reads its half):
# (xq8 i8[b, D], dx f32[b, D/32], xsum f32[b, D/32]) from `quantize_32` for the 32-value kinds,
# (xqk i8[b, D], dk f32[b, D/256], bs32 i16[b, D/32], bs16 i16[b, D/16]) from `quantize_k`.
ACTIVATIONS = ("xq8", "dx", "xsum", "xqk", "dk", "bs32", "bs16")


@numba.njit(**common.JIT)
def activations(x, need_32, need_k):
  """`ACTIVATIONS` of x: f32[b, D]; a half not needed (or D not a multiple of 256 for the K
  half) is placeholder arrays [b, 1] never read."""
  b = x.shape[0]
  if need_32:
    xq8, dx, xsum = quantize_32(x)
  else:
    xq8, dx, xsum = (np.zeros((b, 1), np.int8), np.zeros((b, 1), np.float32),
                     np.zeros((b, 1), np.float32))
  if need_k and x.shape[1] % 256 == 0:
    xqk, dk, bs32, bs16 = quantize_k(x)
  else:
    xqk, dk, bs32, bs16 = (np.zeros((b, 1), np.int8), np.zeros((b, 1), np.float32),
                           np.zeros((b, 1), np.int16), np.zeros((b, 1), np.int16))
  return xq8, dx, xsum, xqk, dk, bs32, bs16


def quantize_k_reference(x) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """NumPy reference of `quantize_k` (f32 arithmetic, round half to even)."""
  x = np.asarray(x, np.float32)
  b, dim = x.shape
  blocks = x.reshape(b, dim // 256, 256)
  dk = (np.abs(blocks).max(-1) / np.float32(127.0)).astype(np.float32)
  with np.errstate(divide="ignore"):
    inv = np.where(dk > 0, np.float32(1.0) / dk, np.float32(0.0)).astype(np.float32)
  xq = np.rint(blocks * inv[..., None]).astype(np.int8).reshape(b, dim)
  bs16 = xq.reshape(b, dim // 16, 16).astype(np.int64).sum(-1).astype(np.int16)
  bs32 = xq.reshape(b, dim // 32, 32).astype(np.int64).sum(-1).astype(np.int16)
  return xq, dk, bs32, bs16
