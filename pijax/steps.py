"""The engine's steps: traceable prefill / decode / sample functions over the backend protocol,
and their ahead-of-time compilation.

Each step takes the backend's params and decode state as its first two arguments; the backend
and kv_len are static (closed over). With `logprobs`, the sampling steps also return f32[B, V]:
log-softmax of the raw logits. A step given `bias` (f32[B, V]: logit_bias, grammar masks;
`pijax.grammar`) compiles apart: a run without one runs the very same executables as before.

`compile_fused` compiles a step as one XLA program (every backend's default,
`Backend.compile_step`); `compile_split` compiles a sampling step as the forward pass then a
sampler of its own (the host backend's choice).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from pijax import sampling as sampling_lib

MIN_KV_BUCKET = 256  # Attention windows are powers of two >= this (capped at max_seq_len).


def next_pow2(n: int) -> int:
  """The smallest power of two >= n (1 for n <= 1)."""
  return 1 << max(0, int(n) - 1).bit_length()


def kv_bucket(needed: int, max_seq_len: int) -> int:
  """The power-of-two attention window (>= MIN_KV_BUCKET, <= max_seq_len) compiled for a pass
  that needs `needed` positions: decoding N tokens compiles once per window bucket."""
  return min(max_seq_len, max(MIN_KV_BUCKET, next_pow2(needed)))


def sample_next(logits, key, sparams, recent, bias=None, *, logprobs=False):
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
  token, key, *lp = sample_next(logits, key, sparams, recent, bias, logprobs=logprobs)
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
  token, key, *lp = sample_next(logits, key, sparams, recent, bias, logprobs=logprobs)
  return (token, state, key, active, *lp)


def all_logits(params, state, tokens, length, pos, *, backend, kv_len):
  """Logits at every position of a chunk: (f32[B, T, V], state, active)."""
  return backend.prefill(params, state, tokens, length, pos, kv_len=kv_len, all_logits=True)


STEPS = {"prefill": prefill_sample, "prefill_chunk": prefill_chunk, "decode": decode_sample,
         "logits": all_logits,
         "prefill_logprobs": functools.partial(prefill_sample, logprobs=True),
         "decode_logprobs": functools.partial(decode_sample, logprobs=True)}
# The sampling steps as (forward pass, its argument count, log-probs), for `compile_split`; the
# other arguments go to `sample_next`.
SPLIT_STEPS = {"prefill": (prefill_logits, 5, False), "decode": (decode_logits, 4, False),
               "prefill_logprobs": (prefill_logits, 5, True),
               "decode_logprobs": (decode_logits, 4, True)}
# The state (argument 1) is donated to every step: a device KV cache is updated in place. The
# host backend's state is only an id, but donated XLA:CPU runs the step on the calling thread,
# where numba's thread pool lives; on XLA's worker thread the same host pass ran 3x slower
# (BUILD_NOTES.md, issue 10).
DONATE = (1,)


class SplitStep:
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


def shapes(args) -> tuple:
  """((shape, dtype name), ...) of every leaf of `args`: a compile-cache key."""
  return tuple((a.shape, str(a.dtype)) for a in jax.tree_util.tree_leaves(args))


def compile_fused(kind: str, backend, kv_len: int, args: tuple):
  """The step `kind` (a key of STEPS) compiled as one XLA program for these arguments."""
  fn = functools.partial(STEPS[kind], backend=backend, kv_len=kv_len)
  return jax.jit(fn, donate_argnums=DONATE).lower(*args).compile()


def compile_split(kind: str, backend, kv_len: int, args: tuple, *,
                  forward: Callable | None, sampler_options: dict[str, Any],
                  shared: dict) -> SplitStep:
  """The sampling step `kind` (a key of SPLIT_STEPS) as a `SplitStep`.

  Args:
    forward: None (the forward pass is compiled) or a plain function of host values with the
      forward pass's arguments and results, called as is.
    sampler_options: XLA compiler options for the sampler.
    shared: executables shared between steps: the sampler is kept under ("sample", logprobs,
      shapes), one for prefill and decode.
  """
  forward_fn, n, logprobs = SPLIT_STEPS[kind]
  fn = functools.partial(forward_fn, backend=backend, kv_len=kv_len)
  if forward is None:
    forward = jax.jit(fn, donate_argnums=DONATE).lower(*args[:n])
    logits = forward.out_info[0]
    forward = forward.compile()
  else:
    logits = jax.eval_shape(fn, *args[:n])[0]
  sample_key = ("sample", logprobs, shapes((logits, args[n:])))
  sample = shared.get(sample_key)
  if sample is None:
    sample = jax.jit(functools.partial(sample_next, logprobs=logprobs)).lower(
        logits, *args[n:]).compile(sampler_options)
    shared[sample_key] = sample
  return SplitStep(forward, n, sample)
