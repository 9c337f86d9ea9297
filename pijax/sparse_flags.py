"""absl flags for hybrid sparse execution, shared by generate, perplexity and bench."""

from __future__ import annotations

import math
import os
import sys
from typing import Any

import jax
from absl import flags

from pijax import sparse_modes

SPARSE = flags.DEFINE_enum("sparse", None, list(sparse_modes.MODES),
                           "FFN execution (pijax.sparse_modes): off = dense; gate / "
                           "contribution = a GGUF's host weights cut at run time by |act(gate)| "
                           "/ by |act(gate) * up|; oracle = a bundle's true active sets "
                           "(correctness); predictor = a bundle's predictors or a PowerInfer "
                           "GGUF's own.")
# Forward passes over this many tokens or more compute every neuron: on dev-2c (SmolLM2,
# low-bit predictor, hot_ratio 0) per-token sets win at 1-2 tokens and lose from 3 on, where
# the union of the tokens' active sets is already 85% of the neurons (BUILD_NOTES.md, issue 4;
# scripts/measure_prefill_switch.py).
DEFAULT_PREFILL_DENSE_TOKENS = 3

HOT_RATIO = flags.DEFINE_float("hot_ratio", None, "Re-place at load: this fraction of each "
                               "layer's neurons is device-resident (overrides the bundle).")
DEVICE_BUDGET_GB = flags.DEFINE_float("device_budget_gb", None,
                                      "Re-place at load for this device budget (GB = 1e9 B).")
HOST_THREADS = flags.DEFINE_integer("host_threads", None, "numba threads for host ops (cold neurons, "
                                    "host weights); 1 on a machine shared with other work.")
ORACLE_THRESHOLD = flags.DEFINE_float("oracle_threshold", None, "Oracle mode: replace every "
                                      "layer's contribution threshold (0 = every neuron active).")

THRESHOLD_SCALE = flags.DEFINE_float("threshold_scale", 1.0, "Oracle mode and a bundle's "
                                     "predictor mode on the host engine / low-bit predictor: "
                                     "multiply every layer's contribution threshold "
                                     "(sparsity-perplexity curves).")
CUT_OFFSET = flags.DEFINE_float("cut_offset", 0.0, "Predictor mode, MLP predictors: add to "
                                "every logit cut (> 0 skips more neurons).")
PREDICTOR_KIND = flags.DEFINE_enum("predictor_kind", None, ["auto", "mlp", "lowbit"],
                                   "Predictor mode: auto = lowbit (4-bit gate/up estimate) for "
                                   "SwiGLU/GeGLU, mlp (fc2(relu(fc1 x))) for ReLU families.")
OVERLAP = flags.DEFINE_bool("overlap", None, "Sparse modes: run the host (cold) part in a worker "
                            "thread while the device computes the hot part (2 callbacks/layer).")
HOST_PREDICT = flags.DEFINE_bool("host_predict", None, "Low-bit predictor: the host predicts "
                                 "its own (cold) neurons inside its callback (default: on).")
PREFILL_DENSE_TOKENS = flags.DEFINE_integer(
    "prefill_dense_tokens", None, "Sparse modes: passes over at least this many tokens compute "
    "every neuron (0 = never; default: the measured switch point).")


HOST_WEIGHTS = flags.DEFINE_enum(
    "host_weights", None, ["auto", "off", "gguf", "q8_0"], "Dense runs: keep the weights on the "
    "host in quantized blocks, read by numba (gguf: the file's Q4_1/Q8_0 blocks as they are; "
    "q8_0: everything int8). auto: gguf on a CPU backend for Q4_1/Q8_0 files, else off (f32 XLA).")

HOST_DOT = flags.DEFINE_enum(
    "host_dot", None, ["int8", "f32"], "Host weights: every matmul (prefill, decode, batched "
    "decode) on activations quantized to 8 bits per block (256 values for K-quants, 32 else) "
    "with integer dot products (int8, the default; llama.cpp's arithmetic), or on f32 "
    "activations (f32: the f32 path's values up to summation order, slower).")


