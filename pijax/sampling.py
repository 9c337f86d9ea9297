"""Seeded, jittable token sampling: repetition penalty, greedy, top-k, top-p, min-p, temperature.

The chain follows llama.cpp's default order:

  repetition penalty -> additive bias -> (temperature == 0: argmax) -> top_k -> top_p -> min_p
  -> temperature -> categorical draw with the caller's PRNG key.

The optional bias, f32[batch, vocab], is per row: OpenAI's logit_bias plus -inf on the tokens a
grammar forbids (`pijax.grammar`), so rows of a batch may follow different constraints.

Every knob lives in `SamplingParams` as a JAX scalar (a pytree leaf, never a static argument), so
a jitted `sample` compiles once per (batch, vocab, n_recent) shape whatever the parameter values.
Validation happens on the host in `make_sampling_params`, which raises `ConfigError`. The public
functions are jitted (one compile per shape) and may be called inside a caller's jit.

Greedy decoding is an exact `argmax` selected with `lax.cond`, so it never divides by the
temperature and never sorts. The stochastic branch filters in descending-probability order and
sorts at most once: not at all when no filter is on, only the `_CANDIDATES` most likely tokens
(`lax.top_k`) when the kept set provably lies among them (the usual case: top_k 40, top_p 0.95,
min_p 0.05), and the whole vocabulary otherwise (a full sort, many times slower on CPU).

Conventions (all rows of a batch share one `SamplingParams`):
  * top_k: keep the k most likely tokens; 0 (or k >= vocab) means off.
  * top_p: after top_k, renormalise and keep the smallest most-likely-first prefix whose
    cumulative probability reaches top_p (always at least one token); 1 means off, 0 keeps
    exactly the most likely token. Ties keep the lower token id first (as `argmax` does).
  * min_p: keep tokens with p >= min_p * p_max; 0 means off.
  * repeat_penalty: CTRL / llama.cpp rule on every token id in `recent_tokens`; 1 means off.
  * presence_penalty / frequency_penalty: OpenAI's additive rule over the same recent tokens,
    logit -= presence * [count > 0] + frequency * count (as llama.cpp applies them); 0 means off.
"""

from __future__ import annotations

import math
import numbers

import flax.struct
import jax
import numpy as np
import jax.numpy as jnp
from jax import lax

from pijax.errors import ConfigError

# top_p boundary slack: a prefix whose f32 cumulative probability is within this of top_p counts as
# reaching it, so softmax rounding (0.7499999 vs 0.75) does not keep one token too many.
_TOP_P_EPS = 1e-6
_INT32_MAX = 2**31 - 1
# How many of the most likely tokens the partial-sort path looks at (lax.top_k, not a full sort).
_CANDIDATES = 256
_TINY = 1e-30


@flax.struct.dataclass
class SamplingParams:
  """Sampling knobs, all JAX scalars (traced under jit: new values never recompile).

  Attributes:
    temperature: f32[]; 0 means greedy (exact argmax).
    top_k: i32[]; 0 means off.
    top_p: f32[] in [0, 1]; 1 means off, 0 keeps only the most likely token.
    min_p: f32[] in [0, 1]; 0 means off.
    repeat_penalty: f32[] > 0; 1 means off.
    presence_penalty: f32[] in [-2, 2]; 0 means off.
    frequency_penalty: f32[] in [-2, 2]; 0 means off.
  """
  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  min_p: jax.Array
  repeat_penalty: jax.Array
  presence_penalty: jax.Array
  frequency_penalty: jax.Array


def _as_float(name: str, value, valid: str) -> float:
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ConfigError(f"{name}={value!r} is not a number; {name} must be {valid}.")
  return float(value)


def _f32_ok(value: float, *, allow_zero: bool) -> bool:
  """The value survives the cast to float32: finite, and non-zero unless it was zero."""
  with np.errstate(over="ignore", under="ignore"):
    v = float(np.float32(value))
  return math.isfinite(v) and (v != 0.0 or (allow_zero and value == 0.0)) and \
      (value == 0.0 or 1e-30 <= abs(v) <= 1e30)


