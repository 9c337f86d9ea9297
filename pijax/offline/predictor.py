"""Per-layer FFN activation predictors (Deja Vu / PowerInfer style) with an adaptive rank.

One predictor per FFN layer guesses, before the FFN runs, which of its F neurons will be
active for a token, so the engine reads only those neurons' weights. It is a two-layer
bias-free MLP

    logits = fc2(relu(fc1(x_hat)))        fc1: f32[D, r], fc2: f32[r, F]

where x is the residual stream entering the FFN block (before its RMSNorm) and
x_hat = x / rms(x) is a parameter-free normalisation. Neuron i is predicted active when
logit_i >= cut, a per-layer logit threshold calibrated on held-out text.

Why x_hat and not x: the MLP has no biases and ReLU is positively homogeneous, so
logits(c * x) = c * logits(x) for any c > 0 and sign(logit) -- the decision at cut 0 -- does
not depend on the token's norm. Normalising therefore loses nothing the network could use
at cut 0; it makes a calibrated non-zero cut scale-invariant too (the FFN itself sees
RMSNorm(x) = x_hat * gamma, so the true active set is a function of x_hat alone), and it
conditions training: residual-stream norms vary by orders of magnitude across tokens
(massive activations on the first token), which would otherwise dominate the loss scale.

Shape letters: N tokens, D hidden_size, F FFN neurons, R predictor rank, B minibatch.

Training (`train_layer_predictor`) uses optax Adam on a positively re-weighted binary
cross-entropy and jits one whole epoch (a `lax.scan` over minibatches, shuffled on device),
so the training split crosses to the device once per rank and Python runs once per epoch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from pijax.errors import ConfigError

SPLIT_TRAIN = 0
SPLIT_VAL = 1
SPLIT_TEST = 2

MAX_POS_WEIGHT = 20.0  # Upper clip of the positive-class weight in the BCE loss.
_EVAL_CHUNK = 8192  # Tokens per forward pass when evaluating (bounds host memory: chunk * F f32).
_ADAM = optax.scale_by_adam()  # Learning rate applied outside, so it stays a traced argument.


# ----------------------------------------------------------------------------------------
# Forward pass.


def normalize_input(x: jax.Array) -> jax.Array:
  """x / rms(x) over the last axis, without learned scale or epsilon.

  Args:
    x: f32[..., D] residual stream (any float dtype; computed in f32).

  Returns:
    f32[..., D] with mean(x_hat**2) == 1 per row; an all-zero row maps to zeros.
  """
  x = jnp.asarray(x, jnp.float32)
  # [..., 1] mean square per token.
  ms = jnp.mean(x * x, axis=-1, keepdims=True)
  inv = jnp.where(ms > 0, lax.rsqrt(jnp.where(ms > 0, ms, 1.0)), 0.0)
  return x * inv


def _logits_from_normalized(params: dict, x_hat: jax.Array) -> jax.Array:
  """fc2(relu(fc1(x_hat))): f32[..., D] -> f32[..., F]."""
  # [..., R]
  h = jax.nn.relu(jnp.einsum("...d,dr->...r", x_hat, params["fc1"]))
  # [..., F]
  return jnp.einsum("...r,rf->...f", h, params["fc2"])


def _check_params(params: dict, x: jax.Array) -> None:
  fc1, fc2 = params["fc1"], params["fc2"]
  if fc1.ndim != 2 or fc2.ndim != 2 or fc1.shape[1] != fc2.shape[0]:
    raise ValueError(f"predictor params must be fc1 [D, R] and fc2 [R, F]; got fc1 {fc1.shape}, "
                     f"fc2 {fc2.shape}")
  if x.shape[-1] != fc1.shape[0]:
    raise ValueError(f"x has {x.shape[-1]} features but fc1 expects D={fc1.shape[0]}")


@jax.jit
def predictor_logits(params: dict, x: jax.Array) -> jax.Array:
  """Predictor logits for the residual stream entering an FFN block.

  Args:
    params: {"fc1": f32[D, R], "fc2": f32[R, F]}.
    x: f32[..., D] residual stream before the FFN's RMSNorm (normalised here).

  Returns:
    f32[..., F] logits; neuron i is predicted active when logit_i >= cut.
  """
  _check_params(params, x)
  return _logits_from_normalized(params, normalize_input(x))


RMS_BOUND_FACTOR = 4.0  # Inputs with rms > this x the median training rms run dense.


def rms(x: jax.Array) -> jax.Array:
  """Root mean square over the last axis: f32[..., D] -> f32[...]."""
  x = x.astype(jnp.float32)
  return jnp.sqrt(jnp.mean(x * x, axis=-1))


@jax.jit
def predict_active(params: dict, cut: float | jax.Array, x: jax.Array,
                   rms_bound: float | jax.Array = jnp.inf) -> jax.Array:
  """Predicted active set: bool[..., F], logits >= cut, every neuron for outlier tokens.

  Tokens whose residual stream has rms(x) > rms_bound (the "massive activation" tokens, such
  as the first token of a sequence, whose norm is 6-130x the typical one on SmolLM2) get every
  neuron: predictors trained on ordinary tokens missed up to 93% of their active neurons, and
  every later token attends to them (BUILD_NOTES.md, issue 4).

  Args:
    params: {"fc1": f32[D, R], "fc2": f32[R, F]}.
    cut: scalar logit threshold; -inf predicts every neuron active, +inf none.
    x: f32[..., D] residual stream before the FFN's RMSNorm.
    rms_bound: scalar; inf disables the fallback.
  """
  pred = predictor_logits(params, x) >= jnp.asarray(cut, jnp.float32)
  outlier = rms(x) > jnp.asarray(rms_bound, jnp.float32)
  return pred | outlier[..., None]


def predictor_bytes(hidden: int, ffn: int, rank: int) -> int:
  """f32 bytes of one predictor's fc1 [hidden, rank] and fc2 [rank, ffn]."""
  return 4 * rank * (hidden + ffn)


