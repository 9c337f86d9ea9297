"""The architecture registry: `general.architecture` -> the family module that reads it.

A family module defines `FAMILY = Family(...)`: its name, how its GGUF metadata becomes a
`ModelConfig`, and its tensor map (the GGUF name of every weight role), declared once and read
by every loader and backend. Unknown architectures are refused by name.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Mapping

import numpy as np

from pijax.arch.spec import ModelConfig
from pijax.errors import GGUFError

# Weight roles of a decoder-only family. Per-layer roles take the layer index.
LAYER_ROLES = ("attn_norm", "q", "k", "v", "o", "ffn_norm", "gate", "up", "down")
GLOBAL_ROLES = ("embedding", "final_norm", "lm_head")

# GGUF architecture name -> module under pijax.arch defining FAMILY.
_FAMILY_MODULES = {"llama": "pijax.arch.llama"}
SUPPORTED_ARCHS = tuple(_FAMILY_MODULES)


@dataclasses.dataclass(frozen=True)
class TensorMap:
  """GGUF tensor names by role: `names[role]` is a format string with `{i}` for the layer."""

  names: Mapping[str, str]

  def name(self, role: str, layer: int | None = None) -> str:
    """The GGUF name of `role` (of layer `layer` for per-layer roles); KeyError if unknown."""
    return self.names[role].format(i=layer)

  def __hash__(self) -> int:
    return hash(tuple(sorted(self.names.items())))


@dataclasses.dataclass(frozen=True)
class Family:
  """One model family: `config_from_metadata(reader, tensor_names, ffn_activation)` and its
  tensor map."""

  name: str
  config_from_metadata: Callable[["MetadataReader", set[str], str | None], ModelConfig]
  tensors: TensorMap


class MetadataReader:
  """Typed access to `{arch}.{key}` GGUF metadata with one-line errors naming the file."""

  def __init__(self, metadata: Mapping[str, Any], arch: str, path: str):
    self.metadata, self.arch, self.path = metadata, arch, path

  def get(self, key: str, default: Any = None) -> Any:
    return self.metadata.get(f"{self.arch}.{key}", default)

  def has(self, key: str) -> bool:
    return f"{self.arch}.{key}" in self.metadata

  def need(self, key: str) -> Any:
    full = f"{self.arch}.{key}"
    if full not in self.metadata:
      raise GGUFError(f"{self.path}: metadata key {full!r} is missing; the file is incomplete, "
                      "re-convert it.")
    return self.metadata[full]

  def positive_int(self, key: str, default: Any = None) -> int:
    value = self.need(key) if default is None else self.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
      raise GGUFError(f"{self.path}: metadata {self.arch}.{key}={value!r} must be a positive "
                      "integer; the file is corrupt, re-convert it.")
    return int(value)

  def positive_float(self, key: str, default: float) -> float:
    value = self.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or \
        not np.isfinite(value) or value <= 0:
      raise GGUFError(f"{self.path}: metadata {self.arch}.{key}={value!r} must be a positive "
                      "number; the file is corrupt, re-convert it.")
    return float(value)


def get_family(arch: Any, path: str = "the model") -> Family:
  """The Family registered for a GGUF `general.architecture` value.

  Raises:
    GGUFError: an architecture no family module declares.
  """
  module = _FAMILY_MODULES.get(arch) if isinstance(arch, str) else None
  if module is None:
    raise GGUFError(f"{path}: architecture {arch!r} is not supported; pijax runs "
                    f"{', '.join(SUPPORTED_ARCHS)} (SwiGLU, ReGLU, dReLU FFNs).")
  return importlib.import_module(module).FAMILY


def config_from_metadata(metadata: Mapping[str, Any], path: str, tensor_names: set[str],
                         ffn_activation: str | None = None) -> ModelConfig:
  """Builds the ModelConfig of a GGUF from its metadata through its family module.

  Args:
    metadata: GGUF key/values (see `pijax.formats.gguf.open_gguf`).
    path: the file, for error messages.
    tensor_names: names of the tensors in the file (e.g. to detect a tied output head).
    ffn_activation: "silu" | "relu" | "drelu", used only when the file does not say.

  Raises:
    GGUFError: unsupported architecture or missing/inconsistent hyper-parameters.
  """
  arch = metadata.get("general.architecture")
  family = get_family(arch, path)
  return family.config_from_metadata(MetadataReader(metadata, arch, path), set(tensor_names),
                                     ffn_activation)
