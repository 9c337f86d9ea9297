"""Several block-format matrices stacked by rows, used as one (`RowConcat`).

A layer's q | k | v product is one matmul when the three share a format; Q4_K_M files often
store v (and some down matrices) in Q6_K beside Q4_K q and k, so the parts keep their own
formats and each writes its slice of the output (no re-quantization).
"""

from __future__ import annotations

import numpy as np

from host_ops import common
from host_ops import qmatmul
from host_ops.common import HostOpError


class RowConcat:
  """Rows of `parts` (QMatrix, same D) in order, with QMatrix's product interface.

  Attributes:
    parts: the matrices; shape: (sum of rows, D); kind: "mixed".
  """

  kind = "mixed"

  def __init__(self, parts: list):
    if not parts or len({p.shape[1] for p in parts}) != 1:
      raise HostOpError(f"RowConcat needs matrices of one input width, got "
                        f"{[p.shape for p in parts]}")
    self.parts = list(parts)
    self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
    self._bounds = np.cumsum([0] + [p.shape[0] for p in parts])

  @property
  def nbytes(self) -> int:
    return sum(p.nbytes for p in self.parts)

  def file_bytes(self) -> int:
    return sum(p.file_bytes() for p in self.parts)

  def dequantize(self, lo: int = 0, hi: int | None = None, out: np.ndarray | None = None
                 ) -> np.ndarray:
    """Rows [lo, hi) as f32[hi - lo, D]."""
    hi = self.shape[0] if hi is None else hi
    rows = np.concatenate([p.dequantize() for p in self.parts])[lo:hi]
    if out is not None:
      out[:hi - lo] = rows
      return out[:hi - lo]
    return rows

  def matmul(self, x, out: np.ndarray | None = None, dot: str = qmatmul.DOT_F32) -> np.ndarray:
    """x @ W.T: x f32[b, D] -> f32[b, n] (f32[D] -> f32[n]); each part writes its columns."""
    x2, squeeze = common.prepare_x(x, self.shape[1])
    if out is None:
      out = np.empty((x2.shape[0], self.shape[0]), np.float32)
    for p, lo, hi in zip(self.parts, self._bounds[:-1], self._bounds[1:]):
      out[:, lo:hi] = p.matmul(x2, dot=dot)
    return out[0] if squeeze else out

  def __repr__(self) -> str:
    return f"RowConcat({', '.join(map(repr, self.parts))})"
