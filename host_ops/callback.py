"""Reaching a registered host FFN layer from jitted JAX code through `jax.pure_callback`.

Only the activations and the id vector cross the callback; the weights stay in the NumPy arrays the
host registry owns (`host_ops.sparse_ffn.register_layer`). On GPU each callback drains the stream
and syncs, ~55-60 us per call with no work (../shared/DESIGN.md §3-4): one callback per layer,
never one per matmul. For CPU/GPU overlap, call `host_ops.sparse_ffn.run_layer` from a worker
thread instead (the kernels release the GIL).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from host_ops import sparse_ffn


def _host_call(handle: int, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
  """The host side: NumPy in, NumPy out (never JAX)."""
  return sparse_ffn.run_layer(handle, x, ids)


def host_sparse_ffn(handle: int, x: jax.Array, ids: jax.Array) -> jax.Array:
  """y = run_layer(handle, x, ids), computed on the host; usable inside jax.jit.

  Args:
    handle: int from `register_layer` (a Python int: static, part of the traced program).
    x: f32[b, D] (or f32[D]) activations (cast to f32).
    ids: i32[b, k] per-row or i32[k] shared active ids, -1 = padding (cast to i32).
  Returns:
    f32 array shaped like x.

  vmap: the callback runs once per mapped element ("sequential"); put tokens in the b axis instead.
  """
  out = jax.ShapeDtypeStruct(x.shape, jnp.float32)
  return jax.pure_callback(functools.partial(_host_call, int(handle)), out,
                           x.astype(jnp.float32), ids.astype(jnp.int32),
                           vmap_method="sequential")