def make_sampling_params(
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repeat_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
) -> SamplingParams:
  """Validates sampling settings on the host and packs them as JAX scalars.

  Args:
    temperature: >= 0 and finite; 0 means greedy.
    top_k: integer >= 0; 0 means off.
    top_p: in [0, 1]; 1 means off.
    min_p: in [0, 1]; 0 means off.
    repeat_penalty: finite and > 0; 1 means off.
    presence_penalty, frequency_penalty: in [-2, 2] (OpenAI's range); 0 means off.

  Returns:
    A `SamplingParams` of f32/i32 scalars.

  Raises:
    ConfigError: a value is out of range, NaN, or of the wrong type (the message names it).
  """
  valid = "a finite number >= 0 (0 = greedy)"
  t = _as_float("temperature", temperature, valid)
  if not (math.isfinite(t) and t >= 0.0) or not _f32_ok(t, allow_zero=True):
    raise ConfigError(f"temperature={temperature!r} is invalid; temperature must be {valid}, "
                      "and 0 or within [1e-30, 1e30] (float32).")

  valid = f"an integer in [0, {_INT32_MAX}] (0 = off)"
  if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
    raise ConfigError(f"top_k={top_k!r} is not an integer; top_k must be {valid}.")
  if not 0 <= int(top_k) <= _INT32_MAX:
    raise ConfigError(f"top_k={top_k!r} is invalid; top_k must be {valid}.")

  valid = "a number in [0, 1] (1 = off)"
  p = _as_float("top_p", top_p, valid)
  if not 0.0 <= p <= 1.0:  # False for NaN.
    raise ConfigError(f"top_p={top_p!r} is invalid; top_p must be {valid}.")

  valid = "a number in [0, 1] (0 = off)"
  m = _as_float("min_p", min_p, valid)
  if not 0.0 <= m <= 1.0:
    raise ConfigError(f"min_p={min_p!r} is invalid; min_p must be {valid}.")

  valid = "a finite number > 0 (1 = off)"
  r = _as_float("repeat_penalty", repeat_penalty, valid)
  if not (math.isfinite(r) and r > 0.0) or not _f32_ok(r, allow_zero=False):
    raise ConfigError(
        f"repeat_penalty={repeat_penalty!r} is invalid; repeat_penalty must be {valid}, "
        "within [1e-30, 1e30] (float32).")

  additive = []
  for name, value in (("presence_penalty", presence_penalty),
                      ("frequency_penalty", frequency_penalty)):
    valid = "a number in [-2, 2] (0 = off)"
    v = _as_float(name, value, valid)
    if not -2.0 <= v <= 2.0:
      raise ConfigError(f"{name}={value!r} is invalid; {name} must be {valid}.")
    additive.append(v)

  return SamplingParams(
      temperature=jnp.asarray(t, jnp.float32),
      top_k=jnp.asarray(int(top_k), jnp.int32),
      top_p=jnp.asarray(p, jnp.float32),
      min_p=jnp.asarray(m, jnp.float32),
      repeat_penalty=jnp.asarray(r, jnp.float32),
      presence_penalty=jnp.asarray(additive[0], jnp.float32),
      frequency_penalty=jnp.asarray(additive[1], jnp.float32),
  )


def _check_shapes(logits: jax.Array, recent_tokens: jax.Array | None) -> None:
  if logits.ndim != 2:
    raise ValueError(
        f"logits must be f32[batch, vocab], got shape {logits.shape}; add a batch axis.")
  if recent_tokens is not None and (
      recent_tokens.ndim != 2 or recent_tokens.shape[0] != logits.shape[0]):
    raise ValueError(
        f"recent_tokens must be i32[batch, n] with batch={logits.shape[0]}, "
        f"got shape {recent_tokens.shape}.")