def predictor_logits_reference(params: dict, x: np.ndarray) -> np.ndarray:
  """Plain NumPy (float64) reference of `predictor_logits`: f32[..., D] -> f64[..., F]."""
  x = np.asarray(x, np.float64)
  ms = np.mean(x * x, axis=-1, keepdims=True)
  x_hat = np.divide(x, np.sqrt(ms), out=np.zeros_like(x), where=ms > 0)
  h = np.maximum(x_hat @ np.asarray(params["fc1"], np.float64), 0.0)
  return h @ np.asarray(params["fc2"], np.float64)


# ----------------------------------------------------------------------------------------
# The trained result.


@dataclasses.dataclass
class LayerPredictor:
  """One layer's trained predictor, its calibrated cut and its held-out quality.

  Attributes:
    params: {"fc1": f32[D, R], "fc2": f32[R, F]} as NumPy arrays.
    rank: R, the chosen rank.
    cut: logit threshold; -inf = every neuron always predicted active (the training split
      had no inactive pair), +inf = never (no active pair to recall).
    val_recall: pooled recall on the validation split at `cut` (>= the recall target by
      construction; 1.0 when the split has no active pair).
    test_recall: pooled recall, sum(pred & true) / sum(true), on the test split
      (1.0 when it has no active pair; NaN when the test split is empty).
    test_precision: sum(pred & true) / sum(pred) on the test split (1.0 when nothing is
      predicted active).
    test_predicted_sparsity: fraction of (token, neuron) pairs predicted inactive on test.
    true_sparsity: fraction of (token, neuron) pairs truly inactive on test.
    ladder: one dict per trained rank, in order: rank, val_predicted_sparsity (at the
      recall target), val_recall, cut, train_loss (mean BCE of the last epoch), train_s
      (wall seconds including compilation), n_bytes.
  """

  params: dict[str, np.ndarray]
  rank: int
  cut: float
  val_recall: float
  test_recall: float
  test_precision: float
  test_predicted_sparsity: float
  true_sparsity: float
  ladder: list[dict]
  rms_bound: float = math.inf  # Tokens with rms(x) above it run dense (see predict_active).

  def n_bytes(self) -> int:
    """f32 bytes of fc1 + fc2."""
    return 4 * (self.params["fc1"].size + self.params["fc2"].size)

  def predict(self, x) -> jax.Array:
    """bool[..., F] predicted active set for residual stream x: f32[..., D]."""
    return predict_active(self.params, self.cut, x)


