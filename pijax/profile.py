"""Activation profiler: run the dense model over calibration text, record FFN activity.

Stage 1 of the offline compile (PowerInfer, arXiv 2312.12456 §5 "offline profiling"):
  1. tokenize the calibration text, cut it into chunks of `chunk_len` tokens (each run from
     position 0, like llama-perplexity), and give every chunk a split: train / validation /
     test, by contiguous blocks of text (held-out data is other text, not other tokens);
  2. run the model over every chunk and stream the FFN-block inputs (the residual stream
     before ffn_norm, the predictors' input) to `ffn_inputs.f32` on disk, [L, N, D];
  3. per layer, recompute gate/up pre-activations from those inputs, calibrate the activity
     threshold t_l on the train split (SwiGLU: the target-sparsity quantile of
     |silu(gate x) * (up x)|; ReLU families: exact zeros) and count how often each neuron fires.

Memory bound: RAM holds the model plus one layer's contributions on the train split,
N_train * intermediate_size * 4 bytes (64k tokens of SmolLM2: ~0.35 GB); disk holds
n_layers * N * hidden_size * 4 bytes (64k tokens of SmolLM2: 4.4 GB).

CLI: python -m pijax.profile --model=default --calibration=FILE --out=WORKDIR
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from pijax.nn import transformer as model_lib
from pijax.nn import sparsity
from pijax.arch.spec import ModelConfig
from pijax.errors import ConfigError

SPLIT_TRAIN, SPLIT_VAL, SPLIT_TEST = 0, 1, 2
FFN_INPUTS_FILE = "ffn_inputs.f32"
PROFILE_FILE = "profile.npz"
PROFILE_META_FILE = "profile.json"


def file_sha256(path: str) -> str:
  """Hex sha256 of a file, read in 8 MB blocks."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 23), b""):
      digest.update(block)
  return digest.hexdigest()


@dataclasses.dataclass
class Profile:
  """What the profiler measured (arrays indexed by layer, neurons in the model's order).

  Attributes:
    family: FFN family of the model.
    target_sparsity: the requested per-layer sparsity (SwiGLU); None for ReLU families.
    thresholds: f32[L] contribution threshold t_l (0 for ReLU families).
    counts: i64[L, F] tokens (train split) on which each neuron was active.
    n_train: tokens in the train split.
    split: i8[N] split of every profiled token (SPLIT_TRAIN / SPLIT_VAL / SPLIT_TEST).
    sparsity: f32[L] measured fraction of inactive (token, neuron) pairs, all splits.
    chunk_len: tokens per chunk.
    calibration: {"path", "sha256", "tokens", "chunks"}.
    workdir: folder holding ffn_inputs.f32 ([L, N, D] float32).
  """

  family: str
  target_sparsity: float | None
  thresholds: np.ndarray
  counts: np.ndarray
  n_train: int
  split: np.ndarray
  sparsity: np.ndarray
  chunk_len: int
  calibration: dict[str, Any]
  workdir: str

  @property
  def n_tokens(self) -> int:
    return int(self.split.shape[0])

  @property
  def frequencies(self) -> np.ndarray:
    """f32[L, F]: probability per token that each neuron is active (train split)."""
    return (self.counts / max(self.n_train, 1)).astype(np.float32)

  def ffn_inputs(self, config: ModelConfig) -> np.ndarray:
    """Read-only memmap f32[L, N, D] of the recorded FFN-block inputs.

    Raises:
      ConfigError: the profile's shapes are not this model's (a profile of another model).
    """
    from pijax.errors import ConfigError
    path = os.path.join(self.workdir, FFN_INPUTS_FILE)
    shape = (config.n_layers, self.n_tokens, config.hidden_size)
    want = 4 * int(np.prod(shape))
    got = os.path.getsize(path) if os.path.exists(path) else -1
    if got != want or self.counts.shape != (config.n_layers, config.intermediate_size):
      raise ConfigError(f"{self.workdir}: the profile does not match this model ({config.n_layers} "
                        f"layers, hidden_size {config.hidden_size}, intermediate_size "
                        f"{config.intermediate_size}): {FFN_INPUTS_FILE} has {got} bytes for "
                        f"{want}; profile the same --model.")
    return np.memmap(path, np.float32, "r", shape=shape)

  def save(self) -> None:
    """Writes profile.npz + profile.json into workdir (temp file, then rename)."""
    path = os.path.join(self.workdir, PROFILE_FILE)
    tmp = path + ".tmp.npz"
    np.savez(tmp, thresholds=self.thresholds, counts=self.counts, split=self.split,
             sparsity=self.sparsity, frequencies=self.frequencies)
    os.replace(tmp, path)
    meta = {"family": self.family, "target_sparsity": self.target_sparsity,
            "n_train": self.n_train, "chunk_len": self.chunk_len,
            "calibration": self.calibration}
    tmp = os.path.join(self.workdir, PROFILE_META_FILE + ".tmp")
    with open(tmp, "w") as f:
      json.dump(meta, f, indent=1)
    os.replace(tmp, os.path.join(self.workdir, PROFILE_META_FILE))

  @classmethod
  def load(cls, workdir: str) -> "Profile":
    """Reads a profile written by `save`. Raises ConfigError if it is missing."""
    npz = os.path.join(workdir, PROFILE_FILE)
    meta_path = os.path.join(workdir, PROFILE_META_FILE)
    if not (os.path.exists(npz) and os.path.exists(meta_path)):
      raise ConfigError(f"{workdir}: no profile here (need {PROFILE_FILE} and "
                        f"{PROFILE_META_FILE}); run `python -m pijax.profile` first.")
    with open(meta_path) as f:
      meta = json.load(f)
    arrays = np.load(npz)
    return cls(family=meta["family"], target_sparsity=meta["target_sparsity"],
               thresholds=arrays["thresholds"], counts=arrays["counts"],
               n_train=int(meta["n_train"]), split=arrays["split"],
               sparsity=arrays["sparsity"], chunk_len=int(meta["chunk_len"]),
               calibration=meta["calibration"], workdir=workdir)


