"""The `gemma3` family (Gemma 3 text GGUFs, e.g. Gemma 3 270M): GeGLU FFN, QK-norm, a second
RMSNorm on each sub-block's output ("sandwich"), embeddings scaled by sqrt(hidden_size), five
sliding-window (local) layers per global one with their own RoPE base, NeoX RoPE and a tied head.

llama.cpp's converter stores Gemma's RMSNorm weights as 1 + w, so every norm is the plain
x / rms(x) * weight (Gemma 3 report, arXiv 2503.19786 §2; llama.cpp `LLM_ARCH_GEMMA3`).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from pijax import config as config_lib
from pijax.arch import qwen
from pijax.arch import registry
from pijax.arch.registry import Family, MetadataReader, TensorMap
from pijax.arch.spec import ModelConfig

TENSORS = TensorMap({
    **qwen.TENSORS.names,
    "post_attn_norm": "blk.{i}.post_attention_norm.weight",
    "post_ffn_norm": "blk.{i}.post_ffw_norm.weight",
})

LOCAL_ROPE_THETA = 10000.0  # RoPE base of the sliding-window layers (not in the GGUF).
GLOBAL_EVERY = 6  # Every 6th layer attends globally (llama.cpp: swa pattern 6).


def config_from_metadata(meta: MetadataReader, tensors: Mapping[str, Any],
                         ffn_activation: str | None = None) -> ModelConfig:
  """The ModelConfig of a `gemma3` GGUF; GGUFError on missing or inconsistent values."""
  fields = registry.base_fields(meta, tensors, ffn_activation, default_activation="gelu")
  fields.update(
      qk_norm=True,
      norm_placement=config_lib.NORM_SANDWICH,
      embedding_scale=math.sqrt(fields["hidden_size"]),
      rms_norm_eps=meta.positive_float("attention.layer_norm_rms_epsilon", 1e-6),
      sliding_window_pattern=GLOBAL_EVERY if fields["sliding_window"] else 0,
      rope_local_theta=LOCAL_ROPE_THETA if fields["sliding_window"] else 0.0,
  )
  if fields["n_layers"] == 62:  # Gemma 3 27B scales by hidden / heads, not head_dim (llama.cpp).
    fields["attn_scale"] = (fields["hidden_size"] / fields["n_heads"]) ** -0.5
  return ModelConfig(**fields)


FAMILY = Family(name="gemma3", config_from_metadata=config_from_metadata, tensors=TENSORS)
