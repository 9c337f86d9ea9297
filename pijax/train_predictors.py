"""Stage 3 of the offline compile: train every layer's activation predictor.

Reads the profiler's workdir (FFN-block inputs + thresholds), recomputes each layer's true
active sets from the recorded inputs, and trains `pijax.offline.predictor.train_layer_predictor`
(rank ladder, cut calibrated on the validation chunks, quality reported on the test chunks).
Memory: one layer's inputs and active sets at a time (N * (D * 4 + F) bytes).

CLI: python -m pijax.train_predictors --model=default --profile=WORKDIR
writes WORKDIR/predictors.npz and WORKDIR/predictors.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

import numpy as np
from tqdm import tqdm

from pijax.offline import predictor as predictor_lib
from pijax.profile import Profile, layer_active, layer_contribution

PREDICTORS_FILE = "predictors.npz"
PREDICTORS_META_FILE = "predictors.json"
DEFAULT_RANKS = (16, 32, 64)


def train_predictors(model, profile: Profile, *, ranks: Sequence[int] = DEFAULT_RANKS,
                     recall_target: float = 0.95, epochs: int = 8, max_rank: int | None = None,
                     learning_rate: float = 1e-2, weighting: str = "count",
                     seed: int = 0, progress: bool = True
                     ) -> list[predictor_lib.LayerPredictor]:
  """Trains one predictor per layer on the profile's recorded inputs (original neuron order).

  weighting: "count" calibrates each cut for recall_target of the active (token, neuron)
  pairs; "contribution" weights pairs by |a| / t_l in the loss and the cut (see
  `pijax.offline.predictor.train_layer_predictor`, argument `importance`).
  """
  from pijax.errors import ConfigError
  if weighting not in ("count", "contribution"):
    raise ConfigError(f"predictor weighting {weighting!r} must be 'count' or 'contribution'.")
  cfg = model.config
  inputs = profile.ffn_inputs(cfg)
  out = []
  layers = tqdm(range(cfg.n_layers), desc="train predictors", disable=not progress)
  for layer in layers:
    x = np.asarray(inputs[layer])
    t = float(profile.thresholds[layer])
    importance = None
    if weighting == "contribution" and t > 0:
      contribution = layer_contribution(model.params, cfg, layer, x)
      active = contribution >= t  # Exactly sparsity.active_mask's definition.
      importance = contribution / t
      del contribution
    else:
      active = layer_active(model.params, cfg, layer, x, t)
    lr = learning_rate
    for attempt in range(3):
      result = predictor_lib.train_layer_predictor(
          x, active, profile.split, ranks=tuple(ranks), recall_target=recall_target,
          max_rank=max_rank, epochs=epochs, learning_rate=lr, seed=seed + layer + 1000 * attempt,
          importance=importance)
      # A run whose ReLUs all died predicts nothing (loss stuck at ln 2, sparsity ~0) although
      # the layer is sparse: retry with a smaller step.
      dead = result.true_sparsity > 0.1 and result.test_predicted_sparsity < 0.01
      if not dead:
        break
      lr /= 3.0
    # Outlier tokens (rms far above the typical training token) run dense at inference.
    train_rms = np.sqrt(np.mean(np.square(x[profile.split == 0], dtype=np.float64), axis=-1))
    result.rms_bound = float(predictor_lib.RMS_BOUND_FACTOR * np.median(train_rms))
    out.append(result)
    if progress:
      layers.set_postfix(rank=result.rank, recall=f"{result.test_recall:.3f}",
                         sparsity=f"{result.test_predicted_sparsity:.3f}")
  return out


def save_predictors(workdir: str, predictors: list[predictor_lib.LayerPredictor]) -> None:
  """predictors.npz (fc1_i, fc2_i) + predictors.json (everything else), temp file + rename."""
  arrays = {}
  for i, p in enumerate(predictors):
    arrays[f"fc1_{i}"] = p.params["fc1"]
    arrays[f"fc2_{i}"] = p.params["fc2"]
  tmp = os.path.join(workdir, PREDICTORS_FILE + ".tmp.npz")
  np.savez(tmp, **arrays)
  os.replace(tmp, os.path.join(workdir, PREDICTORS_FILE))
  meta = [{k: v for k, v in dataclasses.asdict(p).items() if k != "params"} for p in predictors]
  tmp = os.path.join(workdir, PREDICTORS_META_FILE + ".tmp")
  with open(tmp, "w") as f:
    json.dump(meta, f, indent=1)
  os.replace(tmp, os.path.join(workdir, PREDICTORS_META_FILE))


def load_predictors(workdir: str) -> list[predictor_lib.LayerPredictor]:
  """Reads what `save_predictors` wrote."""
  from pijax.errors import ConfigError
  npz_path = os.path.join(workdir, PREDICTORS_FILE)
  meta_path = os.path.join(workdir, PREDICTORS_META_FILE)
  if not (os.path.exists(npz_path) and os.path.exists(meta_path)):
    raise ConfigError(f"{workdir}: no trained predictors here; run "
                      "`python -m pijax.train_predictors` first.")
  arrays = np.load(npz_path)
  with open(meta_path) as f:
    meta = json.load(f)
  return [predictor_lib.LayerPredictor(
      params={"fc1": arrays[f"fc1_{i}"], "fc2": arrays[f"fc2_{i}"]}, **m)
          for i, m in enumerate(meta)]


def main(argv):
  del argv
  from absl import flags
  import pijax
  from pijax import cli
  from pijax.errors import ConfigError
  f = flags.FLAGS
  cli.check_max_seq_len(f.max_seq_len)
  ranks = cli.parse_ints(f.ranks, "ranks")
  if f.epochs < 1:
    raise ConfigError(f"--epochs={f.epochs} must be >= 1.")
  if not 0.0 < f.recall_target <= 1.0:
    raise ConfigError(f"--recall_target={f.recall_target} must be in (0, 1].")
  prof = Profile.load(f.profile)  # Before the model: a wrong --profile fails at once.
  model = pijax.load(f.model, max_seq_len=f.max_seq_len)
  preds = train_predictors(model, prof, ranks=ranks, recall_target=f.recall_target,
                           epochs=f.epochs)
  save_predictors(f.profile, preds)


if __name__ == "__main__":
  from absl import flags
  from pijax import cli
  flags.DEFINE_string("model", "default", "GGUF path or 'default' (the profiled model).")
  flags.DEFINE_string("profile", None, "Workdir written by pijax.profile.", required=True)
  flags.DEFINE_string("ranks", ",".join(map(str, DEFAULT_RANKS)), "Rank ladder.")
  flags.DEFINE_float("recall_target", 0.95, "Recall the cut must reach on validation text.")
  flags.DEFINE_integer("epochs", 8, "Training epochs per rank.")
  flags.DEFINE_integer("max_seq_len", 2048, "KV cache tokens of the loaded model.")
  cli.run(main, "pijax.train_predictors")