def chunk_splits(n_chunks: int, val_fraction: float, test_fraction: float) -> np.ndarray:
  """i8[n_chunks]: train for the first chunks, then validation, then test (contiguous text).

  At least one chunk goes to validation and one to test when n_chunks >= 3.
  """
  split = np.zeros(n_chunks, np.int8)
  if n_chunks < 3:
    raise ConfigError(f"the calibration text gives only {n_chunks} chunk(s); at least 3 "
                      "are needed (train / validation / test). Give more text or a smaller "
                      "chunk length.")
  n_test = max(1, int(round(test_fraction * n_chunks)))
  n_val = max(1, int(round(val_fraction * n_chunks)))
  if n_test + n_val >= n_chunks:
    n_test, n_val = 1, 1
  split[n_chunks - n_test:] = SPLIT_TEST
  split[n_chunks - n_test - n_val:n_chunks - n_test] = SPLIT_VAL
  return split


@functools.partial(jax.jit, static_argnames=("eps",))
def layer_preactivations(x: jax.Array, norm_scale: jax.Array, gate: jax.Array, up: jax.Array,
                         eps: float) -> tuple[jax.Array, jax.Array]:
  """gate and up pre-activations of one layer from its FFN-block input.

  x: f32[N, D] residual stream before ffn_norm; norm_scale: [D]; gate, up: [D, F] kernels.
  Returns (gate x, up x), each f32[N, F], x normed as the model does.
  """
  h = model_lib.rms_norm(x, norm_scale, eps).astype(gate.dtype)
  return (jnp.einsum("ND,DF->NF", h, gate, preferred_element_type=jnp.float32),
          jnp.einsum("ND,DF->NF", h, up, preferred_element_type=jnp.float32))


def _layer_map(params: Any, config: ModelConfig, layer: int, x: np.ndarray, fn, dtype,
               block: int = 4096) -> np.ndarray:
  """fn(gate x, up x) -> [n, F], applied to FFN-block inputs x: f32[N, D] in blocks of tokens."""
  p = params[f"layers_{layer}"]
  out = np.empty((x.shape[0], config.intermediate_size), dtype)
  for start in range(0, x.shape[0], block):
    g, u = layer_preactivations(jnp.asarray(x[start:start + block]), p["ffn_norm"]["scale"],
                                p["ffn"]["gate"]["kernel"], p["ffn"]["up"]["kernel"],
                                config.rms_norm_eps)
    out[start:start + block] = np.asarray(fn(g, u))
  return out


def layer_contribution(params: Any, config: ModelConfig, layer: int, x: np.ndarray) -> np.ndarray:
  """f32[N, F]: |a_i| (see `sparsity.neuron_contribution`) for FFN-block inputs x: f32[N, D]."""
  fn = jax.jit(functools.partial(sparsity.neuron_contribution, family=config.ffn_family))
  return _layer_map(params, config, layer, x, fn, np.float32)


def layer_active(params: Any, config: ModelConfig, layer: int, x: np.ndarray,
                 threshold: float) -> np.ndarray:
  """bool[N, F]: the true active set (see `sparsity.active_mask`) for inputs x: f32[N, D]."""
  fn = jax.jit(functools.partial(sparsity.active_mask, family=config.ffn_family,
                                 threshold=jnp.float32(threshold)))
  return _layer_map(params, config, layer, x, fn, bool)


