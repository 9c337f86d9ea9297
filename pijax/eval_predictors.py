"""`python -m pijax.eval_predictors --model=BUNDLE --text=FILE`: predictor quality on new text.

Runs the bundle's dense model over `max_tokens` of a text (chunks of `chunk_len` tokens), and
per layer compares the predictor's active set (logit >= cut) with the true one (the bundle's
activity thresholds): recall, precision, predicted and true sparsity, pooled over tokens and
neurons. The predictor is the one the runtime uses (`--predictor_kind=auto`): on a CPU backend
a SwiGLU bundle's is the host engine's contribution rule ("contribution": |act(g, u)| from its
int8 products on the GGUF's blocks, along its own dense run, >= the threshold). Use a text the bundle was not calibrated on (e.g. WikiText-2 test for a Shakespeare
calibration).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from pijax import bundle_load
from pijax.nn import transformer as model_lib
from pijax.offline import predictor as predictor_lib
from pijax.errors import ConfigError
from pijax.profile import layer_active

CONTRIBUTION = "contribution"  # The host engine's exact rule (`resolve_kind`).


def evaluate_predictors(model, text: str, *, max_tokens: int = 8192, chunk_len: int = 512,
                        predictor_kind: str = "mlp", threshold_scale: float = 1.0,
                        dot: str | None = None, progress: bool = True) -> list[dict[str, float]]:
  """Per-layer {recall, precision, predicted_sparsity, true_sparsity} of a bundle on `text`.

  predictor_kind: "mlp" (the bundle's trained predictors at their cuts), "lowbit" (the 4-bit
  gate/up estimate at cut = threshold_scale x the layer's contribution threshold; see
  `pijax.offline.predictor`) or "contribution" (the host engine's rule at that cut, products
  as --host_dot=`dot` computes them; `pijax.backends.host.for_bundle`). The true active sets
  always use the unscaled thresholds on the f32 model.

  Raises:
    ConfigError: the model is not a bundle, or the text is shorter than one chunk.
  """
  if model.sparse is None:
    raise ConfigError(f"{model.path} is not a bundle; convert it with pijax.convert first.")
  if max_tokens < 1:
    raise ConfigError(f"--max_tokens={max_tokens} must be >= 1.")
  if not 8 <= chunk_len <= model.max_seq_len:
    raise ConfigError(f"--chunk_len={chunk_len} must be in [8, {model.max_seq_len}] (the "
                      "model's context).")
  cfg = model.config
  ids = model.tokenizer.encode(text, add_special=False)[:max_tokens]
  n_chunks = len(ids) // chunk_len
  if n_chunks == 0:
    raise ConfigError(f"only {len(ids)} tokens to evaluate (text and --max_tokens), fewer than "
                      f"one chunk ({chunk_len}); give more text or a smaller --chunk_len.")
  from pijax.nn import hybrid
  runtime = None  # The host engine's decoder, for the contribution rule.
  if predictor_kind == CONTRIBUTION:
    from pijax.backends import host
    runtime = host.for_bundle(model, "off", dot=dot).decoder
  else:
    predictor_kind = hybrid.resolve_predictor_kind(model, predictor_kind)
  if predictor_kind == predictor_lib.PREDICTOR_MLP and not model.sparse.predictors:
    raise ConfigError(f"{model.path}: this bundle holds the low-bit predictor, not MLP "
                      "predictors; use --predictor_kind=auto (or lowbit).")
  lowbit = {}
  if predictor_kind == predictor_lib.PREDICTOR_LOWBIT:
    for layer in range(cfg.n_layers):
      if model.sparse.lowbit is not None:
        lowbit[layer] = model.sparse.lowbit[f"layers_{layer}"]
        continue
      rows = bundle_load.rows(model)[f"layers_{layer}"]
      lowbit[layer] = predictor_lib.lowbit_params(np.asarray(rows["gate"], np.float32),
                                                  np.asarray(rows["up"], np.float32))
  estimate = jax.jit(functools.partial(predictor_lib.lowbit_contribution, family=cfg.ffn_family))
  run = jax.jit(functools.partial(model_lib.ffn_inputs, config=cfg))
  stats = np.zeros((cfg.n_layers, 4), np.int64)  # tp, predicted, true, total
  for c in tqdm(range(n_chunks), desc="evaluate predictors", disable=not progress):
    tokens = jnp.asarray(np.asarray(ids[c * chunk_len:(c + 1) * chunk_len], np.int32)[None])
    inputs = np.asarray(run(model.params, tokens))[:, 0]  # [L, T, D]
    # The runtime's contributions in the file's neuron order, then the bundle's.
    record = None if runtime is None else runtime.record_ffn(np.asarray(tokens)[0])
    for layer in range(cfg.n_layers):
      true = layer_active(model.params, cfg, layer, inputs[layer],
                          float(model.sparse.thresholds[layer]))
      if record is not None:
        cut = float(model.sparse.thresholds[layer]) * threshold_scale
        pred = record[layer][:, model.sparse.perm[layer]] >= cut
      elif lowbit:
        p = model.params[f"layers_{layer}"]
        h = model_lib.rms_norm(jnp.asarray(inputs[layer]), p["ffn_norm"]["scale"],
                               cfg.rms_norm_eps)
        cut = float(model.sparse.thresholds[layer]) * threshold_scale
        pred = np.asarray(estimate(lowbit[layer], h)) >= cut
      else:
        pred = np.asarray(predictor_lib.predict_active(
            model.sparse.predictors[f"layers_{layer}"], float(model.sparse.cuts[layer]),
            jnp.asarray(inputs[layer]), float(model.sparse.rms_bounds[layer])))
      stats[layer] += [(pred & true).sum(), pred.sum(), true.sum(), true.size]
  out = []
  for tp, pred, true, total in stats:
    out.append({"recall": tp / true if true else 1.0,
                "precision": tp / pred if pred else 1.0,
                "predicted_sparsity": 1.0 - pred / total,
                "true_sparsity": 1.0 - true / total})
  return out


def resolve_kind(model, kind: str) -> str:
  """The predictor a run of bundle `model` uses: "auto" is "contribution" where the bundle's
  --sparse=predictor runs on the host engine, else `pijax.nn.hybrid.resolve_predictor_kind`."""
  from pijax.backends import host
  from pijax.nn import hybrid
  if kind == CONTRIBUTION or (kind == "auto" and host.bundle_runs_on_host(model, "predictor")):
    return CONTRIBUTION
  return hybrid.resolve_predictor_kind(model, kind)


def format_table(rows: list[dict[str, float]], manifest: dict[str, Any],
                 predictor_kind: str = "mlp") -> str:
  lines = ["| layer | predictor | recall | precision | pred. sparsity | true sparsity |",
           "|---|---|---|---|---|---|"]
  for i, r in enumerate(rows):
    kind = (f"rank {manifest['layers'][i]['predictor_rank']}" if predictor_kind == "mlp"
            else predictor_kind)
    lines.append(f"| {i} | {kind} | {r['recall']:.3f} | "
                 f"{r['precision']:.3f} | {r['predicted_sparsity']:.3f} | "
                 f"{r['true_sparsity']:.3f} |")
  mean = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
  lines.append(f"| mean | | {mean['recall']:.3f} | {mean['precision']:.3f} | "
               f"{mean['predicted_sparsity']:.3f} | {mean['true_sparsity']:.3f} |")
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  del argv
  import math
  from absl import flags
  import pijax
  from pijax import cli
  f = flags.FLAGS
  if f.max_tokens < 1 or f.chunk_len < 8:
    raise ConfigError(f"--max_tokens={f.max_tokens} must be >= 1 and --chunk_len={f.chunk_len} "
                      ">= 8.")
  if not (math.isfinite(f.threshold_scale) and f.threshold_scale >= 0):
    raise ConfigError(f"--threshold_scale={f.threshold_scale} must be a finite number >= 0 "
                      "(1 = the calibrated thresholds).")
  text = cli.read_text(f.text, "text")
  model = pijax.load(f.model, max_seq_len=max(f.chunk_len, 16))
  kind = resolve_kind(model, f.predictor_kind)  # Auto: what the runtime runs.
  rows = evaluate_predictors(model, text, max_tokens=f.max_tokens, chunk_len=f.chunk_len,
                             predictor_kind=kind, threshold_scale=f.threshold_scale,
                             dot=f.host_dot)
  sys.stdout.write(format_table(rows, model.sparse.manifest, kind) + "\n")


if __name__ == "__main__":
  from absl import flags
  from pijax import cli
  flags.DEFINE_string("model", None, "Bundle folder.", required=True)
  flags.DEFINE_string("text", None, "Evaluation text file.", required=True)
  flags.DEFINE_integer("max_tokens", 8192, "Tokens to evaluate.")
  flags.DEFINE_integer("chunk_len", 512, "Tokens per chunk.")
  flags.DEFINE_enum("predictor_kind", "auto", ["auto", "mlp", "lowbit", CONTRIBUTION],
                    "Predictor to evaluate (auto: the runtime's: contribution for a SwiGLU "
                    "bundle on the host engine, else lowbit for SwiGLU/GeGLU, mlp for ReLU).")
  flags.DEFINE_enum("host_dot", None, ["int8", "f32"],
                    "The contribution rule's products (default int8, as the runtime).")
  flags.DEFINE_float("threshold_scale", 1.0, "Low-bit predictor: cut = this x the threshold.")
  cli.run(main, "pijax.eval_predictors")
