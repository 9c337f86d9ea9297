"""The `llama` family: LLaMA 1-3, SmolLM2, Mistral (SwiGLU), ReluLLaMA / ProSparse (ReGLU) and
Bamboo (dReLU) GGUFs. Pre-norm blocks, no biases, RoPE on adjacent pairs (llama.cpp's converter
permutes Q/K rows), an optional tied head, LLaMA-3.1 RoPE factors (`rope_freqs.weight`) and
Mistral's sliding window where the file sets one."""

from __future__ import annotations

from typing import Any, Mapping

from pijax import config as config_lib
from pijax.arch import registry
from pijax.arch.registry import Family, MetadataReader, TensorMap
from pijax.arch.spec import ModelConfig

# Kept here too: converters and tests name the key through this module.
ACTIVATION_KEY = registry.ACTIVATION_KEY

TENSORS = TensorMap({
    "embedding": "token_embd.weight",
    "attn_norm": "blk.{i}.attn_norm.weight",
    "q": "blk.{i}.attn_q.weight",
    "k": "blk.{i}.attn_k.weight",
    "v": "blk.{i}.attn_v.weight",
    "o": "blk.{i}.attn_output.weight",
    "ffn_norm": "blk.{i}.ffn_norm.weight",
    "gate": "blk.{i}.ffn_gate.weight",
    "up": "blk.{i}.ffn_up.weight",
    "down": "blk.{i}.ffn_down.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
})


def config_from_metadata(meta: MetadataReader, tensors: Mapping[str, Any],
                         ffn_activation: str | None = None) -> ModelConfig:
  """The ModelConfig of a `llama` GGUF; GGUFError on missing or inconsistent values."""
  fields = registry.base_fields(meta, tensors, ffn_activation)
  fields["rope_style"] = config_lib.ROPE_ADJACENT
  return ModelConfig(**fields)


FAMILY = Family(name="llama", config_from_metadata=config_from_metadata, tensors=TENSORS)