# Replaced by --sparse=gate|contribution; kept so that an old command line gets one line saying so.
_REMOVED = {"gate_sparse": flags.DEFINE_bool("gate_sparse", None, "Removed: use --sparse=gate."),
            "gate_rule": flags.DEFINE_string("gate_rule", None, "Removed: use --sparse=gate or "
                                             "--sparse=contribution.")}
GATE_SPARSITY = flags.DEFINE_float("gate_sparsity", None, "--sparse=gate on SwiGLU, "
                                   "--sparse=contribution: target fraction of FFN neurons "
                                   "skipped (default 0.5).")
CALIBRATION_FILE = flags.DEFINE_string("calibration_file", None, "Text to calibrate the "
                                       "--sparse=gate|contribution cuts on (not the evaluation "
                                       "text).")
GATE_DOWN = flags.DEFINE_enum(
    "gate_down", None, ["q8_0", "file"], "With --sparse=gate|contribution: the format of the "
    "neuron-major down rows: file (the default for Q4_1 files: the file's own blocks "
    "transposed, exact, 16 bytes per 32 weights of an active neuron plus 4 for the scales), "
    "or re-quantized from the file's values: q8_0 (the default for other files; close to the "
    "file).")

def _number(value) -> bool:
  """An int or float that is not NaN (infinities allowed)."""
  return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _finite(value) -> bool:
  return _number(value) and math.isfinite(value)


def _file_down_types(model: str) -> set[str]:
  """The GGML types of a GGUF's FFN down projections, read from its header (no weights
  loaded); empty for a bundle, a missing file or one whose header does not open (the loader
  then says what is wrong)."""
  from pijax.errors import PijaxError
  from pijax.formats import gguf as gguf_io
  try:
    path = gguf_io.default_model_path() if model == "default" else os.fspath(model)
    if not os.path.isfile(path):
      return set()
    reader, _ = gguf_io.open_gguf(path)
  except (PijaxError, OSError, ValueError):
    return set()
  return {t.tensor_type.name for t in reader.tensors if t.name.endswith(".ffn_down.weight")}