# ----------------------------------------------------------------------------------------
# Training.


def _weighted_bce(params: dict, x_hat: jax.Array, y: jax.Array, pos_weight: jax.Array):
  """Mean over [B, F] of pos_weight * y * softplus(-z) + (1 - y) * softplus(z).

  Written with one softplus, via softplus(-z) = softplus(z) - z: on CPU the elementwise loss
  over [B, F] costs as much as the matmuls, so one softplus instead of two trains faster.
  """
  # [B, F] logits and targets.
  z = _logits_from_normalized(params, x_hat)
  wy = pos_weight * y.astype(jnp.float32)
  return jnp.mean((1.0 - y + wy) * jax.nn.softplus(z) - wy * z)


@functools.partial(jax.jit, static_argnames=("batch_size",), donate_argnums=(0, 1))
def _train_epoch(params, opt_state, x_hat, active, key, pos_weight, learning_rate, *,
                 batch_size: int):
  """One shuffled epoch of Adam steps, as one XLA program.

  Args:
    params: {"fc1": f32[D, R], "fc2": f32[R, F]} (donated).
    opt_state: Adam state for params (donated).
    x_hat: f32[N, D] normalised training inputs (stay on device across epochs).
    active: bool[N, F] training targets.
    key: PRNG key for this epoch's permutation.
    pos_weight: f32 scalar weight of the positive class.
    learning_rate: f32 scalar Adam step size (constant: on these small budgets a cosine decay
      underfit on planted-teacher data).
    batch_size: B; the last N % B rows of each permutation are skipped that epoch.

  Returns:
    (params, opt_state, mean loss over the epoch's steps: f32 scalar).
  """
  n = x_hat.shape[0]
  n_steps = n // batch_size
  # [n_steps, B] row ids of each minibatch.
  ids = jax.random.permutation(key, n)[:n_steps * batch_size].reshape(n_steps, batch_size)

  def step(carry, batch_ids):
    params, opt_state = carry
    # pos_weight: a scalar, or f32[N, F] per-pair weights of the positives (importance).
    pw = pos_weight[batch_ids] if pos_weight.ndim == 2 else pos_weight
    loss, grads = jax.value_and_grad(_weighted_bce)(params, x_hat[batch_ids], active[batch_ids],
                                                    pw)
    updates, opt_state = _ADAM.update(grads, opt_state, params)
    params = jax.tree.map(lambda p, u: p - learning_rate * u, params, updates)
    return (params, opt_state), loss

  (params, opt_state), losses = lax.scan(step, (params, opt_state), ids)
  return params, opt_state, jnp.mean(losses)


def _init_params(key: jax.Array, hidden: int, ffn: int, rank: int) -> dict:
  """fc1 ~ N(0, 1/D) (unit-variance pre-activations for unit-rms x_hat), fc2 ~ N(0, 1/R)."""
  k1, k2 = jax.random.split(key)
  return {
      "fc1": jax.random.normal(k1, (hidden, rank), jnp.float32) / math.sqrt(hidden),
      "fc2": jax.random.normal(k2, (rank, ffn), jnp.float32) / math.sqrt(rank),
  }


@jax.jit
def _confusion_chunk(params, cut, x_hat, active):
  """(true positives, predicted positives, true positives + false negatives): int32 scalars."""
  pred = _logits_from_normalized(params, x_hat) >= cut
  return (jnp.sum(pred & active, dtype=jnp.int32), jnp.sum(pred, dtype=jnp.int32),
          jnp.sum(active, dtype=jnp.int32))


_logits_chunk = jax.jit(_logits_from_normalized)


