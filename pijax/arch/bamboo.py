"""The `bamboo` family: PowerInfer's Bamboo GGUFs (a Mistral-7B-shaped llama block with dReLU,
relu(gate x) * relu(up x)). Its files use llama's tensor names (and PowerInfer's layout,
`pijax.formats.powerinfer`) under the architecture name "bamboo", and its converter permutes Q/K
rows as llama's does; PowerInfer runs the FFN as dReLU, dense or sparse."""

from __future__ import annotations

from typing import Any, Mapping

from pijax import config as config_lib
from pijax.arch import llama
from pijax.arch import registry
from pijax.arch.registry import Family, MetadataReader
from pijax.arch.spec import ModelConfig


def config_from_metadata(meta: MetadataReader, tensors: Mapping[str, Any],
                         ffn_activation: str | None = None) -> ModelConfig:
  """The ModelConfig of a `bamboo` GGUF; GGUFError on missing or inconsistent values."""
  fields = registry.base_fields(meta, tensors, ffn_activation, default_activation="drelu")
  fields["rope_style"] = config_lib.ROPE_ADJACENT
  return ModelConfig(**fields)


FAMILY = Family(name="bamboo", config_from_metadata=config_from_metadata, tensors=llama.TENSORS)
