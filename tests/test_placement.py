"""Placement: dense byte accounting, the MILP against brute force, budgets to the byte, CLI."""

import dataclasses
import itertools
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from pijax.offline import placement as placement_lib
from pijax.arch.spec import ModelConfig
from pijax.errors import BudgetError, ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[1]

SMOLLM2 = ModelConfig(
    arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, n_layers=30,
    n_heads=9, n_kv_heads=3, head_dim=64, rope_theta=1e5, rope_style="adjacent", rope_dim=64,
    rms_norm_eps=1e-5, context_length=8192, ffn_family="swiglu", tied_output=True)

# SmolLM2-135M, f32, max_seq_len 2048, worked out by hand:
#   embedding 49152 * 576 * 4                                   = 113_246_208
#   attention 30 * (576 * (9 + 2*3) * 64 + 9 * 64 * 576) * 4
#           = 30 * (552_960 + 331_776) * 4                      = 106_168_320
#   norms     (2*30 + 1) * 576 * 4                              =     140_544
#   kv cache  2 * 30 * 2048 * 3 * 64 * 4                        =  94_371_840
#   total                                                       = 313_926_912
SMOLLM2_DENSE_F32_2048 = 313_926_912
SMOLLM2_NEURON_F32 = 3 * 576 * 4  # 6912


def _power_law(rng, n_layers, n_neurons, shuffle=True):
  """f32[L, F] power-law-ish activation probabilities, optionally shuffled per layer."""
  alpha = rng.uniform(0.3, 2.0, (n_layers, 1))
  ranks = np.arange(1, n_neurons + 1, dtype=np.float64)[None, :]
  freqs = ranks ** -alpha * rng.uniform(0.3, 1.0, (n_layers, 1))
  freqs = np.clip(freqs * rng.uniform(0.5, 1.5, freqs.shape), 0.0, 1.0)
  if shuffle:
    for row in freqs:
      rng.shuffle(row)
  return freqs.astype(np.float32)


def _objective(freqs, hot, weights):
  return float(np.dot(weights, placement_lib.served(freqs, hot)))


def test_solver_matches_brute_force():
  rng = np.random.default_rng(0)
  for case in range(60):
    n_layers = int(rng.integers(2, 5))
    tile = int(rng.integers(1, 9))
    n_neurons = int(rng.integers(1, 6 * tile + 1))  # Up to 6 tiles, often not a multiple.
    freqs = _power_law(rng, n_layers, n_neurons)
    if case % 5 == 0:
      freqs = np.round(freqs, 1)  # Ties between neurons and between layers.
    weights = rng.uniform(0.0, 3.0, n_layers) if case % 2 else None
    one = int(rng.integers(1, 1000))
    budget = [0, 2 * n_layers * n_neurons * one,
              int(rng.integers(0, n_layers * n_neurons * one + 1)),
              int(rng.integers(0, n_layers * n_neurons * one + 1))][case % 4]
    hot = placement_lib.solve_hot_counts(freqs, ffn_budget_bytes=budget, neuron_bytes=one,
                                         tile=tile, layer_weights=weights)
    assert hot.dtype == np.int64 and hot.shape == (n_layers,)
    w = np.ones(n_layers) if weights is None else weights
    candidates = placement_lib.candidate_counts(n_neurons, tile)
    assert set(hot.tolist()) <= set(candidates.tolist())
    assert int(hot.sum()) * one <= budget
    best = max(_objective(freqs, combo, w)
               for combo in itertools.product(candidates, repeat=n_layers)
               if sum(combo) * one <= budget)
    assert _objective(freqs, hot, w) == pytest.approx(best, abs=1e-9, rel=0), (case, hot)
    if budget == 0:
      assert not hot.any()
    if budget >= n_layers * n_neurons * one:
      assert (hot == n_neurons).all()


