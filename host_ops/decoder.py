"""A whole decoder on the host: weights in quantized blocks, KV caches in host RAM (numba).

A CPU decode step reads every weight once per token, so its speed is the speed at which weights
are read; here the weights stay in llama.cpp's block formats (`host_ops.qmatmul`, 4-8 bits per
weight instead of f32).
The whole forward pass (embedding, every layer with its RoPE, attention and KV cache, the LM
head) is one host call, so only token ids and logits cross a JAX callback: a callback per layer,
or a KV cache copied through one, costs more than the matmuls (BUILD_NOTES.md, issue 5).
Within the call, every layer runs inside one compiled function (`_layers_kernel`) when all layers
share their weight formats (the usual case), saving ~8 Python->numba calls per layer.

Arithmetic: the f32 dense model's, on the same weight values: a Q4_1 GGUF kept as Q4_1 gives
the logits of the f32 path up to summation order.

State is explicit: `HostDecoder.new_cache` returns a `HostKVCache` that the caller owns and passes
to every `forward`; one decoder serves any number of sequences, each with its own cache.

Layout per STYLE.md: numba kernels (norm, activation, RoPE + attention; matmuls in
`host_ops.qmatmul`) -> HostDecoder (validates) -> `decoder_reference` (float64 NumPy, whole model).
"""

from __future__ import annotations

import dataclasses
import mmap

import numba
import numpy as np
from numba import extending as numba_extending

from host_ops import _common
from host_ops import gated_ffn as gated_lib
from host_ops import qdot
from host_ops import qmatmul
from host_ops._common import HostOpError


@dataclasses.dataclass
class HostLayer:
  """One decoder layer's host weights.

  attn_norm, ffn_norm: f32[D]; qkv: [(N + 2K) H, D] (q | k | v rows); attn_out: [D, N H];
  gate, up: [F, D]; down: [D, F] (QMatrix, or a `qconcat.RowConcat` of several formats; rows =
  outputs, as GGUF stores them). Family extras, None when absent: qkv_bias f32[(N + 2K) H]
  (Qwen2); q_norm, k_norm f32[H] (QK-norm: Qwen3, Gemma 3); post_attn_norm, post_ffn_norm
  f32[D] (Gemma's sandwich norms on each sub-block's output).
  """

  attn_norm: np.ndarray
  qkv: qmatmul.QMatrix
  attn_out: qmatmul.QMatrix
  ffn_norm: np.ndarray
  gate: qmatmul.QMatrix
  up: qmatmul.QMatrix
  down: qmatmul.QMatrix
  qkv_bias: np.ndarray | None = None
  q_norm: np.ndarray | None = None
  k_norm: np.ndarray | None = None
  post_attn_norm: np.ndarray | None = None
  post_ffn_norm: np.ndarray | None = None

  def matrices(self) -> tuple[qmatmul.QMatrix, ...]:
    return (self.qkv, self.attn_out, self.gate, self.up, self.down)


def _lazy_zeros(shape: tuple[int, ...]) -> np.ndarray:
  """f32 zeros whose 4 KiB pages become resident only when written (an anonymous map). numpy
  asks for 2 MiB transparent huge pages on large arrays, so a KV cache written at a few
  positions per layer was resident in full (94 MB for SmolLM2 at 2048 tokens)."""
  n = int(np.prod(shape))
  return np.frombuffer(mmap.mmap(-1, max(4 * n, 1)), np.float32, count=n).reshape(shape)


@dataclasses.dataclass
class HostKVCache:
  """One sequence batch's keys and values on the host.

  k, v: f32[L, batch, max_seq_len, n_kv_heads, head_dim]; keys are stored after RoPE.
  """

  k: np.ndarray
  v: np.ndarray

  @property
  def batch(self) -> int:
    return self.k.shape[1]

  @property
  def max_seq_len(self) -> int:
    return self.k.shape[2]

  @property
  def nbytes(self) -> int:
    """Bytes held by keys and values."""
    return self.k.nbytes + self.v.nbytes


@numba.njit(**_common._JIT)
def _rms_norm_kernel(x, scale, eps):
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


@numba.njit(**_common._JIT)
def _activation_kernel(g, u, code):
  """act(g, u) elementwise for the FFN family `code`; g, u: f32[b, F]."""
  out = np.empty_like(g)
  for r in range(g.shape[0]):
    for j in range(g.shape[1]):
      out[r, j] = _common.activation(g[r, j], u[r, j], code)
  return out


@numba.njit(**_common._JIT)
def _gate_activation(g, code):
  """act_gate(g): silu(g) (SwiGLU) or relu(g) (ReGLU, dReLU), elementwise over f32[b, F]."""
  out = np.empty_like(g)
  for r in range(g.shape[0]):
    for j in range(g.shape[1]):
      out[r, j] = _common.activation(g[r, j], np.float32(1.0), 0 if code == 0 else 1)
  return out


@numba.njit(inline="always", **_common._JIT)
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


@numba.njit(inline="always", **_common._JIT)
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


