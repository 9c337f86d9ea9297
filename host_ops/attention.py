"""The non-matmul parts of a host decoder layer: RMSNorm, RoPE and grouped-query attention over
host KV caches (numba).

Attention takes a ragged batch: N tokens, token i of sequence slot `slots[i]` at position
`positions[i]` (decode steps of several sequences, a chunk of one prompt, or both in one pass).
Its keys and values are written to the cache at (slot, position) first, then each token
attends to positions [0, position] of its own slot (a sliding window: the last `window`), so a
token's result depends on its own sequence only: a sequence decodes the same alone or batched.
"""

from __future__ import annotations

import numba
import numpy as np

from host_ops import common


@numba.njit(**common.JIT)
def rms_norm(x, scale, eps):
  """x: f32[b, D] -> x / sqrt(mean(x^2) + eps) * scale (sum of squares in f64)."""
  out = np.empty_like(x)
  for r in range(x.shape[0]):
    ss = 0.0
    for j in range(x.shape[1]):
      ss += np.float64(x[r, j]) * np.float64(x[r, j])
    inv = np.float32(1.0 / np.sqrt(ss / x.shape[1] + eps))
    for j in range(x.shape[1]):
      out[r, j] = x[r, j] * inv * scale[j]
  return out


@numba.njit(inline="always", **common.JIT)
def _rope_head(src, dst, cos_t, sin_t, adjacent):
  """dst = src (one head, f32[H]) with its first R = 2 len(cos_t) dims rotated."""
  half = cos_t.shape[0]
  for j in range(src.shape[0]):
    dst[j] = src[j]
  for j in range(half):
    if adjacent:  # pairs (2j, 2j + 1): GGUF llama layout
      a, c = 2 * j, 2 * j + 1
    else:  # pairs (j, j + R/2): NeoX / Hugging Face layout
      a, c = j, j + half
    x0 = src[a]
    x1 = src[c]
    dst[a] = x0 * cos_t[j] - x1 * sin_t[j]
    dst[c] = x0 * sin_t[j] + x1 * cos_t[j]


@numba.njit(inline="always", **common.JIT)
def _head_norm(src, dst, scale, eps):
  """dst = RMSNorm(src) * scale over one head (f32[H]); a no-op copy when scale is empty."""
  if scale.shape[0] == 0:
    for j in range(src.shape[0]):
      dst[j] = src[j]
    return
  ss = 0.0
  for j in range(src.shape[0]):
    ss += np.float64(src[j]) * np.float64(src[j])
  inv = np.float32(1.0 / np.sqrt(ss / src.shape[0] + eps))
  for j in range(src.shape[0]):
    dst[j] = src[j] * inv * scale[j]


@numba.njit(parallel=True, **common.JIT_ORDERED)
def attention(qkv, cache_k, cache_v, slots, positions, cos, sin, adjacent, n_heads, n_kv, scale,
              window, q_norm, k_norm, eps):
  """Causal grouped-query attention for N new tokens, writing their keys and values first.

  qkv: f32[N, N_h + 2K, H] (q heads, then k, then v, before RoPE); cache_k, cache_v: f32[slots,
  S, K, H] (keys stored after RoPE); slots, positions: i64[N]; cos, sin: f32[N, R/2] (each
  token's RoPE angles); window: > 0 attends only positions > p - window; q_norm, k_norm: f32[H]
  RMSNorm scales applied to each head before RoPE (QK-norm), or empty arrays for none.
  Returns f32[N, N_h H]: softmax(q k^T * scale) v per head over the attended positions.
  """
  n, _, hd = qkv.shape
  group = n_heads // n_kv
  for job in numba.prange(n * n_kv):
    i = job // n_kv
    kv = job % n_kv
    s, p = slots[i], positions[i]
    kn = np.empty(hd, np.float32)
    _head_norm(qkv[i, n_heads + kv], kn, k_norm, eps)
    _rope_head(kn, cache_k[s, p, kv], cos[i], sin[i], adjacent)
    for j in range(hd):
      cache_v[s, p, kv, j] = qkv[i, n_heads + n_kv + kv, j]
  out = np.empty((n, n_heads * hd), np.float32)
  for job in numba.prange(n * n_heads):
    i = job // n_heads
    head = job % n_heads
    kv = head // group
    s, last = slots[i], positions[i]  # last: inclusive (causal)
    qn = np.empty(hd, np.float32)
    _head_norm(qkv[i, head], qn, q_norm, eps)
    q = np.empty(hd, np.float32)
    _rope_head(qn, q, cos[i], sin[i], adjacent)
    first = max(0, last - window + 1) if window > 0 else 0
    scores = np.empty(last + 1 - first, np.float32)
    top = np.float32(-np.inf)
    for t in range(first, last + 1):
      acc = common.dot_f32(q, cache_k[s, t, kv]) * scale
      scores[t - first] = acc
      top = max(top, acc)
    total = np.float32(0.0)
    for t in range(scores.shape[0]):
      e = np.exp(scores[t] - top)
      scores[t] = e
      total += e
    o = out[i, head * hd:(head + 1) * hd]
    for j in range(hd):
      o[j] = 0.0
    for t in range(first, last + 1):
      w = scores[t - first] / total
      vrow = cache_v[s, t, kv]
      for j in range(hd):
        o[j] += w * vrow[j]
  return out


def rope_tables(ropes, rope_dim: int, positions) -> tuple[np.ndarray, np.ndarray]:
  """cos, sin: f32[n, N, R/2] for each distinct RoPE (theta, position scale, frequency divisors)
  of `ropes` at positions i64[N] (RoFormer §3.4; as pijax.nn.transformer.rope_angles)."""
  half = rope_dim // 2
  pos = np.asarray(positions, np.float32)
  cos, sin = [], []
  for theta, scale, factors in ropes:
    inv_freq = np.float32(theta) ** (
        -np.arange(half, dtype=np.float32) * np.float32(2.0) / np.float32(rope_dim))
    if factors:
      inv_freq = inv_freq / np.asarray(factors, np.float32)
    angles = pos[:, None] / np.float32(scale) * inv_freq.astype(np.float32)
    cos.append(np.cos(angles).astype(np.float32))
    sin.append(np.sin(angles).astype(np.float32))
  return np.stack(cos), np.stack(sin)