def test_solver_edge_cases():
  freqs = _power_law(np.random.default_rng(1), 3, 100)
  kw = dict(neuron_bytes=10, tile=64)
  assert placement_lib.solve_hot_counts(freqs, ffn_budget_bytes=0, **kw).tolist() == [0] * 3
  assert placement_lib.solve_hot_counts(freqs, ffn_budget_bytes=639, **kw).tolist() == [0] * 3
  assert placement_lib.solve_hot_counts(
      freqs, ffn_budget_bytes=float("inf"), **kw).tolist() == [100] * 3
  assert placement_lib.solve_hot_counts(freqs, ffn_budget_bytes=10**15, **kw).tolist() == [100] * 3
  hot = placement_lib.solve_hot_counts(freqs, ffn_budget_bytes=2640, **kw)  # 264 neurons.
  assert sorted(hot.tolist()) == [64, 100, 100]
  for bad in (np.zeros(5), np.full((2, 3), np.nan), -np.ones((2, 3))):
    with pytest.raises(ValueError):
      placement_lib.solve_hot_counts(bad, ffn_budget_bytes=100, **kw)
  with pytest.raises(ValueError):
    placement_lib.solve_hot_counts(freqs, ffn_budget_bytes=100, layer_weights=[1, -1, 1], **kw)


def test_dense_bytes_smollm2_by_hand():
  dense = placement_lib.dense_device_bytes(SMOLLM2, max_seq_len=2048, dtype_bytes=4,
                                           predictor_ranks=[])
  assert dense == placement_lib.DenseDeviceBytes(
      embedding=113_246_208, lm_head=0, attention=106_168_320, norms=140_544, predictors=0,
      kv_cache=94_371_840)
  assert dense.total == SMOLLM2_DENSE_F32_2048
  assert placement_lib.neuron_bytes(SMOLLM2, 4) == SMOLLM2_NEURON_F32
  # Rank-64 predictors: 30 * (576*64 + 64*1536) * 4 bytes, f32 even when the weights are bf16.
  bf16 = placement_lib.dense_device_bytes(SMOLLM2, max_seq_len=2048, dtype_bytes=2,
                                          predictor_ranks=[64])
  assert bf16.predictors == 30 * (576 * 64 + 64 * 1536) * 4 == 16_220_160
  assert bf16.embedding == 113_246_208 // 2 and bf16.kv_cache == 94_371_840 // 2
  # Tied head with the embedding off the device: the head still needs the matrix there.
  off = placement_lib.dense_device_bytes(SMOLLM2, max_seq_len=2048, dtype_bytes=4,
                                         predictor_ranks=[], embedding_on_device=False)
  assert (off.embedding, off.lm_head, off.total) == (0, 113_246_208, SMOLLM2_DENSE_F32_2048)
  untied = placement_lib.dense_device_bytes(
      dataclasses.replace(SMOLLM2, tied_output=False), max_seq_len=2048, dtype_bytes=4,
      predictor_ranks=[], kv_dtype_bytes=2)
  assert untied.lm_head == 113_246_208 and untied.kv_cache == 94_371_840 // 2
  with pytest.raises(ConfigError):
    placement_lib.dense_device_bytes(SMOLLM2, max_seq_len=2048, dtype_bytes=4,
                                     predictor_ranks=[64, 64])


def test_real_gguf_config_matches(smollm2_path):
  from pijax.place import load_config
  config = load_config(smollm2_path)
  for field in ("vocab_size", "hidden_size", "intermediate_size", "n_layers", "n_heads",
                "n_kv_heads", "head_dim", "tied_output"):
    assert getattr(config, field) == getattr(SMOLLM2, field), field


def _place(freqs, budget, **kw):
  kw = dict(dict(max_seq_len=2048, dtype_bytes=4, predictor_ranks=[]), **kw)
  return placement_lib.place(SMOLLM2, freqs, budget_bytes=budget, **kw)