def _chunks(n: int):
  for start in range(0, n, _EVAL_CHUNK):
    yield slice(start, min(start + _EVAL_CHUNK, n))


def _calibrate_cut(params, x_hat: np.ndarray, active: np.ndarray, recall_target: float) -> float:
  """Largest logit cut with pooled recall >= recall_target on (x_hat, active).

  With P active pairs and k the smallest count with k / P >= recall_target, the cut is the
  k-th largest logit among the active pairs: any larger cut keeps at most k - 1 of them.
  Returns +inf when there is no active pair (every cut recalls vacuously).
  """
  pos = [np.asarray(_logits_chunk(params, x_hat[s]))[active[s]] for s in _chunks(len(x_hat))]
  pos = np.concatenate(pos) if pos else np.zeros((0,), np.float32)
  p = pos.size
  if p == 0:
    return math.inf
  k = min(max(math.ceil(recall_target * p), 1), p)
  while k > 1 and (k - 1) / p >= recall_target:  # Guard against float rounding in the ceil.
    k -= 1
  while k < p and k / p < recall_target:
    k += 1
  return float(np.partition(pos, p - k)[p - k])


def _calibrate_cut_weighted(params, x_hat: np.ndarray, active: np.ndarray, weight: np.ndarray,
                            recall_target: float) -> float:
  """Largest logit cut keeping >= recall_target of the active pairs' total weight.

  weight: f32[N, F] >= 0 importance of each pair (e.g. |a| / t_l). Returns +inf when no active
  pair has weight.
  """
  logits, w = [], []
  for s in _chunks(len(x_hat)):
    z = np.asarray(_logits_chunk(params, x_hat[s]))
    logits.append(z[active[s]])
    w.append(weight[s][active[s]])
  z = np.concatenate(logits) if logits else np.zeros((0,), np.float32)
  w = np.concatenate(w).astype(np.float64) if w else np.zeros((0,))
  total = w.sum()
  if z.size == 0 or total <= 0:
    return math.inf
  order = np.argsort(-z, kind="stable")
  cum = np.cumsum(w[order])
  k = int(np.searchsorted(cum, recall_target * total * (1 - 1e-12)))
  return float(z[order[min(k, z.size - 1)]])


def weighted_recall(params, cut: float, x_hat: np.ndarray, active: np.ndarray,
                    weight: np.ndarray) -> float:
  """Share of the active pairs' total weight that (params, cut) predicts active."""
  kept = total = 0.0
  for s in _chunks(len(x_hat)):
    pred = np.asarray(_logits_chunk(params, x_hat[s])) >= cut
    w = np.where(active[s], weight[s], 0.0)
    kept += float((w * pred).sum())
    total += float(w.sum())
  return kept / total if total else 1.0


def _evaluate(params, cut: float, x_hat: np.ndarray, active: np.ndarray) -> dict:
  """Pooled recall, precision, predicted and true sparsity of (params, cut) on one split.

  Conventions: recall = 1 with no active pair, precision = 1 with nothing predicted active;
  every metric is NaN on an empty split.
  """
  n_pairs = active.size
  if n_pairs == 0:
    nan = float("nan")
    return dict(recall=nan, precision=nan, predicted_sparsity=nan, true_sparsity=nan)
  tp = n_pred = n_true = 0
  cut32 = jnp.float32(cut)
  for s in _chunks(len(x_hat)):
    a, b, c = _confusion_chunk(params, cut32, x_hat[s], active[s])
    tp, n_pred, n_true = tp + int(a), n_pred + int(b), n_true + int(c)
  return dict(recall=tp / n_true if n_true else 1.0,
              precision=tp / n_pred if n_pred else 1.0,
              predicted_sparsity=1.0 - n_pred / n_pairs,
              true_sparsity=1.0 - n_true / n_pairs)


