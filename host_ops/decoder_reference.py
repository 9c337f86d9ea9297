"""Float64 NumPy reference of the whole host decoder (`host_ops.decoder.HostDecoder`): the oracle
its numba layer loop (`host_ops.layers`) is tested against, on random weights and real files.

Apart from the decoder (STYLE.md: the reference is separate because it is the oracle); it reads a
decoder's public attributes and pooled matrices, and imports nothing of `host_ops.decoder`.
"""

from __future__ import annotations

import numpy as np

from host_ops import common
from host_ops import gated_ffn
from host_ops import pool as pool_lib
from host_ops import predicted_ffn
from host_ops import qmatmul
from host_ops import qpack_reference


def decoder_reference(dec, tokens, trace: dict | None = None) -> np.ndarray:
  """Float64 NumPy reference of `HostDecoder.forward` for one fresh sequence (positions 0..T-1).

  tokens: int[T]. Returns f32[T, V] logits. Dequantizes with `qmatmul.dequantize_reference`;
  with dec.dot "int8" every product's input is replaced by its quantized value as the kernel
  of that matrix reads it (`qpack_reference.x_hat_reference`: per 256 values for packed K-quants, per 32
  else; the head as `qmatmul.matmul_int8_reference`); RoPE and causal grouped-query attention
  written out from their definitions; with the gate-first FFN on (`enable_gated`), neurons whose
  gate fails the layer's cut are zeroed and the down projection uses the neuron-major rows
  (`gated_ffn_reference`); with the predicted FFN on (`enable_predicted`), the predictor's
  products as the pool computes them, then `predicted_ffn.predicted_ffn_reference` (the dense
  FFN with the unpredicted neurons' gates zeroed). dec: a `decoder.HostDecoder`; trace: a
  dict that gets each layer's predictor logits f64[T, F] as trace[layer] (predicted FFN on).
  """
  n, k, hd = dec.n_heads, dec.n_kv_heads, dec.head_dim
  tokens = np.asarray(tokens).reshape(-1)
  t = tokens.shape[0]
  half = dec.rope_dim // 2
  int8 = dec.dot == qmatmul.DOT_INT8

  def rope(x, layer):  # [T, heads, H]
    theta, scale, factors = dec.layer_rope[layer]
    inv_freq = theta ** (-np.arange(half) * 2.0 / dec.rope_dim)
    if factors:
      inv_freq = inv_freq / np.asarray(factors, np.float64)
    ang = np.arange(t)[:, None] / scale * inv_freq  # [T, R/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x = x.copy()
    if dec.rope_adjacent:
      a, c = x[..., 0:2 * half:2].copy(), x[..., 1:2 * half:2].copy()
      x[..., 0:2 * half:2], x[..., 1:2 * half:2] = a * cos - c * sin, a * sin + c * cos
    else:
      a, c = x[..., :half].copy(), x[..., half:2 * half].copy()
      x[..., :half], x[..., half:2 * half] = a * cos - c * sin, a * sin + c * cos
    return x

  def norm(x, scale):
    if scale is None:
      return x
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + dec.eps) * \
        np.asarray(scale, np.float64)

  def mm(role, x):  # A pooled role: each part's products as its kernel computes them.
    outs = []
    for p in role.parts:
      w = qmatmul.dequantize_reference(p.qmatrix())
      if int8 and p.kind not in (qmatmul.F16, qmatmul.BF16):
        xk = qpack_reference.x_hat_reference(p.kind if p.packed else qmatmul.Q4_0, x)
        outs.append(xk @ w.T)
      else:
        outs.append(np.asarray(x, np.float64) @ w.T)
    return np.concatenate(outs, axis=-1)

  def plain(w):  # A packed head / embedding as a QMatrix.
    return w.qmatrix() if isinstance(w, pool_lib.PackedMatrix) else w

  def head(x):
    if int8 and isinstance(dec.lm_head, pool_lib.PackedMatrix):
      w = qmatmul.dequantize_reference(dec.lm_head.qmatrix())
      return qpack_reference.x_hat_reference(dec.lm_head.kind, x) @ w.T
    if int8:
      return qmatmul.matmul_int8_reference(dec.lm_head, x.astype(np.float32)).astype(np.float64)
    return x @ qmatmul.dequantize_reference(plain(dec.lm_head)).T

  x = qmatmul.dequantize_reference(plain(dec.embedding))[tokens] * dec.embedding_scale
  for li, layer in enumerate(dec.layers):
    qkv = mm(layer.qkv, norm(x, layer.attn_norm))
    if layer.qkv_bias is not None:
      qkv = qkv + layer.qkv_bias
    qkv = qkv.reshape(t, n + 2 * k, hd)
    q, key, val = norm(qkv[:, :n], layer.q_norm), norm(qkv[:, n:n + k], layer.k_norm), \
        qkv[:, n + k:]
    q, key = rope(q, li), rope(key, li)
    key, val = np.repeat(key, n // k, axis=1), np.repeat(val, n // k, axis=1)  # [T, N, H]
    scores = np.einsum("tnh,snh->nts", q, key) * dec.attn_scale
    qpos, kpos = np.arange(t)[:, None], np.arange(t)[None, :]
    seen_mask = kpos <= qpos
    if dec.windows[li] > 0:
      seen_mask &= kpos > qpos - dec.windows[li]
    scores = np.where(seen_mask, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    attn = np.einsum("nts,snh->tnh", p, val).reshape(t, n * hd)
    x = x + norm(mm(layer.attn_out, attn), layer.post_attn_norm)
    h = norm(x, layer.ffn_norm)
    if dec.thresholds is not None:
      fc1, fc2 = dec.predictor_roles[li]
      logits = mm(fc2, np.maximum(mm(fc1, x).astype(np.float32), 0.0))
      if trace is not None:
        trace[li] = logits
      y = predicted_ffn.predicted_ffn_reference(
          x, h, None, None, dec.thresholds[li], layer.gate.parts[0].qmatrix(),
          layer.up.parts[0].qmatrix(), dec.down_rows[li], family=dec.family, dot=dec.dot,
          logits=logits)[0]
    elif dec.gate_cuts is None:
      a = common.activation_reference(mm(layer.gate, h), mm(layer.up, h), dec.family)
      y = mm(layer.down, a)
    else:
      y = gated_ffn.gated_ffn_reference(mm(layer.gate, h), h, layer.up.parts[0].qmatrix(),
                                        dec.down_rows[li], cut=dec.gate_cuts[li],
                                        family=dec.family, dot=dec.dot,
                                        contribution_cut=0.0 if dec.contribution_cuts is None
                                        else dec.contribution_cuts[li])[0]
    x = x + norm(y, layer.post_ffn_norm)
  return head(norm(x, dec.final_norm)).astype(np.float32)
