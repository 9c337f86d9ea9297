"""One generation's sampler on the host: the state `pijax.sampling.sample` is called with, carried
from token to token — the checked sampling params, the PRNG key, the window of recent tokens the
repetition penalties look at, and the grammar / logit_bias constraint (`pijax.grammar`) whose
bias each step adds to the logits."""

from __future__ import annotations

import collections
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pijax import sampling as sampling_lib
from pijax.errors import ConfigError


def check_int(name: str, value: Any, minimum: int) -> int:
  """value as an int >= minimum (bools refused), else ConfigError naming it."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}.")
  return int(value)


def prng_seed(seed: Any) -> int:
  """The 32 bits of a seed that the PRNG key uses (llama.cpp seeds are uint32 too).

  Raises:
    ConfigError: not an integer in [-2**63, 2**63).
  """
  seed = check_int("seed", seed, -(2 ** 63))
  if seed >= 2 ** 63:
    raise ConfigError(f"seed={seed} must be below 2**63.")
  return seed & 0xFFFFFFFF


class Sampler:
  """What one generation samples with (`Model.generate_ids`).

  Args:
    temperature, top_k, top_p, min_p, repeat_penalty, presence_penalty, frequency_penalty:
      see `pijax.sampling.make_sampling_params`.
    repeat_last_n: how many recent tokens (prompt included) the penalties look at, >= 1.
    seed: PRNG seed, an integer in [-2**63, 2**63) (its low 32 bits are used).

  Raises:
    ConfigError: an invalid value (the message names it).
  """

  def __init__(self, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               min_p: float = 0.0, repeat_penalty: float = 1.0,
               presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
               repeat_last_n: int = 64, seed: int = 0):
    self.repeat_last_n = check_int("repeat_last_n", repeat_last_n, 1)
    self.seed = prng_seed(seed)
    self.params = sampling_lib.make_sampling_params(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty)
    self.constraint = None  # A `pijax.grammar.Constraint` (`constrain`), or None.
    self.key = None  # The PRNG key, from `start` on; each step returns the next one.
    self._recent: collections.deque | None = None
    self._fixed_bias: tuple | None = None

  def constrain(self, tokenizer: Any, vocab_size: int, *,
                logit_bias: dict[int, float] | None = None, response_format: Any = None
                ) -> None:
    """Adds OpenAI's logit_bias and / or a response_format grammar (`pijax.grammar`).

    Raises:
      ConfigError: an invalid logit_bias. GrammarError: a response_format that does not compile.
    """
    if logit_bias or response_format is not None:
      from pijax import grammar as grammar_lib
      self.constraint = grammar_lib.make_constraint(
          tokenizer, vocab_size, response_format=response_format, logit_bias=logit_bias)

  def start(self, ids: Sequence[int]) -> None:
    """Starts a generation after the prompt `ids`: a fresh key, the penalties' window."""
    self._recent = collections.deque([-1] * self.repeat_last_n, maxlen=self.repeat_last_n)
    self._recent.extend(ids[-self.repeat_last_n:])
    self.key = jax.random.PRNGKey(self.seed)
    # A logit_bias alone never changes, so it is sent to the device once.
    self._fixed_bias = None
    if self.constraint is not None and self.constraint.fixed:
      self._fixed_bias = self._bias()

  def _bias(self) -> tuple:
    """() or (f32[1, V],): the bias of the next token (`pijax.grammar.Constraint.bias`)."""
    if self.constraint is None:
      return ()
    return (jnp.asarray(self.constraint.bias()[None]),)

  def args(self) -> tuple:
    """The sampling arguments of the next step: (key, params, recent i32[1, W]) and, when
    constrained, the bias f32[1, V]."""
    recent = jnp.asarray(np.asarray(self._recent, np.int32)[None])
    bias = self._fixed_bias if self._fixed_bias is not None else self._bias()
    return (self.key, self.params, recent, *bias)

  def accept(self, token: int) -> None:
    """Moves past a sampled token: into the penalties' window, and the grammar's state."""
    self._recent.append(token)
    if self.constraint is not None:  # The grammar moves past the token before the next mask.
      self.constraint.advance(token)
