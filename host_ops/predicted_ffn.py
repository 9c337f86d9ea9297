"""PowerInfer's predicted sparse FFN over quantized host weights (numba): a small predictor says
which neurons may fire; only those read their gate row, and of them only the ones whose gate
passes read their up and down rows.

For ReLU families (ReGLU: relu(g) u; dReLU: relu(g) relu(u)) a neuron with g <= 0 contributes
exactly 0. The gate-first FFN (`host_ops.gated_ffn`) computes g = gate . h for every neuron to
find them; PowerInfer (Song et al. 2023, arXiv 2312.12456 §5) asks a low-rank predictor first:

  logits = fc2 @ relu(fc1 @ x)      x: the residual entering the FFN block (before ffn_norm);
                                    fc1 [r, D], fc2 [F, r], r << F: a few % of the FFN's bytes;
  predicted = {j : logits_j >= t}   t: the file's `powerinfer.sparse_threshold`;
  g_j = gate_j . h for predicted j, 0 (inactive) for the others;
  then the gate-first passes: up_j . h where g_j > 0, down row j where act_j != 0.

So an unpredicted neuron reads no gate, up or down row. A missed neuron (truly active, not
predicted) is dropped: the result is the dense FFN with the unpredicted neurons zeroed
(`predicted_ffn_reference`), equal to it when the predicted set holds every g > 0.

Rows are gathered from their file blocks, any kind `host_ops.qblocks` reads: `gathered_dots`
takes one row per id through `qblocks.row_dot_int8` (h quantized per 32 values, as the dense
products read it) or `qblocks.row_dot` (f32). Q4_0 (PowerInfer's Q4_0 files), Q4_1 and Q8_0
rows with integer dots are re-laid as records (`records`: codes, then scales; the same bytes)
and dotted by the gate-first up pass's kernels, Q4_0 as Q4_1 with offsets -8 d
(`qdot.row_dot_q4_0_pairs_far`). The
predictor's two products run in the decoder's own pooled kernels (`host_ops.layers`); the down
rows are `host_ops.gated_down`'s.

Each thread takes a contiguous share of a row's id list, rows prefetched ahead; outputs do not
depend on the thread count (one row's dot per output).

Layout per STYLE.md: kernels -> `predicted_ffn` (validates; the decoder calls the kernels from
its layer loop) -> `predicted_ffn_reference`.
"""

from __future__ import annotations

import numba
import numpy as np

from host_ops import act_quant
from host_ops import common
from host_ops import gated_down
from host_ops import pool as pool_lib
from host_ops import qblocks
from host_ops import qdot
from host_ops import qmatmul
from host_ops import qpack_reference
from host_ops.common import HostOpError

# Rows ahead that a gathered pass prefetches (into L2 for rows of >= 1 KB, `common.far_gather`;
# the gate-first up pass measured 4 best on 7B rows: `gated_ffn.FAR_AHEAD`).
AHEAD = 4
# Kind codes (beside `qblocks`' codes) of rows in this module's record layout (`records`):
# RECORDS + the qblocks code of Q4_0, Q4_1 or Q8_0. Per row its blocks' codes back to back,
# then their f16 scales, then (Q4_1) their f16 offsets, zero-padded to a multiple of 64 bytes.
RECORDS = 100
Q4_0_RECORDS = RECORDS + qblocks.Q4_0
Q4_1_RECORDS = RECORDS + qblocks.Q4_1
Q8_0_RECORDS = RECORDS + qblocks.Q8_0
# Per qblocks code of a kind with records: (code bytes, header bytes: d or d and m) per block.
RECORD_BLOCKS = {qblocks.Q4_0: (16, 2), qblocks.Q4_1: (16, 4), qblocks.Q8_0: (32, 2)}
# The families whose inactive neurons are exact zeros (g <= 0), the only ones predicted here.
RELU_FAMILIES = ("reglu", "drelu")
RELU_CODES = tuple(common.FAMILY_CODES[f] for f in RELU_FAMILIES)


@numba.njit(**common.JIT)
def predicted_ids(logits, threshold):
  """Per row, the neurons with logits[r, j] >= threshold: ids i32[b, F] (ascending, valid
  first), counts i64[b]. Branch-free (as `gated_ffn`'s gate test): every id is written, the
  count advances only for a kept one."""
  b, f = logits.shape
  ids = np.empty((b, f), np.int32)
  counts = np.zeros(b, np.int64)
  for r in range(b):
    c = 0
    for j in range(f):
      ids[r, c] = j
      c += np.int64(logits[r, j] >= threshold)
    counts[r] = c
  return ids, counts