def _recent_counts(logits: jax.Array, recent_tokens: jax.Array) -> jax.Array:
  """f32[batch, vocab]: how often each token id occurs in that row's recent tokens."""
  batch, vocab = logits.shape
  # Padding would wrap around as a negative index: send it out of range, where 'drop' skips it.
  ids = jnp.where(recent_tokens < 0, vocab, recent_tokens)
  rows = jnp.arange(batch, dtype=jnp.int32)[:, None]
  return jnp.zeros((batch, vocab), logits.dtype).at[rows, ids].add(1.0, mode="drop")


def _repetition(logits, counts, penalty):
  penalty = jnp.asarray(penalty, logits.dtype)
  penalised = jnp.where(logits > 0, logits / penalty, logits * penalty)
  return jnp.where(counts > 0, penalised, logits)


def _presence_frequency(logits, counts, presence, frequency):
  presence = jnp.asarray(presence, logits.dtype)
  frequency = jnp.asarray(frequency, logits.dtype)
  return logits - jnp.where(counts > 0, presence + frequency * counts, 0.0)


@jax.jit
def apply_repetition_penalty(
    logits: jax.Array, recent_tokens: jax.Array, penalty: jax.Array | float) -> jax.Array:
  """Penalises every token id seen in `recent_tokens` (CTRL / llama.cpp rule).

  A seen token's logit is divided by `penalty` when positive and multiplied by it otherwise, once
  per id however often it repeats. Ids < 0 (padding) or >= vocab are ignored. `penalty` 1 is an
  exact no-op.

  Args:
    logits: f32[batch, vocab].
    recent_tokens: i32[batch, n]; entries < 0 are padding.
    penalty: f32[] > 0 (validated by `make_sampling_params`).

  Returns:
    f32[batch, vocab], the penalised logits.
  """
  logits = jnp.asarray(logits)
  recent_tokens = jnp.asarray(recent_tokens, jnp.int32)
  _check_shapes(logits, recent_tokens)
  return _repetition(logits, _recent_counts(logits, recent_tokens), penalty)


@jax.jit
def apply_presence_frequency_penalty(
    logits: jax.Array, recent_tokens: jax.Array, presence: jax.Array | float,
    frequency: jax.Array | float) -> jax.Array:
  """OpenAI's additive penalties: logit -= presence * [count > 0] + frequency * count.

  Counts are taken over `recent_tokens` (llama.cpp's penalty window; OpenAI API reference,
  "Parameter details"). Ids < 0 or >= vocab are ignored; both penalties 0 is an exact no-op.

  Args:
    logits: f32[batch, vocab].
    recent_tokens: i32[batch, n]; entries < 0 are padding.
    presence, frequency: f32[] (validated by `make_sampling_params`).

  Returns:
    f32[batch, vocab].
  """
  logits = jnp.asarray(logits)
  recent_tokens = jnp.asarray(recent_tokens, jnp.int32)
  _check_shapes(logits, recent_tokens)
  return _presence_frequency(logits, _recent_counts(logits, recent_tokens), presence,
                             frequency)


def _filter_sorted(
    sorted_logits: jax.Array,
    max_logit: jax.Array,
    norm: jax.Array,
    k: jax.Array,
    params: SamplingParams,
) -> tuple[jax.Array, jax.Array]:
  """Applies top_k, top_p, min_p and temperature to a descending-sorted prefix of each row.

  Args:
    sorted_logits: f32[batch, m], the m largest logits of each row in descending order (m may be
      the whole vocabulary).
    max_logit: f32[batch, 1], the row maximum (0 where it is not finite).
    norm: f32[batch, 1] > 0, sum of exp(logit - max_logit) over the top_k survivors of the whole
      row, so that top_p sees the renormalised top_k distribution.
    k: i32[], the effective top_k (vocab when top_k is off).
    params: `SamplingParams` with temperature > 0.

  Returns:
    (scaled, mass): scaled f32[batch, m], the final logits in sorted order (-inf where filtered
    out); mass f32[batch], the top_k-renormalised probability of all m positions, which tells
    whether top_p would keep anything past the prefix.
  """
  rank = lax.broadcasted_iota(jnp.int32, sorted_logits.shape, 1)
  keep = rank < k
  shifted = sorted_logits - max_logit  # <= 0, with 0 at position 0.
  ratio = jnp.exp(shifted)  # p / p_max.
  probs = jnp.where(keep, ratio, 0.0) / norm
  cumulative = jnp.cumsum(probs, axis=1)
  # top_p: keep a position while the mass before it is still short of top_p.
  keep &= (params.top_p >= 1.0) | (cumulative - probs + _TOP_P_EPS < params.top_p)
  # min_p: p >= min_p * p_max.
  keep &= ratio >= params.min_p
  keep |= rank == 0  # The most likely token always survives.
  # Temperature last. The max is shifted to 0, so a tiny temperature cannot overflow to +inf.
  scaled = jnp.where(keep, shifted / params.temperature, -jnp.inf)
  return scaled, cumulative[:, -1]


