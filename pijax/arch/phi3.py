"""The `phi3` family (Phi-3 / Phi-3.5 mini GGUFs): the llama block with q | k | v stored as one
`attn_qkv` tensor and gate | up as one `ffn_up` tensor, NeoX RoPE, and a sliding window on every
layer where the file sets one. LongRoPE files (`rope_factors_long/short`) are refused."""

from __future__ import annotations

from typing import Any, Mapping

from pijax.arch import registry
from pijax.arch.registry import Family, MetadataReader, TensorMap
from pijax.arch.spec import ModelConfig
from pijax.errors import GGUFError

TENSORS = TensorMap({
    "embedding": "token_embd.weight",
    "attn_norm": "blk.{i}.attn_norm.weight",
    "o": "blk.{i}.attn_output.weight",
    "ffn_norm": "blk.{i}.ffn_norm.weight",
    "down": "blk.{i}.ffn_down.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
}, fused={"blk.{i}.attn_qkv.weight": ("q", "k", "v"), "blk.{i}.ffn_up.weight": ("gate", "up")})


def config_from_metadata(meta: MetadataReader, tensors: Mapping[str, Any],
                         ffn_activation: str | None = None) -> ModelConfig:
  """The ModelConfig of a `phi3` GGUF; GGUFError on missing or inconsistent values."""
  if "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors:
    raise GGUFError(f"{meta.path}: LongRoPE (rope_factors_long/short, Phi-3 128k models) is not "
                    "supported; use a 4k-context Phi-3 file.")
  return ModelConfig(**registry.base_fields(meta, tensors, ffn_activation))


FAMILY = Family(name="phi3", config_from_metadata=config_from_metadata, tensors=TENSORS)