def _train_rank(x_tr, y_tr, *, hidden, ffn, rank, epochs, batch_size, learning_rate, pos_weight,
                seed):
  """Trains one rank on device-resident training data; returns (params as NumPy, last loss)."""
  key = jax.random.key(seed)
  init_key, shuffle_key = jax.random.split(jax.random.fold_in(key, rank))
  params = _init_params(init_key, hidden, ffn, rank)
  opt_state = _ADAM.init(params)
  loss = jnp.float32(jnp.nan)
  pos_weight = pos_weight if isinstance(pos_weight, jax.Array) else jnp.float32(pos_weight)
  for epoch in range(epochs):
    params, opt_state, loss = _train_epoch(
        params, opt_state, x_tr, y_tr, jax.random.fold_in(shuffle_key, epoch),
        pos_weight, jnp.float32(learning_rate), batch_size=batch_size)
  return jax.tree.map(np.asarray, params), float(loss)


def train_layer_predictor(x: np.ndarray, active: np.ndarray, split: np.ndarray, *,
                          ranks=(16, 32, 64, 128, 256), recall_target: float = 0.95,
                          max_rank: int | None = None, epochs: int = 8, batch_size: int = 1024,
                          learning_rate: float = 3e-3, min_gain: float = 0.02,
                          seed: int = 0, importance: np.ndarray | None = None,
                          importance_cap: float = 100.0) -> LayerPredictor:
  """Trains one layer's predictor, calibrates its cut, and picks its rank from a ladder.

  Loss: binary cross-entropy on the logits with the positive class weighted by
  pos_weight = clip(#inactive / #active over the training split, 1, 20), one global number.
  A global weight only shifts every logit's optimum by the same log(pos_weight), so the
  ranking of (token, neuron) pairs by logit -- which is all a single pooled cut uses -- keeps
  tracking the posterior; it moves the model's attention toward the low-probability active
  pairs the 0.95-recall cut must keep. (Per-neuron weights would re-rank neurons against
  each other and cost predicted sparsity at the same pooled recall.)

  Cut: after training a rank, the largest logit cut whose pooled recall on the validation
  split is >= recall_target; predicted sparsity on validation is measured at that cut.

  Rank: every rank meets the recall target by construction of its cut, so ranks compete on
  what the cut costs. The ladder (sorted, ranks > max_rank skipped) is walked upward and
  stops as soon as the next rank improves validation predicted sparsity by less than
  min_gain; the smaller rank is kept. The chosen predictor is then measured on the test
  split (held out by text) at its cut.

  Degenerate layers train nothing (params are zeros, the ladder holds the smallest rank):
  no inactive pair in the training split -> cut = -inf (always active); no active pair ->
  cut = +inf (never active). A trained rank whose validation split has no active pair also
  gets cut = +inf (any cut meets the recall target vacuously).

  Args:
    x: f32[N, D] residual stream entering the FFN block (before its RMSNorm).
    active: bool[N, F] true active sets.
    split: int[N] with SPLIT_TRAIN (0), SPLIT_VAL (1), SPLIT_TEST (2); split by text chunk
      by the caller. Training, calibration and reporting each use only their own split.
    ranks: candidate ranks R.
    recall_target: pooled validation recall the cut must reach, in (0, 1].
    max_rank: ranks above it are skipped (e.g. from a byte budget, `predictor_bytes`).
    epochs: passes over the training split per rank.
    batch_size: tokens per Adam step (capped at the training-split size).
    learning_rate: Adam step size (constant). On planted low-rank teachers 1e-2 reached
      clearly higher predicted sparsity than 3e-3 within 8 epochs (e.g. 0.61 vs 0.52 of 0.60
      at N=50000, D=576, F=1536, r=64); 3e-2 was no better than 1e-2.
    min_gain: smallest validation predicted-sparsity gain (a fraction) that buys the next rank.
    seed: seeds initialisation and shuffling; the same seed gives identical params.
    importance: optional f32[N, F] >= 0 weight of each (token, neuron) pair, e.g. the
      neuron's contribution |a| / t_l. When given, (1) positives are weighted in the loss in
      proportion to clip(importance, 1, importance_cap) (same mean weight as without), so a
      miss of a large contribution costs more than a miss near the threshold; and (2) the cut
      keeps recall_target of the active pairs' total importance instead of their count. On
      SmolLM2 the count-calibrated predictors missed neurons of up to 340x the threshold,
      which is what costs perplexity (BUILD_NOTES.md, issue 4).
    importance_cap: upper clip of the training weight ratio.

  Returns:
    The chosen LayerPredictor.

  Raises:
    ValueError: on mismatched shapes or an empty training or validation split.
    ConfigError: on an invalid option (no usable rank, recall_target outside (0, 1], ...).
  """
  x = np.asarray(x, np.float32)
  active = np.asarray(active, bool)
  split = np.asarray(split)
  if x.ndim != 2 or active.ndim != 2 or split.ndim != 1:
    raise ValueError(f"expected x [N, D], active [N, F], split [N]; got {x.shape}, "
                     f"{active.shape}, {split.shape}")
  if not x.shape[0] == active.shape[0] == split.shape[0]:
    raise ValueError(f"x, active and split disagree on N: {x.shape[0]}, {active.shape[0]}, "
                     f"{split.shape[0]}")
  if not 0.0 < recall_target <= 1.0:
    raise ConfigError(f"recall_target must be in (0, 1], got {recall_target}")
  if epochs < 1 or batch_size < 1 or learning_rate <= 0:
    raise ConfigError(f"need epochs >= 1, batch_size >= 1, learning_rate > 0; got {epochs}, "
                      f"{batch_size}, {learning_rate}")
  ladder_ranks = sorted({int(r) for r in ranks if max_rank is None or r <= max_rank})
  if not ladder_ranks or ladder_ranks[0] < 1:
    raise ConfigError(f"no usable rank in {tuple(ranks)} with max_rank={max_rank}: pass ranks "
                      f">= 1 and a max_rank at least the smallest of them")
  is_tr, is_val, is_te = split == SPLIT_TRAIN, split == SPLIT_VAL, split == SPLIT_TEST
  if not is_tr.any() or not is_val.any():
    raise ValueError(f"need a non-empty train ({SPLIT_TRAIN}) and validation ({SPLIT_VAL}) split; "
                     f"got {int(is_tr.sum())} and {int(is_val.sum())} tokens")
  hidden, ffn = x.shape[1], active.shape[1]

  x_hat = np.asarray(jax.jit(normalize_input)(x))
  x_val, y_val = x_hat[is_val], active[is_val]
  x_te, y_te = x_hat[is_te], active[is_te]
  y_tr_np = active[is_tr]
  n_pos = int(y_tr_np.sum())
  n_neg = y_tr_np.size - n_pos

  if n_pos == 0 or n_neg == 0:  # Degenerate layer: nothing to learn.
    rank = ladder_ranks[0]
    params = {"fc1": np.zeros((hidden, rank), np.float32), "fc2": np.zeros((rank, ffn), np.float32)}
    cut = math.inf if n_pos == 0 else -math.inf
    val = _evaluate(params, cut, x_val, y_val)
    ladder = [dict(rank=rank, val_predicted_sparsity=val["predicted_sparsity"],
                   val_recall=val["recall"], cut=cut, train_loss=float("nan"), train_s=0.0,
                   n_bytes=predictor_bytes(hidden, ffn, rank))]
    return _finish(params, rank, cut, val, x_te, y_te, ladder)

  pos_weight = float(np.clip(n_neg / n_pos, 1.0, MAX_POS_WEIGHT))
  x_tr, y_tr = jnp.asarray(x_hat[is_tr]), jnp.asarray(y_tr_np)  # One host->device copy.
  w_val = None
  if importance is not None:
    importance = np.asarray(importance, np.float32)
    if importance.shape != active.shape:
      raise ValueError(f"importance {importance.shape} must match active {active.shape}")
    w_tr = np.clip(importance[is_tr], 1.0, importance_cap)
    w_tr /= w_tr[y_tr_np].mean()
    pos_weight = jnp.asarray(pos_weight * w_tr, jnp.float32)
    del w_tr
    w_val = importance[is_val]
  batch = min(batch_size, x_tr.shape[0])

  ladder: list[dict] = []
  best = None  # (params, cut, val metrics) of the kept rank.
  for rank in ladder_ranks:
    t0 = time.perf_counter()
    params, loss = _train_rank(x_tr, y_tr, hidden=hidden, ffn=ffn, rank=rank, epochs=epochs,
                               batch_size=batch, learning_rate=learning_rate,
                               pos_weight=pos_weight, seed=seed)
    train_s = time.perf_counter() - t0
    if w_val is None:
      cut = _calibrate_cut(params, x_val, y_val, recall_target)
    else:
      cut = _calibrate_cut_weighted(params, x_val, y_val, w_val, recall_target)
    val = _evaluate(params, cut, x_val, y_val)
    ladder.append(dict(rank=rank, val_predicted_sparsity=val["predicted_sparsity"],
                       val_recall=val["recall"], cut=cut, train_loss=loss, train_s=train_s,
                       n_bytes=predictor_bytes(hidden, ffn, rank)))
    if best is not None and val["predicted_sparsity"] - best[2]["predicted_sparsity"] < min_gain:
      break
    best = (params, cut, val)
  params, cut, val = best
  return _finish(params, params["fc1"].shape[1], cut, val, x_te, y_te, ladder)