def records(rows: np.ndarray, kind: int) -> np.ndarray:
  """u8[..., R]: rows u8[..., row bytes] (file blocks of qblocks code `kind`, a key of
  RECORD_BLOCKS) in the record layout (`RECORDS`), R the file's row bytes rounded up to 64
  (7B's D = 4096: Q4_0 2304, Q4_1 2560, Q8_0 4352, as the file). 64-byte aligned.

  Why: the gathered 7B Q4_0 gate rows in file blocks read ~9.5 GB/s through
  `qblocks.row_dot_int8`; codes in 32-byte vectors with their scales apart feed the gate-first
  up pass's kernels (`qdot.row_dot_q4_1_pairs_far`, `row_dot_q8_0_far`), which read faster."""
  code_bytes, head = RECORD_BLOCKS[kind]
  rows = np.asarray(rows, np.uint8)
  nb = rows.shape[-1] // (code_bytes + head)
  lead = rows.shape[:-1]
  blocks = rows.reshape(lead + (nb, code_bytes + head))
  nq, width = code_bytes * nb, rows.shape[-1]
  out = common.empty_aligned(lead + (-(-width // 64) * 64,), np.uint8)
  out[..., :nq] = blocks[..., head:].reshape(lead + (nq,))
  for k in range(head // 2):  # d, then (Q4_1) m: 2 bytes per block each.
    out[..., nq + 2 * nb * k:nq + 2 * nb * (k + 1)] = \
        blocks[..., 2 * k:2 * k + 2].reshape(lead + (2 * nb,))
  out[..., width:] = 0
  return out


def gather_kind(kind: int, int8: bool) -> int:
  """The kind code `gathered_dots` reads rows of qblocks code `kind` in fastest: RECORDS + kind
  for Q4_0, Q4_1 and Q8_0 with integer dots, else kind (file blocks)."""
  return RECORDS + kind if int8 and kind in RECORD_BLOCKS else kind


def gather_rows(rows: np.ndarray, kind: int, int8: bool) -> tuple[np.ndarray, int]:
  """(rows, kind code) in `gather_kind`'s layout. rows: u8[..., row bytes] file blocks of
  qblocks code `kind`."""
  layout = gather_kind(kind, int8)
  return (records(rows, kind) if layout != kind else rows), layout


@numba.njit(inline="always", **common.JIT)
def _record_scales(row, dim, kind, k):
  """Record row u8[R] of dim weights: its scales (k 0) or Q4_1 offsets (k 1), u16[D/32] f16."""
  nq = dim if kind == Q8_0_RECORDS else dim // 2
  nb = dim // 32
  return row[nq + 2 * nb * k:nq + 2 * nb * (k + 1)].view(np.uint16)


@numba.njit(**common.JIT)
def _record_dot_f32(kind, row, x):
  """f32: a record row (kind code `kind`) . x (f32[D]): per 32 weights w = d (q - 8) (Q4_0),
  d q + m (Q4_1), d q (Q8_0, q signed)."""
  dim = x.shape[0]
  d = _record_scales(row, dim, kind, 0)
  acc = np.float32(0.0)
  for blk in range(d.shape[0]):
    s = np.float32(0.0)
    if kind == Q8_0_RECORDS:
      for k in range(32):
        s += np.float32(np.int8(row[32 * blk + k])) * x[32 * blk + k]
    else:
      off = np.int32(8) if kind == Q4_0_RECORDS else np.int32(0)
      for k in range(16):
        c = np.int32(row[16 * blk + k])
        s += (np.float32((c & 15) - off) * x[32 * blk + k]
              + np.float32((c >> 4) - off) * x[32 * blk + 16 + k])
    acc += qblocks.f16_to_f32(d[blk]) * s
    if kind == Q4_1_RECORDS:
      xs = np.float32(0.0)
      for k in range(32):
        xs += x[32 * blk + k]
      acc += qblocks.f16_to_f32(_record_scales(row, dim, kind, 1)[blk]) * xs
  return acc


if qdot.AVAILABLE:
  @numba.njit(inline="always", **common.JIT)
  def _record_dot_int8(kind, row, xq, xqp, dx, xsum, nxt, far):
    """f32: a record row (kind code `kind`) . x_hat (xq: i8[D] per 32 values, xqp: the same in
    `qdot.pair_blocks`' layout; dx, xsum: f32[D/32]), prefetching the codes of record nxt (into
    L2 when far, else L1) over the row: the gate-first up pass's kernels."""
    dim = xq.shape[0]
    d = _record_scales(row, dim, kind, 0)
    if kind == Q8_0_RECORDS:
      q, nq = row[:dim].view(np.int8), nxt[:dim].view(np.int8)
      if far:
        return qdot.row_dot_q8_0_far(q, d, xq, dx, nq)
      return qdot.row_dot_q8_0_next(q, d, xq, dx, nq)
    qs, nqs = row[:dim // 2], nxt[:dim // 2]
    if kind == Q4_1_RECORDS:
      m = _record_scales(row, dim, kind, 1)
      if far:
        return qdot.row_dot_q4_1_pairs_far(qs, d, m, xqp, dx, xsum, nqs)
      return qdot.row_dot_q4_1_pairs_next(qs, d, m, xqp, dx, xsum, nqs)
    if far:
      return qdot.row_dot_q4_0_pairs_far(qs, d, xqp, dx, xsum, nqs)
    return qdot.row_dot_q4_0_pairs_next(qs, d, xqp, dx, xsum, nqs)
else:  # No AVX2: the decoder's dots are f32 (never compiled with int8 true).
  @numba.njit(inline="always", **common.JIT)
  def _record_dot_int8(kind, row, xq, xqp, dx, xsum, nxt, far):
    """Stand-in where `qdot` is not available (never called: int8 is false there)."""
    return np.float32(0.0)


@numba.njit(parallel=True, **common.JIT)
def _gathered_records(kind, rows, ids, counts, xq, dx, xsum, x, int8, n_threads):
  """`gathered_dots` for record rows u8[F, R] (kind code `kind`, `RECORDS`): each thread's
  first rows prefetched whole AHEAD ahead (rows of >= 1 KB of codes, into L2) or 1, then per
  row the scales of the row that far on, its codes spread over this row's dot
  (`gated_ffn.up_pass_int8`'s scheme)."""
  b = ids.shape[0]
  dim = x.shape[1]
  out = np.empty((b, ids.shape[1]), np.float32)
  xqp = qdot.pair_blocks(xq) if int8 and kind != Q8_0_RECORDS else xq
  nq = dim if kind == Q8_0_RECORDS else dim // 2
  far = common.far_gather(nq)
  ahead = AHEAD if far else 1
  for t in numba.prange(n_threads):
    for r in range(b):
      lo = t * counts[r] // n_threads
      hi = (t + 1) * counts[r] // n_threads
      common.prefetch_first(rows, ids[r], lo, hi, ahead, far)
      for j in range(lo, hi):
        i = ids[r, j]
        nxt = ids[r, j + ahead] if j + ahead < hi else i
        common.prefetch_gathered(rows[nxt, nq:], far)
        if int8:
          out[r, j] = _record_dot_int8(kind, rows[i], xq[r], xqp[r], dx[r], xsum[r], rows[nxt],
                                       far)
        else:
          out[r, j] = _record_dot_f32(kind, rows[i], x[r])
  return out


@numba.njit(**common.JIT)
def gathered_dots(kind, rows, ids, counts, xq, dx, xsum, x, int8, n_threads):
  """out f32[b, F]: out[r, j] = rows[ids[r, j]] . x[r] for j < counts[r] (compact: position j
  of row r's list, the rest unset).

  kind: a `qblocks` kind code or a `RECORDS` one; rows: u8[F, row bytes] (file blocks, or
  records); ids: i32[b, F]; x: f32[b, D]. int8 (a kind of qblocks.INT8_KINDS, or records): x as
  quantized per 32 values (xq i8[b, D], dx and xsum f32[b, D/32], `act_quant.quantize_32`);
  else f32 with xsum the block sums of x."""
  if kind >= RECORDS:
    return _gathered_records(kind, rows, ids, counts, xq, dx, xsum, x, int8, n_threads)
  return _gathered_file(kind, rows, ids, counts, xq, dx, xsum, x, int8, n_threads)


@numba.njit(parallel=True, **common.JIT)
def _gathered_file(kind, rows, ids, counts, xq, dx, xsum, x, int8, n_threads):
  """`gathered_dots` for file blocks of qblocks kind code `kind`, rows prefetched AHEAD ahead."""
  b = ids.shape[0]
  out = np.empty((b, ids.shape[1]), np.float32)
  far = common.far_gather(rows.shape[1])
  for t in numba.prange(n_threads):
    for r in range(b):
      lo = t * counts[r] // n_threads
      hi = (t + 1) * counts[r] // n_threads
      common.prefetch_first(rows, ids[r], lo, hi, AHEAD, far)
      for j in range(lo, hi):
        if j + AHEAD < hi:
          common.prefetch_gathered(rows[ids[r, j + AHEAD]], far)
        i = ids[r, j]
        if int8:
          out[r, j] = qblocks.row_dot_int8(kind, rows[i], xq[r], dx[r], xsum[r])
        else:
          out[r, j] = qblocks.row_dot(kind, rows[i], x[r], xsum[r])
  return out


@numba.njit(**common.JIT)
def row_activations(h, int8):
  """What `gathered_dots` reads of h: f32[b, D] -> (xq, dx, xsum); f32: xsum = block sums."""
  if int8:
    return act_quant.quantize_32(h)
  return np.zeros((1, 1), np.int8), np.zeros((1, 1), np.float32), qblocks.block_sums(h)


@numba.njit(**common.JIT)
def gated_up(g, ids, counts, xq, dx, xsum, h, up_rows, kind, code, int8, n_threads):
  """From gate values of listed neurons, the activations: (acts f32[b, F], passed i64[b]).

  g: f32[b, F], g[r, j] the gate value of neuron ids[r, j] for j < counts[r] (compact); only
  neurons with g > 0 read their up row (up_rows u8[F, row bytes] of `kind`); acts[r, i] =
  act(g, up_i . h[r]) for them (family `code`, ReGLU or dReLU), 0 for every other neuron;
  passed: how many up rows each row read. xq, dx, xsum: `row_activations(h, int8)` (computed
  once for the gate and up rows)."""
  b, f = ids.shape
  pids = np.empty((b, f), np.int32)
  pg = np.empty((b, f), np.float32)
  passed = np.zeros(b, np.int64)
  for r in range(b):  # The listed neurons whose gate passes, in order (branch-free).
    c = 0
    for j in range(counts[r]):
      pids[r, c] = ids[r, j]
      pg[r, c] = g[r, j]
      c += np.int64(g[r, j] > 0)
    passed[r] = c
  u = gathered_dots(kind, up_rows, pids, passed, xq, dx, xsum, h, int8, n_threads)
  acts = np.zeros((b, f), np.float32)
  for r in range(b):
    for j in range(passed[r]):
      acts[r, pids[r, j]] = common.activation(pg[r, j], u[r, j], code)
  return acts, passed


@numba.njit(**common.JIT)
def predicted_gate_up(logits, threshold, h, gate_rows, up_rows, kind, code, int8, n_threads):
  """The predicted neurons' gate, then up where the gate passes: (acts f32[b, F], predicted
  i64[b]: gate rows read, passed i64[b]: up rows read).

  logits: f32[b, F] the predictor's; threshold: f32; h: f32[b, D] the FFN input (after
  ffn_norm); gate_rows, up_rows: u8[F, row bytes] file blocks of `kind` (qblocks code); code:
  the family (ReGLU or dReLU); int8: integer dots on h quantized per 32 values."""
  ids, counts = predicted_ids(logits, threshold)
  xq, dx, xsum = row_activations(h, int8)
  g = gathered_dots(kind, gate_rows, ids, counts, xq, dx, xsum, h, int8, n_threads)
  acts, passed = gated_up(g, ids, counts, xq, dx, xsum, h, up_rows, kind, code, int8,
                          n_threads)
  return acts, counts, passed


@numba.njit(**common.JIT)
def _predicted_kernel(logits, threshold, h, gate_rows, up_rows, kind, code, dt, int8,
                      n_threads, block):
  acts, predicted, passed = predicted_gate_up(logits, threshold, h, gate_rows, up_rows, kind,
                                              code, int8, n_threads)
  y, nonzero = gated_down.down_pass(acts, dt, n_threads, block, int8)
  return y, predicted, passed, nonzero


def file_rows(w) -> np.ndarray:
  """u8[n, row bytes] (C-contiguous): a QMatrix's or pooled matrix's rows as the file's blocks
  (what `gathered_dots` reads; a copy)."""
  return np.ascontiguousarray(pool_lib.file_rows(w)).copy()


def int8_dots(kind: str, dot: str) -> bool:
  """Whether gathered dots on rows of `kind` run in integers for products `dot`."""
  return dot == qmatmul.DOT_INT8 and qdot.AVAILABLE and kind in qblocks.INT8_KINDS


def check_relu(family: str) -> int:
  """The family code of a ReLU family, else HostOpError (a predictor skips exact zeros only)."""
  code = common.family_code(family)
  if code not in RELU_CODES:
    raise HostOpError(f"the predicted sparse FFN runs ReLU families (reglu, drelu), not "
                      f"{family}")
  return code


def predicted_ffn(x, h, fc1: qmatmul.QMatrix, fc2: qmatmul.QMatrix, threshold: float,
                  gate: qmatmul.QMatrix, up: qmatmul.QMatrix, down_t, *, family: str,
                  dot: str = qmatmul.DOT_F32
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """The predicted sparse FFN (module docstring) for b tokens.

  Args:
    x: f32[b, D] the residual entering the FFN block (the predictor's input).
    h: f32[b, D] the FFN input (x after ffn_norm).
    fc1: [r, D], fc2: [F, r] the predictor (any host kind, r a multiple of fc2's block).
    threshold: neuron j is predicted iff its logit >= threshold (a finite f32).
    gate, up: [F, D] of one kind of `qblocks.KIND_CODES`; down_t: [F, D] neuron-major rows,
      Q8_0 QMatrix or `gated_down.FileDownRows`.
    family: "reglu" | "drelu".
    dot: "f32" or "int8" (every product on its input quantized per block, as the decoder's).

  Returns:
    (y f32[b, D], predicted i64[b] gate rows read, passed i64[b] up rows read, nonzero i64[b]
    down rows read).

  Raises:
    HostOpError: shapes or kinds that do not match, a non-ReLU family, a bad threshold or dot.
  """
  code = check_relu(family)
  if dot not in qmatmul.DOTS:
    raise HostOpError(f"predicted_ffn: dot must be one of {', '.join(qmatmul.DOTS)}, got {dot!r}")
  x, _ = common.prepare_x(x, fc1.shape[1])
  h, _ = common.prepare_x(h, gate.shape[1])
  f, dim = gate.shape
  if (x.shape != h.shape or fc2.shape != (f, fc1.shape[0]) or up.shape != (f, dim)
      or up.kind != gate.kind or gate.kind not in qblocks.KIND_CODES
      or down_t.shape != (f, dim) or down_t.kind not in gated_down.DOWN_KINDS):
    raise HostOpError(f"predicted_ffn: x {x.shape}, h {h.shape}, fc1 {fc1.shape}, fc2 "
                      f"{fc2.shape}, gate {gate.kind} {gate.shape}, up {up.kind} {up.shape}, "
                      f"down_t {down_t.kind} {down_t.shape} do not match")
  threshold = np.float32(threshold)
  if not np.isfinite(threshold):
    raise HostOpError(f"predicted_ffn: threshold must be finite in f32, got {threshold}")
  z = np.maximum(fc1.matmul(x, dot=dot), np.float32(0.0))
  logits = fc2.matmul(np.ascontiguousarray(z), dot=dot)
  int8 = int8_dots(gate.kind, dot)
  gate_rows, kind = gather_rows(file_rows(gate), qblocks.KIND_CODES[gate.kind], int8)
  up_rows, _ = gather_rows(file_rows(up), qblocks.KIND_CODES[gate.kind], int8)
  return _predicted_kernel(logits, threshold, h, gate_rows, up_rows, np.int64(kind), code,
                           down_t.arrays, int8, common.ensure_host_threads(),
                           np.int64(qmatmul.BLOCK))


def _product_reference(w, x, int8: bool) -> np.ndarray:
  """f64 x @ W.T with x as an integer product of w's rows reads it (per 32 values; f32: x)."""
  values = qmatmul.dequantize_reference(w) if isinstance(w, qmatmul.QMatrix) else w
  x = np.asarray(x, np.float32)
  xk = qpack_reference.x_hat_reference(qmatmul.Q4_0, x) if int8 else x.astype(np.float64)
  return xk @ values.T


def predicted_ffn_reference(x, h, fc1, fc2, threshold: float, gate, up, down_t, *,
                            family: str, dot: str = qmatmul.DOT_F32, logits=None
                            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """Float64 NumPy reference of `predicted_ffn`: the dense FFN with the unpredicted neurons'
  gates zeroed. fc1, fc2, gate, up: QMatrix or their f64 values; with dot "int8" every
  product's input is quantized per 32 values (`qdot.quantize_x_reference`; the file down rows
  as `gated_down.down_reference`). logits: f64[b, F] given (the decoder's own predictor
  products, `decoder_reference`) instead of computed from fc1 and fc2."""
  int8 = dot == qmatmul.DOT_INT8 and qdot.AVAILABLE
  if logits is None:
    z = np.maximum(_product_reference(fc1, x, int8), 0.0).astype(np.float32)
    logits = _product_reference(fc2, z, int8)
  keep = logits >= np.float32(threshold)
  g = np.where(keep, _product_reference(gate, h, int8), 0.0)
  u = _product_reference(up, h, int8)
  a = np.where(g > 0, common.activation_reference(g, u, family), 0.0)
  y = gated_down.down_reference(a.astype(np.float32), down_t, dot=dot)
  return y, keep.sum(axis=1), (g > 0).sum(axis=1), (a != 0).sum(axis=1)