def profile_model(model, calibration_path: str, workdir: str, *, target_sparsity: float = 0.5,
                  max_tokens: int = 65536, chunk_len: int = 512, val_fraction: float = 0.1,
                  test_fraction: float = 0.1, progress: bool = True) -> Profile:
  """Runs the profiler (see the module docstring) and saves the result in `workdir`.

  Args:
    model: a dense `pijax.engine.Model`.
    calibration_path: UTF-8 text file.
    workdir: output folder (created); holds ffn_inputs.f32, profile.npz, profile.json.
    target_sparsity: per-layer sparsity the SwiGLU thresholds are calibrated to.
    max_tokens: profile at most this many tokens (whole chunks).
    chunk_len: tokens per chunk.

  Raises:
    ConfigError: unreadable calibration file, too little text, bad target_sparsity.
  """
  cfg = model.config
  if not 0.0 <= target_sparsity < 1.0:
    raise ConfigError(f"target_sparsity={target_sparsity} must be in [0, 1).")
  if chunk_len < 8 or chunk_len > model.max_seq_len:
    raise ConfigError(f"chunk_len={chunk_len} must be in [8, max_seq_len={model.max_seq_len}].")
  try:
    with open(calibration_path, encoding="utf-8") as f:
      text = f.read()
  except (OSError, UnicodeDecodeError) as err:
    raise ConfigError(f"{calibration_path}: cannot read calibration text ({err}).") from None
  ids = model.tokenizer.encode(text, add_special=False)
  n_chunks = min(len(ids), max_tokens) // chunk_len
  split_per_chunk = chunk_splits(n_chunks, val_fraction, test_fraction)
  n = n_chunks * chunk_len
  os.makedirs(workdir, exist_ok=True)
  inputs = np.memmap(os.path.join(workdir, FFN_INPUTS_FILE), np.float32, "w+",
                     shape=(cfg.n_layers, n, cfg.hidden_size))
  run = jax.jit(functools.partial(model_lib.ffn_inputs, config=cfg))
  for c in tqdm(range(n_chunks), desc="profile: forward", disable=not progress):
    tokens = jnp.asarray(np.asarray(ids[c * chunk_len:(c + 1) * chunk_len], np.int32)[None])
    inputs[:, c * chunk_len:(c + 1) * chunk_len] = np.asarray(run(model.params, tokens))[:, 0]
  inputs.flush()
  split = np.repeat(split_per_chunk, chunk_len)
  train = split == SPLIT_TRAIN
  thresholds = np.zeros(cfg.n_layers, np.float32)
  counts = np.zeros((cfg.n_layers, cfg.intermediate_size), np.int64)
  layer_sparsity = np.zeros(cfg.n_layers, np.float32)
  exact_zeros = sparsity.has_exact_zeros(cfg.ffn_family)
  for layer in tqdm(range(cfg.n_layers), desc="profile: thresholds", disable=not progress):
    x = np.asarray(inputs[layer])
    if not exact_zeros:
      contrib = layer_contribution(model.params, cfg, layer, x[train])
      thresholds[layer] = sparsity.calibrate_threshold(contrib, target_sparsity)
      del contrib
    active = layer_active(model.params, cfg, layer, x, float(thresholds[layer]))
    counts[layer] = active[train].sum(axis=0)
    layer_sparsity[layer] = 1.0 - active.mean()
  del inputs
  result = Profile(
      family=cfg.ffn_family, target_sparsity=None if exact_zeros else float(target_sparsity),
      thresholds=thresholds, counts=counts, n_train=int(train.sum()), split=split,
      sparsity=layer_sparsity, chunk_len=chunk_len,
      calibration={"path": os.path.abspath(calibration_path),
                   "sha256": file_sha256(calibration_path), "tokens": n, "chunks": n_chunks},
      workdir=workdir)
  result.save()
  return result


def main(argv: list[str]) -> None:
  del argv
  from absl import flags
  import pijax
  from pijax.errors import ConfigError
  f = flags.FLAGS
  if f.chunk_len < 1 or f.max_tokens < f.chunk_len:
    raise ConfigError(f"--max_tokens={f.max_tokens} and --chunk_len={f.chunk_len}: need "
                      "chunk_len >= 1 and max_tokens >= chunk_len.")
  if os.path.exists(f.out) and not os.path.isdir(f.out):
    raise ConfigError(f"--out={f.out} is a file; pass a folder (the profile's workdir).")
  model = pijax.load(f.model, max_seq_len=max(f.chunk_len, 16))
  prof = profile_model(model, f.calibration, f.out, target_sparsity=f.target_sparsity,
                       max_tokens=f.max_tokens, chunk_len=f.chunk_len)
  import sys
  sys.stderr.write(f"profiled {prof.n_tokens} tokens into {f.out}; per-layer sparsity "
                   f"{np.round(prof.sparsity, 3).tolist()}\n")


if __name__ == "__main__":
  from absl import flags
  from pijax import cli
  flags.DEFINE_string("model", "default", "GGUF path or 'default'.")
  flags.DEFINE_string("calibration", None, "Calibration text file.", required=True)
  flags.DEFINE_string("out", None, "Workdir to write.", required=True)
  flags.DEFINE_float("target_sparsity", 0.5, "Per-layer sparsity for SwiGLU thresholds.")
  flags.DEFINE_integer("max_tokens", 65536, "Tokens to profile at most.")
  flags.DEFINE_integer("chunk_len", 512, "Tokens per chunk.")
  cli.run(main, "pijax.profile")
