"""The host decoder's layer body: every layer of a ragged batch of tokens in one call (numba).

One layer body for every pass (issue 30): `layers_kernel` runs every layer for N tokens, token
i of sequence slot `slots[i]` at position `positions[i]`: a prompt's chunk (prefill), one token
of one sequence (decode), one token each of several sequences (batched decode), or a mix.
Matmuls see N activation rows whatever they belong to (`host_ops.pool`); attention reads and
writes each token's own slot of the KV cache (`host_ops.attention`); the FFN is dense or the
gate-first sparse one (`host_ops.gated_ffn`, `host_ops.gated_down`), or PowerInfer's predicted one
(`host_ops.predicted_ffn`).

Layout per STYLE.md: these kernels -> `decoder.HostDecoder` (validates, owns the weights and
the calls) -> `decoder.decoder_reference`.
"""

from __future__ import annotations

import dataclasses

import numba
import numpy as np
from numba import extending as numba_extending

from host_ops import common
from host_ops import act_quant
from host_ops import attention as attn_lib
from host_ops import gated_down
from host_ops import gated_ffn
from host_ops import pool as pool_lib
from host_ops import predicted_ffn
from host_ops import qblocks
from host_ops import qdot
from host_ops import qmatmul


@dataclasses.dataclass
class HostLayer:
  """One decoder layer's host weights.

  attn_norm, ffn_norm: f32[D]; qkv: [(N + 2K) H, D] (q | k | v rows); attn_out: [D, N H];
  gate, up: [F, D]; down: [D, F] (QMatrix, or a `qconcat.RowConcat` of several formats; rows =
  outputs, as GGUF stores them; a HostDecoder replaces them by its pool's `pool.PooledRole`).
  Family extras, None when absent: qkv_bias f32[(N + 2K) H] (Qwen2); q_norm, k_norm f32[H]
  (QK-norm: Qwen3, Gemma 3); post_attn_norm, post_ffn_norm f32[D] (Gemma's sandwich norms on each
  sub-block's output).
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

  def matrices(self) -> tuple:
    return (self.qkv, self.attn_out, self.gate, self.up, self.down)


@numba.njit(**common.JIT)
def activation_kernel(g, u, code):
  """act(g, u) elementwise for the FFN family `code`; g, u: f32[b, F]."""
  out = np.empty_like(g)
  for r in range(g.shape[0]):
    for j in range(g.shape[1]):
      out[r, j] = common.activation(g[r, j], u[r, j], code)
  return out


# What `layers_kernel` times per layer when asked (`HostDecoder.phase_cycles`): the attention
# norm and q/k/v matmul, attention, the output matmul with the residual and the FFN norm, the
# predictor's two products (predicted FFN only), the gate matmul (or the predicted neurons' gate
# rows), then up and down: the matmuls (dense) or the sparse up and down passes, down with the
# FFN's residual (and post-norm).
PHASES = ("qkv", "attention", "attn_out", "predictor", "gate", "up", "down")
NO_PHASES = np.zeros((0, len(PHASES)), np.int64)  # Placeholder when nothing is timed.
# What `layers_kernel` records per layer for `calibrate_gate_cuts`: nothing, |act_gate(g)|,
# or |act(g, u)|.
RECORD_NONE, RECORD_GATE, RECORD_CONTRIBUTION = 0, 1, 2
NO_RECORD = np.zeros((0, 0, 0), np.float32)
# Roles of a layer in the pool's role table (`HostDecoder._roles`).
ROLES = ("qkv", "attn_out", "gate", "up", "down")
QKV, ATTN_OUT, GATE, UP, DOWN = range(5)


@numba.njit(inline="always", **common.JIT)
def stamp(phases, i, k, t_prev):
  """Adds the cycles since t_prev to phases[i, k] and returns now (nothing when phases is
  empty)."""
  if phases.shape[0] == 0:
    return t_prev
  now = common.cycle_counter()
  phases[i, k] += now - t_prev
  return now


@numba.njit(inline="always", **common.JIT)
def product(pool, mats, ids, needs, x, out, int8):
  """out = x @ W.T for a role of the pool (`pool.pool_matmul`), x quantized as its kinds read
  it (needs: (per-32, per-256) flags)."""
  xa = act_quant.activations(x, needs[0] != 0 or not int8, needs[1] != 0 and int8)
  xsum = qblocks.block_sums(x) if not int8 else np.zeros((x.shape[0], 1), np.float32)
  pool_lib.pool_matmul(pool, mats, ids, xa, x, xsum, out, int8)


def layer_gated(up_w, i, g, h, dt, cuts, code, n_threads, int8, phases, t_prev):
  """(y, active, passed, t) of the gate-first FFN of layer i, its up pass timed into phases
  (`stamp`) from t_prev, t the up pass's end (numba only; see the overload below)."""
  raise NotImplementedError("layer_gated runs inside numba-compiled code only")


