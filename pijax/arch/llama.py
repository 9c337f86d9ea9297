"""The `llama` family: LLaMA 1-3, SmolLM2, Mistral (SwiGLU), ReluLLaMA / ProSparse (ReGLU) and
Bamboo (dReLU) GGUFs. Pre-norm blocks, no biases, RoPE on adjacent pairs (llama.cpp's converter
permutes Q/K rows), an optional tied head."""

from __future__ import annotations

from pijax import config as config_lib
from pijax.arch.registry import Family, MetadataReader, TensorMap
from pijax.arch.spec import ModelConfig
from pijax.errors import GGUFError

# GGUF key naming the FFN activation of converted sparse families (absent: SwiGLU, or the
# caller's `ffn_activation`).
ACTIVATION_KEY = "pijax.ffn_activation"

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


def config_from_metadata(meta: MetadataReader, tensor_names: set[str],
                         ffn_activation: str | None = None) -> ModelConfig:
  """The ModelConfig of a `llama` GGUF; GGUFError on missing or inconsistent values."""
  path, arch = meta.path, meta.arch
  hidden = meta.positive_int("embedding_length")
  n_heads = meta.positive_int("attention.head_count")
  n_kv_heads = meta.positive_int("attention.head_count_kv", n_heads)
  head_dim = meta.positive_int("attention.key_length", max(hidden // n_heads, 1))
  if n_heads % n_kv_heads:
    raise GGUFError(f"{path}: head_count {n_heads} is not a multiple of head_count_kv "
                    f"{n_kv_heads}.")
  n_tokens = len(meta.metadata.get("tokenizer.ggml.tokens", []))
  vocab = meta.positive_int("vocab_size", n_tokens) if (meta.has("vocab_size") or n_tokens) \
      else meta.positive_int("vocab_size")
  if n_tokens and vocab != n_tokens:
    raise GGUFError(f"{path}: {arch}.vocab_size={vocab} but the tokenizer has {n_tokens} "
                    "tokens; the file is inconsistent, re-convert it.")
  activation = meta.metadata.get(ACTIVATION_KEY) or ffn_activation or "silu"
  if activation not in config_lib.ACTIVATION_TO_FAMILY:
    raise GGUFError(f"{path}: FFN activation {activation!r} is not supported; use one of "
                    f"{sorted(config_lib.ACTIVATION_TO_FAMILY)}.")
  scaling_type = meta.get("rope.scaling.type", "none")
  rope_scale = 1.0
  if scaling_type == "linear":
    rope_scale = meta.positive_float("rope.scaling.factor", 1.0)
  elif scaling_type not in ("none", None):
    raise GGUFError(f"{path}: RoPE scaling {scaling_type!r} is not supported (only linear).")
  rope_dim = meta.positive_int("rope.dimension_count", head_dim)
  if rope_dim > head_dim or rope_dim % 2:
    raise GGUFError(f"{path}: rope.dimension_count={rope_dim} must be even and <= head_dim "
                    f"{head_dim}.")
  if "rope_freqs.weight" in tensor_names:
    raise GGUFError(f"{path}: per-frequency RoPE factors (rope_freqs.weight, LLaMA-3.1 style) "
                    "are not supported yet.")
  return ModelConfig(
      arch=arch,
      vocab_size=int(vocab),
      hidden_size=hidden,
      intermediate_size=meta.positive_int("feed_forward_length"),
      n_layers=meta.positive_int("block_count"),
      n_heads=n_heads,
      n_kv_heads=n_kv_heads,
      head_dim=head_dim,
      rope_theta=meta.positive_float("rope.freq_base", 10000.0),
      rope_style=config_lib.ROPE_ADJACENT,
      rope_dim=rope_dim,
      rms_norm_eps=meta.positive_float("attention.layer_norm_rms_epsilon", 1e-5),
      context_length=meta.positive_int("context_length", 2048),
      ffn_family=config_lib.ACTIVATION_TO_FAMILY[activation],
      tied_output=TENSORS.name("lm_head") not in tensor_names,
      rope_scale=rope_scale,
  )


FAMILY = Family(name="llama", config_from_metadata=config_from_metadata, tensors=TENSORS)
