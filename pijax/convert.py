"""`python -m pijax.convert`: compile a GGUF into a sparse bundle (profile, predictors, place).

  python -m pijax.convert --model=default --out=bundles/smollm2 \
      --calibration=../shared/data/tinyshakespeare/input.txt --target_sparsity=0.5 \
      --device_budget_gb=0.5
  python -m pijax.convert --config=configs/smollm2_135m_convert.py --out=bundles/smollm2

Stages (each also its own CLI): pijax.profile -> pijax.train_predictors -> pijax.place, then
neurons are permuted by descending activation frequency and the bundle is written atomically
(see pijax.formats.bundle). The intermediate workdir (FFN inputs on disk) is deleted afterwards
unless --keep_workdir.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Sequence

import numpy as np

from pijax.formats import bundle as bundle_lib
from pijax import config as config_lib
from pijax.offline import placement as placement_lib
from pijax.offline import predictor as predictor_lib
from pijax.errors import ConfigError
from pijax.profile import Profile, profile_model
from pijax.train_predictors import DEFAULT_RANKS, train_predictors

# Target: predictor bytes <= 5% of FFN bytes (they are read every token); the manifest notes
# a bundle over it.
PREDICTOR_BUDGET_FRACTION = 0.05
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _versions() -> dict[str, str]:
  import importlib.metadata as md
  out = {}
  for name in ("pijax", "jax", "flax", "orbax-checkpoint", "gguf", "numpy"):
    try:
      out[name] = md.version(name)
    except md.PackageNotFoundError:
      out[name] = "unknown"
  return out


@dataclasses.dataclass
class ConvertOptions:
  """Options of one conversion (units: bytes, tokens)."""

  calibration: str
  out: str
  target_sparsity: float = 0.5
  device_budget_bytes: int | None = None
  hot_ratio: float | None = None
  cost_model: str | None = None
  tile: int = 64
  max_seq_len: int = 2048
  device_dtype: str = "float32"
  max_tokens: int = 65536
  chunk_len: int = 512
  ranks: Sequence[int] = DEFAULT_RANKS
  recall_target: float = 0.95
  epochs: int = 8
  predictor_weighting: str = "count"
  predictor_kind: str = "auto"  # "auto" (the family's, see resolve_predictor_kind), "mlp", "lowbit".
  workdir: str | None = None
  keep_workdir: bool = False
  overwrite: bool = False
  progress: bool = True


def resolve_predictor_kind(cfg, kind: str) -> str:
  """The predictor a conversion builds: "auto" is the one the runtime uses for the family
  (`pijax.nn.hybrid.default_predictor_kind`: low-bit for SwiGLU/GeGLU, whose contributions MLP
  predictors could not rank, MLP for ReLU families).

  Raises:
    ConfigError: not auto, mlp or lowbit.
  """
  from pijax.nn import hybrid as hybrid_nn
  if kind == "auto":
    return hybrid_nn.default_predictor_kind(cfg.ffn_family)
  if kind not in predictor_lib.PREDICTOR_KINDS:
    raise ConfigError(f"--predictor_kind={kind!r} must be auto, "
                      f"{' or '.join(predictor_lib.PREDICTOR_KINDS)}.")
  return kind


def check_budget(cfg, opts: ConvertOptions) -> None:
  """Refuses a device budget that cannot hold the dense part, before any profiling.

  A dry-run placement with the smallest predictors the rank ladder allows (a lower bound of
  what the real placement needs) and flat activation frequencies.

  Raises:
    BudgetError: the dense part (or the --hot_ratio split) does not fit the budget.
  """
  mlp = resolve_predictor_kind(cfg, opts.predictor_kind) == predictor_lib.PREDICTOR_MLP
  ranks = [int(min(opts.ranks))] * cfg.n_layers if mlp and len(opts.ranks) else []
  placement_lib.place(
      cfg, np.full((cfg.n_layers, cfg.intermediate_size), 0.5, np.float32),
      budget_bytes=opts.device_budget_bytes, max_seq_len=opts.max_seq_len,
      dtype_bytes=_DTYPE_BYTES[opts.device_dtype], predictor_ranks=ranks, tile=opts.tile,
      hot_ratio=opts.hot_ratio, hot_neuron_bytes=placement_lib.int8_neuron_bytes(cfg),
      predictor_neuron_bytes=predictor_lib.hot_neuron_bytes(
          cfg.hidden_size, resolve_predictor_kind(cfg, opts.predictor_kind)))


def convert(model, opts: ConvertOptions) -> dict[str, Any]:
  """Profiles, builds the predictor (trains MLP predictors or sketches the rows in 4 bits, per
  `resolve_predictor_kind`), places neurons and writes the bundle; returns the manifest.

  Raises:
    ConfigError, BudgetError, BundleError: bad options, a budget too small for the dense part,
      an existing --out without --overwrite.
    UnsupportedError: a family the hybrid backend does not run (not llama).
  """
  start = time.perf_counter()
  cfg = model.config
  # Bundles run on the hybrid backend: refuse families it does not run before profiling.
  from pijax.backends import hybrid as hybrid_backend
  hybrid_backend.HybridBackend.supports(cfg)
  if opts.device_budget_bytes is None and opts.hot_ratio is None:
    raise ConfigError("pass --device_budget_gb (or --hot_ratio) so neurons can be placed.")
  _check_out(opts)
  if opts.device_dtype not in _DTYPE_BYTES:
    raise ConfigError(f"device dtype {opts.device_dtype!r} must be one of "
                      f"{sorted(_DTYPE_BYTES)}.")
  layer_weights = (placement_lib.load_cost_model(opts.cost_model, cfg.n_layers)
                   if opts.cost_model else None)
  kind = resolve_predictor_kind(cfg, opts.predictor_kind)
  check_budget(cfg, opts)
  parent = os.path.dirname(os.path.abspath(opts.out))
  try:  # --out=bundles/x in a fresh checkout: make bundles/ (mkdir -p), as the README runs it.
    os.makedirs(parent, exist_ok=True)
  except OSError as err:
    raise ConfigError(f"--out={opts.out}: cannot make its folder {parent} ({err.strerror}).") \
        from None
  workdir = opts.workdir or tempfile.mkdtemp(prefix="pijax-convert-", dir=parent)
  try:
    t0 = time.perf_counter()
    prof = profile_model(model, opts.calibration, workdir, target_sparsity=opts.target_sparsity,
                         max_tokens=opts.max_tokens, chunk_len=opts.chunk_len,
                         progress=opts.progress)
    profile_s = time.perf_counter() - t0
    ffn_layer_bytes = 3 * cfg.hidden_size * cfg.intermediate_size * 4
    max_rank = None
    t0 = time.perf_counter()
    preds = None  # The low-bit predictor needs no training: it is the rows' 4-bit sketch.
    if kind == predictor_lib.PREDICTOR_MLP:
      preds = train_predictors(model, prof, ranks=opts.ranks, recall_target=opts.recall_target,
                               epochs=opts.epochs, max_rank=max_rank, progress=opts.progress,
                               weighting=opts.predictor_weighting)
    train_s = time.perf_counter() - t0
    ranks = [p.rank for p in preds] if preds else [0] * cfg.n_layers
    perm = bundle_lib.permutation_from_counts(prof.counts)
    freqs = np.take_along_axis(prof.frequencies, perm, axis=1)
    placement = placement_lib.place(
        cfg, freqs, budget_bytes=opts.device_budget_bytes, max_seq_len=opts.max_seq_len,
        dtype_bytes=_DTYPE_BYTES[opts.device_dtype], predictor_ranks=ranks, tile=opts.tile,
        layer_weights=layer_weights, hot_ratio=opts.hot_ratio,
        hot_neuron_bytes=placement_lib.int8_neuron_bytes(cfg),
        predictor_neuron_bytes=predictor_lib.hot_neuron_bytes(cfg.hidden_size, kind))
    t0 = time.perf_counter()
    host_rule = host_rule_quality(model, prof, opts.calibration)
    manifest = build_manifest(model, opts, prof, preds, placement, ffn_layer_bytes,
                              {"profile_s": profile_s, "train_predictors_s": train_s,
                               "host_rule_s": time.perf_counter() - t0})
    # The rule a CPU run of the bundle uses (`pijax.backends.host.for_bundle`) and its quality.
    manifest["host_rule"] = host_rule
    # The rows themselves are not stored: a load permutes the source GGUF's (bundle version 2).
    tree = {
        "perm": perm,
        "thresholds": np.asarray(prof.thresholds, np.float32),
        "frequencies": freqs.astype(np.float32),
    }
    if preds:
      tree["predictors"] = {
          f"layers_{i}": {"fc1": np.asarray(p.params["fc1"], np.float32),
                          "fc2": np.asarray(p.params["fc2"], np.float32)[:, perm[i]]}
          for i, p in enumerate(preds)}
      tree["cuts"] = np.asarray([p.cut for p in preds], np.float32)
      tree["rms_bounds"] = np.asarray([p.rms_bound for p in preds], np.float32)
    else:  # Low-bit: its cut is the contribution threshold; no rms fallback to dense.
      ffn = bundle_lib.permute_ffn(model.params, cfg.n_layers, perm)
      tree["lowbit"] = {name: predictor_lib.lowbit_params(rows["gate"], rows["up"])
                        for name, rows in ffn.items()}
      del ffn
      tree["cuts"] = tree["thresholds"].copy()
      tree["rms_bounds"] = np.full(cfg.n_layers, np.inf, np.float32)
    manifest["perm_sha256"] = bundle_lib.perm_sha256(perm)
    manifest["timing"]["total_s"] = time.perf_counter() - start
    bundle_lib.write_bundle(opts.out, tree, manifest, overwrite=opts.overwrite)
    return manifest
  finally:
    if not opts.keep_workdir and not opts.workdir:
      shutil.rmtree(workdir, ignore_errors=True)


def host_rule_quality(model, prof: Profile, calibration: str) -> dict[str, Any] | None:
  """What the host engine's predictor mode does on the profile's test split (issue 32): the
  contribution rule |act(g, u)| >= t_l from its int8 products on the GGUF's blocks, along its
  own dense run, against the f32 model's true sets. None where a bundle of this model does not
  run that rule (a family outside `host.CONTRIBUTION_FAMILIES` or a source the host engine
  re-quantizes). Returns {"rule", "products", "split", "tokens", "recall", "precision",
  "predicted_sparsity", "true_sparsity", "layers": [per-layer dicts of those four]}."""
  from pijax.backends import host
  from pijax.profile import SPLIT_TEST, layer_active
  cfg = model.config
  if cfg.ffn_family not in host.CONTRIBUTION_FAMILIES or \
      not host.file_is_block_quantized(model.path):
    return None
  dec = host.build_decoder(model.path, cfg, host.WEIGHTS_GGUF)
  with open(calibration, encoding="utf-8") as f:  # Tokenized as `profile_model` did.
    ids = model.tokenizer.encode(f.read(), add_special=False)
  inputs = prof.ffn_inputs(cfg)
  n = prof.chunk_len
  stats = np.zeros((cfg.n_layers, 4), np.int64)  # tp, predicted, true, total
  test_chunks = [c for c in range(prof.n_tokens // n) if prof.split[c * n] == SPLIT_TEST]
  for c in test_chunks:
    record = dec.record_ffn(np.asarray(ids[c * n:(c + 1) * n]))
    for layer in range(cfg.n_layers):
      t = float(prof.thresholds[layer])
      true = layer_active(model.params, cfg, layer, np.asarray(inputs[layer, c * n:(c + 1) * n]),
                          t)
      pred = record[layer] >= t
      stats[layer] += [(pred & true).sum(), pred.sum(), true.sum(), true.size]
  del inputs
  layers = [{"recall": tp / tr if tr else 1.0, "precision": tp / pr if pr else 1.0,
             "predicted_sparsity": 1.0 - pr / tot, "true_sparsity": 1.0 - tr / tot}
            for tp, pr, tr, tot in stats.tolist()]
  out = {"rule": "contribution", "products": "int8", "split": "test",
         "tokens": len(test_chunks) * n}
  out.update({k: float(np.mean([row[k] for row in layers])) for k in layers[0]})
  return out | {"layers": layers}


def _mean(values: list[float]) -> float | None:
  """nanmean of the values, None when there are none (a low-bit bundle)."""
  finite = [v for v in values if v is not None and np.isfinite(v)]
  return float(np.mean(finite)) if finite else (float("nan") if values else None)


def _finite(x: float) -> float | None:
  return float(x) if np.isfinite(x) else None


def build_manifest(model, opts: ConvertOptions, prof: Profile,
                   preds: list[predictor_lib.LayerPredictor],
                   placement: placement_lib.Placement, ffn_layer_bytes: int,
                   timing: dict[str, float]) -> dict[str, Any]:
  """manifest.json contents (see pijax.formats.bundle)."""
  from pijax.profile import file_sha256
  cfg = model.config
  family_to_activation = {v: k for k, v in config_lib.ACTIVATION_TO_FAMILY.items()}
  model_cfg = dataclasses.asdict(cfg)
  model_cfg["ffn_activation"] = family_to_activation[cfg.ffn_family]
  lowbit_bytes = predictor_lib.lowbit_bytes(cfg.hidden_size, cfg.intermediate_size)
  predictor_bytes = sum(p.n_bytes() for p in preds) if preds else lowbit_bytes * cfg.n_layers
  ffn_bytes = ffn_layer_bytes * cfg.n_layers
  notes = []
  if preds and predictor_bytes > PREDICTOR_BUDGET_FRACTION * ffn_bytes:
    notes.append(f"predictor bytes are {predictor_bytes / ffn_bytes:.1%} of the FFN bytes, "
                 f"over the {PREDICTOR_BUDGET_FRACTION:.0%} budget: the rank ladder kept "
                 "larger ranks because they raised predicted sparsity at the recall target.")
  layers = []
  if not preds:  # Low-bit: nothing trained, so no held-out recall to report.
    for i in range(cfg.n_layers):
      layers.append({
          "layer": i, "threshold": float(prof.thresholds[i]),
          "hot_count": int(placement.hot_counts[i]), "predictor_rank": 0,
          "predictor_bytes": int(lowbit_bytes), "cut": float(prof.thresholds[i]),
          "rms_bound": None, "val_recall": None, "recall": None, "precision": None,
          "predicted_sparsity": None, "true_sparsity": None,
          "profiled_sparsity": float(prof.sparsity[i]), "ladder": []})
  for i, p in enumerate(preds or ()):
    layers.append({
        "layer": i,
        "threshold": float(prof.thresholds[i]),
        "hot_count": int(placement.hot_counts[i]),
        "predictor_rank": int(p.rank),
        "predictor_bytes": int(p.n_bytes()),
        "cut": _finite(p.cut),
        "rms_bound": _finite(p.rms_bound),
        "val_recall": _finite(p.val_recall),
        "recall": _finite(p.test_recall),
        "precision": _finite(p.test_precision),
        "predicted_sparsity": _finite(p.test_predicted_sparsity),
        "true_sparsity": _finite(p.true_sparsity),
        "profiled_sparsity": float(prof.sparsity[i]),
        "ladder": p.ladder,
    })
  return {
      "format": bundle_lib.BUNDLE_FORMAT,
      "version": bundle_lib.BUNDLE_VERSION,
      "versions": _versions(),
      "model": model_cfg,
      "source": {"path": os.path.abspath(model.path), "sha256": file_sha256(model.path),
                 "size": os.path.getsize(model.path)},
      "calibration": prof.calibration | {"chunk_len": prof.chunk_len,
                                         "split": "train/validation/test by contiguous chunks",
                                         "n_train": prof.n_train},
      "target_sparsity": prof.target_sparsity,
      "recall_target": opts.recall_target,
      "predictor_weighting": opts.predictor_weighting,
      "predictor": {"kind": predictor_lib.PREDICTOR_MLP if preds else
                    predictor_lib.PREDICTOR_LOWBIT},
      "placement": placement.to_json(),
      "device": {"dtype": opts.device_dtype, "max_seq_len": opts.max_seq_len,
                 "device_bytes": int(placement.device_bytes),
                 "budget_bytes": placement.budget_bytes,
                 # Hot rows are int8 blocks on the device (`pijax.nn.hybrid`, row format int8).
                 "hot_rows": "int8",
                 "bytes_per_hot_neuron": placement_lib.int8_neuron_bytes(cfg)},
      "totals": {
          "predictor_bytes": int(predictor_bytes),
          "ffn_bytes": int(ffn_bytes),
          "predictor_fraction_of_ffn": predictor_bytes / ffn_bytes,
          "mean_recall": _mean([p.test_recall for p in preds or ()]),
          "mean_predicted_sparsity": _mean([p.test_predicted_sparsity for p in preds or ()]),
          "mean_true_sparsity": _mean([p.true_sparsity for p in preds or ()]),
      },
      "layers": layers,
      "timing": dict(timing),
      "notes": notes,
  }


def format_table(manifest: dict[str, Any]) -> str:
  """The per-layer table of a manifest, in markdown."""
  rows = ["| layer | threshold | hot | rank | recall | precision | pred. sparsity | "
          "true sparsity | predictor KB |", "|---|---|---|---|---|---|---|---|---|"]
  for layer in manifest["layers"]:
    rows.append("| {layer} | {threshold:.4f} | {hot_count} | {predictor_rank} | {r} | {p} | "
                "{ps} | {ts} | {kb:.0f} |".format(
                    r=_fmt(layer["recall"]), p=_fmt(layer["precision"]),
                    ps=_fmt(layer["predicted_sparsity"]), ts=_fmt(layer["true_sparsity"]),
                    kb=layer["predictor_bytes"] / 1024, **layer))
  t = manifest["totals"]
  rule = manifest.get("host_rule")
  if rule:
    rows.append(f"\nhost engine (CPU runs of --sparse=predictor): {rule['rule']} rule, "
                f"{rule['products']} products, {rule['split']} split ({rule['tokens']} tokens): "
                f"recall {rule['recall']:.3f}, precision {rule['precision']:.3f}, predicted "
                f"sparsity {rule['predicted_sparsity']:.3f}, true {rule['true_sparsity']:.3f}")
  rows.append(f"\nmean recall {_fmt(t['mean_recall'])}, mean predicted sparsity "
              f"{_fmt(t['mean_predicted_sparsity'])}, mean true sparsity "
              f"{_fmt(t['mean_true_sparsity'])}, predictor bytes "
              f"{t['predictor_fraction_of_ffn']:.2%} of FFN bytes; device "
              f"{manifest['device']['device_bytes']} of {manifest['device']['budget_bytes']} "
              f"bytes ({manifest['device'].get('bytes_per_hot_neuron', '-')} per hot neuron)")
  return "\n".join(rows)


def _fmt(x) -> str:
  return "-" if x is None else f"{x:.3f}"


def _check_options(opts: ConvertOptions, given) -> None:
  """Refuses option values that would otherwise fail only after minutes of profiling.

  given(name): whether the value came from the flag (else from the --config file).
  """
  from pijax import cli

  def where(name: str) -> str:
    return f"--{name}" if given(name) else f"--config field {name}"

  cli.check_max_seq_len(opts.max_seq_len, where("max_seq_len"))
  checks = (
      ("target_sparsity", lambda v: 0.0 <= v < 1.0, "must be in [0, 1)"),
      ("recall_target", lambda v: 0.0 < v <= 1.0, "must be in (0, 1]"),
      ("hot_ratio", lambda v: v is None or 0.0 <= v <= 1.0, "must be in [0, 1]"),
      ("tile", lambda v: v >= 1, "must be >= 1"),
      ("max_tokens", lambda v: v >= 1, "must be >= 1"),
      ("chunk_len", lambda v: 8 <= v <= opts.max_seq_len,
       f"must be in [8, max_seq_len={opts.max_seq_len}]"),
      ("epochs", lambda v: v >= 1, "must be >= 1"),
      ("predictor_weighting", lambda v: v in ("count", "contribution"),
       "must be count or contribution"),
      ("predictor_kind", lambda v: v in ("auto",) + predictor_lib.PREDICTOR_KINDS,
       "must be auto, mlp or lowbit"),
      ("device_dtype", lambda v: v in _DTYPE_BYTES,
       f"must be one of {', '.join(sorted(_DTYPE_BYTES))}"),
  )
  for name, valid, what in checks:
    value = getattr(opts, name)
    try:
      ok = bool(valid(value))
    except TypeError:  # A config field of the wrong type.
      ok = False
    if not ok:
      raise ConfigError(f"{where(name)}={value!r} {what}.")
  if opts.device_budget_bytes is None and opts.hot_ratio is None:
    raise ConfigError("pass --device_budget_gb (or --hot_ratio) so neurons can be placed.")
  _check_out(opts)


def _check_out(opts: ConvertOptions) -> None:
  """ConfigError for an --out that exists, unless it is a bundle and --overwrite is given."""
  if os.path.exists(opts.out) and not opts.overwrite:
    raise ConfigError(f"{opts.out} already exists; choose another --out or pass --overwrite.")
  if os.path.exists(opts.out) and not bundle_lib.is_bundle(opts.out):
    raise ConfigError(f"--out={opts.out} exists and is not a bundle; --overwrite only replaces a "
                      "bundle: choose another --out.")


def main(argv: list[str]) -> None:
  from absl import flags
  import pijax
  from pijax import cli
  if len(argv) > 1:
    raise ConfigError(f"unexpected arguments {argv[1:]}.")
  f = flags.FLAGS
  cfg = cli.config_value(_CONFIG) if f.config else None

  def pick(name: str, default=None):
    value = getattr(f, name)
    if value is not None:
      return value
    if cfg is not None and name in cfg:
      return cfg[name]
    return default

  out = pick("out")
  calibration = pick("calibration")
  if not out or not calibration:
    raise ConfigError("--out and --calibration are required.")
  budget_gb = pick("device_budget_gb")
  if budget_gb is not None and not (isinstance(budget_gb, (int, float)) and budget_gb > 0
                                    and math.isfinite(budget_gb) and budget_gb < 1e9):
    raise ConfigError(f"--device_budget_gb={budget_gb} must be a finite number of GB in (0, 1e9).")
  opts = ConvertOptions(
      calibration=calibration, out=out,
      target_sparsity=pick("target_sparsity", 0.5),
      device_budget_bytes=None if budget_gb is None else int(budget_gb * 1e9),
      hot_ratio=pick("hot_ratio"), cost_model=pick("cost_model"), tile=pick("tile", 64),
      max_seq_len=pick("max_seq_len", 2048), device_dtype=pick("device_dtype", "float32"),
      max_tokens=pick("max_tokens", 65536), chunk_len=pick("chunk_len", 512),
      ranks=cli.parse_ints(pick("ranks", ",".join(map(str, DEFAULT_RANKS))), "ranks"),
      recall_target=pick("recall_target", 0.95), epochs=pick("epochs", 8),
      predictor_weighting=pick("predictor_weighting", "count"),
      predictor_kind=pick("predictor_kind", "auto"),
      workdir=pick("workdir"), keep_workdir=f.keep_workdir, overwrite=f.overwrite)
  if not os.path.isfile(opts.calibration):
    raise ConfigError(f"{opts.calibration}: no such calibration text file.")
  _check_options(opts, given=lambda name: getattr(f, name) is not None
                 or cfg is None or name not in cfg)
  model = pijax.load(pick("model", "default"), max_seq_len=opts.max_seq_len)
  manifest = convert(model, opts)
  sys.stderr.write(format_table(manifest) + "\n")
  sys.stderr.write(f"wrote {os.path.abspath(opts.out)} in {manifest['timing']['total_s']:.0f} s\n")


if __name__ == "__main__":
  from absl import flags
  from pijax import cli
  _CONFIG = cli.define_config_file("config", "Optional convert config file.", lock_config=False)
  flags.DEFINE_string("model", None, "GGUF path or 'default'.")
  flags.DEFINE_string("out", None, "Bundle folder to write.")
  flags.DEFINE_string("calibration", None, "Calibration text file (UTF-8).")
  flags.DEFINE_float("target_sparsity", None, "Per-layer sparsity for SwiGLU thresholds.")
  flags.DEFINE_float("device_budget_gb", None, "Device memory budget, GB (1e9 bytes).")
  flags.DEFINE_float("hot_ratio", None, "Fraction of each layer's neurons made hot "
                     "(overrides the solver).")
  flags.DEFINE_string("cost_model", None, "JSON with host_us_per_neuron/device_us_per_neuron.")
  flags.DEFINE_integer("tile", None, "Hot counts are multiples of this.")
  flags.DEFINE_integer("max_seq_len", None, "KV cache tokens accounted on the device.")
  flags.DEFINE_string("device_dtype", None, "float32 | bfloat16 | float16 device weights.")
  flags.DEFINE_integer("max_tokens", None, "Calibration tokens to profile at most.")
  flags.DEFINE_integer("chunk_len", None, "Tokens per calibration chunk.")
  flags.DEFINE_string("ranks", None, "Predictor rank ladder, e.g. 16,32,64.")
  flags.DEFINE_float("recall_target", None, "Held-out recall the predictor cut must reach.")
  flags.DEFINE_integer("epochs", None, "Predictor training epochs per rank.")
  flags.DEFINE_string("predictor_weighting", None, "count (recall of active pairs) or "
                      "contribution (pairs weighted by |a| / t in the loss and the cut).")
  flags.DEFINE_string("predictor_kind", None, "auto (the runtime's for the family: lowbit "
                      "for SwiGLU/GeGLU, mlp for ReLU families), mlp (trained) or lowbit.")
  flags.DEFINE_string("workdir", None, "Keep intermediate files here (default: temp).")
  flags.DEFINE_boolean("keep_workdir", False, "Do not delete the temporary workdir.")
  flags.DEFINE_boolean("overwrite", False, "Replace an existing --out bundle.")
  cli.run(main, "pijax.convert")
