"""Cold neurons with the low-bit predictor on the host: predict and compute in one pass (numba).

The low-bit predictor (`pijax.offline.predictor`, "Low-bit pre-activation predictor") estimates each
neuron's contribution |act(g) * u| from a 4-bit copy of its gate and up rows (blocks of 32
values, one scale each; two codes per byte, code = q + 8, the even column in the low nibble).
On a CPU-only run the XLA side cannot read 4-bit codes fast (XLA CPU does not fuse an integer
convert into a dot), so for the host's neurons this op does both steps
in one numba pass, reached by one `jax.pure_callback` per layer with only x crossing:

  pass 1, every host neuron i:  est_i = |act(g~_i, u~_i)| from the codes (0.56 bytes/weight)
  pass 2, the i with est_i >= cut:  y += act(gate_i . x, up_i . x) * down_i  (exact f32 rows,
          `host_ops.sparse_ffn`'s kernel: per-thread partials summed in thread order)

and it returns y: f32[b, D] and the active count per row (bitwise reproducible for a fixed
thread count).

Layout: numba kernel -> public function (validates) -> NumPy reference (float64).
"""

from __future__ import annotations

import numba
import numpy as np

from host_ops import common
from host_ops import sparse_ffn
from host_ops.common import HostOpError

BLOCK = 32  # Values per scale block (16 bytes of codes).


@numba.njit(inline="always", **common.JIT)
def _dot_q4(codes_row, scales_row, xe, xo):
  """sum_j w_j x_j for one 4-bit row: codes_row u8[D/2], scales_row f32[D/32], xe/xo = x[0::2],
  x[1::2] (f32[D/2]).

  One flat loop with the block scale looked up per byte (j >> 4: 16 bytes per block): LLVM
  vectorizes it; a loop nest over blocks is several times slower.
  """
  total = np.float32(0.0)
  for j in range(codes_row.shape[0]):
    c = np.int32(codes_row[j])
    total += scales_row[j >> 4] * (np.float32((c & 15) - 8) * xe[j]
                                   + np.float32((c >> 4) - 8) * xo[j])
  return total


@numba.njit(parallel=True, **common.JIT)
def _lowbit_active_kernel(gate_codes, gate_scales, up_codes, up_scales, xe, xo, cut, code):
  """Predicted active ids per row: (ids: i32[b, n], valid first, -1 after; counts: i32[b])."""
  b = xe.shape[0]
  n = gate_codes.shape[0]
  keep = np.zeros((b, n), dtype=np.bool_)
  for i in numba.prange(n):
    for r in range(b):
      g_est = _dot_q4(gate_codes[i], gate_scales[i], xe[r], xo[r])
      u_est = _dot_q4(up_codes[i], up_scales[i], xe[r], xo[r])
      keep[r, i] = abs(common.activation(g_est, u_est, code)) >= cut
  ids = np.full((b, n), -1, dtype=np.int32)
  counts = np.zeros(b, dtype=np.int32)
  for r in range(b):
    c = 0
    for i in range(n):
      if keep[r, i]:
        ids[r, c] = i
        c += 1
    counts[r] = c
  return ids, counts