@numba.njit(parallel=True, **_common._JIT_ORDERED)
def _attention_kernel(qkv, cache_k, cache_v, pos, cos, sin, adjacent, n_heads, n_kv, scale,
                      window, q_norm, k_norm, eps):
  """Causal grouped-query attention for t new tokens, writing their keys/values to the cache.

  qkv: f32[b, t, N + 2K, H] (q heads, then k, then v, before RoPE); cache_k, cache_v:
  f32[b, S, K, H] (positions < pos already filled); cos, sin: f32[t, R/2]; window: > 0 attends
  only positions > p - window (sliding-window layer); q_norm, k_norm: f32[H] RMSNorm scales
  applied to each head before RoPE (QK-norm), or empty arrays for none.
  Returns f32[b t, N H]: softmax(q k^T * scale) v per head over the attended positions.
  """
  b, t, _, hd = qkv.shape
  group = n_heads // n_kv
  for job in numba.prange(b * t * n_kv):  # Write this chunk's rotated keys and values.
    r = job // (t * n_kv)
    i = (job // n_kv) % t
    kv = job % n_kv
    kn = np.empty(hd, np.float32)
    _head_norm(qkv[r, i, n_heads + kv], kn, k_norm, eps)
    _rope_head(kn, cache_k[r, pos + i, kv], cos[i], sin[i], adjacent)
    for j in range(hd):
      cache_v[r, pos + i, kv, j] = qkv[r, i, n_heads + n_kv + kv, j]
  out = np.empty((b * t, n_heads * hd), np.float32)
  for job in numba.prange(b * t * n_heads):
    r = job // (t * n_heads)
    i = (job // n_heads) % t
    head = job % n_heads
    kv = head // group
    qn = np.empty(hd, np.float32)
    _head_norm(qkv[r, i, head], qn, q_norm, eps)
    q = np.empty(hd, np.float32)
    _rope_head(qn, q, cos[i], sin[i], adjacent)
    last = pos + i  # inclusive: causal
    first = max(0, last - window + 1) if window > 0 else 0
    scores = np.empty(last + 1 - first, np.float32)
    top = np.float32(-np.inf)
    for s in range(first, last + 1):
      acc = _common.dot_f32(q, cache_k[r, s, kv]) * scale
      scores[s - first] = acc
      top = max(top, acc)
    total = np.float32(0.0)
    for s in range(scores.shape[0]):
      e = np.exp(scores[s] - top)
      scores[s] = e
      total += e
    o = out[r * t + i, head * hd:(head + 1) * hd]
    for j in range(hd):
      o[j] = 0.0
    for s in range(first, last + 1):
      w = scores[s - first] / total
      vrow = cache_v[r, s, kv]
      for j in range(hd):
        o[j] += w * vrow[j]
  return out


def _layer_matmul(w, i, x, out, int8):
  """out = x @ W_i.T for layer i of a stacked matrix w (numba only; see the overload below)."""
  raise NotImplementedError("_layer_matmul runs inside numba-compiled code only")


@numba_extending.overload(_layer_matmul, jit_options=_common._JIT)
def _layer_matmul_overload(w, i, x, out, int8):
  """Picks the kernel from w's type: (qs, d, m) stacked Q4_1 or (q, d) stacked Q8_0, each
  [L, n, ...]; for <= GEMV_MAX_ROWS rows of x the integer gemv (int8 true, where qdot runs) or
  the f32 one, the tiled product above (the same choice and kernels as `QMatrix.matmul`). The
  integer kernels are only referenced where qdot.AVAILABLE, so other CPUs never compile them."""
  if len(w) == 3:
    def q4_1(w, i, x, out, int8):
      if x.shape[0] > qmatmul.GEMV_MAX_ROWS:
        qmatmul._gemm_q4_1_kernel(w[0][i], w[1][i], w[2][i], x, out)
      elif int8:
        qdot.gemv_q4_1(w[0][i], w[1][i], w[2][i], x, out)
      else:
        qmatmul._gemv_q4_1_kernel(w[0][i], w[1][i], w[2][i], x, out)

    def q4_1_f32(w, i, x, out, int8):
      if x.shape[0] > qmatmul.GEMV_MAX_ROWS:
        qmatmul._gemm_q4_1_kernel(w[0][i], w[1][i], w[2][i], x, out)
      else:
        qmatmul._gemv_q4_1_kernel(w[0][i], w[1][i], w[2][i], x, out)
    return q4_1 if qdot.AVAILABLE else q4_1_f32

  def q8_0(w, i, x, out, int8):
    if x.shape[0] > qmatmul.GEMV_MAX_ROWS:
      qmatmul._gemm_q8_0_kernel(w[0][i], w[1][i], x, out)
    elif int8:
      qdot.gemv_q8_0(w[0][i], w[1][i], x, out)
    else:
      qmatmul._gemv_q8_0_kernel(w[0][i], w[1][i], x, out)

  def q8_0_f32(w, i, x, out, int8):
    if x.shape[0] > qmatmul.GEMV_MAX_ROWS:
      qmatmul._gemm_q8_0_kernel(w[0][i], w[1][i], x, out)
    else:
      qmatmul._gemv_q8_0_kernel(w[0][i], w[1][i], x, out)
  return q8_0 if qdot.AVAILABLE else q8_0_f32


# What `_layers_kernel` times per layer when asked (`HostDecoder.phase_cycles`): the attention
# norm and q/k/v matmul, attention, the output matmul with the residual and the FFN norm, the
# gate matmul, then up and down: the matmuls (dense) or the gate-first up and down passes, down
# with the FFN's residual (and post-norm).
PHASES = ("qkv", "attention", "attn_out", "gate", "up", "down")
# Placeholder when nothing is timed.
_NO_PHASES = np.zeros((0, len(PHASES)), np.int64)


@numba.njit(inline="always", **_common._JIT)
def _stamp(phases, i, k, t_prev):
  """Adds the cycles since t_prev to phases[i, k] and returns now (nothing when phases is
  empty)."""
  if phases.shape[0] == 0:
    return t_prev
  now = _common.cycle_counter()
  phases[i, k] += now - t_prev
  return now


def _layer_gated(up_w, i, g, h, dt, cuts, code, n_threads, int8, phases, t_prev):
  """(y, active, passed, t) of the gate-first FFN of layer i, its up pass timed into phases
  (`_stamp`) from t_prev, t the up pass's end (numba only; see the overload below)."""
  raise NotImplementedError("_layer_gated runs inside numba-compiled code only")


@numba_extending.overload(_layer_gated, jit_options=_common._JIT)
def _layer_gated_overload(up_w, i, g, h, dt, cuts, code, n_threads, int8, phases, t_prev):
  """`gated_ffn.gated_ffn`'s kernel for stacked up rows (Q4_1 (qs, d, m) or Q8_0 (q, d), each
  [L, F, ...]: separate C arrays, or views into one record per row, `_build_up_records`: each
  row contiguous, rows R bytes apart) and stacked neuron-major down rows dt: Q8_0 (i8[L, F, D],
  u16[L, F, D/32]) or Q4_1 (u8[L, F, D/2], u16[L, F, D/32] twice); the integer kernel only
  where qdot.AVAILABLE."""
  block = np.int64(qmatmul.BLOCK)
  q4 = len(up_w) == 3
  m = 2 if q4 else 1  # Q8_0: its scales stand in for the offsets, never read.
  if len(dt) == 3:
    layer_dt = lambda dt, i: (dt[0][i], dt[1][i], dt[2][i])  # noqa: E731
  else:
    layer_dt = lambda dt, i: (dt[0][i], dt[1][i])  # noqa: E731
  layer_dt = numba.njit(inline="always", **_common._JIT)(layer_dt)
  if not qdot.AVAILABLE:
    def f32_only(up_w, i, g, h, dt, cuts, code, n_threads, int8, phases, t_prev):
      acts, passed = gated_lib._up_pass(g, h, up_w[0][i], up_w[1][i], up_w[m][i], cuts, code,
                                        n_threads, q4)
      t_prev = _stamp(phases, i, 4, t_prev)
      y, counts = gated_lib._down_pass(acts, layer_dt(dt, i), n_threads, block, False)
      return y, counts, passed, t_prev
    return f32_only

  def impl(up_w, i, g, h, dt, cuts, code, n_threads, int8, phases, t_prev):
    # `_gated_int8_kernel` / `_gated_kernel` inlined, timed per pass (PHASES "up", "down").
    if int8:
      acts, passed = gated_lib._up_pass_int8(g, h, up_w[0][i], up_w[1][i], up_w[m][i], cuts,
                                             code, n_threads, q4)
    else:
      acts, passed = gated_lib._up_pass(g, h, up_w[0][i], up_w[1][i], up_w[m][i], cuts, code,
                                        n_threads, q4)
    t_prev = _stamp(phases, i, 4, t_prev)
    y, counts = gated_lib._down_pass(acts, layer_dt(dt, i), n_threads, block, int8)
    return y, counts, passed, t_prev
  return impl


@numba.njit(**_common._JIT)
def _layers_kernel(x, b, t, attn_norms, ffn_norms, qkv_w, out_w, gate_w, up_w, down_w, extras,
                   cache_k, cache_v, pos, cos, sin, rope_of, windows, adjacent, n_heads, n_kv,
                   head_dim, scale, eps, code, int8, cuts, dt, active, passed, n_threads,
                   phases):
  """Every layer of the decoder in one compiled call (the same kernels, in the same order, as
  `HostDecoder.forward`'s per-layer loop, so the same result bit for bit, without ~8 Python
  calls per layer). x: f32[b t, D] embeddings -> f32[b t, D] after the last layer.
  Weights: stacked per role ([L, ...] arrays, `_layer_matmul`; with the gate-first FFN of ReLU
  families the up rows may be record views, `HostDecoder._build_up_records`); norms f32[L, D];
  extras:
  (qkv_bias f32[L, E], q_norm, k_norm f32[L, H], post_attn_norm, post_ffn_norm f32[L, D]), each
  [L, 0] when the family has none; cache_k, cache_v: f32[L, b, S, K, H]; cos, sin: f32[n, t, R/2]
  RoPE tables, layer i using table rope_of[i]; windows: i64[L] (0: global attention).
  Gate-first FFN (`gated_ffn`) when cuts (f32[L, 2]: gate, contribution) is not empty: down
  rows neuron-major in dt ([L, F, ...] Q8_0 or Q4_1 arrays); layer i's fraction of neurons
  computed (down rows read) is written to active[i], of neurons whose gate passed (up rows
  read) to passed[i]. phases: i64[L, len(PHASES)] gets each layer's cycles per phase added
  (`_common.cycle_counter`), or [0, len(PHASES)]: nothing timed.
  (numba's disk cache keys it on every host_ops source, not on decoder.py only:
  `host_ops._cache`.)"""
  rows = x.shape[0]
  qkv_bias, q_norms, k_norms, post_attn, post_ffn = extras
  qkv = np.empty((rows, (n_heads + 2 * n_kv) * head_dim), np.float32)
  attn_proj = np.empty_like(x)
  ffn = np.empty_like(x)
  f = gate_w[0].shape[1]
  g = np.empty((rows, f), np.float32)
  u = np.empty((rows, f), np.float32)
  t_prev = _common.cycle_counter() if phases.shape[0] else 0
  for i in range(attn_norms.shape[0]):
    _layer_matmul(qkv_w, i, _rms_norm_kernel(x, attn_norms[i], eps), qkv, int8)
    if qkv_bias.shape[1]:
      for r in range(rows):
        qkv[r] += qkv_bias[i]
    t_prev = _stamp(phases, i, 0, t_prev)
    attn = _attention_kernel(qkv.reshape(b, t, n_heads + 2 * n_kv, head_dim), cache_k[i],
                             cache_v[i], pos, cos[rope_of[i]], sin[rope_of[i]], adjacent, n_heads,
                             n_kv, scale, windows[i], q_norms[i], k_norms[i], eps)
    t_prev = _stamp(phases, i, 1, t_prev)
    _layer_matmul(out_w, i, attn, attn_proj, int8)
    if post_attn.shape[1]:
      x = x + _rms_norm_kernel(attn_proj, post_attn[i], eps)
    else:
      x = x + attn_proj
    h = _rms_norm_kernel(x, ffn_norms[i], eps)
    t_prev = _stamp(phases, i, 2, t_prev)
    _layer_matmul(gate_w, i, h, g, int8)
    t_prev = _stamp(phases, i, 3, t_prev)
    if cuts.shape[0]:
      ffn, counts, passed_i, t_prev = _layer_gated(up_w, i, g, h, dt, cuts[i], code, n_threads,
                                                   int8, phases, t_prev)
      active[i] = counts.sum() / (rows * f)
      passed[i] = passed_i.sum() / (rows * f)
    else:
      _layer_matmul(up_w, i, h, u, int8)
      t_prev = _stamp(phases, i, 4, t_prev)
      _layer_matmul(down_w, i, _activation_kernel(g, u, code), ffn, int8)
    if post_ffn.shape[1]:
      x = x + _rms_norm_kernel(ffn, post_ffn[i], eps)
    else:
      x = x + ffn
    t_prev = _stamp(phases, i, 5, t_prev)
  return x


# Placeholder neuron-major down rows for `_layers_kernel` when the gate-first FFN is off.
_NO_DOWN_T = (np.zeros((0, 0, qmatmul.BLOCK), np.int8), np.zeros((0, 0, 1), np.uint16))


class HostDecoder:
  """A whole decoder's weights on the host (see the module docstring for the call sequence).

  Args:
    embedding: [V, D] QMatrix (token embedding rows).
    layers: HostLayer per layer.
    final_norm: f32[D].
    lm_head: [V, D] QMatrix (the embedding itself when the model ties them).
    eps: RMSNorm epsilon; family: FFN family ("swiglu" | "reglu" | "drelu" | "geglu").
    rope_freq_factors: R/2 divisors of RoPE's inverse frequencies (LLaMA-3.1), or ().
    layer_rope: per layer (theta, position scale, factors), overriding the three above (Gemma 3's
      local layers have their own base); None = every layer the same.
    windows: per layer, the sliding window in tokens (0 = global); None = all global.
    attn_scale: the factor on q . k (None = head_dim ** -0.5).
    embedding_scale: the token embeddings are multiplied by it (Gemma: sqrt(hidden_size)).
    dot: "int8" (decode products quantize activations per block and sum integers, as
      llama.cpp; `host_ops.qdot`) or "f32" (the f32 dense path's values up to summation order).
      `self.dot` holds what runs: "f32" where qdot.AVAILABLE is False.

  Raises:
    HostOpError: inconsistent shapes or an unknown family.
  """

  def __init__(self, embedding: qmatmul.QMatrix, layers: list[HostLayer],
               final_norm: np.ndarray, lm_head: qmatmul.QMatrix, *, eps: float, family: str,
               n_heads: int, n_kv_heads: int, head_dim: int, rope_theta: float, rope_dim: int,
               rope_scale: float = 1.0, rope_adjacent: bool = True,
               rope_freq_factors: tuple[float, ...] = (), layer_rope=None, windows=None,
               attn_scale: float | None = None, embedding_scale: float = 1.0,
               dot: str = qmatmul.DOT_INT8):
    if dot not in qmatmul.DOTS:
      raise HostOpError(f"dot must be one of {', '.join(qmatmul.DOTS)}, got {dot!r}")
    self.dot = dot if qdot.AVAILABLE else qmatmul.DOT_F32
    self.code = _common.family_code(family)
    if n_heads % n_kv_heads or rope_dim > head_dim or rope_dim % 2:
      raise HostOpError(f"bad attention shape: {n_heads} heads, {n_kv_heads} KV heads, head_dim "
                        f"{head_dim}, rope_dim {rope_dim}")
    self.n_heads, self.n_kv_heads, self.head_dim = int(n_heads), int(n_kv_heads), int(head_dim)
    self.rope_theta, self.rope_dim = float(rope_theta), int(rope_dim)
    self.rope_scale, self.rope_adjacent = float(rope_scale), bool(rope_adjacent)
    n_layers = len(layers)
    default_rope = (self.rope_theta, self.rope_scale, tuple(float(f) for f in rope_freq_factors))
    self.layer_rope = [tuple(r) for r in layer_rope] if layer_rope is not None else \
        [default_rope] * n_layers
    self.windows = np.asarray(windows if windows is not None else [0] * n_layers, np.int64)
    if len(self.layer_rope) != n_layers or self.windows.shape != (n_layers,) or \
        (self.windows < 0).any() or any(len(r[2]) not in (0, rope_dim // 2)
                                         for r in self.layer_rope):
      raise HostOpError(f"layer_rope / windows need one entry per layer ({n_layers}), windows "
                        f">= 0, factors of length {rope_dim // 2}")
    # Distinct RoPE tables and which one each layer uses.
    self._ropes = sorted(set(self.layer_rope))
    self._rope_of = np.asarray([self._ropes.index(r) for r in self.layer_rope], np.int64)
    self.attn_scale = float(attn_scale) if attn_scale else float(head_dim) ** -0.5
    self.embedding_scale = float(embedding_scale)
    self.gate_cuts = None  # Per-layer cuts when the gate-first sparse FFN is on (enable_gated).
    self.contribution_cuts = None  # Per-layer |act| cuts of the down rows (None: all 0).
    self._down_t = None  # Per-layer neuron-major down rows for it (Q8_0 or Q4_1).
    self._stacked_down_t = None  # The same rows stacked [L, F, ...] for `_layers_kernel`.
    self._up_records = None  # ReLU families' gate-first up rows as records (`_build_up_records`).
    self._record = None  # Calibration: per-layer lists of |act_gate(g)| (calibrate_gate_cuts).
    self._record_contribution = False  # ... or of |act(g, u)|.
    self.last_active = np.ones(len(layers), np.float32)  # Active FFN fraction, last forward.
    self.last_passed = np.ones(len(layers), np.float32)  # Gate-passed fraction (up rows read).
    # Sums over gate-first forward passes of mean(last_active), mean(last_passed): the up rows
    # read per computed neuron, for the bytes per token (`ffn_bytes_per_token`).
    self.read_sums = np.zeros(2)
    # i64[L, len(PHASES)]: when set, the one-call layer loop adds each layer's cycles per phase
    # (`_layers_kernel`; the per-layer loop times nothing). None: nothing timed.
    self.phase_cycles = None
    self.family = family
    self.eps = float(eps)
    self.embedding = embedding
    self.layers = list(layers)
    self.final_norm = np.ascontiguousarray(final_norm, np.float32)
    self.lm_head = lm_head
    d = embedding.shape[1]
    self.hidden_size = d
    if not self.layers:
      raise HostOpError("a host decoder needs at least one layer")
    for i, layer in enumerate(self.layers):
      f = layer.gate.shape[0]
      want = {"qkv": ((n_heads + 2 * n_kv_heads) * head_dim, d),
              "attn_out": (d, n_heads * head_dim),
              "gate": (f, d), "up": (f, d), "down": (d, f)}
      for name, shape in want.items():
        if getattr(layer, name).shape != shape:
          raise HostOpError(f"layer {i}: {name} has shape {getattr(layer, name).shape}, "
                            f"expected {shape}")
      for name in ("attn_norm", "ffn_norm"):
        setattr(layer, name, np.ascontiguousarray(getattr(layer, name), np.float32))
        if getattr(layer, name).shape != (d,):
          raise HostOpError(f"layer {i}: {name} must be f32[{d}]")
      extras = {"qkv_bias": ((n_heads + 2 * n_kv_heads) * head_dim,), "q_norm": (head_dim,),
                "k_norm": (head_dim,), "post_attn_norm": (d,), "post_ffn_norm": (d,)}
      for name, shape in extras.items():
        if getattr(layer, name) is not None:
          setattr(layer, name, np.ascontiguousarray(getattr(layer, name), np.float32))
          if getattr(layer, name).shape != shape:
            raise HostOpError(f"layer {i}: {name} must be f32{list(shape)}")
        if (getattr(layer, name) is None) != (getattr(self.layers[0], name) is None):
          raise HostOpError(f"layer {i}: {name} must be given for every layer or none")
    if (self.layers[0].q_norm is None) != (self.layers[0].k_norm is None) or \
        (self.layers[0].post_attn_norm is None) != (self.layers[0].post_ffn_norm is None):
      raise HostOpError("q_norm and k_norm (and post_attn_norm and post_ffn_norm) come together")
    if lm_head.shape[1] != d or self.final_norm.shape != (d,):
      raise HostOpError(f"lm_head {lm_head.shape} / final_norm {self.final_norm.shape} do not "
                        f"match hidden size {d}")
    self._stacked = self._stack_layers()
    self._layer_extras = [self._extras_of(layer) for layer in self.layers]  # Once, not per token.

  _ROLES = ("qkv", "attn_out", "gate", "up", "down")

  _EXTRAS = ("qkv_bias", "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm")

  def _extras_of(self, layer: HostLayer) -> tuple[np.ndarray, ...]:
    """The layer's family extras for the kernels: f32 arrays, empty where absent."""
    return tuple(np.zeros(0, np.float32) if getattr(layer, n) is None else getattr(layer, n)
                 for n in self._EXTRAS)

  def _stack_layers(self):
    """The layers' weights stacked per role for `_layers_kernel`: (attn_norms, ffn_norms: f32[L, D],
    then per role a tuple of [L, ...] arrays, then the extras f32[L, *]); each layer's QMatrix
    then views its slice, so nothing is held twice. None (the per-layer loop runs) when a
    role's format or shape differs between layers, or is not one the kernel reads (Q4_1, Q8_0)."""
    for role in self._ROLES:
      kinds = {(getattr(layer, role).kind, getattr(layer, role).shape) for layer in self.layers}
      if len(kinds) != 1 or next(iter(kinds))[0] not in (qmatmul.Q4_1, qmatmul.Q8_0):
        return None
    stacked = [np.stack([layer.attn_norm for layer in self.layers]),
               np.stack([layer.ffn_norm for layer in self.layers])]
    for role in self._ROLES:  # One role at a time: the old copy of a role is freed as we go.
      kind = getattr(self.layers[0], role).kind
      arrays = tuple(_common.stack_aligned(parts) for parts in
                     zip(*(getattr(layer, role).arrays for layer in self.layers)))
      for i, layer in enumerate(self.layers):
        setattr(layer, role, qmatmul.QMatrix(kind, tuple(a[i] for a in arrays)))
      stacked.append(arrays)
    for i, layer in enumerate(self.layers):
      layer.attn_norm, layer.ffn_norm = stacked[0][i], stacked[1][i]
    stacked.append(tuple(np.stack(parts) for parts in
                         zip(*(self._extras_of(layer) for layer in self.layers))))
    return tuple(stacked)

  @property
  def n_layers(self) -> int:
    return len(self.layers)

  @property
  def qkv_size(self) -> int:
    return self.layers[0].qkv.shape[0]

  @property
  def vocab_size(self) -> int:
    return self.lm_head.shape[0]

  def bytes_per_token(self, active_fraction: float | None = None) -> int:
    """Weight bytes one decode token reads, in GGUF block bytes (f16 scales): the attention
    matrices, the FFN (`ffn_bytes_per_token`) and the LM head (the embedding lookup reads one
    row, not counted)."""
    attn = sum(w.file_bytes() for layer in self.layers for w in (layer.qkv, layer.attn_out))
    return attn + self.ffn_bytes_per_token(active_fraction) + self.lm_head.file_bytes()

  def nbytes(self) -> int:
    """Host bytes held (codes, f16 scales, norms; a tied head counted once), plus the sparse
    FFN's copies once built (`sparse_nbytes`)."""
    mats = [w for layer in self.layers for w in layer.matrices()] + [self.embedding]
    if self.lm_head is not self.embedding:
      mats.append(self.lm_head)
    return (sum(w.nbytes for w in mats) + 4 * self.hidden_size * (2 * self.n_layers + 1)
            + self.sparse_nbytes())

  def sparse_nbytes(self) -> int:
    """Bytes of the gate-first FFN's own copies (`enable_gated`): the neuron-major down rows
    and ReLU families' up records; 0 before they are built. Held while the sparse FFN is off."""
    if self._stacked_down_t is not None:
      held = sum(a.nbytes for a in self._stacked_down_t)
    else:
      held = sum(w.nbytes for w in self._down_t or ())
    if self._up_records is not None:  # Views into one u8[L, F, R] buffer, R the row stride.
      first = self._up_records[0]
      held += first.shape[0] * first.shape[1] * first.strides[1]
    return int(held)

  # ------------------------------------------------------------------------- KV cache
  def new_cache(self, batch: int, max_seq_len: int) -> HostKVCache:
    """A zeroed host KV cache for `batch` rows of `max_seq_len` tokens (the caller owns it)."""
    if batch < 1 or max_seq_len < 1:
      raise HostOpError(f"a KV cache needs batch >= 1 and max_seq_len >= 1, got {batch}, "
                        f"{max_seq_len}")
    shape = (self.n_layers, int(batch), int(max_seq_len), self.n_kv_heads, self.head_dim)
    return HostKVCache(_lazy_zeros(shape), _lazy_zeros(shape))

  # ------------------------------------------------------------------------- sparsity
  def enable_gated(self, cuts, down_format: str | None = None,
                   contribution_cuts=None) -> None:
    """Turns on the gate-first sparse FFN (`host_ops.gated_ffn`) with per-layer cuts
    (float[L], >= 0; ReLU families skip exactly g <= 0 whatever the cut), or off with None.

    contribution_cuts: float[L] >= 0, or None (zeros): a neuron that passes the gate keeps its
    down row only if |act(g, u)| reaches its layer's cut (`gated_ffn`'s contribution_cut).

    down_format: the neuron-major down rows: "file", a Q4_1 file's own blocks transposed,
    nothing rounded again (`gated_ffn.FileDownRows`: 0.5 bytes/weight per active neuron plus
    0.125 for the scales; HostOpError for other down formats); or re-quantized from the
    file's values, "q8_0" (1.0625 bytes/weight; SmolLM2 Q4_1 perplexity 27.09 against 26.99
    dense) or "q4_1" (0.625, but a second 4-bit rounding: 28.45; BUILD_NOTES.md, issue 11).
    None: "file" where every layer's down projection is Q4_1, else "q8_0". Built on first use and when the format changes; the old rows
    are dropped first (never both held), so if building fails the sparse FFN is left off.
    Memory: these down rows are a second copy of down; ReLU families' stacked layers also get a
    record copy of up (`_build_up_records`). Both stay held when the sparse FFN is turned off
    (the bench toggles it); `nbytes` counts both (`sparse_nbytes`).

    Raises:
      HostOpError: cuts of the wrong count or value, an unknown format, a GeGLU model.
    """
    if down_format is None:  # The file's own blocks where it can (exact, fewest bytes read).
      down_format = gated_lib.DOWN_FILE if all(
          layer.down.kind == qmatmul.Q4_1 and layer.down.shape[0] % qmatmul.BLOCK == 0
          for layer in self.layers) else qmatmul.Q8_0
    if down_format not in gated_lib.DOWN_KINDS:
      raise HostOpError(f"down_format must be one of {', '.join(gated_lib.DOWN_KINDS)}, got "
                        f"{down_format!r}")
    if cuts is None:
      if contribution_cuts is not None:
        raise HostOpError("contribution_cuts need cuts (the gate cuts; zeros for the "
                          "contribution rule alone); None turns the sparse FFN off")
      self.gate_cuts = self.contribution_cuts = None
      self.last_active[:] = 1.0
      self.last_passed[:] = 1.0
      return
    if self.family == "geglu":
      raise HostOpError("the gate-first sparse FFN supports swiglu, reglu and drelu, not geglu")
    cuts = self._cut_list("cuts", cuts)
    ccuts = [0.0] * self.n_layers if contribution_cuts is None else \
        self._cut_list("contribution_cuts", contribution_cuts)
    if self._down_t is None or self._down_t[0].kind != down_format:
      self.enable_gated(None)  # Off and the old rows freed while the new ones are built.
      self._down_t = self._stacked_down_t = None
      quantize = qmatmul.quantize_q4_1 if down_format == qmatmul.Q4_1 else qmatmul.quantize_q8_0
      down_t, stacked_t = [], None
      for i, layer in enumerate(self.layers):  # One layer's f32 copy at a time.
        if down_format == gated_lib.DOWN_FILE:
          w = gated_lib.FileDownRows.from_down(layer.down)
        else:
          w = quantize(np.ascontiguousarray(layer.down.dequantize().T))
        if self._stacked is not None:  # Stacked for `_layers_kernel`; each layer views its slice.
          if i == 0:
            stacked_t = tuple(_common.empty_aligned((self.n_layers,) + a.shape, a.dtype)
                              for a in w.arrays)
          for stacked, a in zip(stacked_t, w.arrays):
            stacked[i] = a
          views = tuple(a[i] for a in stacked_t)
          w = gated_lib.FileDownRows(*views) if down_format == gated_lib.DOWN_FILE else \
              qmatmul.QMatrix(down_format, views)
        down_t.append(w)
      self._down_t, self._stacked_down_t = down_t, stacked_t
    if self._up_records is None and self._stacked is not None and self.code in (
        _common.FAMILY_CODES["reglu"], _common.FAMILY_CODES["drelu"]):
      self._up_records = self._build_up_records()
    self.gate_cuts = cuts
    self.contribution_cuts = None if contribution_cuts is None else ccuts
    # What `_layers_kernel` reads, once, not per pass: f32[L, 2] (gate cut, contribution cut).
    self._cuts = np.ascontiguousarray(np.stack([cuts, ccuts], axis=1), np.float32)

  def _build_up_records(self):
    """The stacked up rows again, each row's codes and scales side by side in one record
    (views into u8[L, F, R], R the row's bytes rounded up to 64, every record on a cache line),
    for the gathered up pass of ReLU families (gate-first reads only the rows whose gate
    passes). One 2560-byte gathered read per 7B Q4_1 row instead of three (2048 + 256 + 256):
    the up pass at 50% / 25% of rows 708-758 -> 514-601 / 406-433 -> 282-302 us. Dense matvecs
    keep the separate arrays: over records the hardware prefetcher lost them (1.0 -> 1.5 ms;
    BUILD_NOTES.md, issue 11). A second copy of up, as `_down_t` is of down."""
    parts = self._stacked[2 + self._ROLES.index("up")]
    n_layers, f = parts[0].shape[:2]
    widths = [a.shape[2] * a.itemsize for a in parts]
    row = -(-sum(widths) // 64) * 64
    buf = _common.empty_aligned((n_layers, f, row), np.uint8)
    views, start = [], 0
    for a, width in zip(parts, widths):
      view = buf[:, :, start:start + width].view(a.dtype)
      view[...] = a
      views.append(view)
      start += width
    return tuple(views)

  def _cut_list(self, name: str, values) -> list[float]:
    """values as n_layers floats (each finite in f32 and >= 0), or HostOpError."""
    try:
      values = list(values)
    except TypeError:
      raise HostOpError(f"enable_gated needs {self.n_layers} {name} (one per layer), got "
                        f"{values!r}") from None
    if len(values) != self.n_layers:
      raise HostOpError(f"enable_gated needs {self.n_layers} {name} (one per layer), got "
                        f"{len(values)}")
    return [float(_common.cut_value(f"enable_gated: {name}", v)) for v in values]

  @property
  def down_format(self) -> str | None:
    """The format of the neuron-major down rows built ("q4_1" | "q8_0" | "file"; kept while the sparse
    FFN is off), None before any."""
    return None if self._down_t is None else self._down_t[0].kind

  def calibrate_gate_cuts(self, chunks, sparsity: float, contribution: bool = False
                          ) -> list[float]:
    """Per-layer cuts on |act_gate(gate . h)| that skip `sparsity` of the FFN neurons on the
    calibration tokens (the per-layer quantile; CATS §3), or with contribution=True on the
    neuron's whole activation |act(gate . h, up . h)| (`enable_gated`'s contribution_cuts).
    chunks: int[t] token arrays, each run from position 0 with the dense FFN in a cache of its
    own. Returns float[L].
    """
    if not 0.0 <= sparsity < 1.0:
      raise HostOpError(f"target sparsity must be in [0, 1), got {sparsity}")
    chunks = list(chunks)
    if not chunks:
      raise HostOpError("calibrate_gate_cuts needs at least one chunk of tokens")
    saved = self.gate_cuts
    self.gate_cuts = None
    self._record = [[] for _ in self.layers]
    self._record_contribution = bool(contribution)
    try:
      for chunk in chunks:
        chunk = np.asarray(chunk).reshape(1, -1)
        self.forward(self.new_cache(1, chunk.shape[1]), chunk, 0, rows=[chunk.shape[1] - 1])
      return [float(np.quantile(np.concatenate(v), sparsity)) for v in self._record]
    finally:
      self._record = None
      self.gate_cuts = saved

  def ffn_bytes_per_token(self, active_fraction: float | None = None,
                          passed_fraction: float | None = None) -> int:
    """FFN weight bytes one token reads (GGUF block bytes): dense, or gate-first with
    active_fraction of the neurons computed (their neuron-major down rows read: Q8_0, or Q4_1
    once `enable_gated` built those) and
    passed_fraction passing the gate (their up rows read; ReGLU/dReLU read more up rows than
    down rows). passed_fraction None: active_fraction times the ratio measured over this
    decoder's gate-first passes so far (`read_sums`), or active_fraction before any."""
    if active_fraction is None:
      return sum(w.file_bytes() for layer in self.layers for w in (layer.gate, layer.up,
                                                                    layer.down))
    if passed_fraction is None:
      active_sum, passed_sum = self.read_sums
      passed_fraction = active_fraction * (passed_sum / active_sum if active_sum > 0 else 1.0)
    kind = qmatmul.Q8_0 if self._down_t is None else self._down_t[0].kind
    per_block, fixed = gated_lib.DOWN_BLOCK_BYTES[kind]
    blocks = sum(layer.down.shape[0] * layer.down.shape[1] // 32 for layer in self.layers)
    return int(sum(layer.gate.file_bytes() + passed_fraction * layer.up.file_bytes()
                   for layer in self.layers) + (active_fraction * per_block + fixed) * blocks)

  # ------------------------------------------------------------------------- forward
  def _norm(self, x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return _rms_norm_kernel(x, scale, self.eps)

  def _rope_tables(self, pos: int, t: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin: f32[n, t, R/2] for positions pos + [0, t), one table per distinct layer RoPE
    (RoFormer §3.4; as pijax.nn.transformer.rope_angles)."""
    half = self.rope_dim // 2
    cos, sin = [], []
    for theta, scale, factors in self._ropes:
      inv_freq = np.float32(theta) ** (
          -np.arange(half, dtype=np.float32) * np.float32(2.0) / np.float32(self.rope_dim))
      if factors:
        inv_freq = inv_freq / np.asarray(factors, np.float32)
      angles = (np.arange(pos, pos + t, dtype=np.float32)[:, None] / np.float32(scale)
                * inv_freq.astype(np.float32))
      cos.append(np.cos(angles).astype(np.float32))
      sin.append(np.sin(angles).astype(np.float32))
    return np.stack(cos), np.stack(sin)

  def forward(self, cache: HostKVCache, tokens, pos: int, rows=None) -> np.ndarray:
    """Runs tokens through the decoder, reading and writing `cache`.

    Args:
      cache: from `new_cache` (positions [pos, pos + t) are written).
      tokens: int[b, t] ids at positions pos + [0, t).
      pos: position of tokens[:, 0]; pos + t <= the cache's max_seq_len.
      rows: None for logits at every position, or int[b * t] flat rows (r * t + i) to keep.

    Returns:
      f32[b * t, V] logits (or f32[len(rows), V]).

    Raises:
      HostOpError: a cache of another shape, a batch/length that does not fit it, bad ids.
    """
    tokens = np.asarray(tokens)
    b, t = tokens.shape
    want = (self.n_layers, self.n_kv_heads, self.head_dim)
    if not isinstance(cache, HostKVCache) or (cache.k.shape[0],) + cache.k.shape[3:] != want:
      raise HostOpError(f"forward needs a HostKVCache of this decoder (new_cache), got "
                        f"{type(cache).__name__}")
    _, cb, seq, _, _ = cache.k.shape
    if b != cb or not 0 <= pos <= seq - t:
      raise HostOpError(f"tokens [{b}, {t}] at position {pos} do not fit the KV cache "
                        f"[{cb} rows, {seq} positions]")
    n, k, hd = self.n_heads, self.n_kv_heads, self.head_dim
    phases = self.phase_cycles
    if phases is not None and (not isinstance(phases, np.ndarray) or phases.dtype != np.int64
                               or phases.shape != (self.n_layers, len(PHASES))
                               or not phases.flags.c_contiguous or not phases.flags.writeable):
      raise HostOpError(f"phase_cycles must be None or a writable C-contiguous i64[{self.n_layers}"
                        f", {len(PHASES)}] array")
    cos, sin = self._rope_tables(pos, t)
    x = self.embedding.rows_f32(tokens.reshape(-1))  # [b t, D]
    if self.embedding_scale != 1.0:
      x *= np.float32(self.embedding_scale)
    if self._stacked is not None and self._record is None:
      n_threads = _common.ensure_host_threads()
      stacked = self._stacked
      if self.gate_cuts is None:
        cuts, dt = np.zeros((0, 2), np.float32), _NO_DOWN_T
      else:
        cuts, dt = self._cuts, self._stacked_down_t
        if self._up_records is not None:
          up = 2 + self._ROLES.index("up")
          stacked = stacked[:up] + (self._up_records,) + stacked[up + 1:]
      x = _layers_kernel(x, b, t, *stacked, cache.k, cache.v, pos, cos, sin,
                         self._rope_of, self.windows, self.rope_adjacent, n, k, hd,
                         np.float32(self.attn_scale), self.eps, self.code,
                         self.dot == qmatmul.DOT_INT8, cuts, dt, self.last_active,
                         self.last_passed, n_threads,
                         _NO_PHASES if phases is None else phases)
      layers = ()
    else:
      layers = self.layers
    scale = np.float32(self.attn_scale)
    for i, layer in enumerate(layers):
      dot = self.dot
      bias, q_norm, k_norm, post_attn, post_ffn = self._layer_extras[i]
      qkv = layer.qkv.matmul(self._norm(x, layer.attn_norm), dot=dot)  # [b t, (N + 2K) H]
      if bias.size:
        qkv += bias
      rope = self._rope_of[i]
      attn = _attention_kernel(qkv.reshape(b, t, n + 2 * k, hd), cache.k[i], cache.v[i], pos,
                               cos[rope], sin[rope], self.rope_adjacent, n, k, scale,
                               self.windows[i], q_norm, k_norm, self.eps)  # [b t, N H]
      h = layer.attn_out.matmul(attn, dot=dot)
      x = x + (self._norm(h, post_attn) if post_attn.size else h)
      h = self._norm(x, layer.ffn_norm)
      g = layer.gate.matmul(h, dot=dot)
      if self._record is not None and not self._record_contribution:
        self._record[i].append(np.abs(_gate_activation(g, self.code)).ravel())
      if self.gate_cuts is None:
        a = _activation_kernel(g, layer.up.matmul(h, dot=dot), self.code)
        if self._record is not None and self._record_contribution:
          self._record[i].append(np.abs(a).ravel())
        y = layer.down.matmul(a, dot=dot)
      else:
        y, active, passed = gated_lib.gated_ffn(g, h, layer.up, self._down_t[i],
                                                cut=self.gate_cuts[i], family=self.family,
                                                dot=dot, contribution_cut=self._cuts[i, 1])
        self.last_active[i] = active.mean() / g.shape[1]
        self.last_passed[i] = passed.mean() / g.shape[1]
      x = x + (self._norm(y, post_ffn) if post_ffn.size else y)
    if self.gate_cuts is not None:
      self.read_sums += (float(self.last_active.mean()), float(self.last_passed.mean()))
    if rows is not None:
      x = x[np.asarray(rows, np.int64)]
    return self.lm_head.matmul(self._norm(x, self.final_norm), dot=self.dot)

  def __repr__(self) -> str:
    kinds = sorted({w.kind for layer in self.layers for w in layer.matrices()})
    return (f"HostDecoder({self.n_layers} layers, {'/'.join(kinds)}, head {self.lm_head.kind}, "
            f"{self.nbytes() / 1e6:.1f} MB)")


def decoder_reference(dec: HostDecoder, tokens) -> np.ndarray:
  """Float64 NumPy reference of `HostDecoder.forward` for one fresh sequence (positions 0..T-1).

  tokens: int[T]. Returns f32[T, V] logits. Dequantizes with `qmatmul.dequantize_reference`;
  with dec.dot "int8" every product quantizes its input as `qdot.matmul_reference` does (what
  the decoder computes when each forward pass has at most qmatmul.GEMV_MAX_ROWS tokens);
  RoPE and causal grouped-query attention written out from their definitions; with the
  gate-first FFN on (`enable_gated`), neurons whose gate fails the layer's cut are zeroed and
  the down projection uses the neuron-major Q8_0 rows (`gated_ffn_reference`).
  """
  n, k, hd = dec.n_heads, dec.n_kv_heads, dec.head_dim
  tokens = np.asarray(tokens).reshape(-1)
  t = tokens.shape[0]
  half = dec.rope_dim // 2

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

  def mm(w, x):
    if dec.dot == qmatmul.DOT_INT8:
      return _matmul_reference_int8(w, x)
    return x @ _dequantize_reference(w).T

  x = _dequantize_reference(dec.embedding)[tokens] * dec.embedding_scale
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
    if dec.gate_cuts is None:
      a = _common.activation_reference(mm(layer.gate, h), mm(layer.up, h), dec.family)
      y = mm(layer.down, a)
    else:
      y = gated_lib.gated_ffn_reference(mm(layer.gate, h), h, layer.up, dec._down_t[li],
                                        cut=dec.gate_cuts[li], family=dec.family,
                                        dot=dec.dot,
                                        contribution_cut=float(dec._cuts[li, 1]))[0]
    x = x + norm(y, layer.post_ffn_norm)
  return mm(dec.lm_head, norm(x, dec.final_norm)).astype(np.float32)


def _parts(w) -> list:
  """The QMatrix parts of w stacked by rows (w itself unless a RowConcat)."""
  return list(getattr(w, "parts", [w]))


def _dequantize_reference(w) -> np.ndarray:
  return np.concatenate([qmatmul.dequantize_reference(p) for p in _parts(w)])


def _matmul_reference_int8(w, x) -> np.ndarray:
  outs = []
  for p in _parts(w):
    if p.kind in (qmatmul.Q4_1, qmatmul.Q8_0):
      outs.append(qdot.matmul_reference(p.kind, p.arrays, x).astype(np.float64))
    else:  # Formats without an int8 kernel run the f32 one.
      outs.append(x @ qmatmul.dequantize_reference(p).T)
  return np.concatenate(outs, axis=-1)
