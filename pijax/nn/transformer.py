"""The decoder of every supported family as flax.linen modules, applied as pure functions.

Shape letters (einsums and comments): B batch, T query tokens, S key positions (KV cache
window), D hidden_size, N query heads, K KV heads, G query heads per KV head (N = K * G),
H head_dim, F intermediate_size (FFN neurons), V vocab_size, L layers.

The KV cache is an explicit pytree (`KVCache`) passed in and returned, one array per layer,
updated in place (`dynamic_update_slice`) when the caller donates it. Layers are unrolled
with separate per-layer params: on XLA CPU a scan over stacked weights copies each layer's
weights per step (BUILD_NOTES.md, "Layer loop").
"""

from __future__ import annotations

from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from pijax import config as config_lib
from pijax.arch.spec import ModelConfig


@flax.struct.dataclass
class KVCache:
  """Keys and values of every layer.

  Attributes:
    k: L arrays [B, S, K, H] of keys, already rotated by RoPE.
    v: L arrays [B, S, K, H] of values.
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]

  @property
  def max_seq_len(self) -> int:
    return self.k[0].shape[1]


def init_cache(config: ModelConfig, batch: int, max_seq_len: int,
               dtype: Any = jnp.float32) -> KVCache:
  """Zeroed KV cache: n_layers arrays k, v of [batch, max_seq_len, n_kv_heads, head_dim]."""
  shape = (batch, max_seq_len, config.n_kv_heads, config.head_dim)
  return KVCache(k=tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layers)),
                 v=tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layers)))


def kv_cache_bytes(config: ModelConfig, batch: int, max_seq_len: int, dtype_bytes: int) -> int:
  """Bytes of a KV cache (k and v) for `max_seq_len` tokens."""
  return 2 * config.n_layers * batch * max_seq_len * config.n_kv_heads * config.head_dim \
      * dtype_bytes


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) * scale.

  Accumulates in f32 whatever the input dtype (fp16 inputs of 300.0 would overflow x^2).
  x: [..., D]; scale: [D]. Returns x's dtype.
  """
  x32 = x.astype(jnp.float32)
  var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
  return (x32 * lax.rsqrt(var + eps) * scale.astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nn.Module):
  eps: float

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), x.dtype)
    return rms_norm(x, scale, self.eps)


