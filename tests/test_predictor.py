"""Tests of pijax.offline.predictor on synthetic data (fast: no model, no corpus)."""

import math

import numpy as np
import pytest

from pijax.offline import predictor as pred
from pijax.errors import ConfigError

LADDER = (4, 8, 16, 32)
# Planted-teacher training budget: N_train = 4200 tokens -> 16 steps/epoch at batch 256.
FIT = dict(epochs=40, batch_size=256, learning_rate=1e-2)


def _random_params(rng, d, r, f):
  return {"fc1": rng.standard_normal((d, r)).astype(np.float32) / math.sqrt(d),
          "fc2": rng.standard_normal((r, f)).astype(np.float32) / math.sqrt(r)}


def _contiguous_split(n: int) -> np.ndarray:
  """int8[n]: first 70% train, next 15% validation, last 15% test (contiguous blocks)."""
  split = np.zeros(n, np.int8)
  split[int(0.70 * n):int(0.85 * n)] = pred.SPLIT_VAL
  split[int(0.85 * n):] = pred.SPLIT_TEST
  return split


def _planted(teacher_rank: int, *, n=6000, d=64, f=256, seed=0):
  """Residual-stream-like x (random per-token scale) and a rank-`teacher_rank` teacher.

  active = x_hat @ U @ V > 0: scale-invariant like a real FFN behind RMSNorm, ~50% sparse.
  """
  rng = np.random.default_rng(seed)
  scale = np.exp(rng.normal(0.0, 1.0, (n, 1)))  # Token norms spread over ~e^+-2.
  x = (rng.standard_normal((n, d)) * scale).astype(np.float32)
  u = rng.standard_normal((d, teacher_rank))
  v = rng.standard_normal((teacher_rank, f))
  x_hat = x / np.sqrt(np.mean(np.square(x, dtype=np.float64), axis=1, keepdims=True))
  return x, (x_hat @ u @ v) > 0, _contiguous_split(n)


def _check_ladder(p: pred.LayerPredictor, min_gain: float):
  """The ladder was walked upward and stopped exactly where the rule says."""
  ranks = [step["rank"] for step in p.ladder]
  assert ranks == sorted(ranks)
  gains = np.diff([step["val_predicted_sparsity"] for step in p.ladder])
  chosen = ranks.index(p.rank)
  assert all(g >= min_gain for g in gains[:chosen])
  assert chosen == len(ranks) - 1 or (chosen == len(ranks) - 2 and gains[-1] < min_gain)
  for step in p.ladder:
    assert step["train_s"] >= 0 and step["n_bytes"] == pred.predictor_bytes(
        p.params["fc1"].shape[0], p.params["fc2"].shape[1], step["rank"])


def _all_finite(p: pred.LayerPredictor):
  numbers = [p.val_recall, p.test_recall, p.test_precision, p.test_predicted_sparsity,
             p.true_sparsity]
  assert not any(math.isnan(v) for v in numbers), numbers
  assert all(0.0 <= v <= 1.0 for v in numbers), numbers
  assert all(np.isfinite(a).all() for a in p.params.values())


@pytest.fixture(scope="module")
def teacher8():
  x, active, split = _planted(8)
  return pred.train_layer_predictor(x, active, split, ranks=LADDER, **FIT)


@pytest.fixture(scope="module")
def teacher32():
  x, active, split = _planted(32, seed=1)
  return pred.train_layer_predictor(x, active, split, ranks=LADDER, **FIT)


# ---------------------------------------------------------------------------------------
# Forward pass.


def test_logits_match_numpy_reference():
  rng = np.random.default_rng(0)
  params = _random_params(rng, 48, 12, 80)
  x = (rng.standard_normal((3, 5, 48)) * rng.uniform(0.1, 30, (3, 5, 1))).astype(np.float32)
  x[1, 2] = 0.0  # An all-zero token normalises to zeros, not NaN.
  got = np.asarray(pred.predictor_logits(params, x))
  want = pred.predictor_logits_reference(params, x)
  assert got.shape == (3, 5, 80) and got.dtype == np.float32
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  assert np.all(got[1, 2] == 0)
  cut = 0.3
  np.testing.assert_array_equal(np.asarray(pred.predict_active(params, cut, x)), got >= cut)
  assert np.asarray(pred.predict_active(params, -np.inf, x)).all()
  assert not np.asarray(pred.predict_active(params, np.inf, x)).any()


def test_scaling_the_input_does_not_change_predictions():
  rng = np.random.default_rng(1)
  params = _random_params(rng, 64, 16, 128)
  x = rng.standard_normal((200, 64)).astype(np.float32)
  logits = np.asarray(pred.predictor_logits(params, x))
  cut = float(np.quantile(logits, 0.6))  # A non-zero cut: scale invariance comes from x_hat.
  base = np.asarray(pred.predict_active(params, cut, x))
  for c in (2.0**-8, 0.5, 4.0, 2.0**12):  # Powers of two scale exactly in f32.
    np.testing.assert_array_equal(np.asarray(pred.predict_active(params, cut, c * x)), base)
  for c in (3.7e-3, 1.3, 517.0):
    np.testing.assert_allclose(np.asarray(pred.predictor_logits(params, c * x)), logits,
                               rtol=1e-5, atol=1e-5)