def layer_down(dt, i, acts, n_threads, int8):
  """(y, nonzero) of layer i's down pass over its neuron-major rows (numba only; see the
  overload below)."""
  raise NotImplementedError("layer_down runs inside numba-compiled code only")


@numba_extending.overload(layer_down, jit_options=common.JIT)
def _layer_down_overload(dt, i, acts, n_threads, int8):
  """`gated_down.down_pass` on layer i of stacked down rows dt: Q8_0 (i8[L, F, D], u16[L, F,
  D/32]) or `FileDownRows`' three arrays."""
  block = np.int64(qmatmul.BLOCK)
  if len(dt) == 3:
    def impl(dt, i, acts, n_threads, int8):
      return gated_down.down_pass(acts, (dt[0][i], dt[1][i], dt[2][i]), n_threads, block, int8)
  else:
    def impl(dt, i, acts, n_threads, int8):
      return gated_down.down_pass(acts, (dt[0][i], dt[1][i]), n_threads, block, int8)
  return impl


@numba_extending.overload(layer_gated, jit_options=common.JIT)
def _layer_gated_overload(up_w, i, g, h, dt, cuts, code, n_threads, int8, phases, t_prev):
  """`gated_ffn.gated_ffn`'s passes for stacked up rows (Q4_1 (qs, d, m) or Q8_0 (q, d), each
  [L, F, ...]: separate C arrays, or views into one record per row, `_build_up_records`; or
  for ReLU families any kind's file blocks (rows u8[L, F, row bytes], kind i64[1]: a qblocks
  code), read by `predicted_ffn.gated_up`) and stacked neuron-major down rows dt (`layer_down`);
  the integer kernels only where qdot.AVAILABLE."""
  q4 = len(up_w) == 3
  raw = len(up_w) == 2 and up_w[0].dtype == numba.types.uint8
  m = 2 if q4 else 1  # Q8_0: its scales stand in for the offsets, never read.
  # Without AVX2 the integer up pass is never compiled (a decoder's dot is then "f32": int8 is
  # always False there).
  up_int8 = gated_ffn.up_pass_int8 if qdot.AVAILABLE else gated_ffn.up_pass

  if raw:
    def impl(up_w, i, g, h, dt, cuts, code, n_threads, int8, phases, t_prev):
      b, f = g.shape
      ids = np.empty((b, f), np.int32)
      for r in range(b):
        for j in range(f):
          ids[r, j] = j
      kind = up_w[1][0]
      dots = int8 and row_int8(kind)
      xq, dx, xs = predicted_ffn.row_activations(h, dots)
      acts, passed = predicted_ffn.gated_up(g, ids, np.full(b, f, np.int64), xq, dx, xs, h,
                                            up_w[0][i], kind, code, dots, n_threads)
      t_prev = stamp(phases, i, 5, t_prev)
      y, counts = layer_down(dt, i, acts, n_threads, int8)
      return y, counts, passed, t_prev
    return impl

  def impl(up_w, i, g, h, dt, cuts, code, n_threads, int8, phases, t_prev):
    if int8:
      acts, passed = up_int8(g, h, up_w[0][i], up_w[1][i], up_w[m][i], cuts, code, n_threads, q4)
    else:
      acts, passed = gated_ffn.up_pass(g, h, up_w[0][i], up_w[1][i], up_w[m][i], cuts, code,
                                       n_threads, q4)
    t_prev = stamp(phases, i, 5, t_prev)
    y, counts = layer_down(dt, i, acts, n_threads, int8)
    return y, counts, passed, t_prev
  return impl


@numba.njit(inline="always", **common.JIT)
def row_int8(kind):
  """Whether rows of qblocks kind code `kind` have integer dots (F16 and BF16 run f32)."""
  return kind != qblocks.F16 and kind != qblocks.BF16


