"""Placement: how many FFN neurons of each layer are hot (resident on the device).

PowerInfer's offline placement step (arXiv 2312.12456). The dense part (embedding, LM head,
attention, norms, predictors, KV cache) goes to the device first and is accounted to the byte;
the rest of the budget goes to FFN neurons. Each layer's neurons are sorted by descending
activation frequency (`pijax.convert` permutes them so), so a layer's hot set is a prefix:
`hot_counts[l]` = the first h_l neurons.

The split is chosen by a mixed-integer program (scipy.optimize.milp, HiGHS): per layer one
binary per candidate count {0, tile, 2 tile, ..., F}, exactly one chosen, maximising the
(optionally cost-weighted) expected activations per token that the device serves, under one
knapsack constraint on bytes. A layer weight w_l = host_us - device_us per neuron (a measured
cost model) turns "activations served" into "host microseconds saved".

Units: bytes are exact ints; GB/MB in messages are 1e9/1e6 bytes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from typing import Any, Sequence

import numpy as np

from pijax.arch.spec import ModelConfig
from pijax.errors import BudgetError, ConfigError

PREDICTOR_DTYPE_BYTES = 4  # Predictors (fc1, fc2) are stored and run in f32.
METHOD_MILP = "milp"
METHOD_HOT_RATIO = "hot_ratio"
METHODS = (METHOD_MILP, METHOD_HOT_RATIO)


def _human(n_bytes: float) -> str:
  """`n_bytes` as GB (>= 1e9) or MB, decimal units."""
  if abs(n_bytes) >= 1e9:
    return f"{n_bytes / 1e9:.3f} GB"
  return f"{n_bytes / 1e6:.3f} MB"


@dataclasses.dataclass(frozen=True)
class DenseDeviceBytes:
  """Exact bytes of every device-resident tensor other than hot FFN neurons.

  Attributes:
    embedding: token embedding [vocab, hidden] when it lives on the device, else 0.
    lm_head: output projection [hidden, vocab]; 0 when tied and the embedding is on the device
      (the head shares it), else vocab * hidden * dtype_bytes.
    attention: q|k|v [hidden, (n_heads + 2 n_kv_heads) head_dim] and o
      [n_heads head_dim, hidden] of every layer.
    norms: 2 RMSNorm scales [hidden] per layer plus the final one.
    predictors: f32 fc1 [hidden, r_l] + fc2 [r_l, ffn] of every layer.
    kv_cache: K and V [n_layers, max_seq_len, n_kv_heads, head_dim].
  """

  embedding: int
  lm_head: int
  attention: int
  norms: int
  predictors: int
  kv_cache: int

  @property
  def total(self) -> int:
    """Sum of all fields (bytes)."""
    return (self.embedding + self.lm_head + self.attention + self.norms + self.predictors
            + self.kv_cache)

  def describe(self) -> str:
    """One line: every part in bytes, e.g. for error messages."""
    parts = [f"{f.name} {getattr(self, f.name)}" for f in dataclasses.fields(self)]
    return ", ".join(parts)


def _positive_int(name: str, value: Any, minimum: int = 1) -> int:
  if isinstance(value, bool) or int(value) != value or int(value) < minimum:
    raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}.")
  return int(value)


def _predictor_ranks(config: ModelConfig, predictor_ranks: Sequence[int]) -> list[int]:
  """Per-layer ranks: L values, one value for all layers, or empty (no predictors)."""
  ranks = [int(r) for r in predictor_ranks]
  if not ranks:
    return [0] * config.n_layers
  if len(ranks) == 1:
    ranks = ranks * config.n_layers
  if len(ranks) != config.n_layers:
    raise ConfigError(f"predictor_ranks has {len(ranks)} values but the model has "
                      f"{config.n_layers} layers; give one rank per layer, one for all, or none.")
  if any(r < 0 for r in ranks):
    raise ConfigError(f"predictor_ranks {ranks} must all be >= 0.")
  return ranks


def dense_device_bytes(config: ModelConfig, *, max_seq_len: int, dtype_bytes: int,
                       predictor_ranks: Sequence[int], embedding_on_device: bool = True,
                       kv_dtype_bytes: int | None = None,
                       predictor_bytes: int | None = None) -> DenseDeviceBytes:
  """Exact device bytes of everything but the hot FFN neurons.

  Args:
    config: the model.
    max_seq_len: KV cache length (tokens).
    dtype_bytes: bytes per weight of the device copy (4 for f32, 2 for bf16/f16).
    predictor_ranks: r_l of each layer's predictor (L values), one value for every layer, or
      empty for no predictors. Predictors are f32 whatever `dtype_bytes`.
    embedding_on_device: keep the token embedding on the device. The LM head always runs on
      the device; a tied head then needs the shared matrix there anyway, counted as `lm_head`.
    kv_dtype_bytes: bytes per KV cache element; None = `dtype_bytes`.
    predictor_bytes: the predictors' device bytes when they are not MLPs of `predictor_ranks`
      (the low-bit predictor's codes of every row); None = from the ranks.

  Returns:
    DenseDeviceBytes (ints, bytes).

  Raises:
    ConfigError: non-positive sizes, or predictor_ranks of the wrong length / negative.
  """
  dtype_bytes = _positive_int("dtype_bytes", dtype_bytes)
  max_seq_len = _positive_int("max_seq_len", max_seq_len)
  kv_bytes = dtype_bytes if kv_dtype_bytes is None else _positive_int("kv_dtype_bytes",
                                                                      kv_dtype_bytes)
  d, f, n_layers = config.hidden_size, config.intermediate_size, config.n_layers
  table = config.vocab_size * d * dtype_bytes
  embedding = table if embedding_on_device else 0
  lm_head = 0 if (config.tied_output and embedding_on_device) else table
  # [hidden, (n_heads + 2 n_kv_heads) head_dim] (q|k|v) + [n_heads head_dim, hidden] (o).
  per_layer_attn = (d * (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
                    + config.n_heads * config.head_dim * d)
  attention = n_layers * per_layer_attn * dtype_bytes
  norms = (2 * n_layers + 1) * d * dtype_bytes
  ranks = _predictor_ranks(config, predictor_ranks)
  predictors = sum(d * r + r * f for r in ranks) * PREDICTOR_DTYPE_BYTES \
      if predictor_bytes is None else _nonnegative_int("predictor_bytes", predictor_bytes)
  kv_cache = 2 * n_layers * max_seq_len * config.n_kv_heads * config.head_dim * kv_bytes
  return DenseDeviceBytes(embedding=int(embedding), lm_head=int(lm_head),
                          attention=int(attention), norms=int(norms),
                          predictors=int(predictors), kv_cache=int(kv_cache))


def _nonnegative_int(name: str, value) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
    raise ConfigError(f"{name}={value!r} must be an integer >= 0.")
  return int(value)


def neuron_bytes(config: ModelConfig, dtype_bytes: int) -> int:
  """Bytes of one FFN neuron: its gate row, up row and down row (3 * hidden * dtype_bytes)."""
  return 3 * config.hidden_size * _positive_int("dtype_bytes", dtype_bytes)


def int8_neuron_bytes(config: ModelConfig) -> int:
  """Device bytes of one hot neuron held as int8 blocks (`pallas_kernels.sparse_ffn`'s
  Q8_0-style rows: 32 int8 values and one f32 scale per block): 3 rows x hidden x 36 / 32."""
  return 3 * config.hidden_size // 32 * 36


def _check_frequencies(frequencies: np.ndarray) -> np.ndarray:
  freqs = np.asarray(frequencies, dtype=np.float64)
  if freqs.ndim != 2 or freqs.shape[0] < 1 or freqs.shape[1] < 1:
    raise ValueError(f"frequencies must be [layers, neurons] with both > 0, got shape "
                     f"{freqs.shape}.")
  if not np.all(np.isfinite(freqs)) or np.any(freqs < 0):
    raise ValueError("frequencies must be finite and >= 0 (activation probability per token).")
  return freqs


def candidate_counts(n_neurons: int, tile: int) -> np.ndarray:
  """i64[K]: the hot counts a layer may take, 0, tile, 2 tile, ..., capped at n_neurons."""
  n_options = -(-n_neurons // tile) + 1
  return np.minimum(np.arange(n_options, dtype=np.int64) * tile, n_neurons)


def served(frequencies: np.ndarray, hot_counts: Sequence[int]) -> np.ndarray:
  """f64[L]: expected activations per token that the first h_l neurons (by frequency) serve.

  Args:
    frequencies: f32[L, F] activation probability per token (any order; sorted here).
    hot_counts: h_l per layer.
  """
  freqs = np.sort(_check_frequencies(frequencies), axis=1)[:, ::-1]
  prefix = np.concatenate([np.zeros((freqs.shape[0], 1)), np.cumsum(freqs, axis=1)], axis=1)
  counts = np.asarray(hot_counts, dtype=np.int64)
  return prefix[np.arange(freqs.shape[0]), counts]


def solve_hot_counts(frequencies: np.ndarray, *, ffn_budget_bytes: int, neuron_bytes: int,
                     tile: int = 64, layer_weights: np.ndarray | None = None,
                     time_limit_s: float = 300.0) -> np.ndarray:
  """Hot neurons per layer maximising the weighted activations the device serves.

  Solves, with h_l in {0, tile, 2 tile, ..., F},
    max sum_l w_l * served_l(h_l)  s.t.  sum_l h_l * neuron_bytes <= ffn_budget_bytes,
  where served_l(h) is the sum of layer l's h largest frequencies, as a MILP: binaries
  y[l, k] (layer l takes candidate k), sum_k y[l, k] = 1, one knapsack row counted in neurons
  (integer coefficients, capacity floor(budget / neuron_bytes)), so the rounded solution is
  checked exactly.

  Args:
    frequencies: f32[L, F] activation probability per token of each neuron, any order.
    ffn_budget_bytes: bytes available for hot neurons (>= 0; may be float('inf')).
    neuron_bytes: bytes of one neuron (see `neuron_bytes`).
    tile: granularity of hot counts (neurons); F itself is allowed even if not a multiple.
    layer_weights: f[L] >= 0, weight of one served activation per layer (default all 1).
    time_limit_s: HiGHS wall-clock limit (seconds).

  Returns:
    i64[L] hot counts; sum * neuron_bytes <= ffn_budget_bytes.

  Raises:
    ValueError: malformed frequencies, weights, tile, neuron_bytes or budget.
    RuntimeError: HiGHS did not prove an optimum (message included).
  """
  from scipy import optimize, sparse

  freqs = _check_frequencies(frequencies)
  n_layers, n_neurons = freqs.shape
  if isinstance(tile, bool) or int(tile) != tile or tile < 1:
    raise ValueError(f"tile={tile!r} must be an integer >= 1.")
  if isinstance(neuron_bytes, bool) or int(neuron_bytes) != neuron_bytes or neuron_bytes < 1:
    raise ValueError(f"neuron_bytes={neuron_bytes!r} must be an integer >= 1.")
  if math.isnan(ffn_budget_bytes) or ffn_budget_bytes < 0:
    raise ValueError(f"ffn_budget_bytes={ffn_budget_bytes!r} must be >= 0.")
  tile, neuron_bytes = int(tile), int(neuron_bytes)
  weights = np.ones(n_layers) if layer_weights is None else np.asarray(layer_weights,
                                                                          np.float64)
  if weights.shape != (n_layers,) or not np.all(np.isfinite(weights)) or np.any(weights < 0):
    raise ValueError(f"layer_weights must be {n_layers} finite values >= 0, got "
                     f"{np.asarray(layer_weights).tolist()!r}.")

  counts = candidate_counts(n_neurons, tile)  # [K]
  total_neurons = n_layers * n_neurons
  capacity = (total_neurons if math.isinf(ffn_budget_bytes)
              else min(int(ffn_budget_bytes // neuron_bytes), total_neurons))
  if capacity >= total_neurons:
    return np.full(n_layers, n_neurons, np.int64)
  if capacity < int(counts[1]):
    return np.zeros(n_layers, np.int64)

  n_options = counts.size
  # [L, F + 1]: served_l(h) for every h (sorted descending, prefix sums).
  prefix = np.concatenate([np.zeros((n_layers, 1)),
                           np.cumsum(np.sort(freqs, axis=1)[:, ::-1], axis=1)], axis=1)
  values = weights[:, None] * prefix[:, counts]  # [L, K] weighted activations served.
  scale = float(values[:, -1].sum())
  if scale <= 0:  # Nothing to serve anywhere: any feasible split is optimal.
    return np.zeros(n_layers, np.int64)
  # Normalise so the best conceivable objective is 1e3: keeps HiGHS' absolute gap (1e-6)
  # far below any meaningful difference without large cost coefficients.
  cost = -(values * (1e3 / scale)).reshape(-1)  # milp minimises.

  n_vars = n_layers * n_options
  rows = np.repeat(np.arange(n_layers), n_options)
  one_hot = sparse.csr_array((np.ones(n_vars), (rows, np.arange(n_vars))),
                             shape=(n_layers, n_vars))
  knapsack = np.tile(counts.astype(np.float64), n_layers)[None, :]  # [1, L*K] neurons.
  constraints = [optimize.LinearConstraint(one_hot, 1.0, 1.0),
                 optimize.LinearConstraint(knapsack, 0.0, float(capacity))]
  result = optimize.milp(cost, constraints=constraints, integrality=np.ones(n_vars),
                         bounds=optimize.Bounds(0.0, 1.0),
                         options={"mip_rel_gap": 0.0, "time_limit": float(time_limit_s),
                                  "presolve": True})
  if result.status != 0 or result.x is None:
    raise RuntimeError(f"placement MILP failed (status {result.status}): {result.message}; "
                       f"{n_layers} layers x {n_options} candidates, capacity {capacity} "
                       "neurons. Pass --hot_ratio to place without the solver.")
  choice = np.argmax(result.x.reshape(n_layers, n_options), axis=1)
  hot = counts[choice]
  if int(hot.sum()) > capacity:
    raise RuntimeError(f"placement MILP returned {int(hot.sum())} hot neurons for a capacity "
                       f"of {capacity} (solver tolerance); this is a bug, please report it.")
  return hot.astype(np.int64)


@dataclasses.dataclass
class Placement:
  """The chosen split of FFN neurons between device (hot) and host (cold).

  Attributes:
    hot_counts: h_l per layer; layer l's first h_l neurons (sorted by frequency) are hot.
    tile: granularity of the counts (neurons).
    budget_bytes: the device budget (bytes), or None when placed by hot_ratio without one.
    device_bytes: dense.total + ffn_bytes_hot; never above budget_bytes.
    dense: the dense device bytes.
    ffn_bytes_hot: bytes of the hot neurons (sum h_l * neuron bytes).
    served_fraction: expected fraction of FFN activations served by the device
      (sum of hot frequencies / sum of all frequencies; 1.0 when nothing ever fires).
    method: "milp" or "hot_ratio".
  """

  hot_counts: list[int]
  tile: int
  budget_bytes: int | None
  device_bytes: int
  dense: DenseDeviceBytes
  ffn_bytes_hot: int
  served_fraction: float
  method: str

  def to_json(self) -> dict[str, Any]:
    """A JSON-serialisable dict (dense parts in bytes, plus their total)."""
    dense = dataclasses.asdict(self.dense)
    dense["total"] = self.dense.total
    return {
        "hot_counts": [int(h) for h in self.hot_counts],
        "tile": int(self.tile),
        "budget_bytes": None if self.budget_bytes is None else int(self.budget_bytes),
        "device_bytes": int(self.device_bytes),
        "dense": dense,
        "ffn_bytes_hot": int(self.ffn_bytes_hot),
        "served_fraction": float(self.served_fraction),
        "method": self.method,
    }

  @classmethod
  def from_json(cls, d: dict[str, Any]) -> Placement:
    """Inverse of `to_json`. Raises ConfigError on a missing key or bad value."""
    try:
      dense = {f.name: int(d["dense"][f.name]) for f in dataclasses.fields(DenseDeviceBytes)}
      budget = d["budget_bytes"]
      placement = cls(
          hot_counts=[int(h) for h in d["hot_counts"]],
          tile=int(d["tile"]),
          budget_bytes=None if budget is None else int(budget),
          device_bytes=int(d["device_bytes"]),
          dense=DenseDeviceBytes(**dense),
          ffn_bytes_hot=int(d["ffn_bytes_hot"]),
          served_fraction=float(d["served_fraction"]),
          method=str(d["method"]))
    except (KeyError, TypeError, ValueError) as err:
      raise ConfigError(f"bad placement JSON ({type(err).__name__}: {err}); regenerate it "
                        "with `python -m pijax.place`.") from None
    if placement.method not in METHODS:
      raise ConfigError(f"bad placement JSON: method {placement.method!r} is not one of "
                        f"{METHODS}.")
    return placement


def load_cost_model(path: str | os.PathLike[str], n_layers: int) -> np.ndarray:
  """Per-layer weights w_l = host_us_per_neuron - device_us_per_neuron from a JSON file.

  The file holds {"host_us_per_neuron": float | [L floats],
                  "device_us_per_neuron": float | [L floats]}: measured microseconds to compute
  one active neuron on the host and on the device. w_l is the time an activation served by the
  device saves, so the solver maximises host microseconds saved per token.

  Returns:
    f64[n_layers], all > 0.

  Raises:
    ConfigError: missing/unreadable file, bad JSON, missing key, wrong length, non-numeric
      value, or a layer where the host is not slower than the device (w_l <= 0).
  """
  path = os.fspath(path)
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except OSError as err:
    raise ConfigError(f"cost model {path}: cannot read it ({err.strerror or err}); pass an "
                      "existing JSON file to --cost_model.") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as err:
    raise ConfigError(f"cost model {path}: not valid JSON ({err}).") from None
  if not isinstance(data, dict):
    raise ConfigError(f"cost model {path}: expected a JSON object with host_us_per_neuron "
                      "and device_us_per_neuron.")

  def per_layer(key: str) -> np.ndarray:
    if key not in data:
      raise ConfigError(f"cost model {path}: key {key!r} is missing (a float or a list of "
                        f"{n_layers} floats, microseconds per neuron).")
    value = data[key]
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
      raise ConfigError(f"cost model {path}: {key} must be a number or a list of numbers, "
                        f"got {value!r}.")
    arr = np.asarray(values, np.float64)
    if arr.size == 1:
      arr = np.full(n_layers, arr[0])
    if arr.shape != (n_layers,):
      raise ConfigError(f"cost model {path}: {key} has {arr.size} values, the model has "
                        f"{n_layers} layers.")
    if not np.all(np.isfinite(arr)):
      raise ConfigError(f"cost model {path}: {key} must be finite.")
    return arr

  weights = per_layer("host_us_per_neuron") - per_layer("device_us_per_neuron")
  bad = np.flatnonzero(weights <= 0)
  if bad.size:
    raise ConfigError(f"cost model {path}: host_us_per_neuron must exceed device_us_per_neuron "
                      f"in every layer, but not in layers {bad.tolist()}; re-measure.")
  return weights


def _check_profile(config: ModelConfig, frequencies: np.ndarray) -> np.ndarray:
  freqs = np.asarray(frequencies)
  expected = (config.n_layers, config.intermediate_size)
  if freqs.shape != expected:
    raise ConfigError(f"profile frequencies have shape {freqs.shape}, the model needs "
                      f"{expected} (layers, FFN neurons); profile this model.")
  freqs = freqs.astype(np.float64)
  if not np.all(np.isfinite(freqs)) or np.any(freqs < 0):
    raise ConfigError("profile frequencies must be finite and >= 0; re-run the profiler.")
  return freqs


def place(config: ModelConfig, frequencies: np.ndarray, *, budget_bytes: int | float | None,
          max_seq_len: int, dtype_bytes: int, predictor_ranks: Sequence[int], tile: int = 64,
          layer_weights: np.ndarray | None = None, hot_ratio: float | None = None,
          embedding_on_device: bool = True, kv_dtype_bytes: int | None = None,
          predictor_neuron_bytes: int = 0,
          predictor_bytes: int | None = None,
          hot_neuron_bytes: int | None = None) -> Placement:
  """Places the dense part, then the hottest FFN neurons, within a device budget.

  Args:
    config: the model.
    frequencies: f32[n_layers, intermediate_size] activation probability per token.
    budget_bytes: device bytes available; None or inf only with hot_ratio ("no budget").
    max_seq_len: KV cache length (tokens).
    dtype_bytes: bytes per device weight (4 f32, 2 bf16/f16).
    predictor_ranks: see `dense_device_bytes`.
    tile: hot counts are multiples of tile (or the whole layer).
    layer_weights: f[L] > 0 per-layer weights (e.g. from `load_cost_model`); default 1.
    hot_ratio: in [0, 1]: every layer gets round(hot_ratio * F / tile) * tile hot neurons
      (capped at F) instead of the solver.
    embedding_on_device: see `dense_device_bytes`.
    kv_dtype_bytes: see `dense_device_bytes`.
    predictor_neuron_bytes: device bytes each hot neuron adds for its predictor (the low-bit
      predictor's 4-bit gate/up codes of the hot rows: `pijax.offline.predictor.lowbit_bytes`
      of one neuron); 0 for MLP predictors, counted in the dense part by their ranks.
    predictor_bytes: see `dense_device_bytes`.
    hot_neuron_bytes: device bytes of one hot neuron's rows (`int8_neuron_bytes` for the
      hybrid backend's int8 rows); None = 3 * hidden * dtype_bytes (`neuron_bytes`).

  Returns:
    Placement with device_bytes <= budget_bytes.

  Raises:
    BudgetError: the dense part, or the hot_ratio split, does not fit budget_bytes.
    ConfigError: bad hot_ratio, tile, budget, profile shape or sizes.
    RuntimeError: the MILP solver failed.
  """
  freqs = _check_profile(config, frequencies)
  tile = _positive_int("tile", tile)
  no_budget = budget_bytes is None or (isinstance(budget_bytes, float)
                                       and math.isinf(budget_bytes) and budget_bytes > 0)
  if no_budget and hot_ratio is None:
    raise ConfigError("a device budget is required unless hot_ratio is given; pass "
                      "--device_budget_gb (or --hot_ratio).")
  if not no_budget:
    if (isinstance(budget_bytes, float) and not math.isfinite(budget_bytes)) or budget_bytes < 0:
      raise ConfigError(f"budget_bytes={budget_bytes!r} must be >= 0.")
    budget_bytes = int(budget_bytes)
  dense = dense_device_bytes(config, max_seq_len=max_seq_len, dtype_bytes=dtype_bytes,
                             predictor_ranks=predictor_ranks,
                             embedding_on_device=embedding_on_device,
                             kv_dtype_bytes=kv_dtype_bytes, predictor_bytes=predictor_bytes)
  rows = neuron_bytes(config, dtype_bytes) if hot_neuron_bytes is None else \
      _positive_int("hot_neuron_bytes", hot_neuron_bytes)
  one_neuron = rows + _nonnegative_int("predictor_neuron_bytes", predictor_neuron_bytes)
  if not no_budget and dense.total > budget_bytes:
    remedies = ["raise --device_budget_gb", "lower --max_seq_len"]
    if dtype_bytes > 2:
      remedies.append("use --dtype=bfloat16")
    if dense.predictors:
      remedies.append("use smaller --predictor_ranks")
    if embedding_on_device and not config.tied_output:
      remedies.append("keep the embedding on the host (--noembedding_on_device)")
    raise BudgetError(
        f"the dense part needs {dense.total} bytes ({_human(dense.total)}) on the device "
        f"({dense.describe()}) but the budget is {budget_bytes} bytes ({_human(budget_bytes)}); "
        f"{', '.join(remedies[:-1])} or {remedies[-1]}.")
  n_neurons = config.intermediate_size

  if hot_ratio is not None:
    if (isinstance(hot_ratio, bool) or not isinstance(hot_ratio, numbers.Real)
        or not 0.0 <= hot_ratio <= 1.0):
      raise ConfigError(f"hot_ratio={hot_ratio!r} must be in [0, 1].")
    per_layer = min(n_neurons, int(math.floor(hot_ratio * n_neurons / tile + 0.5)) * tile)
    hot = np.full(config.n_layers, per_layer, np.int64)
    method = METHOD_HOT_RATIO
    if not no_budget and dense.total + int(hot.sum()) * one_neuron > budget_bytes:
      need = dense.total + int(hot.sum()) * one_neuron
      raise BudgetError(
          f"hot_ratio={hot_ratio} puts {per_layer} neurons per layer on the device, needing "
          f"{need} bytes ({_human(need)}: dense {dense.total} + FFN "
          f"{int(hot.sum()) * one_neuron}) but the budget is {budget_bytes} bytes "
          f"({_human(budget_bytes)}); lower --hot_ratio, raise --device_budget_gb, or drop "
          "--hot_ratio to let the solver fit the budget.")
    budget_out = None if no_budget else budget_bytes
  else:
    hot = solve_hot_counts(freqs, ffn_budget_bytes=budget_bytes - dense.total,
                           neuron_bytes=one_neuron, tile=tile, layer_weights=layer_weights)
    method = METHOD_MILP
    budget_out = budget_bytes

  ffn_bytes_hot = int(hot.sum()) * one_neuron
  total_freq = float(freqs.sum())
  fraction = float(served(freqs, hot).sum()) / total_freq if total_freq > 0 else 1.0
  placement = Placement(hot_counts=[int(h) for h in hot], tile=tile, budget_bytes=budget_out,
                        device_bytes=dense.total + ffn_bytes_hot, dense=dense,
                        ffn_bytes_hot=ffn_bytes_hot, served_fraction=fraction, method=method)
  assert budget_out is None or placement.device_bytes <= budget_out
  return placement