def test_predictor_bytes():
  assert pred.predictor_bytes(576, 1536, 64) == 4 * 64 * (576 + 1536)
  rng = np.random.default_rng(2)
  p = pred.LayerPredictor(params=_random_params(rng, 10, 3, 7), rank=3, cut=0.0, val_recall=1,
                          test_recall=1, test_precision=1, test_predicted_sparsity=0,
                          true_sparsity=0, ladder=[])
  assert p.n_bytes() == pred.predictor_bytes(10, 7, 3)


# ---------------------------------------------------------------------------------------
# Training on planted structure.


def test_planted_rank8_teacher(teacher8):
  p = teacher8
  assert p.test_recall >= 0.93, p
  assert p.test_predicted_sparsity >= 0.35, p
  assert p.rank <= 16, p.ladder  # Ranks above the teacher's needs buy nothing.
  assert 0.45 <= p.true_sparsity <= 0.55
  assert p.test_precision > 0.8
  _check_ladder(p, min_gain=0.02)
  assert p.params["fc1"].shape == (64, p.rank) and p.params["fc2"].shape == (p.rank, 256)
  assert p.params["fc1"].dtype == np.float32
  # The dataclass' own predict() agrees with the reported test numbers.
  x, active, split = _planted(8)
  test = split == pred.SPLIT_TEST
  got = np.asarray(p.predict(x[test]))
  assert np.sum(got & active[test]) / np.sum(active[test]) == pytest.approx(p.test_recall)
  assert 1 - got.mean() == pytest.approx(p.test_predicted_sparsity)


def test_harder_teacher_gets_a_larger_rank(teacher8, teacher32):
  assert teacher32.rank > teacher8.rank, (teacher8.ladder, teacher32.ladder)
  _check_ladder(teacher32, min_gain=0.02)
  assert teacher32.test_recall >= 0.93


@pytest.mark.parametrize("target", [0.9, 0.99])
def test_cut_meets_recall_target_on_validation(target):
  x, active, split = _planted(8, n=2000, seed=3)
  p = pred.train_layer_predictor(x, active, split, ranks=(8,), recall_target=target, epochs=3,
                                 batch_size=256)
  assert p.val_recall >= target
  # The largest such cut: nudging it up loses recall below the target.
  val = split == pred.SPLIT_VAL
  logits = np.asarray(pred.predictor_logits(p.params, x[val]))
  pos = logits[active[val]]
  assert np.mean(pos >= p.cut) >= target
  assert np.mean(pos >= np.nextafter(np.float32(p.cut), np.float32(np.inf))) < target


def test_max_rank_skips_larger_ranks():
  x, active, split = _planted(32, n=2000, seed=4)
  p = pred.train_layer_predictor(x, active, split, ranks=(32, 4, 8), max_rank=8, epochs=2,
                                 batch_size=256, min_gain=0.0)
  assert [s["rank"] for s in p.ladder] == [4, 8]
  with pytest.raises(ConfigError, match="no usable rank"):
    pred.train_layer_predictor(x, active, split, ranks=(16,), max_rank=8)


def test_same_seed_same_params():
  x, active, split = _planted(8, n=1500, seed=5)
  kw = dict(ranks=(8,), epochs=2, batch_size=128)
  a = pred.train_layer_predictor(x, active, split, seed=7, **kw)
  b = pred.train_layer_predictor(x, active, split, seed=7, **kw)
  c = pred.train_layer_predictor(x, active, split, seed=8, **kw)
  for k in ("fc1", "fc2"):
    np.testing.assert_array_equal(a.params[k], b.params[k])
  assert a.cut == b.cut
  assert not np.array_equal(a.params["fc1"], c.params["fc1"])


# ---------------------------------------------------------------------------------------
# Degenerate layers.


def test_layer_always_active():
  x, _, split = _planted(8, n=300, d=16, f=24)
  p = pred.train_layer_predictor(x, np.ones((300, 24), bool), split, ranks=(4, 8))
  assert p.cut == -math.inf and p.rank == 4
  assert p.test_recall == 1.0 and p.test_precision == 1.0
  assert p.test_predicted_sparsity == 0.0 and p.true_sparsity == 0.0
  _all_finite(p)
  assert np.asarray(p.predict(x[:5])).all()


def test_layer_never_active():
  x, _, split = _planted(8, n=300, d=16, f=24)
  p = pred.train_layer_predictor(x, np.zeros((300, 24), bool), split, ranks=(4, 8))
  assert p.cut == math.inf
  assert p.test_recall == 1.0 and p.test_precision == 1.0
  assert p.test_predicted_sparsity == 1.0 and p.true_sparsity == 1.0
  _all_finite(p)
  assert not np.asarray(p.predict(x[:5])).any()