def _stochastic(logits: jax.Array, params: SamplingParams, finish):
  """Runs top_k -> top_p -> min_p -> temperature, sorting only as much as needed.

  Three `lax.cond` paths give the same distribution:
    * no filter active: no sort at all;
    * the kept tokens provably lie in the `_CANDIDATES` most likely (top_k <= _CANDIDATES, or top_p
      or min_p already exhausted there): a partial `lax.top_k`;
    * otherwise one full sort of the vocabulary.

  Args:
    logits: f32[batch, vocab], already penalised.
    params: `SamplingParams` with temperature > 0.
    finish: (scaled f32[batch, m], ids i32[batch, m]) -> result; `scaled` are the final logits
      (-inf where filtered out) of the tokens `ids`, in any order.

  Returns:
    `finish`'s result for whichever path ran.
  """
  batch, vocab = logits.shape
  logits = logits.astype(jnp.float32)
  k = jnp.where((params.top_k <= 0) | (params.top_k > vocab), vocab, params.top_k)
  max_logit = jnp.max(logits, axis=1, keepdims=True)
  max_logit = jnp.where(jnp.isfinite(max_logit), max_logit, 0.0)
  iota = lax.broadcasted_iota(jnp.int32, (batch, vocab), 1)

  def unfiltered(logits):
    return finish((logits - max_logit) / params.temperature, iota)

  def full_sort(logits):
    # [batch, vocab] each: logits in descending order (stable: ties keep lower ids first), ids.
    neg_sorted, ids = lax.sort((-logits, iota), dimension=1, num_keys=1)
    sorted_logits = -neg_sorted
    norm = jnp.sum(jnp.where(iota < k, jnp.exp(sorted_logits - max_logit), 0.0), axis=1,
                   keepdims=True)
    scaled, _ = _filter_sorted(sorted_logits, max_logit, jnp.maximum(norm, _TINY), k, params)
    return finish(scaled, ids)

  def filtered(logits):
    m = min(_CANDIDATES, vocab)
    # [batch, m] each: the m largest logits, descending (ties keep lower ids first), and their ids.
    top_logits, top_ids = lax.top_k(logits, m)
    top_ratio = jnp.exp(top_logits - max_logit)
    rank = lax.broadcasted_iota(jnp.int32, (batch, m), 1)
    norm = jnp.where(
        k <= m,
        jnp.sum(jnp.where(rank < k, top_ratio, 0.0), axis=1, keepdims=True),
        jnp.sum(jnp.exp(logits - max_logit), axis=1, keepdims=True))
    scaled, mass = _filter_sorted(top_logits, max_logit, jnp.maximum(norm, _TINY), k, params)
    # The prefix holds every kept token when top_k stops inside it, when top_p keeps nothing past
    # it (same test as in _filter_sorted), or when even its smallest token fails min_p.
    fits = ((k <= m)
            | ((k == vocab) & (params.top_p < 1.0) & ~(mass + _TOP_P_EPS < params.top_p))
            | ((k == vocab) & (top_ratio[:, -1] < params.min_p)))
    return lax.cond(jnp.all(fits), lambda: finish(scaled, top_ids), lambda: full_sort(logits))

  no_filter = (k == vocab) & (params.top_p >= 1.0) & (params.min_p <= 0.0)
  return lax.cond(no_filter, unfiltered, filtered, logits)


