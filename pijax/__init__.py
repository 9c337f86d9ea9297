"""pijax: PowerInfer-style hybrid sparse LLM inference in JAX.

Library entry points:
  pijax.load(path_or_default) -> Model    (Model.generate / Model.stream)
  pijax.prefill / pijax.decode_step: pure functions usable inside a caller's jax.jit.

Attributes are imported lazily so that `import pijax.config` stays light.
"""

import importlib

_EXPORTS = {
    "load": "pijax.engine",
    "Model": "pijax.engine",
    "GenerationResult": "pijax.generation",
    "KVCache": "pijax.nn.transformer",
    "init_cache": "pijax.nn.transformer",
    "prefill": "pijax.nn.transformer",
    "decode_step": "pijax.nn.transformer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name in _EXPORTS:
    return getattr(importlib.import_module(_EXPORTS[name]), name)
  raise AttributeError(f"module 'pijax' has no attribute {name!r}")
