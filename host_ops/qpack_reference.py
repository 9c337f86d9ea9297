"""Float64 references of `host_ops.qpack`'s packed products (test oracles; the layout's own
inverse, `qpack.unpack_reference`, stays with the layout): the activations as the kernels see
them, and their product with a matrix's exact values."""

from __future__ import annotations

import numpy as np

from host_ops import act_quant
from host_ops import qdot
from host_ops.qpack import K_KINDS


def x_hat_reference(kind: str, x) -> np.ndarray:
  """f64[b, D]: the activations as the kernels of `kind` see them (dk * xq per 256 values for
  the K-quants, dx * xq per 32 else)."""
  x = np.asarray(x, np.float32)
  b, dim = x.shape
  if kind in K_KINDS:
    xq, dk, _, _ = act_quant.quantize_k_reference(x)
    return (xq.reshape(b, -1, 256).astype(np.float64) * dk[..., None]).reshape(b, dim)
  xq, dx, _ = qdot.quantize_x_reference(x)
  return (xq.reshape(b, -1, 32).astype(np.float64) * dx[..., None]).reshape(b, dim)


def matmul_reference(kind: str, w: np.ndarray, x) -> np.ndarray:
  """Float64 reference of `matmul`: x_hat(kind, x) @ w.T for w: f64[n, D] (the matrix's values,
  e.g. `gguf.quants.dequantize` of its blocks). Returns f32[b, n]."""
  return (x_hat_reference(kind, x) @ np.asarray(w, np.float64).T).astype(np.float32)
