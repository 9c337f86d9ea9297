"""The `qwen2` and `qwen3` families (Qwen2 / Qwen2.5, Qwen3 dense GGUFs): the llama block with
NeoX RoPE (the converter keeps Q/K rows in Hugging Face's half-split order); Qwen2 adds biases
to q, k and v, Qwen3 an RMSNorm on every query and key head before RoPE (QK-norm)."""

from __future__ import annotations

from typing import Any, Mapping

from pijax.arch import llama
from pijax.arch import registry
from pijax.arch.registry import Family, MetadataReader, TensorMap
from pijax.arch.spec import ModelConfig

TENSORS = TensorMap({
    **llama.TENSORS.names,
    "q_bias": "blk.{i}.attn_q.bias",
    "k_bias": "blk.{i}.attn_k.bias",
    "v_bias": "blk.{i}.attn_v.bias",
    "q_norm": "blk.{i}.attn_q_norm.weight",
    "k_norm": "blk.{i}.attn_k_norm.weight",
})


def config_from_metadata(meta: MetadataReader, tensors: Mapping[str, Any],
                         ffn_activation: str | None = None) -> ModelConfig:
  """The ModelConfig of a `qwen2` / `qwen3` GGUF; GGUFError on missing or inconsistent values."""
  fields = registry.base_fields(meta, tensors, ffn_activation)
  if meta.arch == "qwen2":
    fields["qkv_bias"] = True
  else:
    fields["qk_norm"] = True
  return ModelConfig(**fields)


FAMILY = Family(name="qwen", config_from_metadata=config_from_metadata, tensors=TENSORS)
