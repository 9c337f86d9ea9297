"""Every JAX -> host crossing: the callbacks that reach host weights and host KV caches.

Host objects (a `host_ops.decoder.HostDecoder` with its caches, `host_ops.sparse_ffn.HostFFNWeights`)
are closed over by the callback target, never registered in a global table; only activations, id
vectors, positions and small state ids cross. Each callback costs tens of microseconds with no work
(more on GPU, where it drains the stream), so a backend makes as few as it can: one per forward pass
(host backend), one per layer (hybrid backend), or two per layer when the host part overlaps the
device's (`--overlap`).
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback


# ----------------------------------------------------------------------------- host backend
def host_forward(fn: Callable[..., tuple[np.ndarray, np.ndarray]], state_id: jax.Array,
                 tokens: jax.Array, pos: jax.Array, index: jax.Array,
                 out_shapes: tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]
                 ) -> tuple[jax.Array, jax.Array]:
  """One whole forward pass on the host: fn(state_id, tokens, pos, index) -> (logits, active).

  An `io_callback` (the host writes its KV cache: a side effect, not a pure function).
  state_id: i32[1]; tokens: i32[B, T]; pos, index: i32[].
  """
  return io_callback(fn, out_shapes, state_id, tokens.astype(jnp.int32),
                     jnp.asarray(pos, jnp.int32), jnp.asarray(index, jnp.int32))


# ----------------------------------------------------------------------------- hybrid backend
def _cold_ffn(weights, h: np.ndarray, ids: np.ndarray) -> np.ndarray:
  return np.asarray(weights(np.asarray(h, np.float32), np.asarray(ids, np.int32)), np.float32)


def cold_partial(weights, h: jax.Array, ids: jax.Array) -> jax.Array:
  """The cold neurons' partial FFN output, computed on the host (one pure_callback).

  weights: host_ops.sparse_ffn.HostFFNWeights (the cold rows); h: f32[N, D] normed FFN input;
  ids: i32[N, C] per-row active cold ids (-1 = skip) or i32[C] shared. Returns f32[N, D].
  """
  n, d = h.shape
  return jax.pure_callback(lambda h_, ids_: _cold_ffn(weights, h_, ids_),
                           jax.ShapeDtypeStruct((n, d), jnp.float32),
                           h.astype(jnp.float32), ids.astype(jnp.int32),
                           vmap_method="sequential")


def cold_partial_predicted(weights, h: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The host predicts its own cold neurons and computes them (low-bit predictor in host RAM):
  h f32[N, D] -> (f32[N, D], active i32[N])."""
  n, d = h.shape

  def target(h_):
    y, active = weights.run_predicted(np.asarray(h_, np.float32))
    return np.asarray(y, np.float32), np.asarray(active, np.int32)

  return jax.pure_callback(target, (jax.ShapeDtypeStruct((n, d), jnp.float32),
                                    jax.ShapeDtypeStruct((n,), jnp.int32)),
                           h.astype(jnp.float32), vmap_method="sequential")


class Overlap:
  """A worker thread that runs host partials while the device computes the hot part.

  One instance per hybrid backend; its in-flight partials are keyed by layer.
  """

  def __init__(self):
    self._pool: concurrent.futures.ThreadPoolExecutor | None = None
    self._pending: dict[int, Any] = {}

  def _start(self, layer: int, weights, h: np.ndarray, ids: np.ndarray) -> np.ndarray:
    if self._pool is None:
      self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pijax-host-ffn")
    # Copies: the callback's operand buffers are not ours after we return.
    h, ids = np.array(h, np.float32), np.array(ids, np.int32)
    self._pending[layer] = self._pool.submit(weights, h, ids)
    return np.zeros((), np.int32)

  def _finish(self, layer: int, ticket: np.ndarray, after: np.ndarray) -> np.ndarray:
    del ticket, after  # Data dependencies only: after the start and the hot part.
    return np.asarray(self._pending.pop(layer).result(), np.float32)

  def start(self, layer: int, weights, h: jax.Array, ids: jax.Array) -> jax.Array:
    """Part 1: hands (h f32[N, D], ids) to the worker; returns an i32[] ticket at once."""
    return jax.pure_callback(lambda h_, i_: self._start(layer, weights, h_, i_),
                             jax.ShapeDtypeStruct((), jnp.int32), h.astype(jnp.float32),
                             ids.astype(jnp.int32), vmap_method="sequential")

  def finish(self, layer: int, ticket: jax.Array, after: jax.Array, n: int, d: int
             ) -> jax.Array:
    """Part 2: f32[n, d] host partial, ordered after `after` (the device's hot result)."""
    return jax.pure_callback(lambda t_, a_: self._finish(layer, t_, a_),
                             jax.ShapeDtypeStruct((n, d), jnp.float32), ticket, after,
                             vmap_method="sequential")
