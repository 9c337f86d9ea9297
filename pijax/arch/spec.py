"""The frozen description of one model: its sizes and the switches that tell families apart.

Built from GGUF metadata by `pijax.arch.registry.config_from_metadata`; every backend reads it and
none re-derives it. Hashable, so it can be a static argument of `jax.jit`.
"""

from __future__ import annotations

import dataclasses

from pijax import config as config_lib


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters and family switches of a decoder-only transformer.

  Attributes:
    arch: GGUF `general.architecture` (e.g. "llama"); the registry's key.
    vocab_size: number of token ids.
    hidden_size: width of the residual stream (d_model).
    intermediate_size: FFN neurons per layer.
    n_layers: transformer blocks.
    n_heads: query heads.
    n_kv_heads: key/value heads (grouped-query attention when < n_heads).
    head_dim: width of one head.
    rope_theta: RoPE base frequency.
    rope_style: ROPE_ADJACENT or ROPE_HALF (which dims pair up in a rotation).
    rope_dim: leading dims of each head that RoPE rotates (== head_dim for llama).
    rms_norm_eps: epsilon inside RMSNorm's rsqrt.
    context_length: the context the model was trained for (tokens).
    ffn_family: one of FFN_FAMILIES (the FFN activation).
    tied_output: the LM head reuses the token embedding (no `output.weight`).
    rope_scale: linear position scaling (positions are divided by it); 1.0 = none.
    qkv_bias: q, k, v projections carry a bias (Qwen2).
    qk_norm: RMSNorm on each query and key head before RoPE (Qwen3, Gemma 3).
    norm_placement: NORM_PRE (LLaMA) or NORM_SANDWICH (Gemma 2/3: sub-block outputs normed too).
    sliding_window: tokens a local-attention layer sees, itself included (a query at position
      p attends keys at positions > p - sliding_window); 0 = every layer attends globally.
    sliding_window_pattern: n > 0: layer i is global when (i + 1) % n == 0 and local otherwise
      (Gemma 3: 6); 0: every layer is local (Mistral, Phi-3), when sliding_window > 0.
    embedding_scale: the token embeddings are multiplied by this (Gemma: sqrt(hidden_size)).
    rope_local_theta: RoPE base of local (sliding-window) layers, unscaled (Gemma 3: 1e4);
      0 = the same RoPE as global layers.
    rope_freq_factors: per-frequency divisors of RoPE's inverse frequencies (R/2 floats; the
      file's `rope_freqs.weight`, LLaMA-3.1 "llama3" scaling); () = none.
    attn_scale: the attention logit scale; 0 = head_dim ** -0.5.
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
  qkv_bias: bool = False
  qk_norm: bool = False
  norm_placement: str = config_lib.NORM_PRE
  sliding_window: int = 0
  sliding_window_pattern: int = 0
  embedding_scale: float = 1.0
  rope_local_theta: float = 0.0
  rope_freq_factors: tuple[float, ...] = ()
  attn_scale: float = 0.0

  @property
  def n_groups(self) -> int:
    """Query heads per KV head."""
    return self.n_heads // self.n_kv_heads

  def is_local(self, layer: int) -> bool:
    """Whether `layer` attends only its last `sliding_window` positions."""
    if self.sliding_window <= 0:
      return False
    n = self.sliding_window_pattern
    return n == 0 or (layer + 1) % n != 0

  @property
  def attention_scale(self) -> float:
    """The factor on q . k before the softmax."""
    return self.attn_scale or self.head_dim ** -0.5

  def rope_params(self, layer: int) -> tuple[float, float, tuple[float, ...]]:
    """(theta, position scale, per-frequency factors) of `layer`'s RoPE."""
    if self.rope_local_theta and self.is_local(layer):
      return self.rope_local_theta, 1.0, ()
    return self.rope_theta, self.rope_scale, self.rope_freq_factors

  def variant_switches(self) -> dict[str, object]:
    """The switches set away from LLaMA's defaults, {name: value} (empty for llama files).

    Backends compare this with what they implement and refuse the rest by name.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(self)
                if f.name in SWITCHES}
    return {name: getattr(self, name) for name, default in defaults.items()
            if getattr(self, name) != default}

  def n_params(self) -> int:
    """Number of weights (embedding counted once when tied)."""
    d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
    attn = d * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
    per_layer = attn + 3 * d * f + 2 * d
    if self.qkv_bias:
      per_layer += self.head_dim * (self.n_heads + 2 * self.n_kv_heads)
    if self.qk_norm:
      per_layer += 2 * self.head_dim
    if self.norm_placement != config_lib.NORM_PRE:
      per_layer += 2 * d
    head = 0 if self.tied_output else v * d
    return v * d + self.n_layers * per_layer + d + head


# Switches that distinguish families; a backend that does not implement one refuses the model.
SWITCHES = ("qkv_bias", "qk_norm", "norm_placement", "sliding_window",
             "sliding_window_pattern", "embedding_scale", "rope_local_theta", "rope_freq_factors",
             "attn_scale")
