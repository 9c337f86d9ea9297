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

from pijax import config as config_lib
from pijax.arch import registry
from pijax.arch.spec import ModelConfig
from pijax.errors import GGUFError
from pijax.formats import powerinfer
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

  A view pijax derives (`tensor.source`: a PowerInfer file's dense ffn_down, the transpose of
  its ffn_down_t) is read from its source: dequantized, then transposed.

  Raises:
    GGUFError: a type gguf.quants cannot dequantize, or corrupt data.
  """
  source = getattr(tensor, "source", None)
  if source is not None:
    full = dequantize(source, path)  # [in, out] of the view.
    cols = full if rows is None else full[:, rows[0]:rows[1]]
    return np.ascontiguousarray(cols.T, dtype)
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
      with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf: _check_finite says so.
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


def slice_rows(tensor: Any, where: registry.TensorSlice, shape: tuple[int, ...], path: str
               ) -> tuple[int, int] | None:
  """Checks that `tensor` holds `where`'s role with `shape`; returns the rows to read (None: all).

  Raises:
    GGUFError: a tensor of another shape (for a fused tensor: other than all its parts).
  """
  got = tuple(int(x) for x in reversed(tensor.shape))
  if where.lo is None:
    if got != shape:
      raise GGUFError(f"{path}: tensor {where.name!r} has shape {got}, expected {shape}.")
    return None
  want = (where.rows,) + tuple(shape[1:])
  if got != want:
    raise GGUFError(f"{path}: fused tensor {where.name!r} has shape {got}, expected {want}.")
  return where.lo, where.hi


def weight_plan(cfg: ModelConfig, path: str) -> list[tuple[str, int | None, registry.TensorSlice,
                                                          tuple[int, ...]]]:
  """Every weight the model reads: (role, layer or None, where it lives, NumPy shape)."""
  names = registry.get_family(cfg.arch, path).tensors
  plan = [("embedding", None, names.locate("embedding", None, cfg),
           (cfg.vocab_size, cfg.hidden_size)),
          ("final_norm", None, names.locate("final_norm", None, cfg), (cfg.hidden_size,))]
  if not cfg.tied_output:
    plan.append(("lm_head", None, names.locate("lm_head", None, cfg),
                 (cfg.vocab_size, cfg.hidden_size)))
  shapes = registry.layer_shapes(cfg)
  for i in range(cfg.n_layers):
    plan += [(role, i, names.locate(role, i, cfg), shape) for role, shape in shapes.items()]
  return plan


def read_gguf(path: str | os.PathLike[str], *, ffn_activation: str | None = None
              ) -> tuple[ModelConfig, dict[str, Any]]:
  """(config, metadata) of a GGUF, checking that every tensor the model needs is present with
  its shape and a type `dequantize` reads (one row of each is decoded; no tensor is loaded).

  A PowerInfer file (magic b"PWRI") also has its own tensors' shapes checked
  (`powerinfer.check_layout`); its predictors are not read here (`powerinfer.read_predictors`).

  Raises:
    GGUFError: any problem with the file (see `open_gguf`, `config_from_metadata`), a missing
      tensor or one of the wrong shape.
  """
  path = os.fspath(path)
  reader, metadata = open_gguf(path)
  tensors = {t.name: t for t in reader.tensors}
  cfg = registry.config_from_metadata(metadata, path, tensors, ffn_activation)
  if reader.powerinfer:
    powerinfer.check_layout(tensors, cfg.n_layers, cfg.hidden_size, cfg.intermediate_size, path)
  for _, _, where, shape in weight_plan(cfg, path):
    if where.name not in tensors:
      hint = ""
      if reader.powerinfer and where.name.endswith(".ffn_down.weight"):
        hint = " (PowerInfer files hold it as ffn_down_t; that is missing too)"
      raise GGUFError(f"{path}: tensor {where.name!r} is missing{hint}; the file is incomplete.")
    tensor = tensors[where.name]
    rows = slice_rows(tensor, where, shape, path)
    # One row through the dequantizer: an unsupported type fails here, at load, not later (a
    # derived view: one row of its source).
    if tensor.source is not None:
      dequantize(tensor.source, path, rows=(0, 1))
    elif len(shape) == 2:
      lo = rows[0] if rows else 0
      dequantize(tensor, path, rows=(lo, lo + 1))
    else:
      dequantize(tensor, path)
  return cfg, metadata


def read_weight(tensors: dict[str, Any], where: registry.TensorSlice, shape: tuple[int, ...],
                path: str, dtype: np.dtype = np.dtype(np.float32)) -> np.ndarray:
  """One role's weight (`weight_plan`) dequantized to `dtype` with its `shape`, checked finite.

  Raises:
    GGUFError: missing, wrong shape, unreadable type, NaN/inf.
  """
  if where.name not in tensors:
    raise GGUFError(f"{path}: tensor {where.name!r} is missing; the file is incomplete.")
  rows = slice_rows(tensors[where.name], where, shape, path)
  arr = dequantize(tensors[where.name], path, dtype, rows=rows).reshape(shape)
  _check_finite(arr, where.name, path)
  return arr


def load_gguf(path: str | os.PathLike[str], *, dtype: str = "float32",
              ffn_activation: str | None = None,
              ) -> tuple[ModelConfig, dict[str, Any], dict[str, Any]]:
  """Loads a GGUF of a supported family as (config, params, metadata).

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
      final_norm/scale: [hidden]; lm_head/kernel: [hidden, vocab] (absent when tied). Where
      the config says so: layers_{i}/attn/qkv_bias: [(n_heads + 2 n_kv_heads) head_dim],
      layers_{i}/attn/{q_norm,k_norm}/scale: [head_dim],
      layers_{i}/{post_attn_norm,post_ffn_norm}/scale: [hidden].
    metadata: the GGUF key/values (tokenizer, chat template...).

  Raises:
    GGUFError: any problem with the file (see `open_gguf`, `config_from_metadata`).
  """
  path = os.fspath(path)
  reader, metadata = open_gguf(path)
  tensors = {t.name: t for t in reader.tensors}
  cfg = registry.config_from_metadata(metadata, path, tensors, ffn_activation)
  np_dtype = numpy_dtype(dtype)
  plan = {(role, i): (where, shape) for role, i, where, shape in weight_plan(cfg, path)}

  def get(role: str, i: int | None = None, dtype: np.dtype = np.dtype(np.float32)) -> np.ndarray:
    return read_weight(tensors, *plan[role, i], path, dtype)

  def matrix_on_device(role: str) -> jax.Array:
    """A large [rows, cols] tensor moved to JAX in row blocks (no full host copy)."""
    where, shape = plan[role, None]
    if where.name not in tensors:
      raise GGUFError(f"{path}: tensor {where.name!r} is missing; the file is incomplete.")
    slice_rows(tensors[where.name], where, shape, path)
    out = jnp.zeros(shape, np_dtype)
    block = 4096
    for start in range(0, shape[0], block):
      stop = min(start + block, shape[0])
      rows = dequantize(tensors[where.name], path, np_dtype, rows=(start, stop))
      _check_finite(rows, where.name, path)
      out = _set_rows(out, rows, start)
    return out

  def vec(role: str, i: int) -> dict[str, jax.Array]:
    return {"scale": jnp.asarray(get(role, i).astype(np_dtype))}

  # GGUF stores matrices as [out, in]; our kernels are [in, out] (split into heads).
  params: dict[str, Any] = {"embed": {"embedding": matrix_on_device("embedding")}}
  for i in range(cfg.n_layers):
    def w(role: str) -> jax.Array:
      return jnp.asarray(np.ascontiguousarray(get(role, i).T, np_dtype))
    attn: dict[str, Any] = {
        "qkv_proj": {"kernel": jnp.asarray(np.concatenate(
            [get("q", i).T, get("k", i).T, get("v", i).T], axis=1).astype(np_dtype))},
        "o_proj": {"kernel": w("o")},
    }
    if cfg.qkv_bias:
      attn["qkv_bias"] = jnp.asarray(np.concatenate(
          [get("q_bias", i), get("k_bias", i), get("v_bias", i)]).astype(np_dtype))
    if cfg.qk_norm:
      attn["q_norm"], attn["k_norm"] = vec("q_norm", i), vec("k_norm", i)
    layer = {
        "attn_norm": vec("attn_norm", i),
        "attn": attn,
        "ffn_norm": vec("ffn_norm", i),
        "ffn": {"gate": {"kernel": w("gate")}, "up": {"kernel": w("up")},
                "down": {"kernel": w("down")}},
    }
    if cfg.norm_placement == config_lib.NORM_SANDWICH:
      layer["post_attn_norm"], layer["post_ffn_norm"] = vec("post_attn_norm", i), \
          vec("post_ffn_norm", i)
    params[f"layers_{i}"] = layer
  params["final_norm"] = {"scale": jnp.asarray(get("final_norm").astype(np_dtype))}
  if not cfg.tied_output:
    params["lm_head"] = {"kernel": jnp.asarray(get("lm_head", None, np_dtype).T)}
  logging.debug("loaded %s: %s, %d params", path, cfg, cfg.n_params())
  return cfg, params, metadata