def _penalise(logits, params, recent_tokens, bias=None):
  logits = jnp.asarray(logits)
  if recent_tokens is not None:
    recent_tokens = jnp.asarray(recent_tokens, jnp.int32)
  _check_shapes(logits, recent_tokens)
  if bias is not None and (bias.ndim != 2 or bias.shape[0] != logits.shape[0] or
                           bias.shape[1] != logits.shape[1]):
    raise ValueError(f"bias must be f32[batch, vocab] = {logits.shape}, got shape "
                     f"{bias.shape}.")
  if recent_tokens is not None:
    counts = _recent_counts(logits, recent_tokens)  # One scatter per step for both rules.
    logits = _repetition(logits, counts, params.repeat_penalty)
    logits = _presence_frequency(logits, counts, params.presence_penalty,
                                 params.frequency_penalty)
  if bias is not None:
    # After the penalties (llama.cpp adds logit_bias before them): a bias is the caller's last
    # word on a token, never divided by the repetition penalty.
    logits = logits + jnp.asarray(bias, logits.dtype)
  return logits


@jax.jit
def sample(
    logits: jax.Array,
    key: jax.Array,
    params: SamplingParams,
    recent_tokens: jax.Array | None = None,
    bias: jax.Array | None = None,
) -> jax.Array:
  """Draws one token per row (jittable; `params` may be traced).

  Args:
    logits: f32[batch, vocab], the model's next-token logits.
    key: a PRNG key; the same key, logits and params give the same tokens.
    params: a `SamplingParams` (see `make_sampling_params`).
    recent_tokens: optional i32[batch, n] token ids for the repetition penalty; < 0 is padding.
    bias: optional f32[batch, vocab] added to each row's logits after the penalties and before
      every filter: OpenAI's logit_bias, and -inf on tokens a grammar forbids
      (`pijax.grammar`). Each row has its own. None compiles the same program as before.

  Returns:
    i32[batch], the sampled token ids (never a -inf token while the row has a finite one).
  """
  logits = _penalise(logits, params, recent_tokens, bias)

  def greedy(logits, key):
    del key
    return jnp.argmax(logits, axis=1).astype(jnp.int32)

  def stochastic(logits, key):
    def finish(scaled, ids):
      position = jax.random.categorical(key, scaled, axis=1)  # [batch]
      return jnp.take_along_axis(ids, position[:, None], axis=1)[:, 0].astype(jnp.int32)
    return _stochastic(logits, params, finish)

  return lax.cond(params.temperature <= 0, greedy, stochastic, logits, key)


@jax.jit
def filtered_probs(
    logits: jax.Array,
    params: SamplingParams,
    recent_tokens: jax.Array | None = None,
    bias: jax.Array | None = None,
) -> jax.Array:
  """The distribution `sample` draws from, in token-id order (for tests and inspection).

  Args:
    logits: f32[batch, vocab].
    params: a `SamplingParams`.
    recent_tokens: optional i32[batch, n], as for `sample`.
    bias: optional f32[batch, vocab], as for `sample`.

  Returns:
    f32[batch, vocab]: probabilities after the penalty, all filters and temperature, exactly 0 for
    filtered tokens; a one-hot at the argmax when temperature is 0.
  """
  logits = _penalise(logits, params, recent_tokens, bias)
  vocab = logits.shape[1]

  def greedy(logits):
    return jax.nn.one_hot(jnp.argmax(logits, axis=1), vocab, dtype=jnp.float32)

  def stochastic(logits):
    def finish(scaled, ids):
      probs = jax.nn.softmax(scaled, axis=1)  # [batch, m]
      rows = jnp.arange(logits.shape[0])[:, None]
      return jnp.zeros(logits.shape, jnp.float32).at[rows, ids].set(probs)
    return _stochastic(logits, params, finish)

  return lax.cond(params.temperature <= 0, greedy, stochastic, logits)
