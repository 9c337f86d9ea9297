"""The bundle half of `pijax.load`: a bundle converted by `pijax.convert` put on the model of its
source GGUF (the FFN rows in the bundle's neuron order, predictors and placement in
`Model.sparse`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from pijax.backends import xla as xla_backend
from pijax.formats import bundle as bundle_lib
from pijax.formats.loader import load_gguf


def attach(model: Any, bundle: bundle_lib.SparseBundle, src: str, activation: str | None
           ) -> None:
  """Puts `bundle` on `model` (a `pijax.engine.Model` loaded from the bundle's source GGUF
  `src`): the dense XLA backend over the permuted FFN rows; `model.sparse` and `model.path`
  name the bundle.

  Raises:
    BundleError: the bundle does not fit the source's config.
  """
  bundle_lib.check_source_config(bundle, model.config)
  if bundle.ffn is None:  # Version 2: the source's own rows, in the bundle's neuron order.
    # f32 rows whatever the compute dtype (the host part reads them as f32, as version 1).
    f32 = model.params if np.dtype(model.dtype) == np.float32 else \
        load_gguf(src, dtype="float32", ffn_activation=activation)[1]
    bundle.ffn = bundle_lib.permute_ffn(f32, model.config.n_layers, bundle.perm)
    del f32
  model.params = bundle_lib.with_ffn(model.params, bundle.ffn, model.dtype)
  model.use_backend(xla_backend.XlaBackend(model.config, model.params, model.dtype))
  model.sparse = bundle
  model.path = bundle.path
