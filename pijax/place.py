"""`python -m pijax.place --profile=profile.npz --device_budget_gb=0.5 --out=placement.json`

Chooses how many FFN neurons of each layer are hot (device-resident) from a profile of
activation frequencies, writes the `pijax.offline.placement.Placement` as JSON (atomically) and prints
a per-layer table on stderr. Reads only the model's metadata, never its weights. Bad input
(missing profile, budget too small for the dense part, ...) gives one line on stderr and exit
status 2.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import numpy as np
from absl import flags

from pijax import cli

_PROFILE = flags.DEFINE_string("profile", None, "A .npz holding `frequencies` f32[L, F].")
_MODEL = flags.DEFINE_string("model", "default", "GGUF path or 'default' (metadata only).")
_BUDGET_GB = flags.DEFINE_float("device_budget_gb", None,
                                "Device memory budget, GB (1e9 bytes).")
_HOT_RATIO = flags.DEFINE_float("hot_ratio", None,
                                "Fixed fraction of hot neurons per layer instead of the solver.")
_COST_MODEL = flags.DEFINE_string(
    "cost_model", None, "JSON {host_us_per_neuron, device_us_per_neuron} (float or per layer).")
_TILE = flags.DEFINE_integer("tile", 64, "Hot counts are multiples of this (or the whole layer).")
_MAX_SEQ_LEN = flags.DEFINE_integer("max_seq_len", 2048, "KV cache length (tokens).")
_DTYPE = flags.DEFINE_string("dtype", "float32", "Device dtype: float32 | bfloat16 | float16.")
_PREDICTOR_RANKS = flags.DEFINE_list(
    "predictor_ranks", [], "Predictor rank per layer, one for all, or empty (no predictors).")
_EMBEDDING_ON_DEVICE = flags.DEFINE_boolean("embedding_on_device", True,
                                            "Keep the token embedding on the device.")
_OUT = flags.DEFINE_string("out", None, "Where to write the placement JSON.")


def load_profile(path: str) -> np.ndarray:
  """f32[L, F] `frequencies` from a profile .npz. Raises ConfigError if unreadable."""
  from pijax.errors import ConfigError
  import zipfile
  if os.path.isfile(path) and not zipfile.is_zipfile(path):
    raise ConfigError(f"profile {path}: not a .npz archive; pass the profiler's .npz output.")
  try:
    with np.load(path, allow_pickle=False) as data:
      if "frequencies" not in data.files:
        raise ConfigError(f"profile {path}: no `frequencies` array (has {data.files}); "
                          "pass a profile written by the profiler.")
      return np.asarray(data["frequencies"], np.float32)
  except ConfigError:
    raise
  except OSError as err:
    raise ConfigError(f"profile {path}: cannot read it ({err.strerror or err}); pass an "
                      "existing .npz to --profile.") from None
  except Exception as err:  # Not a zip / corrupt member: numpy raises ValueError, BadZipFile...
    raise ConfigError(f"profile {path}: not a valid .npz ({type(err).__name__}: {err}).") \
        from None


def load_config(model: str):
  """ModelConfig from a GGUF's metadata ('default' = the default model). Raises GGUFError."""
  from pijax.formats.gguf import default_model_path, open_gguf
  from pijax.arch.registry import config_from_metadata
  path = default_model_path() if model == "default" else model
  reader, metadata = open_gguf(path)
  return config_from_metadata(metadata, path, {t.name: t for t in reader.tensors})


def write_json_atomic(path: str, payload: dict) -> None:
  """Writes `payload` as JSON to `path` via a temp file in the same folder + os.replace."""
  from pijax.errors import ConfigError
  folder = os.path.dirname(os.path.abspath(path))
  try:
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".placement-", suffix=".json.tmp", dir=folder)
    try:
      with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1)
        f.write("\n")
      os.replace(tmp, path)
    except BaseException:
      if os.path.exists(tmp):
        os.unlink(tmp)
      raise
  except OSError as err:
    raise ConfigError(f"cannot write --out={path} ({err.strerror or err}).") from None


