"""The bundle half of `pijax.load`: a bundle converted by `pijax.convert` put on the model of its
source GGUF (the FFN rows in the bundle's neuron order, predictors and placement in
`Model.sparse`), and the backend each --sparse mode of a bundle runs on."""

from __future__ import annotations

from typing import Any

import numpy as np

from pijax.backends import xla as xla_backend
from pijax.formats import bundle as bundle_lib
from pijax.formats.loader import load_gguf


def attach(model: Any, bundle: bundle_lib.SparseBundle, src: str, activation: str | None
           ) -> None:
  """Puts `bundle` on `model` (a `pijax.engine.Model` loaded from the bundle's source GGUF
  `src`); `model.sparse` and `model.path` name the bundle. The dense tree with the permuted FFN
  rows is built when first read (`rows`, `model.params`): a run on the host engine never
  builds it (`backend_for`).

  Raises:
    BundleError: the bundle does not fit the source's config.
  """
  bundle_lib.check_source_config(bundle, model.config)
  dtype = model.dtype

  def permuted() -> Any:
    source = load_gguf(src, dtype=str(np.dtype(dtype)), ffn_activation=activation)[1]
    if bundle.ffn is None:  # Version 2: the source's own rows, in the bundle's neuron order.
      # f32 rows whatever the compute dtype (the host part reads them as f32, as version 1).
      f32 = source if np.dtype(dtype) == np.float32 else \
          load_gguf(src, dtype="float32", ffn_activation=activation)[1]
      bundle.ffn = bundle_lib.permute_ffn(f32, model.config.n_layers, bundle.perm)
      del f32
    return bundle_lib.with_ffn(source, bundle.ffn, dtype)

  model.params = permuted
  model.use_backend(xla_backend.XlaBackend(model.config, lambda: model.params, model.dtype))
  model.sparse = bundle
  model.path = bundle.path


def rows(model: Any) -> dict[str, Any]:
  """The bundle's permuted neuron-major FFN rows {layers_i: {gate, up, down}: f32[F, D]},
  built from the source GGUF on first use."""
  model.params  # Builds bundle.ffn with the permuted tree (`attach`).
  return model.sparse.ffn


def backend_for(model: Any, mode: str, *, hot_ratio: float | None = None,
                device_budget_gb: float | None = None, predictor_kind: str = "auto",
                use_pallas: bool | None = None, threshold_scale: float | None = None,
                host_dot: str | None = None, host_threads: int | None = None, **options):
  """The backend of bundle `model` in `mode` ("off" | "oracle" | "predictor"): the host engine
  over the source GGUF's blocks (`pijax.backends.host.for_bundle`) when every neuron is on the
  host (hot_ratio None or 0, no device_budget_gb, no GPU) and the mode runs there; else the
  hybrid backend (`pijax.backends.hybrid.for_model`, options passed on).

  Raises:
    ConfigError, BudgetError: see those two.
  """
  from pijax.backends import host, hybrid
  from pijax.errors import ConfigError
  if host_threads is not None:
    host.set_threads(host_threads)
  from pijax.nn import hybrid as hybrid_nn
  hybrid_nn.check_row_format(options.get("row_format", hybrid_nn.ROWS_INT8))  # Either backend.
  all_host = not hot_ratio and device_budget_gb is None and not use_pallas
  on_host = (all_host and predictor_kind == "auto" and options.get("overlap") in (None, False)
             and host.bundle_runs_on_host(model, mode))
  if on_host:
    cut_offset = options.get("cut_offset")  # Read by MLP predictors only, but never a NaN.
    if cut_offset is not None and not cut_offset == cut_offset:
      raise ConfigError(f"--cut_offset={cut_offset} must be a number (0 = the calibrated cuts).")
    return host.for_bundle(model, mode, threshold_scale=1.0 if threshold_scale is None
                           else threshold_scale, dot=host_dot)
  if host_dot is not None and mode == "off":
    raise ConfigError("--host_dot is for runs on host weights; --sparse=off with hot neurons "
                      "runs the dense XLA backend (drop --host_dot).")
  return hybrid.for_model(model, mode, hot_ratio=hot_ratio, device_budget_gb=device_budget_gb,
                          predictor_kind=predictor_kind, use_pallas=use_pallas,
                          threshold_scale=1.0 if threshold_scale is None else threshold_scale,
                          host_dot=host_dot, **options)