def test_budget_never_exceeded_to_the_byte():
  rng = np.random.default_rng(2)
  freqs = _power_law(rng, 30, 1536, shuffle=False)
  tile_bytes = 64 * SMOLLM2_NEURON_F32
  for k in (0, 1, 37, 300, 719):
    exact = SMOLLM2_DENSE_F32_2048 + k * tile_bytes
    for budget in (exact, exact - 1, exact + tile_bytes - 1):
      if budget < SMOLLM2_DENSE_F32_2048:
        continue  # Below the dense part: test_budget_below_dense_part_raises.
      p = _place(freqs, budget)
      assert p.device_bytes <= budget, (k, budget)
      assert p.method == "milp" and all(h % 64 == 0 for h in p.hot_counts)
      assert p.ffn_bytes_hot == sum(p.hot_counts) * SMOLLM2_NEURON_F32
      assert p.device_bytes == p.dense.total + p.ffn_bytes_hot
      # Every frequency is > 0, so the solver fills every whole tile the budget allows.
      fits = (budget - SMOLLM2_DENSE_F32_2048) // tile_bytes
      assert sum(p.hot_counts) == 64 * fits, (k, budget)
  for _ in range(3):
    dense = SMOLLM2_DENSE_F32_2048 + 30 * (576 * 32 + 32 * 1536) * 4  # Rank-32 predictors.
    budget = dense + int(rng.integers(0, 30 * 1536 * SMOLLM2_NEURON_F32))
    p = _place(_power_law(rng, 30, 1536), budget, predictor_ranks=[32])
    assert p.dense.total == dense and p.device_bytes <= budget
    assert 0.0 <= p.served_fraction <= 1.0
  p = _place(freqs, 10**12)
  assert p.hot_counts == [1536] * 30 and p.served_fraction == pytest.approx(1.0)