def _finish(params, rank, cut, val, x_te, y_te, ladder) -> LayerPredictor:
  test = _evaluate(params, cut, x_te, y_te)
  return LayerPredictor(params=params, rank=int(rank), cut=float(cut),
                        val_recall=float(val["recall"]), test_recall=float(test["recall"]),
                        test_precision=float(test["precision"]),
                        test_predicted_sparsity=float(test["predicted_sparsity"]),
                        true_sparsity=float(test["true_sparsity"]), ladder=ladder)


# ----------------------------------------------------------------------------------------
# Low-bit pre-activation predictor (SwiGLU / GeGLU).
#
# Which SwiGLU neurons matter for a token is a high-rank function of its input: low-rank
# estimates and the MLP predictors above skip few neurons at a high perplexity cost, while a
# 4-bit copy of the gate and up rows (Q4_0-like: blocks of 32 values, one f16 scale each)
# estimates each neuron's contribution |act(gate x) * (up x)| well enough to skip about half
# of them (BUILD_NOTES.md, issue 4). It costs 4.5 bits per gate/up weight, 9.4% of the f32 FFN
# bytes (the predictor budget, `pijax.convert.PREDICTOR_BUDGET_FRACTION`, is 5%), read on
# every token.

LOWBIT_BLOCK = 32  # Values per scale block along the hidden axis.
LOWBIT_QMAX = 7  # Symmetric 4-bit codes in [-7, 7], stored as code + 8 in one nibble.
PREDICTOR_MLP = "mlp"
PREDICTOR_LOWBIT = "lowbit"
PREDICTOR_KINDS = (PREDICTOR_MLP, PREDICTOR_LOWBIT)