def test_single_neuron_and_tiny_split():
  # F = 1, and fewer training tokens (28) than one batch (1024).
  x, active, split = _planted(4, n=40, d=16, f=1)
  p = pred.train_layer_predictor(x, active, split, ranks=(2, 4))
  assert p.params["fc2"].shape[1] == 1
  assert p.val_recall >= 0.95 and math.isfinite(p.cut)
  _all_finite(p)


def test_hot_and_dead_neurons_mixed_in():
  x, active, split = _planted(8, n=1000, d=32, f=40, seed=6)
  active[:, :5] = True  # Hot: always active.
  active[:, 5:10] = False  # Dead: never active.
  p = pred.train_layer_predictor(x, active, split, ranks=(8,), epochs=4, batch_size=128)
  _all_finite(p)
  assert p.val_recall >= 0.95 and math.isfinite(p.cut)
  assert p.ladder[0]["train_loss"] > 0


def test_validation_without_active_pairs_gets_infinite_cut():
  x, active, split = _planted(8, n=400, d=16, f=8)
  active[split != pred.SPLIT_TRAIN] = False
  p = pred.train_layer_predictor(x, active, split, ranks=(4,), epochs=2)
  assert p.cut == math.inf and p.val_recall == 1.0
  _all_finite(p)


def test_bad_inputs_raise():
  x, active, split = _planted(8, n=100, d=8, f=4)
  with pytest.raises(ValueError, match="disagree on N"):
    pred.train_layer_predictor(x[:-1], active, split)
  with pytest.raises(ValueError, match="non-empty train"):
    pred.train_layer_predictor(x, active, np.full(100, pred.SPLIT_TEST, np.int8))
  with pytest.raises(ConfigError, match="recall_target"):
    pred.train_layer_predictor(x, active, split, recall_target=1.5)


# ---------------------------------------------------------------------------------------
# Low-bit (4-bit gate/up) predictor.


def test_q4_quantization_round_trip_random():
  from pijax.offline import predictor as P
  rng = np.random.default_rng(3)
  rows = rng.standard_t(4, size=(37, 96)) * rng.uniform(0.01, 2.0, size=(37, 1))
  rows = rows.astype(np.float32)
  rows[5, :32] = 0.0  # An all-zero block: scale 0, codes decode to 0.
  codes, scales = P.quantize_rows_q4(rows)
  assert codes.shape == (37, 48) and codes.dtype == np.uint8
  assert scales.shape == (37, 3) and scales.dtype == np.float16
  lo, hi = codes & 15, codes >> 4
  assert lo.min() >= 1 and lo.max() <= 15 and hi.min() >= 1 and hi.max() <= 15
  deq = np.asarray(P.dequantize_rows_q4(codes, scales))
  s = np.repeat(scales.astype(np.float32), 32, axis=1)
  # Round-to-nearest: error <= half a step, plus the f16 rounding of the scale (7 steps max).
  assert (np.abs(deq - rows) <= 0.5 * s + 7 * s * 2.0 ** -10 + 1e-7).all()
  np.testing.assert_array_equal(deq[5, :32], 0.0)


@pytest.mark.parametrize("family", ["swiglu", "reglu", "drelu"])
def test_lowbit_contribution_matches_numpy_reference(family):
  from pijax.offline import predictor as P
  rng = np.random.default_rng(4)
  gate = rng.normal(size=(50, 64)).astype(np.float32)
  up = rng.normal(size=(50, 64)).astype(np.float32)
  params = P.lowbit_params(gate, up)
  h = rng.normal(size=(2, 7, 64)).astype(np.float32)
  got = np.asarray(P.lowbit_contribution(params, h, family))
  want = P.lowbit_contribution_reference(params, h.reshape(-1, 64), family).reshape(2, 7, 50)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
  # And it estimates the exact contribution: rank correlation well above chance.
  g, u = h.reshape(-1, 64) @ gate.T, h.reshape(-1, 64) @ up.T
  exact = {"swiglu": np.abs(g / (1 + np.exp(-g)) * u), "reglu": np.abs(np.maximum(g, 0) * u),
           "drelu": np.maximum(g, 0) * np.maximum(u, 0)}[family]
  assert np.corrcoef(exact.ravel(), want.ravel())[0, 1] > 0.9
  assert P.lowbit_bytes(64, 50) == 2 * (50 * 32 + 50 * 2 * 2)


def test_lowbit_needs_hidden_multiple_of_block():
  from pijax.offline import predictor as P
  from pijax.errors import ConfigError
  with pytest.raises(ConfigError, match="divisible by 32"):
    P.quantize_rows_q4(np.ones((4, 40), np.float32))
