"""Synthetic active sets: which of a layer's neurons fire per call, drawn from a power law.

Neurons are sorted by frequency as in our bundles (neuron 0 the hottest); neuron i of n is
active, independently per call, with probability p_i = min(1, c * (i + 1) ** -alpha), c set so
that the expected active fraction is 1 - sparsity (see `pijax.bench_ops`).
"""

from __future__ import annotations

import numpy as np

DEFAULT_ALPHA = 1.0
ID_SETS = 16  # Independent active sets drawn per row, cycled over the calls.


def power_law_probs(n: int, sparsity: float, alpha: float = DEFAULT_ALPHA) -> np.ndarray:
  """Per-neuron activation probabilities: f64[n], p_i = min(1, c * (i + 1) ** -alpha).

  c is solved by bisection so that sum(p) = (1 - sparsity) * n (to ~1e-12 relative); p is
  non-increasing (neuron 0 the most frequent, as in a bundle sorted by frequency). sparsity 0 gives
  all ones, sparsity 1 all zeros; alpha 0 gives the uniform p_i = 1 - sparsity.
  """
  n = int(n)
  if n < 0:
    raise ValueError(f"n must be >= 0, got {n}")
  if not 0.0 <= sparsity <= 1.0:
    raise ValueError(f"sparsity must be in [0, 1], got {sparsity}")
  if not alpha >= 0.0:
    raise ValueError(f"alpha must be >= 0, got {alpha}")
  target = (1.0 - sparsity) * n
  if n == 0 or target <= 0.0:
    return np.zeros(n)
  if target >= n:
    return np.ones(n)
  w = np.arange(1, n + 1, dtype=np.float64) ** -alpha  # [n], w_0 = 1
  lo, hi = 0.0, 1.0 / w[-1]  # sum(min(1, c w)) is 0 at c = lo and n at c = hi.
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    if np.minimum(1.0, mid * w).sum() < target:
      lo = mid
    else:
      hi = mid
    if hi - lo <= 1e-15 * hi:
      break
  return np.minimum(1.0, 0.5 * (lo + hi) * w)


def power_law_active(n: int, sparsity: float, rng: np.random.Generator,
                     alpha: float = DEFAULT_ALPHA) -> np.ndarray:
  """One random active set: i32[k] ascending ids in [0, n), neuron i drawn with power_law_probs.

  E[k] = (1 - sparsity) * n; sparsity 0 -> every neuron, 1 -> an empty array.
  """
  p = power_law_probs(n, sparsity, alpha)
  return np.flatnonzero(rng.random(n) < p).astype(np.int32)


def draw_sets(n: int, sparsity: float, alpha: float, seed: int,
              count: int = ID_SETS) -> list[np.ndarray]:
  """`count` active sets (i32[k_j] each) for one (n, sparsity), reproducible from the seed."""
  rng = np.random.default_rng([seed, n, int(round(sparsity * 1e4))])
  return [power_law_active(n, sparsity, rng, alpha) for _ in range(count)]
