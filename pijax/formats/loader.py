"""GGUF -> (ModelConfig, params): the family's config and tensor map, layer-by-layer dequantization.

Tensors are dequantized with `gguf.quants.dequantize` straight from the memory map, one
tensor (the embedding: one block of rows) at a time, and handed to JAX at once, so peak RSS
stays near the final weights plus one tensor and the reader's metadata.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pijax.arch import registry
from pijax.arch.spec import ModelConfig
from pijax.errors import GGUFError
from pijax.formats.gguf import open_gguf

_DTYPES = {"float32": np.float32, "f32": np.float32, "bfloat16": ml_dtypes.bfloat16,
           "bf16": ml_dtypes.bfloat16, "float16": np.float16, "f16": np.float16}


def numpy_dtype(name: str) -> np.dtype:
  """Maps a config dtype name ("float32", "bfloat16", "float16") to a numpy dtype."""
  try:
    return np.dtype(_DTYPES[name])
  except KeyError:
    from pijax.errors import ConfigError
    raise ConfigError(f"unknown dtype {name!r}; use one of {sorted(set(_DTYPES))}.") from None


@functools.partial(jax.jit, donate_argnums=0)
def _set_rows(matrix: jax.Array, rows: jax.Array, start: int) -> jax.Array:
  """matrix[start:start + len(rows)] = rows, in place (the matrix is donated)."""
  return jax.lax.dynamic_update_slice_in_dim(matrix, rows, start, 0)


_CHUNK_VALUES = 1 << 22  # Dequantize at most this many values at a time (bounded temporaries).


def dequantize(tensor: Any, path: str, dtype: np.dtype = np.dtype(np.float32),
                rows: tuple[int, int] | None = None) -> np.ndarray:
  """One GGUF tensor as a numpy array of `dtype`, shape in numpy order ([out, in] for matrices).

  `rows=(start, stop)` dequantizes only those rows of a matrix.

  Rows are dequantized in chunks so the f32 temporaries of `gguf.quants.dequantize` stay
  bounded (a few MB) whatever the tensor size.

  Raises:
    GGUFError: a type gguf.quants cannot dequantize, or corrupt data.
  """
  shape = tuple(int(d) for d in reversed(tensor.shape))
  data = tensor.data
  n_rows = data.shape[0] if data.ndim > 1 else 1
  if data.ndim == 1:
    data = data[None]
  cols = int(np.prod(shape)) // max(n_rows, 1)
  if rows is not None:
    data = data[rows[0]:rows[1]]
    shape = (rows[1] - rows[0], cols)
    n_rows = data.shape[0]
  out = np.empty((n_rows, cols), dtype)
  step = max(1, _CHUNK_VALUES // max(out.shape[1], 1))
  try:
    for start in range(0, n_rows, step):
      chunk = gguf.quants.dequantize(data[start:start + step], tensor.tensor_type)
      out[start:start + step] = np.asarray(chunk, np.float32).reshape(-1, out.shape[1])
  except NotImplementedError:
    raise GGUFError(f"{path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, which "
                    "gguf.quants cannot dequantize; re-quantize the model (e.g. Q4_K_M, Q8_0).") \
        from None
  except Exception as err:
    raise GGUFError(f"{path}: tensor {tensor.name!r} ({tensor.tensor_type.name}) is corrupt "
                    f"({type(err).__name__}: {err}).") from None
  return out.reshape(shape)


def _check_finite(arr: np.ndarray, name: str, path: str) -> None:
  """GGUFError when a dequantized tensor holds NaN or inf (a corrupt file: without this the
  model silently produces NaN logits)."""
  if not np.isfinite(arr).all():
    raise GGUFError(f"{path}: tensor {name!r} holds NaN or inf values; the file is corrupt "
                    "(re-download or re-convert it).")


def read_gguf(path: str | os.PathLike[str], *, ffn_activation: str | None = None
              ) -> tuple[ModelConfig, dict[str, Any]]:
  """(config, metadata) of a GGUF, checking that every tensor the model needs is present with
  its shape and a type `dequantize` reads (one row of each is decoded; no tensor is loaded).

  Raises:
    GGUFError: any problem with the file (see `open_gguf`, `config_from_metadata`), a missing
      tensor or one of the wrong shape.
  """
  path = os.fspath(path)
  reader, metadata = open_gguf(path)
  tensors = {t.name: t for t in reader.tensors}
  cfg = registry.config_from_metadata(metadata, path, set(tensors), ffn_activation)
  names = registry.get_family(cfg.arch, path).tensors
  d, n, k, h, f = (cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                   cfg.intermediate_size)
  want = [("embedding", None, (cfg.vocab_size, d)), ("final_norm", None, (d,))]
  if not cfg.tied_output:
    want.append(("lm_head", None, (cfg.vocab_size, d)))
  for i in range(cfg.n_layers):
    want += [("attn_norm", i, (d,)), ("q", i, (n * h, d)), ("k", i, (k * h, d)),
             ("v", i, (k * h, d)), ("o", i, (d, n * h)), ("ffn_norm", i, (d,)),
             ("gate", i, (f, d)), ("up", i, (f, d)), ("down", i, (d, f))]
  for role, i, shape in want:
    name = names.name(role, i)
    if name not in tensors:
      raise GGUFError(f"{path}: tensor {name!r} is missing; the file is incomplete.")
    got = tuple(int(x) for x in reversed(tensors[name].shape))
    if got != shape:
      raise GGUFError(f"{path}: tensor {name!r} has shape {got}, expected {shape}.")
    # One row through the dequantizer: an unsupported type fails here, at load, not later.
    dequantize(tensors[name], path, rows=(0, 1) if len(shape) == 2 else None)
  return cfg, metadata


def load_gguf(path: str | os.PathLike[str], *, dtype: str = "float32",
              ffn_activation: str | None = None,
              ) -> tuple[ModelConfig, dict[str, Any], dict[str, Any]]:
  """Loads a llama-family GGUF as (config, params, metadata).

  Args:
    path: the .gguf file.
    dtype: parameter/compute dtype name ("float32" default; "bfloat16" on GPU).
    ffn_activation: "silu" | "relu" | "drelu" for files whose metadata does not say.

  Returns:
    config: ModelConfig.
    params: the flax param tree of `pijax.nn.transformer.Transformer`, one subtree per layer:
      embed/embedding: [vocab, hidden]; layers_{i}/attn_norm/scale: [hidden];
      layers_{i}/attn/qkv_proj/kernel: [hidden, (n_heads + 2 n_kv_heads) head_dim] (q | k | v);
      layers_{i}/attn/o_proj/kernel: [n_heads head_dim, hidden]; layers_{i}/ffn_norm/scale;
      layers_{i}/ffn/{gate,up}/kernel: [hidden, ffn]; layers_{i}/ffn/down/kernel: [ffn, hidden];
      final_norm/scale: [hidden]; lm_head/kernel: [hidden, vocab] (absent when tied).
    metadata: the GGUF key/values (tokenizer, chat template...).

  Raises:
    GGUFError: any problem with the file (see `open_gguf`, `config_from_metadata`).
  """
  path = os.fspath(path)
  reader, metadata = open_gguf(path)
  tensors = {t.name: t for t in reader.tensors}
  cfg = registry.config_from_metadata(metadata, path, set(tensors), ffn_activation)
  names = registry.get_family(cfg.arch, path).tensors
  np_dtype = numpy_dtype(dtype)
  d, n, k, h, f = (cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                   cfg.intermediate_size)

  def get(name: str, shape: tuple[int, ...], dtype: np.dtype = np.dtype(np.float32)
          ) -> np.ndarray:
    if name not in tensors:
      raise GGUFError(f"{path}: tensor {name!r} is missing; the file is incomplete.")
    arr = dequantize(tensors[name], path, dtype)
    if arr.shape != shape:
      raise GGUFError(f"{path}: tensor {name!r} has shape {arr.shape}, expected {shape}.")
    _check_finite(arr, name, path)
    return arr

  def matrix_on_device(name: str, shape: tuple[int, int]) -> jax.Array:
    """A large [rows, cols] tensor moved to JAX in row blocks (no full host copy)."""
    if name not in tensors:
      raise GGUFError(f"{path}: tensor {name!r} is missing; the file is incomplete.")
    tensor = tensors[name]
    got = tuple(int(x) for x in reversed(tensor.shape))
    if got != shape:
      raise GGUFError(f"{path}: tensor {name!r} has shape {got}, expected {shape}.")
    out = jnp.zeros(shape, np_dtype)
    block = 4096
    for start in range(0, shape[0], block):
      stop = min(start + block, shape[0])
      rows = dequantize(tensor, path, np_dtype, rows=(start, stop))
      _check_finite(rows, name, path)
      out = _set_rows(out, rows, start)
    return out

  # GGUF stores matrices as [out, in]; our kernels are [in, out] (split into heads).
  params: dict[str, Any] = {
      "embed": {"embedding": matrix_on_device(names.name("embedding"), (cfg.vocab_size, d))},
  }
  for i in range(cfg.n_layers):
    def w(name: str, shape: tuple[int, ...], layout=lambda a: a) -> jax.Array:
      return jnp.asarray(np.ascontiguousarray(layout(get(names.name(name, i), shape)), np_dtype))
    params[f"layers_{i}"] = {
        "attn_norm": {"scale": w("attn_norm", (d,))},
        "attn": {
            "qkv_proj": {"kernel": jnp.asarray(np.concatenate(
                [get(names.name("q", i), (n * h, d)).T,
                 get(names.name("k", i), (k * h, d)).T,
                 get(names.name("v", i), (k * h, d)).T], axis=1).astype(np_dtype))},
            "o_proj": {"kernel": w("o", (d, n * h), lambda a: a.T)},
        },
        "ffn_norm": {"scale": w("ffn_norm", (d,))},
        "ffn": {
            "gate": {"kernel": w("gate", (f, d), lambda a: a.T)},
            "up": {"kernel": w("up", (f, d), lambda a: a.T)},
            "down": {"kernel": w("down", (d, f), lambda a: a.T)},
        },
    }
  params["final_norm"] = {"scale": jnp.asarray(get(names.name("final_norm"), (d,)).astype(np_dtype))}
  if not cfg.tied_output:
    params["lm_head"] = {"kernel": jnp.asarray(
        get(names.name("lm_head"), (cfg.vocab_size, d), np_dtype).T)}
  logging.debug("loaded %s: %s, %d params", path, cfg, cfg.n_params())
  return cfg, params, metadata
