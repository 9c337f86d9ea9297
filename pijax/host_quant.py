"""CPU decoding with quantized host weights: the GGUF's own blocks, read by numba, one callback
per layer; the jitted step keeps the KV cache, RoPE and attention.

Why: on a CPU backend every decode token reads all weights, and XLA reads only f32 fast
(../shared/DESIGN.md §4), so the dense f32 path reads 538 MB per SmolLM2 token. Keeping the file's
Q4_1 blocks (5 bits per weight) and the Q8_0 embedding, the same token reads 97 MB
(`HostDecoder.bytes_per_token`), on the same weight values (activations stay f32).

Weight formats (`--host_weights`):
  "gguf": Q4_1 and Q8_0 tensors keep their blocks (lossless); any other type (F32, F16, K-quants)
    is dequantized and re-quantized to Q8_0. A layer's q, k, v share one format (all Q8_0 if the
    file mixes them).
  "q8_0": every matrix in Q8_0 (int8 blocks of 32 with one scale: Q8_0 tensors kept, the rest
    re-quantized from their f32 values).
"auto" (the CLIs' default) picks "gguf" on a CPU backend for a GGUF whose layer matrices are all
Q4_1 or Q8_0, token embedding and output head included (nothing re-quantized), and the f32
XLA path ("off") otherwise.

Step structure (`forward`): one host call per forward pass (`host_ops.decoder.HostDecoder`:
embedding, every layer with its attention over a host KV cache, LM head), then XLA samples.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from host_ops import decoder as decoder_lib
from host_ops import qmatmul
from pijax import gguf_io
from pijax import loader
from pijax import model as model_lib
from pijax.config import FFN_FAMILIES
from pijax.config import ROPE_ADJACENT
from pijax.config import ModelConfig
from pijax.errors import ConfigError
from pijax.errors import GGUFError

WEIGHTS_OFF = "off"
WEIGHTS_GGUF = "gguf"
WEIGHTS_Q8_0 = "q8_0"
WEIGHTS_AUTO = "auto"
WEIGHT_CHOICES = (WEIGHTS_AUTO, WEIGHTS_OFF, WEIGHTS_GGUF, WEIGHTS_Q8_0)
_KEPT_TYPES = {"Q4_1": qmatmul.Q4_1, "Q8_0": qmatmul.Q8_0}


@dataclasses.dataclass(frozen=True)
class HostQuantSpec:
  """Static description of a host-weights run (hashable: part of the jit cache key).

  handle: `host_ops.decoder` registry handle; weights: "gguf" | "q8_0".
  """

  handle: int
  weights: str


def _tensor_kind(tensor: Any) -> str | None:
  return _KEPT_TYPES.get(tensor.tensor_type.name)


def file_is_block_quantized(path: str | os.PathLike[str]) -> bool:
  """True when every matrix of the GGUF (layers, token embedding, output head) is Q4_1 or Q8_0,
  so "gguf" re-quantizes nothing. (llama.cpp's Q4_1 files often keep output.weight in Q6_K:
  those run "off" under "auto".)"""
  reader, _ = gguf_io.open_gguf(os.fspath(path))
  mats = [t for t in reader.tensors if len(t.shape) == 2]
  return bool(mats) and all(_tensor_kind(t) is not None for t in mats)


def build_decoder(path: str | os.PathLike[str], config: ModelConfig, weights: str
                  ) -> decoder_lib.HostDecoder:
  """Reads a llama-family GGUF into a HostDecoder in the `weights` format ("gguf" | "q8_0").

  Raises:
    GGUFError: missing tensors or types gguf cannot dequantize.
    ConfigError: an unknown weights format.
  """
  if weights not in (WEIGHTS_GGUF, WEIGHTS_Q8_0):
    raise ConfigError(f"--host_weights={weights!r}: build needs 'gguf' or 'q8_0'.")
  path = os.fspath(path)
  reader, _ = gguf_io.open_gguf(path)
  tensors = {t.name: t for t in reader.tensors}

  def raw(name: str):
    if name not in tensors:
      raise GGUFError(f"{path}: tensor {name!r} is missing; the file is incomplete.")
    return tensors[name]

  def shape_of(tensor) -> tuple[int, ...]:
    return tuple(int(s) for s in reversed(tensor.shape))

  def f32(name: str) -> np.ndarray:
    return loader._dequantize(raw(name), path)

  def matrix(names: list[str]) -> qmatmul.QMatrix:
    """The named [out, in] matrices stacked by rows, kept in their blocks when allowed."""
    ts = [raw(n) for n in names]
    kinds = {_tensor_kind(t) for t in ts}
    keep = kinds.pop() if len(kinds) == 1 else None
    if keep is not None and (weights == WEIGHTS_GGUF or keep == qmatmul.Q8_0):
      mats = [qmatmul.from_gguf_blocks(keep, t.data, shape_of(t)) for t in ts]
    else:
      mats = [qmatmul.quantize_q8_0(loader._dequantize(t, path)) for t in ts]
    return mats[0] if len(mats) == 1 else qmatmul.stack_rows(mats)

  if config.hidden_size % qmatmul.BLOCK or config.intermediate_size % qmatmul.BLOCK:
    raise ConfigError(f"--host_weights={weights}: {path} has hidden_size {config.hidden_size} / "
                      f"intermediate_size {config.intermediate_size}, not multiples of "
                      f"{qmatmul.BLOCK} (the block size); use --host_weights=off.")
  layers = []
  for i in range(config.n_layers):
    p = f"blk.{i}."
    layers.append(decoder_lib.HostLayer(
        attn_norm=f32(p + "attn_norm.weight"),
        qkv=matrix([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]),
        attn_out=matrix([p + "attn_output.weight"]),
        ffn_norm=f32(p + "ffn_norm.weight"),
        gate=matrix([p + "ffn_gate.weight"]),
        up=matrix([p + "ffn_up.weight"]),
        down=matrix([p + "ffn_down.weight"])))
  embedding = matrix(["token_embd.weight"])
  head = embedding if config.tied_output else matrix(["output.weight"])
  family = config.ffn_family
  if family not in FFN_FAMILIES:
    raise ConfigError(f"--host_weights needs a gated FFN (swiglu, reglu, drelu); this model's "
                      f"FFN is {config.ffn_family}; use --host_weights=off.")
  return decoder_lib.HostDecoder(
      embedding, layers, f32("output_norm.weight"), head, eps=config.rms_norm_eps,
      family=family, n_heads=config.n_heads, n_kv_heads=config.n_kv_heads,
      head_dim=config.head_dim, rope_theta=config.rope_theta, rope_dim=config.rope_dim,
      rope_scale=config.rope_scale, rope_adjacent=config.rope_style == ROPE_ADJACENT)


# ----------------------------------------------------------------------------- the step
def new_cache(spec: HostQuantSpec, batch: int, max_seq_len: int) -> model_lib.KVCache:
  """A fresh KV cache for host weights: the keys/values live on the host (see
  `host_ops.decoder`); the returned pytree only carries the cache's shape and id:
  k = (f32[batch, max_seq_len, 0, 0],), v = (i32[1] cache id,)."""
  cache_id = decoder_lib.get(spec.handle).new_cache(batch, max_seq_len)
  return model_lib.KVCache(k=(jnp.zeros((batch, max_seq_len, 0, 0), jnp.float32),),
                           v=(jnp.asarray([cache_id], jnp.int32),))


def _forward_cb(handle: int, all_rows: bool, vocab: int, cache_id: np.ndarray,
                tokens: np.ndarray, pos: np.ndarray, index: np.ndarray):
  dec = decoder_lib.get(handle)
  b, t = tokens.shape
  rows = None if all_rows else np.arange(b) * t + int(index)
  logits = dec.forward(int(np.asarray(cache_id)[0]), np.asarray(tokens), int(pos), rows)
  logits = logits.reshape(b, t, vocab) if all_rows else logits
  return logits, dec.last_active.astype(np.float32)


def forward(cache: model_lib.KVCache, tokens: jax.Array, pos: jax.Array, *,
            config: ModelConfig, kv_len: int, spec: HostQuantSpec,
            logits_index: jax.Array | None = None) -> tuple[jax.Array, model_lib.KVCache]:
  """The decoder with host weights and a host KV cache; usable inside `jax.jit`.

  One `io_callback` per call (the host mutates its KV cache, so the call is a side effect, not
  a pure function); see `host_ops.decoder` for why the whole pass is one call.

  Args:
    cache: from `new_cache` (the live one for this model).
    tokens: i32[B, T] ids at positions pos + [0, T).
    pos: i32[] position of tokens[:, 0].
    config: static ModelConfig; kv_len: unused (the host attends [0, pos + T) exactly), kept
      for the same signature as `pijax.model.forward`.
    spec: static HostQuantSpec.
    logits_index: None for logits at every position, or i32[] (logits of tokens[:, t] only).

  Returns:
    (logits f32[B, T, V] or f32[B, V], the same cache pytree, active f32[L]: the FFN fraction
    computed per layer, 1 with the dense FFN; mean over the B T rows).
  """
  del kv_len
  b, t = tokens.shape
  all_rows = logits_index is None
  shape = (b, t, config.vocab_size) if all_rows else (b, config.vocab_size)
  index = jnp.zeros((), jnp.int32) if all_rows else jnp.asarray(logits_index, jnp.int32)
  logits, active = io_callback(
      functools.partial(_forward_cb, spec.handle, all_rows, config.vocab_size),
      (jax.ShapeDtypeStruct(shape, jnp.float32),
       jax.ShapeDtypeStruct((config.n_layers,), jnp.float32)),
      cache.v[0], tokens.astype(jnp.int32), jnp.asarray(pos, jnp.int32), index)
  return logits, cache, active


def prefill(cache, tokens, length, *, config, kv_len, spec, pos=0, all_logits=False):
  """`pijax.model.prefill` with host weights: (logits, cache, active)."""
  index = None if all_logits else jnp.asarray(length, jnp.int32) - 1
  return forward(cache, tokens, jnp.asarray(pos, jnp.int32), config=config, kv_len=kv_len,
                 spec=spec, logits_index=index)


def decode_step(cache, tokens, pos, *, config, kv_len, spec):
  """`pijax.model.decode_step` with host weights: tokens i32[B] -> (logits f32[B, V], cache,
  active f32[L])."""
  return forward(cache, tokens[:, None], pos, config=config, kv_len=kv_len, spec=spec,
                 logits_index=jnp.zeros((), jnp.int32))
