"""The `llama` family: LLaMA 1-3, SmolLM2, Mistral (SwiGLU), ReluLLaMA / ProSparse (ReGLU) and
Bamboo (dReLU) GGUFs. Pre-norm blocks, no biases, RoPE on adjacent pairs (llama.cpp's converter
permutes Q/K rows), an optional tied head, LLaMA-3.1 RoPE factors (`rope_freqs.weight`) and
Mistral's sliding window where the file sets one.

PowerInfer's files of this family (`pijax.formats.powerinfer`) add per-layer predictors and
store the down projection transposed (`POWERINFER_TENSORS`); PowerInfer runs them as ReGLU, so a
file in that layout without `pijax.ffn_activation` is read as ReGLU."""

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

# PowerInfer's per-layer extras (its converters' names): the predictor fc1 [rank, hidden] and
# fc2 [ffn, rank], and ffn_down_t, the down projection transposed [ffn, hidden] (which replaces
# ffn_down in its files).
POWERINFER_TENSORS = TensorMap({
    "fc1": "blk.{i}.fc1.weight",
    "fc2": "blk.{i}.fc2.weight",
    "down_t": "blk.{i}.ffn_down_t.weight",
})


def powerinfer_layout(tensors: Mapping[str, Any]) -> bool:
  """Whether the file's first layer is in PowerInfer's layout (a predictor or ffn_down_t)."""
  return hasattr(tensors, "__contains__") and any(
      POWERINFER_TENSORS.name(role, 0) in tensors for role in ("fc1", "down_t"))


def config_from_metadata(meta: MetadataReader, tensors: Mapping[str, Any],
                         ffn_activation: str | None = None) -> ModelConfig:
  """The ModelConfig of a `llama` GGUF; GGUFError on missing or inconsistent values."""
  fields = registry.base_fields(meta, tensors, ffn_activation, default_activation=(
      "relu" if powerinfer_layout(tensors) else "silu"))
  fields["rope_style"] = config_lib.ROPE_ADJACENT
  return ModelConfig(**fields)


FAMILY = Family(name="llama", config_from_metadata=config_from_metadata, tensors=TENSORS)
