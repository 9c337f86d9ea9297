"""The dense backend: the Flax transformer (`pijax.nn.transformer`) compiled by XLA, every weight in the
compute dtype on the default JAX device, the KV cache a device pytree."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from pijax.nn import transformer as model_lib
from pijax.arch import spec
from pijax.arch.spec import ModelConfig
from pijax.backends import base


class XlaBackend(base.Backend):
  """Dense f32/bf16 weights in XLA.

  Args:
    config: ModelConfig.
    params: the param tree of `pijax.nn.transformer.Transformer` (`pijax.formats.loader.load_gguf`),
      or a zero-argument function returning it (called when a step first needs it).
    dtype: numpy dtype of params and KV cache.
  """

  name = "xla"
  implemented_switches = frozenset(spec.SWITCHES)  # Every family's switches.

  def __init__(self, config: ModelConfig, params: Any, dtype: Any):
    super().__init__(config)
    self._params = params
    self.dtype = np.dtype(dtype)

  @property
  def label(self) -> str:
    return str(self.dtype)

  @property
  def params(self) -> Any:
    if callable(self._params):
      self._params = self._params()
    return self._params

  def init_state(self, batch: int, max_seq_len: int) -> model_lib.KVCache:
    return model_lib.init_cache(self.config, batch, max_seq_len, self.dtype)

  def prefill(self, params, state, tokens, length, pos, *, kv_len, all_logits):
    logits, state = model_lib.prefill(params, state, tokens, length, config=self.config,
                                      kv_len=kv_len, pos=pos, all_logits=all_logits)
    return logits, state, jnp.ones((self.config.n_layers,), jnp.float32)

  def decode(self, params, state, tokens, pos, *, kv_len):
    logits, state = model_lib.decode_step(params, state, tokens, pos, config=self.config,
                                          kv_len=kv_len)
    return logits, state, jnp.ones((self.config.n_layers,), jnp.float32)

  def weight_bytes_per_token(self, ffn_sparsity: float = 0.0) -> tuple[int, int]:
    del ffn_sparsity  # Dense: every weight once (a tied head reads the embedding matrix).
    total = self.weight_bytes()
    return total, total

  def weight_bytes(self) -> int:
    return self.config.n_params() * self.dtype.itemsize