@numba.njit(inline="always", **common.JIT)
def predictor_logits(pred, i, x, f, int8):
  """f32[N, F] = fc2 @ relu(fc1 @ x) of layer i's predictor (`layers_kernel`'s pred), x the
  residual entering the FFN block."""
  ppool, pmats, proles, pneeds = pred[0], pred[1], pred[2], pred[3]
  rank = 0
  for p in range(proles.shape[2]):
    if proles[i, 0, p] >= 0:
      rank += pmats[proles[i, 0, p], pool_lib.M_ROWS]
  z = np.empty((x.shape[0], rank), np.float32)  # [N, r]
  product(ppool, pmats, proles[i, 0], pneeds[i, 0], x, z, int8)
  for r in range(x.shape[0]):
    for k in range(rank):
      z[r, k] = max(z[r, k], np.float32(0.0))
  logits = np.empty((x.shape[0], f), np.float32)  # [N, F]
  product(ppool, pmats, proles[i, 1], pneeds[i, 1], z, logits, int8)
  return logits


@numba.njit(**common.JIT)
def layers_kernel(x, slots, positions, pool, mats, roles, needs, norms, extras, cache_k,
                   cache_v, cos, sin, rope_of, windows, adjacent, n_heads, n_kv, head_dim, scale,
                   eps, code, int8, cuts, up_w, dt, pred, active, passed, nonzero, n_threads,
                   phases, record, record_mode):
  """Every layer of the decoder for a ragged batch (module docstring): x: f32[N, D] embeddings
  -> f32[N, D] after the last layer.

  slots, positions: i64[N]; pool, mats: `pool.WeightPool`; roles: i64[L, 5, MAX_PARTS] matrix ids
  of each layer's roles (`ROLES`); needs: i64[L, 5, 2] the activation quantizations of each
  role's input (per-32, per-256); norms: f32[L, 2, D] (attention, FFN); extras: (qkv_bias
  f32[L, E], q_norm, k_norm f32[L, H], post_attn_norm, post_ffn_norm f32[L, D]), each [L, 0]
  when the family has none; cache_k, cache_v: f32[L, slots, S, K, H]; cos, sin: f32[n, N, R/2]
  RoPE tables, layer i using table rope_of[i]; windows: i64[L] (0: global attention).
  Gate-first FFN (`gated_ffn`) when cuts (f32[L, 2]: gate, contribution) is not empty: up rows
  up_w (stacked split Q4_1 / Q8_0) and neuron-major down rows dt; layer i's fraction of neurons
  computed (down rows read) is written to active[i] and nonzero[i], of neurons whose gate passed
  (up rows read) to passed[i].
  Predicted FFN (`predicted_ffn`) when pred's thresholds are not empty: pred = (pool u8[P], mats
  i64[M, 6], roles i64[L, 2, MAX_PARTS] (fc1, fc2), needs i64[L, 2, 2]: the predictors in a
  `pool.WeightPool` of their own; thresholds f32[L]; gate_rows, up_rows u8[L, F, row bytes] file
  blocks of the qblocks kind code pred[7], or a `predicted_ffn.RECORDS` code), down rows dt as
  gate-first; then active[i] is the fraction of neurons predicted (gate rows read), passed[i] of
  up rows read, nonzero[i] of down rows read (`NO_PREDICTOR`: off). phases:
  i64[L, len(PHASES)] gets each layer's cycles per phase added, or [0, ...]: nothing timed.
  record: f32[L, N, F] filled per `record_mode` (RECORD_*), or empty.
  """
  rows = x.shape[0]
  qkv_bias, q_norms, k_norms, post_attn, post_ffn = extras
  n_qkv = (n_heads + 2 * n_kv) * head_dim
  qkv = np.empty((rows, n_qkv), np.float32)
  attn_proj = np.empty_like(x)
  ffn = np.empty_like(x)
  f = 0
  for p in range(roles.shape[2]):
    if roles[0, GATE, p] >= 0:
      f += mats[roles[0, GATE, p], pool_lib.M_ROWS]
  g = np.empty((rows, f), np.float32)
  u = np.empty((rows, f), np.float32)
  t_prev = common.cycle_counter() if phases.shape[0] else 0
  for i in range(roles.shape[0]):
    h = attn_lib.rms_norm(x, norms[i, 0], eps)
    product(pool, mats, roles[i, QKV], needs[i, QKV], h, qkv, int8)
    if qkv_bias.shape[1]:
      for r in range(rows):
        qkv[r] += qkv_bias[i]
    t_prev = stamp(phases, i, 0, t_prev)
    att = attn_lib.attention(qkv.reshape(rows, n_heads + 2 * n_kv, head_dim), cache_k[i],
                             cache_v[i], slots, positions, cos[rope_of[i]], sin[rope_of[i]],
                             adjacent, n_heads, n_kv, scale, windows[i], q_norms[i], k_norms[i],
                             eps)
    t_prev = stamp(phases, i, 1, t_prev)
    product(pool, mats, roles[i, ATTN_OUT], needs[i, ATTN_OUT], att, attn_proj, int8)
    if post_attn.shape[1]:
      x = x + attn_lib.rms_norm(attn_proj, post_attn[i], eps)
    else:
      x = x + attn_proj
    h = attn_lib.rms_norm(x, norms[i, 1], eps)
    t_prev = stamp(phases, i, 2, t_prev)
    if pred[4].shape[0]:  # Predicted: gate rows of the predicted neurons only.
      logits = predictor_logits(pred, i, x, f, int8)
      t_prev = stamp(phases, i, 3, t_prev)
      ids, counts = predicted_ffn.predicted_ids(logits, pred[4][i])
      dots = int8 and row_int8(pred[7])
      xq, dx, xs = predicted_ffn.row_activations(h, dots)
      g = predicted_ffn.gathered_dots(pred[7], pred[5][i], ids, counts, xq, dx, xs, h, dots,
                                      n_threads)
      t_prev = stamp(phases, i, 4, t_prev)
      acts, passed_i = predicted_ffn.gated_up(g, ids, counts, xq, dx, xs, h, pred[6][i],
                                              pred[7], code, dots, n_threads)
      t_prev = stamp(phases, i, 5, t_prev)
      ffn, nonzero_i = layer_down(dt, i, acts, n_threads, int8)
      active[i] = counts.sum() / (rows * f)
      passed[i] = passed_i.sum() / (rows * f)
      nonzero[i] = nonzero_i.sum() / (rows * f)
    else:
      product(pool, mats, roles[i, GATE], needs[i, GATE], h, g, int8)
      t_prev = stamp(phases, i, 4, t_prev)
      if cuts.shape[0]:
        ffn, counts, passed_i, t_prev = layer_gated(up_w, i, g, h, dt, cuts[i], code,
                                                     n_threads, int8, phases, t_prev)
        active[i] = counts.sum() / (rows * f)
        nonzero[i] = active[i]
        passed[i] = passed_i.sum() / (rows * f)
      else:
        product(pool, mats, roles[i, UP], needs[i, UP], h, u, int8)
        t_prev = stamp(phases, i, 5, t_prev)
        a = activation_kernel(g, u, code)
        if record_mode == RECORD_CONTRIBUTION:
          for r in range(rows):
            for j in range(f):
              record[i, r, j] = abs(a[r, j])
        elif record_mode == RECORD_GATE:
          for r in range(rows):
            for j in range(f):
              record[i, r, j] = abs(common.activation(g[r, j], np.float32(1.0),
                                                       0 if code == 0 else 1))
        product(pool, mats, roles[i, DOWN], needs[i, DOWN], a, ffn, int8)
    if post_ffn.shape[1]:
      x = x + attn_lib.rms_norm(ffn, post_ffn[i], eps)
    else:
      x = x + ffn
    t_prev = stamp(phases, i, 6, t_prev)
  return x


# Placeholders for `layers_kernel` when the gate-first FFN is off.
NO_UP = (np.zeros((0, 0, qmatmul.BLOCK), np.int8), np.zeros((0, 0, 1), np.uint16))
NO_DOWN_T = (np.zeros((0, 0, qmatmul.BLOCK), np.int8), np.zeros((0, 0, 1), np.uint16))
# ... and when the predicted FFN is off (`layers_kernel`'s pred, no thresholds).
NO_PREDICTOR = (np.zeros(64, np.uint8), np.zeros((0, 6), np.int64),
                np.zeros((0, 2, pool_lib.MAX_PARTS), np.int64), np.zeros((0, 2, 2), np.int64),
                np.zeros(0, np.float32), np.zeros((0, 0, 0), np.uint8),
                np.zeros((0, 0, 0), np.uint8), np.int64(0))