def check(cfg: Any = None, model: str | None = None) -> None:
  """Checks the ranges of these flags (falling back to the config's fields), model-free but
  for what the file's header says (`model`: the -m / --model path, "default" included).

  Called before a model loads, so a bad value fails in a second, and on a plain GGUF (where
  `configure` ignores the placement flags) it fails instead of being silently ignored.

  Raises:
    ConfigError: naming the first bad flag.
  """
  from pijax.errors import ConfigError
  get = (lambda name: None) if cfg is None else (lambda name: cfg.get(name, None))

  def pick(flag, name):
    return flag.value if flag.value is not None else get(name)

  rules = (  # flag, config field, valid, what it must be.
      (HOT_RATIO, "hot_ratio", lambda v: _finite(v) and 0 <= v <= 1, "a fraction in [0, 1]"),
      (DEVICE_BUDGET_GB, "device_budget_gb", lambda v: _finite(v) and v > 0,
       "a finite number of GB > 0 (GB = 1e9 bytes)"),
      (HOST_THREADS, "host_threads", lambda v: isinstance(v, int) and v >= 1, ">= 1"),
      (ORACLE_THRESHOLD, "oracle_threshold", lambda v: _number(v) and v >= 0,
       "a number >= 0 (0 = every neuron active)"),
      (THRESHOLD_SCALE, None, lambda v: _finite(v) and v >= 0,
       "a finite number >= 0 (1 = the calibrated thresholds)"),
      (CUT_OFFSET, None, _number, "a number (0 = the calibrated cuts)"),
      (PREFILL_DENSE_TOKENS, "prefill_dense_tokens", lambda v: isinstance(v, int) and v >= 0,
       ">= 0 (0 = never)"),
      (GATE_SPARSITY, "gate_sparsity", lambda v: _finite(v) and 0 <= v < 1,
       "a fraction in [0, 1)"),
  )
  for flag, name, valid, what in rules:
    value = flag.value if name is None else pick(flag, name)
    if value is not None and not valid(value):
      raise ConfigError(f"--{flag.name}={value} must be {what}.")
  for name, flag in _REMOVED.items():  # Old spellings: one line naming the new flag.
    if flag.value is not None or get(name) is not None:
      raise ConfigError(f"--{name} was replaced: use {sparse_modes.REMOVED_FLAGS[name]}.")
  # The mode against the model (a bundle or a plain GGUF) and the combinations refused, all
  # before a model loads (a server would otherwise load and compile first).
  mode = pick(SPARSE, "sparse") or sparse_modes.OFF
  bundle, predictors = None, False
  if model is not None and model != "default":
    from pijax.formats import bundle as bundle_lib
    bundle = bundle_lib.is_bundle(model) if os.path.exists(model) else None
    if bundle is False:
      from pijax.formats import powerinfer
      predictors = powerinfer.has_predictors(model)
  elif model == "default":
    bundle = False
  sparse_modes.check(mode)  # The mode against the model: last, after the flag combinations.
  host_mode = mode in sparse_modes.HOST_MODES
  down = pick(GATE_DOWN, "gate_down")
  calibration = pick(CALIBRATION_FILE, "calibration_file")
  sparsity = pick(GATE_SPARSITY, "gate_sparsity")
  for flag, name, value in ((GATE_DOWN, "gate_down", down),
                            (GATE_SPARSITY, "gate_sparsity", sparsity),
                            (CALIBRATION_FILE, "calibration_file", calibration)):
    if value is not None and not host_mode:
      raise ConfigError(f"--{name}={value} sets up --sparse=gate or contribution (this run is "
                        f"--sparse={mode}): add one of them or drop --{name}.")
  if mode == sparse_modes.CONTRIBUTION and sparsity != 0 and not calibration:
    raise ConfigError("--sparse=contribution calibrates its cuts on text: pass "
                      "--calibration_file=FILE (e.g. ../shared/data/tinyshakespeare/input.txt; "
                      "never the evaluation text).")
  if host_mode and calibration and not os.path.isfile(calibration):
    raise ConfigError(f"--calibration_file={calibration}: no such file.")
  if host_mode and pick(HOST_WEIGHTS, "host_weights") == "off":
    raise ConfigError(f"--sparse={mode} runs on quantized host weights, but --host_weights=off "
                      "keeps the weights in XLA; drop one of them.")
  if down == "file" and model is not None:  # Else refused only once the weights are loaded.
    types = _file_down_types(model)
    if types and types != {"Q4_1"}:
      raise ConfigError(f"--gate_down=file reads a Q4_1 file's own down blocks, but this file's "
                        f"down projections are {', '.join(sorted(types))}: use "
                        "--gate_down=q8_0, or drop --gate_down.")
  dot = pick(HOST_DOT, "host_dot")
  if dot is not None and pick(HOST_WEIGHTS, "host_weights") == "off":
    raise ConfigError(f"--host_dot={dot} sets how host weights multiply, but --host_weights=off "
                      "keeps the weights in XLA; drop --host_dot or use --host_weights=gguf.")
  sparse_modes.check(mode, bundle=bundle, predictors=predictors)