def test_lowbit_codes_of_hot_rows_count_against_the_budget():
  """With the low-bit predictor each hot neuron also puts its 4-bit gate/up codes (648 bytes at
  hidden 576) on the device: counted per hot neuron, never over the budget, fewer hot neurons."""
  from pijax.offline import predictor as predictor_lib
  extra = predictor_lib.hot_neuron_bytes(576, predictor_lib.PREDICTOR_LOWBIT)
  assert extra == 2 * (576 // 2 + 2 * 576 // 32) == 648
  assert predictor_lib.hot_neuron_bytes(576, predictor_lib.PREDICTOR_MLP) == 0
  freqs = _power_law(np.random.default_rng(5), 30, 1536, shuffle=False)
  tile_bytes = 64 * (SMOLLM2_NEURON_F32 + extra)
  budget = SMOLLM2_DENSE_F32_2048 + 500 * tile_bytes - 1
  plain = _place(freqs, budget)
  coded = _place(freqs, budget, predictor_neuron_bytes=extra)
  assert coded.device_bytes <= budget and sum(coded.hot_counts) == 64 * 499
  assert coded.ffn_bytes_hot == sum(coded.hot_counts) * (SMOLLM2_NEURON_F32 + extra)
  assert sum(coded.hot_counts) < sum(plain.hot_counts)
  with pytest.raises(ConfigError, match="predictor_neuron_bytes"):
    _place(freqs, budget, predictor_neuron_bytes=-1)


def test_budget_below_dense_part_raises():
  freqs = _power_law(np.random.default_rng(3), 30, 1536)
  p = _place(freqs, SMOLLM2_DENSE_F32_2048)
  assert p.hot_counts == [0] * 30 and p.device_bytes == SMOLLM2_DENSE_F32_2048
  with pytest.raises(BudgetError) as err:
    _place(freqs, SMOLLM2_DENSE_F32_2048 - 1)
  message = str(err.value)
  assert str(SMOLLM2_DENSE_F32_2048) in message
  assert str(SMOLLM2_DENSE_F32_2048 - 1) in message
  assert "MB" in message and "--device_budget_gb" in message and "\n" not in message
  with pytest.raises(ConfigError):
    _place(freqs, None)  # No budget needs hot_ratio.
  with pytest.raises(ConfigError):
    _place(freqs[:, :100], 10**12)  # Profile of another model.


def test_hot_ratio():
  freqs = _power_law(np.random.default_rng(4), 30, 1536)
  assert _place(freqs, None, hot_ratio=0.0).hot_counts == [0] * 30
  p = _place(freqs, None, hot_ratio=0.3)  # 0.3 * 1536 / 64 = 7.2 tiles -> 7 -> 448.
  assert p.hot_counts == [448] * 30 and p.method == "hot_ratio" and p.budget_bytes is None
  assert _place(freqs, float("inf"), hot_ratio=1.0).hot_counts == [1536] * 30
  assert _place(freqs, None, hot_ratio=0.99, tile=1000).hot_counts == [1536] * 30  # Capped.
  need = SMOLLM2_DENSE_F32_2048 + 30 * 448 * SMOLLM2_NEURON_F32
  assert _place(freqs, need, hot_ratio=0.3).device_bytes == need
  with pytest.raises(BudgetError) as err:
    _place(freqs, need - 1, hot_ratio=0.3)
  assert str(need) in str(err.value) and str(need - 1) in str(err.value)
  for bad in (-0.1, 1.5, float("nan")):
    with pytest.raises(ConfigError):
      _place(freqs, None, hot_ratio=bad)


def test_cost_model(tmp_path):
  path = tmp_path / "cost.json"
  host = [10.0] * 30
  host[7] = 40.0
  path.write_text(json.dumps({"host_us_per_neuron": host, "device_us_per_neuron": 1.0}))
  weights = placement_lib.load_cost_model(path, 30)
  assert weights.shape == (30,) and weights[7] == 39.0 and weights[0] == 9.0
  freqs = np.tile(_power_law(np.random.default_rng(5), 1, 1536, shuffle=False), (30, 1))
  budget = SMOLLM2_DENSE_F32_2048 + 100 * 64 * SMOLLM2_NEURON_F32
  p = _place(freqs, budget, layer_weights=weights)
  assert p.device_bytes <= budget
  assert p.hot_counts[7] >= max(p.hot_counts[:7] + p.hot_counts[8:])
  assert p.hot_counts[7] > min(p.hot_counts)

  def bad(text, needle):
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
      placement_lib.load_cost_model(path, 30)
    assert needle in str(err.value) and "\n" not in str(err.value)

  bad("{not json", "not valid JSON")
  bad(json.dumps({"host_us_per_neuron": 1.0}), "device_us_per_neuron")
  bad(json.dumps({"host_us_per_neuron": [1.0] * 3, "device_us_per_neuron": 0.5}), "3 values")
  bad(json.dumps({"host_us_per_neuron": "fast", "device_us_per_neuron": 0.5}), "number")
  bad(json.dumps({"host_us_per_neuron": 1.0, "device_us_per_neuron": 1.0}), "re-measure")
  with pytest.raises(ConfigError, match="cannot read"):
    placement_lib.load_cost_model(tmp_path / "missing.json", 30)


def test_json_round_trip():
  p = _place(_power_law(np.random.default_rng(6), 30, 1536), 400_000_000, predictor_ranks=[16])
  d = json.loads(json.dumps(p.to_json()))
  assert d["dense"]["total"] == p.dense.total
  assert placement_lib.Placement.from_json(d) == p
  with pytest.raises(ConfigError):
    placement_lib.Placement.from_json({"hot_counts": [1]})


def _run_cli(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "pijax.place", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)


def test_cli(tmp_path, smollm2_path):
  profile = tmp_path / "profile.npz"
  np.savez(profile, frequencies=_power_law(np.random.default_rng(7), 30, 1536))
  out = tmp_path / "sub" / "placement.json"
  proc = _run_cli(f"--profile={profile}", f"--model={smollm2_path}", "--device_budget_gb=0.45",
                  "--predictor_ranks=32", f"--out={out}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  placement = placement_lib.Placement.from_json(json.loads(out.read_text()))
  assert placement.budget_bytes == 450_000_000 and placement.device_bytes <= 450_000_000
  assert placement.method == "milp" and len(placement.hot_counts) == 30
  assert "served" in proc.stderr and proc.stdout == ""
  assert [p.name for p in out.parent.iterdir()] == ["placement.json"]  # No temp file left.

  proc = _run_cli(f"--profile={profile}", f"--model={smollm2_path}", "--device_budget_gb=0.1",
                  f"--out={tmp_path / 'small.json'}")
  assert proc.returncode == 2, proc.stderr[-3000:]
  lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
  assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
  assert str(SMOLLM2_DENSE_F32_2048) in lines[0] and "100000000" in lines[0]
  assert not (tmp_path / "small.json").exists()