class LowbitPredictor:
  """One layer's 4-bit gate/up copy for its host neurons, and the cut.

  Attributes:
    gate_codes, up_codes: u8[n, D/2]; gate_scales, up_scales: f32[n, D/32]; cut: float.
  """

  def __init__(self, gate_codes, gate_scales, up_codes, up_scales, cut: float):
    self.gate_codes = np.ascontiguousarray(gate_codes, np.uint8)
    self.up_codes = np.ascontiguousarray(up_codes, np.uint8)
    self.gate_scales = np.ascontiguousarray(gate_scales, np.float32)
    self.up_scales = np.ascontiguousarray(up_scales, np.float32)
    self.cut = float(cut)
    n, half = self.gate_codes.shape
    for name, arr, shape in (("up_codes", self.up_codes, (n, half)),
                             ("gate_scales", self.gate_scales, (n, 2 * half // BLOCK)),
                             ("up_scales", self.up_scales, (n, 2 * half // BLOCK))):
      if arr.shape != shape:
        raise HostOpError(f"{name} has shape {arr.shape}, expected {shape}")

  @property
  def nbytes(self) -> int:
    return sum(a.nbytes for a in (self.gate_codes, self.up_codes, self.gate_scales,
                                  self.up_scales))

  def active_ids(self, x, family: str) -> tuple[np.ndarray, np.ndarray]:
    """Pass 1 alone: x f32[b, D] -> (ids i32[b, n] predicted active, valid first, -1 after;
    counts i32[b]) (what `host_ops.cold_ffn.QuantColdFFN.run_predicted` computes on)."""
    x = np.ascontiguousarray(x, np.float32)
    if x.ndim != 2 or x.shape[1] != 2 * self.gate_codes.shape[1]:
      raise HostOpError(f"x must be f32[b, {2 * self.gate_codes.shape[1]}], got {x.shape}")
    xe, xo = np.ascontiguousarray(x[:, 0::2]), np.ascontiguousarray(x[:, 1::2])
    return _lowbit_active_kernel(self.gate_codes, self.gate_scales, self.up_codes,
                                 self.up_scales, xe, xo, np.float32(self.cut),
                                 common.family_code(family))

  def run(self, gate, up, down, x, family: str) -> tuple[np.ndarray, np.ndarray]:
    """`lowbit_sparse_ffn_host` with this predictor (what `HostFFNWeights.run_predicted`
    calls: sparse_ffn does not import this module)."""
    return lowbit_sparse_ffn_host(self, gate, up, down, x, family)


def lowbit_sparse_ffn_host(pred: LowbitPredictor, gate, up, down, x, family: str
                           ) -> tuple[np.ndarray, np.ndarray]:
  """Predict-and-compute for one layer's host neurons.

  Args:
    pred: the layer's LowbitPredictor (n neurons, same order as the rows).
    gate, up, down: f32[n, D] neuron-major rows (down transposed), C-contiguous.
    x: f32[b, D] normed FFN input.
    family: "swiglu" | "reglu" | "drelu".

  Returns:
    (y: f32[b, D], active: i64[b] neurons computed per row).

  Raises:
    HostOpError: shape mismatches or D not a multiple of 32.
  """
  x = np.ascontiguousarray(x, np.float32)
  if x.ndim != 2:
    raise HostOpError(f"x must be f32[b, D], got shape {x.shape}")
  n, d = gate.shape
  if d % BLOCK or pred.gate_codes.shape != (n, d // 2) or x.shape[1] != d:
    raise HostOpError(f"rows [{n}, {d}], codes {pred.gate_codes.shape} and x {x.shape} disagree "
                      f"(D must be a multiple of {BLOCK})")
  code = common.family_code(family)
  n_threads = common.ensure_host_threads()
  # Pass 1: the predicted active ids; pass 2: the exact rows of those ids only, with the
  # sparse op's prefetching (one fused loop with a branch per neuron was slower).
  ids, counts = pred.active_ids(x, family)
  y = sparse_ffn.sparse_ffn_f32_kernel(gate, up, down, x, ids, counts, False, code, n_threads,
                                        common.PREFETCH_AHEAD)
  return y, counts.astype(np.int64)


def dequantize_q4_reference(codes, scales) -> np.ndarray:
  """f64[n, D] from 4-bit rows: codes u8[n, D/2] (even column in the low nibble, code = q + 8),
  scales [n, D/32]."""
  codes = np.asarray(codes)
  q = np.empty((codes.shape[0], codes.shape[1] * 2), np.float64)
  q[:, 0::2] = (codes & 15).astype(np.float64) - 8.0
  q[:, 1::2] = (codes >> 4).astype(np.float64) - 8.0
  return q * np.repeat(np.asarray(scales, np.float64), BLOCK, axis=1)


activation_reference = common.activation_reference  # One NumPy definition for host_ops.


def lowbit_sparse_ffn_host_reference(pred: LowbitPredictor, gate, up, down, x, family: str
                                     ) -> tuple[np.ndarray, np.ndarray]:
  """NumPy (float64) reference of `lowbit_sparse_ffn_host`; also returns the estimates.

  Returns (y: f32[b, D], active: i64[b], est: f64[b, n]).
  """
  x = np.asarray(x, np.float64)
  est = np.abs(activation_reference(x @ dequantize_q4_reference(pred.gate_codes,
                                                                pred.gate_scales).T,
                                    x @ dequantize_q4_reference(pred.up_codes,
                                                                pred.up_scales).T, family))
  keep = est >= pred.cut
  a = activation_reference(x @ np.asarray(gate, np.float64).T,
                           x @ np.asarray(up, np.float64).T, family) * keep
  y = a @ np.asarray(down, np.float64)
  return y.astype(np.float32), keep.sum(axis=1).astype(np.int64), est