def configure(model, cfg: Any = None, *, per_token_prefill: bool = False) -> None:
  """Applies the flags (falling back to the config's fields) to a loaded model.

  per_token_prefill: default --prefill_dense_tokens to 0 (every token keeps its own active
  set in long passes too). pijax.perplexity uses it, so perplexity measures the sparse
  function decode computes rather than the dense prefill switch.

  Raises:
    ConfigError, BudgetError: see `pijax.engine.Model.configure_sparse`.
  """
  check(cfg)
  get = (lambda name: None) if cfg is None else (lambda name: cfg.get(name, None))

  def pick(flag, name):
    return flag.value if flag.value is not None else get(name)

  mode = pick(SPARSE, "sparse") or "off"
  hot_ratio = pick(HOT_RATIO, "hot_ratio")
  budget = pick(DEVICE_BUDGET_GB, "device_budget_gb")
  threads = pick(HOST_THREADS, "host_threads")
  kind = pick(PREDICTOR_KIND, "predictor_kind") or "auto"
  dense_tokens = pick(PREFILL_DENSE_TOKENS, "prefill_dense_tokens")
  host_weights = pick(HOST_WEIGHTS, "host_weights") or "auto"
  if model.sparse is None and mode == sparse_modes.PREDICTOR:
    # A PowerInfer GGUF's own predictors on the host engine (Model.configure_sparse checks
    # that the file has them).
    if threads is not None:
      from pijax.backends import host
      host.set_threads(threads)
    model.configure_sparse(mode, weights=host_weights, dot=pick(HOST_DOT, "host_dot"))
    return
  if mode in (sparse_modes.OFF,) + sparse_modes.HOST_MODES and model.sparse is None:
    # A plain GGUF runs dense or host-sparse; placement flags mean nothing there.
    # Silent on purpose: stderr stays one stats line (or one error line); bench and the
    # closing stats name the weights.
    if threads is not None:
      from pijax.backends import host
      host.set_threads(threads)
    sparsity = pick(GATE_SPARSITY, "gate_sparsity")
    host_mode = mode in sparse_modes.HOST_MODES
    model.configure_host_weights(
        host_weights, gate_sparse=host_mode,
        gate_sparsity=0.5 if sparsity is None else sparsity,
        calibration_file=pick(CALIBRATION_FILE, "calibration_file"),
        dot=pick(HOST_DOT, "host_dot"), gate_down=pick(GATE_DOWN, "gate_down"),
        gate_rule=mode if host_mode else None)
    return
  sparse_modes.check(mode, bundle=model.sparse is not None)
  from pijax.errors import ConfigError
  if host_weights not in ("auto", "off"):
    raise ConfigError(f"--host_weights={host_weights} is for runs of a GGUF; a bundle runs on "
                      "its source GGUF's blocks by itself where it can (drop --host_weights).")
  from pijax.backends import host
  host_dot = pick(HOST_DOT, "host_dot")
  if (not hot_ratio and budget is None and host_weights == "auto"
      and host.bundle_runs_on_host(model, mode) and kind == "auto"
      and not pick(OVERLAP, "overlap")):
    # No accelerator and no placement asked: the host engine over the source's blocks.
    sys.stderr.write(f"pijax: CPU backend, the bundle runs on the host engine over its source "
                     f"GGUF's blocks{' (the contribution rule at its thresholds)' if mode != 'off' else ''}"
                     "; pass --hot_ratio > 0 or --device_budget_gb for the hybrid backend.\n")
    model.configure_sparse(mode, host_threads=threads, host_dot=host_dot,
                           threshold_scale=THRESHOLD_SCALE.value)
    return
  if host_dot is not None and mode == "off":
    raise ConfigError("--host_dot is for runs on host weights; --sparse=off with hot neurons "
                      "runs the dense XLA backend (drop --host_dot).")
  if (mode != "off" and model.sparse is not None and hot_ratio is None and budget is None
      and jax.default_backend() == "cpu"):
    # No accelerator: "device" and host are the same CPU and memory, and the host path is the
    # faster one (BUILD_NOTES.md, issue 4), so every neuron goes to the host.
    hot_ratio = 0.0
    sys.stderr.write("pijax: CPU backend, every FFN neuron on the host (--hot_ratio=0); pass "
                     "--hot_ratio or --device_budget_gb to place neurons otherwise.\n")
  model.configure_sparse(mode, hot_ratio=hot_ratio, device_budget_gb=budget,
                         host_threads=threads, oracle_threshold=ORACLE_THRESHOLD.value,
                         threshold_scale=THRESHOLD_SCALE.value, cut_offset=CUT_OFFSET.value,
                         predictor_kind=kind, overlap=bool(pick(OVERLAP, "overlap")),
                         host_predict=pick(HOST_PREDICT, "host_predict"), host_dot=host_dot,
                         prefill_dense_tokens=(
                             dense_tokens if dense_tokens is not None
                             else 0 if per_token_prefill else DEFAULT_PREFILL_DENSE_TOKENS))
