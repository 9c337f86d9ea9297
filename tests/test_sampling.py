"""Tests of pijax.sampling: cases S1-S5 of ../shared/cases/README.md, jit behaviour, and agreement
with a plain NumPy reference of the llama.cpp chain on every internal path."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pijax import sampling
from pijax.errors import ConfigError
from pijax.sampling import (SamplingParams, apply_repetition_penalty, filtered_probs,
                            make_sampling_params, sample)

S3_PROBS = [0.5, 0.25, 0.125, 0.125]

# i32[n_keys, batch]: one draw per key; module level so that equal shapes share one compile.
_draw_per_key = jax.jit(jax.vmap(sample, in_axes=(None, 0, None)))


def _s3_logits():
  """f32[1, 4]: logits whose softmax is exactly S3_PROBS."""
  return jnp.log(jnp.asarray([S3_PROBS], jnp.float32))


def _kept(probs):
  """Token ids with nonzero probability in f32[1, vocab] probs."""
  return set(np.flatnonzero(np.asarray(probs)[0] > 0).tolist())


def _reference_probs(logits, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0):
  """The llama.cpp chain on one row, sequentially in float64: f64[vocab] final probabilities."""
  logits = np.asarray(logits, np.float64)
  out = np.zeros_like(logits)
  if temperature == 0:
    out[np.argmax(logits)] = 1.0
    return out
  cands = np.argsort(-logits, kind="stable")  # Descending, ties keep lower ids first.
  if top_k > 0:
    cands = cands[:top_k]
  if top_p < 1.0:
    p = np.exp(logits[cands] - logits[cands[0]])
    p /= p.sum()
    cumulative = np.cumsum(p)
    reached = np.flatnonzero(cumulative >= top_p - 1e-9)
    n = reached[0] + 1 if reached.size else len(cands)
    cands = cands[:max(n, 1)]
  if min_p > 0.0:
    ratio = np.exp(logits[cands] - logits[cands[0]])
    cands = cands[ratio >= min_p]
  z = (logits[cands] - logits[cands[0]]) / temperature
  w = np.exp(z)
  out[cands] = w / w.sum()
  return out


# S1 ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_s1_temperature_zero_is_exact_argmax(seed):
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(5, 300)).astype(np.float32) * 4
  logits[rng.random(logits.shape) < 0.3] = -np.inf  # Masked-out tokens.
  logits[0, :] = -np.inf
  logits[0, 7] = 1.0  # A row with a single finite entry.
  logits = jnp.asarray(logits)
  # Filters set too: temperature 0 ignores them.
  params = make_sampling_params(temperature=0.0, top_k=3, top_p=0.1, min_p=0.5)
  expected = np.argmax(np.asarray(logits), axis=1)
  for key_seed in range(3):
    tokens = sample(logits, jax.random.key(key_seed), params)
    assert tokens.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(tokens), expected)
  probs = np.asarray(filtered_probs(logits, params))
  assert not np.isnan(probs).any()
  np.testing.assert_array_equal(probs, np.eye(300, dtype=np.float32)[expected])


def test_s1_tiny_temperature_is_finite_and_greedy_like():
  logits = jnp.asarray([[1.0, 3.0, 2.9, -jnp.inf]])
  params = make_sampling_params(temperature=1e-6)
  probs = np.asarray(filtered_probs(logits, params))
  assert np.isfinite(probs).all()
  np.testing.assert_allclose(probs, [[0.0, 1.0, 0.0, 0.0]], atol=1e-6)
  assert int(sample(logits, jax.random.key(0), params)[0]) == 1


# S2 ---------------------------------------------------------------------------------------------


def test_s2_top_k_zero_is_off():
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(1, 1000)) * 0.1, jnp.float32)
  params = make_sampling_params(temperature=1.0, top_k=0)
  tokens = {int(sample(logits, jax.random.key(seed), params)[0]) for seed in range(10)}
  assert len(tokens) > 1
  assert _kept(filtered_probs(logits, params)) == set(range(1000))


# S3 ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("top_p, kept", [
    (0.75, {0, 1}),
    (0.6, {0, 1}),
    (0.5, {0}),
    (0.0, {0}),
    (1.0, {0, 1, 2, 3}),
])
def test_s3_top_p_kept_sets(top_p, kept):
  probs = filtered_probs(_s3_logits(), make_sampling_params(temperature=1.0, top_p=top_p))
  assert _kept(probs) == kept
  np.testing.assert_allclose(np.asarray(probs).sum(), 1.0, rtol=1e-6)


@pytest.mark.parametrize("min_p, kept", [(0.3, {0, 1}), (0.0, {0, 1, 2, 3}), (1.0, {0})])
def test_s3_min_p_kept_sets(min_p, kept):
  probs = filtered_probs(_s3_logits(), make_sampling_params(temperature=1.0, min_p=min_p))
  assert _kept(probs) == kept


@pytest.mark.parametrize("top_k, kept", [(1, {0}), (2, {0, 1}), (4, {0, 1, 2, 3}),
                                         (100, {0, 1, 2, 3})])
def test_top_k_kept_sets(top_k, kept):
  probs = filtered_probs(_s3_logits(), make_sampling_params(temperature=1.0, top_k=top_k))
  assert _kept(probs) == kept


def test_top_p_renormalises_after_top_k():
  # After top_k 2 the distribution is {2/3, 1/3}; top_p 0.6 then keeps only the first token.
  params = make_sampling_params(temperature=1.0, top_k=2, top_p=0.6)
  np.testing.assert_allclose(np.asarray(filtered_probs(_s3_logits(), params)), [[1, 0, 0, 0]])


def test_top_p_zero_with_tied_maximum_keeps_exactly_one():
  params = make_sampling_params(temperature=1.0, top_p=0.0)
  logits = jnp.asarray([[1.0, 3.0, 3.0, 3.0]])
  np.testing.assert_array_equal(np.asarray(filtered_probs(logits, params)), [[0, 1, 0, 0]])
  wide = np.zeros((1, 1000), np.float32)
  wide[0, [5, 900]] = 2.0
  assert _kept(filtered_probs(jnp.asarray(wide), params)) == {5}
  for seed in range(5):
    assert int(sample(logits, jax.random.key(seed), params)[0]) == 1
    assert int(sample(jnp.asarray(wide), jax.random.key(seed), params)[0]) == 5


def test_temperature_applies_after_filters():
  params = make_sampling_params(temperature=2.0, top_k=2)
  probs = np.asarray(filtered_probs(_s3_logits(), params))[0]
  # logits / 2 over {0.5, 0.25}: weights sqrt(0.5), sqrt(0.25).
  w = np.sqrt([0.5, 0.25])
  np.testing.assert_allclose(probs, [*(w / w.sum()), 0, 0], rtol=1e-6)


# S4 ---------------------------------------------------------------------------------------------


def test_s4_repetition_penalty_rule():
  logits = jnp.asarray([[2.0, -2.0]])
  seen = jnp.asarray([[0, 1]], jnp.int32)
  np.testing.assert_array_equal(
      np.asarray(apply_repetition_penalty(logits, seen, 2.0)), [[1.0, -4.0]])
  np.testing.assert_array_equal(np.asarray(apply_repetition_penalty(logits, seen, 1.0)),
                                np.asarray(logits))


def test_s4_padding_ignored_and_duplicates_penalised_once():
  logits = jnp.asarray([[2.0, -2.0, 3.0, 0.5], [2.0, -2.0, 3.0, 0.5]])
  recent = jnp.asarray([[2, 2, 2, -1, -1], [-1, -1, -1, -1, 1]], jnp.int32)
  out = np.asarray(apply_repetition_penalty(logits, recent, 2.0))
  np.testing.assert_array_equal(out, [[2.0, -2.0, 1.5, 0.5], [2.0, -4.0, 3.0, 0.5]])


def test_s4_out_of_range_ids_ignored():
  logits = jnp.asarray([[2.0, -2.0]])
  out = apply_repetition_penalty(logits, jnp.asarray([[2, 5, -3]], jnp.int32), 2.0)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(logits))


def test_s4_penalty_changes_greedy_choice_inside_sample():
  logits = jnp.asarray([[2.0, 1.5, -1.0]])
  recent = jnp.asarray([[0, -1]], jnp.int32)
  assert int(sample(logits, jax.random.key(0), make_sampling_params())[0]) == 0
  params = make_sampling_params(repeat_penalty=2.0)
  assert int(sample(logits, jax.random.key(0), params, recent)[0]) == 1
  np.testing.assert_array_equal(
      np.asarray(filtered_probs(logits, params, recent)), [[0.0, 1.0, 0.0]])


@pytest.mark.parametrize("penalty", [0.0, -1.0, float("nan"), float("inf")])
def test_s4_bad_penalty_rejected(penalty):
  with pytest.raises(ConfigError, match="repeat_penalty"):
    make_sampling_params(repeat_penalty=penalty)


# S5 ---------------------------------------------------------------------------------------------


def test_s5_same_seed_same_tokens_different_seeds_differ():
  logits = jnp.asarray(np.random.default_rng(1).normal(size=(4, 1000)) * 0.1, jnp.float32)
  params = make_sampling_params(temperature=1.0, top_p=0.9, min_p=0.01)
  a = sample(logits, jax.random.key(42), params)
  b = sample(logits, jax.random.key(42), params)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  others = [np.asarray(sample(logits, jax.random.key(seed), params)) for seed in range(5)]
  assert any(not np.array_equal(np.asarray(a), o) for o in others)


# Jit ----------------------------------------------------------------------------------------------


def test_jitted_sample_compiles_once_for_all_parameter_values():
  traces = []

  def traced_sample(logits, key, params, recent):
    traces.append(1)  # Runs once per trace, not per call.
    return sample(logits, key, params, recent)

  draw = jax.jit(traced_sample)
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 500)), jnp.float32)
  recent = jnp.asarray([[1, 2, -1], [3, 3, 4]], jnp.int32)
  settings = [
      dict(),
      dict(temperature=0.7),
      dict(temperature=1.0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1),
      dict(temperature=1.3, top_k=400),
      dict(temperature=0.5, top_p=0.999),
      dict(temperature=2.0, min_p=0.2, repeat_penalty=0.8),
  ]
  for i, kw in enumerate(settings):
    draw(logits, jax.random.key(i), make_sampling_params(**kw), recent).block_until_ready()
  assert len(traces) == 1
  assert draw._cache_size() == 1


def test_sampling_params_is_a_pytree_of_scalars():
  params = make_sampling_params(temperature=0.5, top_k=3)
  leaves = jax.tree_util.tree_leaves(params)
  assert len(leaves) == 7 and all(leaf.shape == () for leaf in leaves)
  assert params.top_k.dtype == jnp.int32 and params.temperature.dtype == jnp.float32
  assert isinstance(jax.tree_util.tree_map(lambda x: x, params), SamplingParams)


# Statistics and agreement with the reference -----------------------------------------------------


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_k=3)])
def test_empirical_frequencies_match_distribution(kw):
  logits = jnp.asarray([[1.0, 0.2, -0.5, 0.7, -1.5]])
  params = make_sampling_params(**kw)
  keys = jax.random.split(jax.random.key(0), 4000)
  draws = _draw_per_key(logits, keys, params)[:, 0]
  freq = np.bincount(np.asarray(draws), minlength=5) / 4000
  expected = _reference_probs(np.asarray(logits[0]), **kw)
  if kw == dict(temperature=1.0):
    np.testing.assert_allclose(expected, np.asarray(jax.nn.softmax(logits[0])), atol=1e-6)
  assert np.max(np.abs(freq - expected)) < 0.03, (freq, expected)


def _path_cases():
  """(name, logits f32[batch, vocab], kwargs) covering the no-sort, partial and full-sort paths."""
  rng = np.random.default_rng(7)
  peaked = (rng.normal(size=(3, 2000)) * 3).astype(np.float32)
  flat = (rng.normal(size=(3, 2000)) * 0.2).astype(np.float32)
  small = rng.normal(size=(3, 6)).astype(np.float32)
  return [
      ("small_vocab", small, dict(temperature=0.8, top_k=4, top_p=0.7, min_p=0.1)),
      ("no_filter", peaked, dict(temperature=1.2)),
      ("partial_top_k", peaked, dict(temperature=0.7, top_k=40, top_p=0.95)),
      ("partial_min_p", peaked, dict(temperature=1.0, min_p=0.05)),
      ("partial_top_p", peaked, dict(temperature=1.0, top_p=0.5)),
      ("full_top_k", flat, dict(temperature=1.0, top_k=700)),
      ("full_top_p", flat, dict(temperature=0.9, top_p=0.8)),
      ("full_min_p", flat, dict(temperature=1.0, min_p=0.5)),
      ("full_all", flat, dict(temperature=1.5, top_k=1500, top_p=0.9, min_p=0.6)),
  ]


@pytest.mark.parametrize("name, logits, kw", _path_cases(), ids=[c[0] for c in _path_cases()])
def test_filtered_probs_match_reference_on_every_path(name, logits, kw):
  del name
  probs = np.asarray(filtered_probs(jnp.asarray(logits), make_sampling_params(**kw)))
  for row in range(logits.shape[0]):
    expected = _reference_probs(logits[row], **kw)
    assert _kept(probs[row:row + 1]) == _kept(expected[None]), row
    np.testing.assert_allclose(probs[row], expected, atol=1e-5)


@pytest.mark.parametrize("name, logits, kw", _path_cases(), ids=[c[0] for c in _path_cases()])
def test_samples_stay_in_kept_set_on_every_path(name, logits, kw):
  del name
  logits = jnp.asarray(logits)
  params = make_sampling_params(**kw)
  kept = np.asarray(filtered_probs(logits, params)) > 0
  draws = np.asarray(_draw_per_key(logits, jax.random.split(jax.random.key(1), 64), params))
  for row in range(logits.shape[0]):
    assert kept[row, draws[:, row]].all()


def test_partial_sort_candidate_count_is_exercised():
  # The path cases rely on vocab 2000 being larger than the partial-sort prefix.
  assert sampling._CANDIDATES < 700 < 2000


# Validation -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, name", [
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=-0.1), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(top_k=-3), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_p=float("nan")), "min_p"),
    (dict(temperature="hot"), "temperature"),
])
def test_invalid_params_raise_config_error(kw, name):
  with pytest.raises(ConfigError, match=name) as err:
    make_sampling_params(**kw)
  message = str(err.value)
  assert "\n" not in message
  assert repr(next(iter(kw.values()))) in message


def test_valid_edges_accepted():
  params = make_sampling_params(temperature=0, top_k=np.int64(5), top_p=0, min_p=1,
                                repeat_penalty=1e-3)
  assert int(params.top_k) == 5 and float(params.top_p) == 0.0
  assert math.isclose(float(params.repeat_penalty), 1e-3, rel_tol=1e-6)


def test_bad_shapes_raise_value_error():
  params = make_sampling_params()
  with pytest.raises(ValueError, match="batch"):
    sample(jnp.zeros((5,)), jax.random.key(0), params)
  with pytest.raises(ValueError, match="recent_tokens"):
    sample(jnp.zeros((2, 5)), jax.random.key(0), params, jnp.zeros((3, 4), jnp.int32))


# Additive bias (logit_bias, grammar masks) -------------------------------------------------------


def test_bias_is_applied_per_row():
  """Each row follows its own bias: -inf bans, +100 forces, zeros change nothing."""
  logits = jnp.asarray([[3.0, 1.0, 0.5, 0.0]] * 3)
  bias = np.zeros((3, 4), np.float32)
  bias[0, 0] = -np.inf  # Row 0: the greedy token banned.
  bias[1, 2] = 100.0  # Row 1: token 2 forced.
  greedy = make_sampling_params(temperature=0)
  assert np.asarray(sample(logits, jax.random.key(0), greedy, None, jnp.asarray(bias))).tolist() \
      == [1, 2, 0]
  hot = make_sampling_params(temperature=1.5, top_k=3, top_p=0.9, min_p=0.01)
  mask = np.full((3, 4), -np.inf, np.float32)
  mask[0, [1, 3]] = 0.0  # Row 0 may only say 1 or 3; row 1 only 2; row 2 only 0.
  mask[1, 2] = 0.0
  mask[2, 0] = 0.0
  draws = np.asarray(_draw_per_key_biased(logits, jax.random.split(jax.random.key(1), 200), hot,
                                          None, jnp.asarray(mask)))
  assert set(draws[:, 0]) == {1, 3} and set(draws[:, 1]) == {2} and set(draws[:, 2]) == {0}


_draw_per_key_biased = jax.jit(jax.vmap(sample, in_axes=(None, 0, None, None, None)))


@pytest.mark.parametrize("name, logits, kw", _path_cases(), ids=[c[0] for c in _path_cases()])
def test_biased_probs_match_the_reference_on_biased_logits(name, logits, kw):
  """The bias is added before every filter: the same as sampling from logits + bias."""
  del name
  rng = np.random.default_rng(3)
  bias = rng.normal(size=logits.shape).astype(np.float32)
  bias[rng.random(logits.shape) < 0.3] = -np.inf  # A grammar's mask, different in every row.
  params = make_sampling_params(**kw)
  got = np.asarray(filtered_probs(jnp.asarray(logits), params, None, jnp.asarray(bias)))
  want = np.asarray(filtered_probs(jnp.asarray(logits + bias), params))
  np.testing.assert_allclose(got, want, atol=1e-6)
  assert (got[~np.isfinite(bias)] == 0).all()


def test_bias_comes_after_the_penalties():
  """A seen token's +bias is not divided by the repetition penalty; -inf stays -inf."""
  logits = jnp.asarray([[2.0, 1.0, 0.0]])
  recent = jnp.asarray([[0, 1]], jnp.int32)
  params = make_sampling_params(temperature=0, repeat_penalty=4.0)
  bias = jnp.asarray([[0.0, 1.2, 0.0]])  # 2/4 = 0.5 < 1/4 + 1.2 = 1.45: token 1.
  assert int(sample(logits, jax.random.key(0), params, recent, bias)[0]) == 1
  banned = jnp.asarray([[-jnp.inf, -jnp.inf, 0.0]])
  assert int(sample(logits, jax.random.key(0), params, recent, banned)[0]) == 2


def test_bias_shape_is_checked():
  with pytest.raises(ValueError, match="bias"):
    sample(jnp.zeros((2, 5)), jax.random.key(0), make_sampling_params(), None,
           jnp.zeros((1, 5)))