def rope_angles(positions: jax.Array, config: ModelConfig, layer: int = 0
                ) -> tuple[jax.Array, jax.Array]:
  """cos, sin of RoPE (Su et al. 2021, RoFormer §3.4) for integer positions [B, T] -> [B, T, R/2].

  Pair i rotates by position / scale * theta ** (-2i / R) / factor_i, R = rope_dim, with
  (theta, scale, factors) = `config.rope_params(layer)` (local layers may have their own base;
  factors are LLaMA-3.1's `rope_freqs`).
  """
  theta, scale, factors = config.rope_params(layer)
  half = config.rope_dim // 2
  inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / config.rope_dim)
  if factors:
    inv_freq = inv_freq / jnp.asarray(factors, jnp.float32)
  angles = positions.astype(jnp.float32)[..., None] / scale * inv_freq
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, style: str) -> jax.Array:
  """Rotates the first R = 2 * cos.shape[-1] dims of each head of x: [B, T, heads, H].

  style ROPE_ADJACENT rotates pairs (x0, x1), (x2, x3), ... (GGUF `llama` files);
  ROPE_HALF rotates (x_i, x_{i+R/2}) (NeoX / Hugging Face layout).
  """
  rot = 2 * cos.shape[-1]
  xr, xpass = x[..., :rot].astype(jnp.float32), x[..., rot:]
  # [B, T, 1, R/2]: broadcast over heads.
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  if style == config_lib.ROPE_ADJACENT:
    pairs = xr.reshape(xr.shape[:-1] + (rot // 2, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1).reshape(xr.shape)
  else:
    x0, x1 = xr[..., : rot // 2], xr[..., rot // 2:]
    out = jnp.concatenate([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
  return jnp.concatenate([out.astype(x.dtype), xpass], axis=-1)


def ffn_activation(gate: jax.Array, up: jax.Array, family: str) -> jax.Array:
  """Per-neuron FFN activation a = act(gate x) * (up x) by family: SwiGLU silu(g) u (Shazeer
  2020), ReGLU relu(g) u, dReLU relu(g) relu(u) (Turbo Sparse, arXiv 2406.05955 §3), GeGLU
  gelu_tanh(g) u (Gemma)."""
  if family == config_lib.FFN_SWIGLU:
    return jax.nn.silu(gate) * up
  if family == config_lib.FFN_REGLU:
    return jax.nn.relu(gate) * up
  if family == config_lib.FFN_DRELU:
    return jax.nn.relu(gate) * jax.nn.relu(up)
  if family == config_lib.FFN_GEGLU:
    return jax.nn.gelu(gate, approximate=True) * up
  raise ValueError(f"unknown FFN family {family!r}")


class Einsum(nn.Module):
  """A weight applied with an einsum equation, e.g. "BTD,DNH->BTNH" (param `kernel`)."""

  shape: tuple[int, ...]
  equation: str

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    kernel = self.param("kernel", nn.initializers.normal(0.02), self.shape, x.dtype)
    return jnp.einsum(self.equation, x, kernel.astype(x.dtype))


def attention_core(qkv: jax.Array, cache_k: jax.Array, cache_v: jax.Array, pos: jax.Array,
                   cos: jax.Array, sin: jax.Array, *, config: ModelConfig, kv_len: int,
                   window: int = 0, q_norm: jax.Array | None = None,
                   k_norm: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Grouped-query attention from projected q | k | v, reading and writing one layer's KV cache.

  Args:
    qkv: [B, T, (N + 2K) H] the q, k, v projections of tokens at positions pos + [0, T).
    cache_k, cache_v: [B, S, K, H] this layer's cache.
    pos: i32[] position of the first token.
    cos, sin: [B, T, R/2] from `rope_angles`.
    config: static ModelConfig; kv_len: static window [0, kv_len) attended (causal mask).
    window: static; > 0 attends only keys at positions > query position - window (local layer).
    q_norm, k_norm: [H] RMSNorm scales applied to each query / key head before RoPE (QK-norm).

  Returns:
    (out [B, T, N H] before the output projection, cache_k, cache_v with [pos, pos + T) written).
  """
  cfg = config
  b, t, _ = qkv.shape
  n, k, g, h = cfg.n_heads, cfg.n_kv_heads, cfg.n_groups, cfg.head_dim
  dtype = qkv.dtype
  q = qkv[..., : n * h].reshape(b, t, n, h)  # [B, T, N, H]
  key = qkv[..., n * h:(n + k) * h].reshape(b, t, k, h)  # [B, T, K, H]
  value = qkv[..., (n + k) * h:].reshape(b, t, k, h)  # [B, T, K, H]
  if q_norm is not None:
    q = rms_norm(q, q_norm, cfg.rms_norm_eps)
    key = rms_norm(key, k_norm, cfg.rms_norm_eps)
  q = apply_rope(q, cos, sin, cfg.rope_style)
  key = apply_rope(key, cos, sin, cfg.rope_style)

  # Write this step's keys/values at [:, pos:pos+T], then read the window [0, kv_len).
  zero = jnp.zeros((), jnp.int32)
  pos = jnp.asarray(pos, jnp.int32)
  start = (zero, pos, zero, zero)
  cache_k = lax.dynamic_update_slice(cache_k, key.astype(cache_k.dtype), start)
  cache_v = lax.dynamic_update_slice(cache_v, value.astype(cache_v.dtype), start)
  keys = cache_k[:, :kv_len].astype(dtype)  # [B, S, K, H]
  values = cache_v[:, :kv_len].astype(dtype)  # [B, S, K, H]

  qg = q.reshape(b, t, k, g, h)  # [B, T, K, G, H]
  scores = jnp.einsum("BTKGH,BSKH->BKGTS", qg, keys,
                      preferred_element_type=jnp.float32) * cfg.attention_scale
  q_pos = pos + jnp.arange(t, dtype=jnp.int32)  # [T]
  k_pos = jnp.arange(kv_len, dtype=jnp.int32)  # [S]
  causal = k_pos[None, :] <= q_pos[:, None]  # [T, S]
  if window > 0:
    causal = causal & (k_pos[None, :] > q_pos[:, None] - window)
  scores = jnp.where(causal, scores, config_lib.MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype)  # [B, K, G, T, S]
  out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, values).reshape(b, t, n * h)
  return out, cache_k, cache_v


class Attention(nn.Module):
  """Grouped-query self-attention; reads and writes its layer's KV cache."""

  config: ModelConfig
  kv_len: int  # static: keys [0, kv_len) of the cache are attended (causal mask inside).
  window: int = 0  # static: > 0 for a sliding-window (local) layer.

  @nn.compact
  def __call__(self, x: jax.Array, cache_k: jax.Array, cache_v: jax.Array, pos: jax.Array,
               cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x: [B, T, D] normed input at positions pos + [0, T); cache_k, cache_v: [B, S, K, H].

    Returns the attention output [B, T, D] and the layer's cache with keys/values for
    positions [pos, pos + T) written.
    """
    cfg = self.config
    d = x.shape[-1]
    n, k, h = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    # One fused [D, (N + 2K) * H] projection: on XLA CPU one 2-D matmul reads weights ~3x
    # faster than three small 3-D einsums (BUILD_NOTES.md, "Layer loop").
    qkv = Einsum((d, (n + 2 * k) * h), "BTD,DE->BTE", name="qkv_proj")(x)  # [B, T, (N+2K)*H]
    if cfg.qkv_bias:
      qkv = qkv + self.param("qkv_bias", nn.initializers.zeros, (qkv.shape[-1],), qkv.dtype)
    q_norm = k_norm = None
    if cfg.qk_norm:
      q_norm = self.param("q_norm", lambda *_: {"scale": jnp.ones((h,), x.dtype)})["scale"]
      k_norm = self.param("k_norm", lambda *_: {"scale": jnp.ones((h,), x.dtype)})["scale"]
    out, cache_k, cache_v = attention_core(qkv, cache_k, cache_v, pos, cos, sin, config=cfg,
                                           kv_len=self.kv_len, window=self.window,
                                           q_norm=q_norm, k_norm=k_norm)
    y = Einsum((n * h, d), "BTE,ED->BTD", name="o_proj")(out)  # [B, T, D]
    return y, cache_k, cache_v


class FeedForward(nn.Module):
  """Gated FFN: down(act(gate x) * (up x)), family from the config."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """x: [B, T, D] -> [B, T, D]."""
    d, f = self.config.hidden_size, self.config.intermediate_size
    gate = Einsum((d, f), "BTD,DF->BTF", name="gate")(x)  # [B, T, F]
    up = Einsum((d, f), "BTD,DF->BTF", name="up")(x)  # [B, T, F]
    act = ffn_activation(gate, up, self.config.ffn_family)
    return Einsum((f, d), "BTF,FD->BTD", name="down")(act)


class Block(nn.Module):
  """One decoder layer: pre-norm x += attn(norm(x)); x += ffn(norm(x)), or "sandwich" (Gemma)
  x += post_norm(attn(norm(x))); x += post_norm(ffn(norm(x))).

  With `sparse` set (a `pijax.nn.hybrid.SparseSpec`), the FFN is the module its `make_ffn` returns:
  the hybrid one (predicted or oracle active neurons, hot on the device, cold on the host).
  """

  config: ModelConfig
  kv_len: int
  layer: int = 0
  sparse: Any = None

  @nn.compact
  def __call__(self, x: jax.Array, cache_k: jax.Array, cache_v: jax.Array, pos: jax.Array,
               cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x: [B, T, D]; cache_k, cache_v: this layer's [B, S, K, H]. Returns (x, k, v)."""
    cfg = self.config
    eps = cfg.rms_norm_eps
    sandwich = cfg.norm_placement == config_lib.NORM_SANDWICH
    window = cfg.sliding_window if cfg.is_local(self.layer) else 0
    h, cache_k, cache_v = Attention(cfg, self.kv_len, window, name="attn")(
        RMSNorm(eps, name="attn_norm")(x), cache_k, cache_v, pos, cos, sin)
    if sandwich:
      h = RMSNorm(eps, name="post_attn_norm")(h)
    x = x + h
    # The FFN-block input (residual stream before its norm): the predictors' input. Recorded
    # only when applied with mutable=["intermediates"] (the profiler); free otherwise.
    self.sow("intermediates", "ffn_input", x)
    h = RMSNorm(eps, name="ffn_norm")(x)
    if self.sparse is None:
      h = FeedForward(cfg, name="ffn")(h)
    else:
      h = self.sparse.make_ffn(cfg, self.layer, name="ffn")(x, h)
    if sandwich:
      h = RMSNorm(eps, name="post_ffn_norm")(h)
    return x + h, cache_k, cache_v


class Transformer(nn.Module):
  """Token ids -> logits, reading and updating an explicit KV cache.

  Attributes:
    config: the model's ModelConfig.
    kv_len: static number of cache positions attended (a bucket >= pos + T, <= max_seq_len).
  """

  config: ModelConfig
  kv_len: int
  sparse: Any = None  # pijax.nn.hybrid.SparseSpec for hybrid sparse FFNs; None = dense.

  @nn.compact
  def __call__(self, tokens: jax.Array, pos: jax.Array, cache: KVCache,
               logits_index: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
    """Runs the decoder.

    Args:
      tokens: i32[B, T] token ids at positions pos + [0, T).
      pos: i32[] position of tokens[:, 0].
      cache: KVCache with max_seq_len >= pos + T.
      logits_index: None for logits at every position, or i32[] selecting one position t
        (logits only for tokens[:, t], as prefill needs for the next token).

    Returns:
      logits: f32[B, T, V] (or f32[B, V] with logits_index), and the updated cache.
    """
    cfg = self.config
    embedding = Embed(cfg.vocab_size, cfg.hidden_size, name="embed")
    x = embedding.lookup(tokens)  # [B, T, D]
    if cfg.embedding_scale != 1.0:
      x = x * jnp.asarray(cfg.embedding_scale, x.dtype)
    t = tokens.shape[1]
    positions = jnp.broadcast_to(jnp.asarray(pos, jnp.int32) + jnp.arange(t, dtype=jnp.int32),
                                 tokens.shape)  # [B, T]
    angles = {}  # One cos/sin table per distinct RoPE (global and local layers may differ).
    pos = jnp.asarray(pos, jnp.int32)
    new_k, new_v = [], []
    for i in range(cfg.n_layers):
      key = cfg.rope_params(i)
      if key not in angles:
        angles[key] = rope_angles(positions, cfg, i)  # [B, T, R/2] each
      cos, sin = angles[key]
      x, k, v = Block(cfg, self.kv_len, i, self.sparse, name=f"layers_{i}")(
          x, cache.k[i], cache.v[i], pos, cos, sin)
      new_k.append(k)
      new_v.append(v)
    cache = KVCache(k=tuple(new_k), v=tuple(new_v))
    if logits_index is not None:
      x = lax.dynamic_index_in_dim(x, logits_index, axis=1, keepdims=False)  # [B, D]
    x = RMSNorm(cfg.rms_norm_eps, name="final_norm")(x)
    if cfg.tied_output:
      logits = embedding.attend(x)
    else:
      logits = Einsum((cfg.hidden_size, cfg.vocab_size), "...D,DV->...V", name="lm_head")(x)
    return logits.astype(jnp.float32), cache


class Embed(nn.Module):
  """Token embedding [V, D]; `attend` is the tied LM head (x @ embedding.T)."""

  vocab_size: int
  hidden_size: int

  def setup(self):
    self.embedding = self.param("embedding", nn.initializers.normal(1.0),
                                (self.vocab_size, self.hidden_size), jnp.float32)

  def lookup(self, tokens: jax.Array) -> jax.Array:
    """tokens: i32[B, T] -> [B, T, D]."""
    return jnp.take(self.embedding, tokens, axis=0)

  def attend(self, x: jax.Array) -> jax.Array:
    """x: [..., D] -> logits [..., V]."""
    return jnp.einsum("...D,VD->...V", x, self.embedding.astype(x.dtype))


def forward(params: Any, cache: KVCache, tokens: jax.Array, pos: jax.Array, *,
            config: ModelConfig, kv_len: int,
            logits_index: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
  """Pure function: `Transformer(config, kv_len).apply` on explicit params and cache."""
  return Transformer(config, kv_len).apply({"params": params}, tokens, pos, cache, logits_index)


def prefill(params: Any, cache: KVCache, tokens: jax.Array, length: jax.Array, *,
            config: ModelConfig, kv_len: int, pos: jax.Array | int = 0,
            all_logits: bool = False) -> tuple[jax.Array, KVCache]:
  """Processes a (right-padded) prompt and fills the KV cache; usable inside `jax.jit`.

  Args:
    params: param tree from `pijax.formats.loader.load_gguf`.
    cache: KVCache; positions [pos, pos + T) are overwritten.
    tokens: i32[B, T] prompt ids, right-padded to a bucket length T (padding is ignored:
      it only writes cache slots that later tokens overwrite before they are read).
    length: i32[] number of real tokens in each row.
    config: static ModelConfig.
    kv_len: static attention window, pos + T <= kv_len <= cache.max_seq_len.
    pos: position of tokens[:, 0] (0 for a fresh prompt).
    all_logits: static; True returns f32[B, T, V] for every position, else f32[B, V] for
      the last real token (tokens[:, length - 1]).

  Returns:
    (logits, cache).
  """
  index = None if all_logits else jnp.asarray(length, jnp.int32) - 1
  return forward(params, cache, tokens, jnp.asarray(pos, jnp.int32), config=config,
                 kv_len=kv_len, logits_index=index)


def ffn_inputs(params: Any, tokens: jax.Array, *, config: ModelConfig) -> jax.Array:
  """The residual stream entering every FFN block, for a fresh sequence; usable inside jit.

  Args:
    tokens: i32[B, T] ids at positions [0, T).

  Returns:
    f32[L, B, T, D]: layer l's FFN-block input (before ffn_norm).
  """
  b, t = tokens.shape
  cache = init_cache(config, b, t, jnp.float32)
  _, state = Transformer(config, t).apply(
      {"params": params}, tokens, jnp.zeros((), jnp.int32), cache,
      jnp.zeros((), jnp.int32), mutable=["intermediates"])
  inter = state["intermediates"]
  return jnp.stack([inter[f"layers_{i}"]["ffn_input"][0] for i in range(config.n_layers)])


def decode_step(params: Any, cache: KVCache, tokens: jax.Array, pos: jax.Array, *,
                config: ModelConfig, kv_len: int) -> tuple[jax.Array, KVCache]:
  """One decode step; usable inside `jax.jit` (donate `cache`).

  Args:
    tokens: i32[B] the latest token of each row, at position `pos` (i32[]).
    kv_len: static attention window, pos < kv_len <= cache.max_seq_len.

  Returns:
    logits f32[B, V] for the next token, and the cache with position `pos` written.
  """
  return forward(params, cache, tokens[:, None], pos, config=config, kv_len=kv_len,
                 logits_index=jnp.zeros((), jnp.int32))
