"""One sparse vocabulary for every CLI (`--sparse=`) and the library (`Model.configure_sparse`).

  off           dense.
  oracle        a bundle's true active sets, computed densely (the correctness reference).
  gate          a plain GGUF's quantized host weights, gate-first: a neuron whose |act(gate)|
                is under its layer's cut reads neither its up nor its down row (ReGLU/dReLU:
                the exact zeros; SwiGLU: cuts calibrated on text for a target sparsity).
  contribution  the same host weights, cut on the exact contribution |act(gate) * up|: every
                up row is read, only the down rows of small contributions are skipped.
  predictor     predictors say which neurons fire (PowerInfer's runtime): a bundle's, or a
                PowerInfer GGUF's own (fc1/fc2 per layer, its threshold; host engine).

`check` is the one place that says which mode fits which model; the CLIs call it before a
model loads (from the path), `Model.configure_sparse` after.
"""

from __future__ import annotations

from pijax.errors import ConfigError

OFF, ORACLE, GATE, CONTRIBUTION, PREDICTOR = "off", "oracle", "gate", "contribution", "predictor"
MODES = (OFF, ORACLE, GATE, CONTRIBUTION, PREDICTOR)
HOST_MODES = (GATE, CONTRIBUTION)  # A plain GGUF's host weights, cut at run time.
BUNDLE_MODES = (ORACLE, PREDICTOR)  # A bundle from `pijax.convert` (its statistics, predictors).
# Flags that were replaced by --sparse (one line saying what to use instead).
REMOVED_FLAGS = {"gate_sparse": "--sparse=gate",
                 "gate_rule": "--sparse=gate or --sparse=contribution"}


def check(mode: str, *, bundle: bool | None = None, predictors: bool = False) -> str:
  """mode if it is one of MODES and fits the model, else ConfigError in one line.

  Args:
    mode: one of MODES.
    bundle: whether the model is a bundle folder (None: not known yet).
    predictors: whether a plain GGUF carries PowerInfer's predictors (`powerinfer.has_predictors`):
      then predictor runs it.

  Raises:
    ConfigError: an unknown mode; gate / contribution on a bundle; oracle on a plain GGUF;
      predictor on a plain GGUF without predictors.
  """
  if mode not in MODES:
    raise ConfigError(f"--sparse={mode!r} must be one of {', '.join(MODES)}.")
  if bundle is True and mode in HOST_MODES:
    raise ConfigError(f"--sparse={mode} cuts a plain GGUF's host weights at run time; a bundle "
                      f"runs --sparse=predictor or oracle (or give its source GGUF for {mode}).")
  if bundle is False and mode == PREDICTOR and not predictors:
    raise ConfigError("--sparse=predictor needs predictors: a PowerInfer GGUF (with per-layer "
                      "fc1/fc2), or a bundle made with `python -m pijax.convert` (or use "
                      "--sparse=gate or contribution on this GGUF).")
  if bundle is False and mode in BUNDLE_MODES and mode != PREDICTOR:
    raise ConfigError(f"--sparse={mode} needs a bundle's predictors and statistics: make one "
                      "with `python -m pijax.convert` (or use --sparse=gate or contribution "
                      "on this GGUF).")
  return mode


def backend_for(model, mode: str, **options):
  """The backend that runs `model` (`pijax.engine.Model`) in `mode`, after `check`: "gate" /
  "contribution" and a PowerInfer GGUF's "predictor" on its host weights (options of
  `pijax.backends.host.for_model`); "off" on a plain GGUF the dense backend; a bundle's modes
  where `pijax.bundle_load.backend_for` puts them (host engine or hybrid; options of
  `pijax.backends.hybrid.for_model`).

  Raises:
    ConfigError: a mode that does not fit the model, bad options.
  """
  predictors = False
  if model.sparse is None and mode == PREDICTOR:
    from pijax.formats import powerinfer
    predictors = powerinfer.has_predictors(model.path)
  check(mode, bundle=model.sparse is not None, predictors=predictors)
  if mode in HOST_MODES or predictors:
    from pijax import load_checks
    from pijax.backends import host
    if model.file_stamp is not None:  # The host path reads the file's blocks now.
      load_checks.check_unchanged(*model.file_stamp)
    rule = {"gate_sparse": True, "gate_rule": mode} if mode in HOST_MODES else {"predictor": True}
    return host.for_model(model, options.pop("weights", "auto"), **rule, **options)
  if model.sparse is None:  # "off" on a plain GGUF: the dense backend.
    from pijax.backends import hybrid
    return hybrid.for_model(model, mode, **options)
  from pijax import bundle_load
  return bundle_load.backend_for(model, mode, **options)