def quantize_rows_q4(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Symmetric 4-bit block quantization of weight rows.

  Each block of LOWBIT_BLOCK consecutive values of a row gets scale s = max|w| / 7 (stored
  f16) and codes q = clip(round(w / s), -7, 7); two codes (q + 8) are packed per byte, the
  even column in the low nibble.

  Args:
    rows: f32[F, D] (one row per neuron), D a multiple of LOWBIT_BLOCK.

  Returns:
    (codes: uint8[F, D // 2], scales: f16[F, D // LOWBIT_BLOCK]).

  Raises:
    ConfigError: D is not a multiple of LOWBIT_BLOCK.
  """
  rows = np.asarray(rows, np.float32)
  n, d = rows.shape
  if d % LOWBIT_BLOCK:
    raise ConfigError(f"the low-bit predictor needs hidden_size divisible by {LOWBIT_BLOCK}, "
                      f"got {d}; use --predictor_kind=mlp.")
  blocks = rows.reshape(n, d // LOWBIT_BLOCK, LOWBIT_BLOCK)
  scales = (np.abs(blocks).max(axis=-1) / LOWBIT_QMAX).astype(np.float16)
  s = scales.astype(np.float32)[..., None]
  q = np.where(s > 0, np.rint(blocks / np.where(s > 0, s, 1.0)), 0.0)
  q = (np.clip(q, -LOWBIT_QMAX, LOWBIT_QMAX).astype(np.int16) + 8).astype(np.uint8).reshape(n, d)
  codes = q[:, 0::2] | (q[:, 1::2] << 4)
  return np.ascontiguousarray(codes, np.uint8), scales


def dequantize_rows_q4(codes: jax.Array, scales: jax.Array) -> jax.Array:
  """Inverse of `quantize_rows_q4` in jnp: uint8[F, D/2], f16[F, D/32] -> f32[F, D]."""
  n = codes.shape[0]
  # [F, D/2, 2] -> [F, D]: low nibble = even column.
  q = jnp.stack([codes & 15, codes >> 4], axis=-1).reshape(n, 2 * codes.shape[1])
  q = q.astype(jnp.float32) - 8.0
  s = jnp.repeat(scales.astype(jnp.float32), LOWBIT_BLOCK, axis=-1)
  return q * s


def lowbit_params(gate_rows: np.ndarray, up_rows: np.ndarray) -> dict[str, np.ndarray]:
  """The low-bit predictor of one layer from its gate and up rows: f32[F, D] each.

  Returns {"gate_codes": uint8[F, D/2], "gate_scales": f16[F, D/32], "up_codes", "up_scales"}.
  """
  gc, gs = quantize_rows_q4(gate_rows)
  uc, us = quantize_rows_q4(up_rows)
  return {"gate_codes": gc, "gate_scales": gs, "up_codes": uc, "up_scales": us}


def lowbit_bytes(hidden: int, ffn: int) -> int:
  """Bytes of one layer's low-bit predictor: codes and f16 scales of gate and up."""
  return 2 * (ffn * hidden // 2 + ffn * (hidden // LOWBIT_BLOCK) * 2)


def hot_neuron_bytes(hidden: int, kind: str) -> int:
  """Device bytes a hot neuron's predictor adds in placement: its 4-bit gate and up codes for
  the low-bit predictor (the device holds the hot rows' codes and the host predicts its cold
  ones), 0 for MLP predictors (their ranks count in the dense part)."""
  return lowbit_bytes(hidden, 1) if kind == PREDICTOR_LOWBIT else 0


def lowbit_contribution(params: dict, h: jax.Array, family: str) -> jax.Array:
  """Estimated neuron contributions |act(g) * u| from the 4-bit gate and up rows.

  Args:
    params: see `lowbit_params` (NumPy or jax arrays).
    h: f32[..., D] the normed FFN input (what the FFN itself multiplies).
    family: FFN family (see `pijax.nn.sparsity.neuron_contribution`).

  Returns:
    f32[..., F].
  """
  from pijax.nn import sparsity
  h = jnp.asarray(h, jnp.float32)
  g = jnp.einsum("...d,fd->...f", h, dequantize_rows_q4(params["gate_codes"],
                                                        params["gate_scales"]))
  u = jnp.einsum("...d,fd->...f", h, dequantize_rows_q4(params["up_codes"], params["up_scales"]))
  return sparsity.neuron_contribution(g, u, family)


def lowbit_contribution_reference(params: dict, h: np.ndarray, family: str) -> np.ndarray:
  """Plain NumPy (float64) reference of `lowbit_contribution` (same layout as host_ops.lowbit)."""
  from host_ops import lowbit as host_lowbit
  h = np.asarray(h, np.float64)
  g = h @ host_lowbit.dequantize_q4_reference(params["gate_codes"], params["gate_scales"]).T
  u = h @ host_lowbit.dequantize_q4_reference(params["up_codes"], params["up_scales"]).T
  return np.abs(host_lowbit.activation_reference(g, u, family))
