"""Static model configuration read from GGUF metadata, plus the project's constants."""

from __future__ import annotations

import dataclasses

# FFN families (../shared/DESIGN.md §1, table "FFN families").
FFN_SWIGLU = "swiglu"  # silu(gate x) * (up x): LLaMA, SmolLM2, Mistral.
FFN_REGLU = "reglu"  # relu(gate x) * (up x): ReluLLaMA, ProSparse.
FFN_DRELU = "drelu"  # relu(gate x) * relu(up x): Bamboo, TurboSparse.
FFN_RELU_MLP = "relu_mlp"  # relu(up x + b): OPT, ReluFalcon (activation definition only).
FFN_FAMILIES = (FFN_SWIGLU, FFN_REGLU, FFN_DRELU)

# User-facing activation names (config `ffn_activation`, GGUF key `pijax.ffn_activation`).
ACTIVATION_TO_FAMILY = {"silu": FFN_SWIGLU, "relu": FFN_REGLU, "drelu": FFN_DRELU}

# RoPE conventions. GGUF `llama` files rotate adjacent pairs (x0,x1),(x2,x3)... because
# llama.cpp's converter permuted Q/K; NeoX-style files rotate (x_i, x_{i+d/2}).
ROPE_ADJACENT = "adjacent"
ROPE_HALF = "half"

MASK_VALUE = -1e30  # Added to attention scores of masked keys (finite: no NaN on empty rows).


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of a llama-family decoder, hashable so it can be a jit static arg.

  Attributes:
    arch: GGUF `general.architecture` (e.g. "llama").
    vocab_size: number of token ids.
    hidden_size: width of the residual stream (d_model).
    intermediate_size: FFN neurons per layer.
    n_layers: transformer blocks.
    n_heads: query heads.
    n_kv_heads: key/value heads (grouped-query attention when < n_heads).
    head_dim: width of one head.
    rope_theta: RoPE base frequency.
    rope_style: ROPE_ADJACENT or ROPE_HALF.
    rope_dim: leading dims of each head that RoPE rotates (== head_dim for llama).
    rope_scale: linear position scaling (positions are divided by it); 1.0 = none.
    rms_norm_eps: epsilon inside RMSNorm's rsqrt.
    context_length: the context the model was trained for (tokens).
    ffn_family: one of FFN_FAMILIES.
    tied_output: the LM head reuses the token embedding (no `output.weight`).
  """

  arch: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  rope_theta: float
  rope_style: str
  rope_dim: int
  rms_norm_eps: float
  context_length: int
  ffn_family: str
  tied_output: bool
  rope_scale: float = 1.0

  @property
  def n_groups(self) -> int:
    """Query heads per KV head."""
    return self.n_heads // self.n_kv_heads

  def n_params(self) -> int:
    """Number of weights (embedding counted once when tied)."""
    d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
    attn = d * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
    per_layer = attn + 3 * d * f + 2 * d
    head = 0 if self.tied_output else v * d
    return v * d + self.n_layers * per_layer + d + head