def format_table(placement, frequencies: np.ndarray, layer_weights=None) -> str:
  """Per-layer table: hot count, share of the layer, share of its activations served."""
  from pijax.offline.placement import served
  n_neurons = frequencies.shape[1]
  per_layer = served(frequencies, placement.hot_counts)
  totals = frequencies.astype(np.float64).sum(axis=1)
  head = "layer    hot / F      hot%  served%"
  if layer_weights is not None:
    head += "   weight"
  lines = [head]
  for layer, hot in enumerate(placement.hot_counts):
    share = per_layer[layer] / totals[layer] if totals[layer] > 0 else 1.0
    line = f"{layer:5d} {hot:6d} / {n_neurons:<6d} {100 * hot / n_neurons:5.1f}  {100 * share:6.1f}"
    if layer_weights is not None:
      line += f"  {layer_weights[layer]:7.3g}"
    lines.append(line)
  budget = ("none" if placement.budget_bytes is None
            else f"{placement.budget_bytes} B ({placement.budget_bytes / 1e9:.3f} GB)")
  lines.append(
      f"method {placement.method}: device {placement.device_bytes} B "
      f"({placement.device_bytes / 1e9:.3f} GB; dense {placement.dense.total}, hot FFN "
      f"{placement.ffn_bytes_hot}) of budget {budget}; {sum(placement.hot_counts)} hot neurons; "
      f"device serves {100 * placement.served_fraction:.1f}% of activations")
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  from pijax.offline import placement as placement_lib
  from pijax.errors import ConfigError
  from pijax.formats.loader import numpy_dtype
  if len(argv) > 1:
    raise ConfigError(f"unexpected arguments {argv[1:]}; see --helpfull.")
  if not _PROFILE.value:
    raise ConfigError("--profile is required (a .npz holding `frequencies` [layers, neurons]).")
  if not _OUT.value:
    raise ConfigError("--out is required (where to write the placement JSON).")
  if _BUDGET_GB.value is None and _HOT_RATIO.value is None:
    raise ConfigError("--device_budget_gb is required (or --hot_ratio without a budget).")
  if _BUDGET_GB.value is not None and not 0 <= _BUDGET_GB.value < 1e9:
    raise ConfigError(f"--device_budget_gb={_BUDGET_GB.value} must be a finite number of GB in "
                      "[0, 1e9).")
  cli.check_max_seq_len(_MAX_SEQ_LEN.value)
  dtype_bytes = numpy_dtype(_DTYPE.value).itemsize
  try:
    ranks = [int(r) for r in _PREDICTOR_RANKS.value]
  except ValueError:
    raise ConfigError(f"--predictor_ranks={','.join(_PREDICTOR_RANKS.value)} must be integers "
                      "separated by commas.") from None
  frequencies = load_profile(_PROFILE.value)
  config = load_config(_MODEL.value)
  weights = (placement_lib.load_cost_model(_COST_MODEL.value, config.n_layers)
             if _COST_MODEL.value else None)
  budget = None if _BUDGET_GB.value is None else int(round(_BUDGET_GB.value * 1e9))
  placement = placement_lib.place(
      config, frequencies, budget_bytes=budget, max_seq_len=_MAX_SEQ_LEN.value,
      dtype_bytes=dtype_bytes, predictor_ranks=ranks, tile=_TILE.value, layer_weights=weights,
      hot_ratio=_HOT_RATIO.value, embedding_on_device=_EMBEDDING_ON_DEVICE.value)
  write_json_atomic(_OUT.value, placement.to_json())
  sys.stderr.write(format_table(placement, frequencies, weights) + "\n")
  sys.stderr.write(f"wrote {_OUT.value}\n")


if __name__ == "__main__":
  cli.run(main, "pijax.place")
