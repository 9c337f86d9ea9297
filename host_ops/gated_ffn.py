"""Gate-first sparse FFN over quantized host weights (numba): the gate decides, up and down rows
of inactive neurons are never read.

With 4-bit weights a separate predictor costs as much as the rows it saves (the low-bit
predictor reads 4.5 bits per gate/up weight, a Q4_1 row 5), so on quantized host weights the
gate itself is the predictor: gate . h is computed for every neuron (it is needed anyway), and
only neurons it marks active read their up row and their down row:

  ReGLU, dReLU:  active iff gate . h > 0 (exact: relu(g) = 0 makes the neuron's output 0;
                 dReLU also drops u <= 0 after reading the up row);
  SwiGLU:        active iff |silu(gate . h)| >= cut_l, a per-layer cut calibrated for a target
                 sparsity (CATS, Lee et al. 2024, arXiv 2404.08763 §3: threshold the gate
                 activation's magnitude; no fine-tuning here).
  any family, with a contribution cut c_l > 0: a neuron that passed also needs
                 |act(g, u)| >= c_l, so its up row is read but its down row may not be
                 (`contribution_cut`; SwiGLU's cut 0 then reads every up row).

The down projection is read neuron-major (`down_t`: row i = neuron i's output weights): Q8_0
or Q4_1 rows re-quantized from the file's values, or a Q4_1 file's own blocks transposed
(`FileDownRows`); their formats and kernels are `host_ops.gated_down`'s.

Two passes (`up_pass`: the activations of the neurons the gate passes; `gated_down.down_pass`:
the down rows of the nonzero ones), each thread on a contiguous share of a row's list;
per-thread partial sums added in thread order: bitwise reproducible for a fixed thread count.
Layout: kernels -> `gated_ffn` (validates) -> `gated_ffn_reference`.
"""

from __future__ import annotations

import numba
import numpy as np

from host_ops import common
from host_ops import qdot
from host_ops import qmatmul
from host_ops import qmatmul_kernels
from host_ops import qpack_reference
from host_ops.common import HostOpError
from host_ops.gated_down import AHEAD, down_pass
# The down rows' formats and their reference, used with gated_ffn by the decoder and the bench.
from host_ops.gated_down import (DOWN_BLOCK_BYTES, DOWN_FILE, DOWN_KINDS,  # noqa: F401
                                 FileDownRows, down_reference)


@numba.njit(**common.JIT)
def _active_ids(g, cut, code):
  """Per row, the neurons whose gate passes: ids i32[b, F] (valid first), counts i64[b].

  SwiGLU: |silu(g)| >= cut in f32; ReLU families: g > 0. A separate serial pass (F exps per row
  in f32) so the parallel pass can split the active neurons evenly between threads.
  """
  b, f = g.shape
  ids = np.empty((b, f), np.int32)
  counts = np.zeros(b, np.int64)
  for r in range(b):
    if code == 0 and cut <= 0:  # Every |silu(g)| >= 0: no exps (the contribution rule's case).
      for i in range(f):
        ids[r, i] = i
      counts[r] = f
      continue
    # Branch-free: every id is written, the count advances only for a kept one (at 50% kept a
    # branch mispredicted half the time: 59 -> 8 us for 7B's 11008 neurons, 2 threads idle).
    c = 0
    for i in range(f):
      gi = g[r, i]
      if code == 0:
        keep = abs(common.silu_f32(gi)) >= cut
      else:
        keep = gi > 0
      ids[r, c] = i
      c += np.int64(keep)
    counts[r] = c
  return ids, counts


# Rows ahead that the gathered up pass prefetches into L2 (`common.far_gather`). 7B Q4_1 up
# rows, 50% read, from DRAM, alternated in one process: 1 row 679-711 us, 2 573-635, 4 575-613,
# 6 569-630 (BUILD_NOTES.md, issue 11).
FAR_AHEAD = 4


@numba.njit(inline="always", **common.JIT)
def _prefetch_up(ids, j, hi, up_w, up_d, up_m, q4):
  """Prefetches up row ids[j]: codes, scales and (Q4_1) offsets."""
  common.prefetch_at(ids, j, hi, up_w)
  common.prefetch_at(ids, j, hi, up_d)
  if q4:
    common.prefetch_at(ids, j, hi, up_m)


@numba.njit(inline="always", **common.JIT)
def _contribution(a, cut):
  """a, or 0 when the neuron's contribution |a| is below the cut (cut 0: a unchanged)."""
  return np.float32(0.0) if cut > 0 and abs(a) < cut else a


@numba.njit(inline="always", **common.JIT)
def _contribution_row(out, g, u, cut, code):
  """out[i] = act(g[i], u[i]) with the contribution cut (`_contribution`), one row of neurons."""
  for i in range(g.shape[0]):
    out[i] = _contribution(common.activation(g[i], u[i], code), cut)


@numba.njit(parallel=True, **common.JIT)
def up_pass(g, h, up_w, up_d, up_m, cuts, code, n_threads, q4):
  """Pass 1: (acts f32[b, F]: act(g, up . h) for the neurons whose gate passes cuts[0] and whose
  |act| reaches cuts[1] (the contribution cut; 0: off), 0 elsewhere; passed i64[b]: how many
  passed the gate, i.e. up rows read).

  up: Q4_1 (q4 true: up_w nibbles u8[F, D/2], up_d, up_m u16[F, D/32]) or Q8_0 (up_w i8[F, D];
  up_m unused), f32 dots. Each thread takes a contiguous share of each row's gate-active list,
  whole rows prefetched AHEAD neurons ahead. Two passes, not one: prefetching a neuron's down
  row before its up row says it is active wasted half the down reads on dReLU (7B shapes: 4.0
  -> 3.1 ms per layer).
  """
  b, f = g.shape
  ids, counts = _active_ids(g, cuts[0], code)
  xlo, xhi, xsum = qmatmul_kernels.split_q4_1_x(h)
  acts = np.zeros((b, f), np.float32)
  for t in numba.prange(n_threads):
    for r in range(b):
      lo = t * counts[r] // n_threads
      hi = (t + 1) * counts[r] // n_threads
      # Every row read (the contribution rule): sequential, the hardware prefetcher's case;
      # software prefetches cost SmolLM2's up pass ~30%.
      ahead = 0 if counts[r] == f else AHEAD
      for j in range(lo, min(lo + ahead, hi)):
        _prefetch_up(ids[r], j, hi, up_w, up_d, up_m, q4)
      for j in range(lo, hi):
        if ahead:
          _prefetch_up(ids[r], j + ahead, hi, up_w, up_d, up_m, q4)
        i = ids[r, j]
        if q4:
          u = qmatmul_kernels.dot_q4_1(up_w[i], up_d[i], up_m[i], xlo[r], xhi[r], xsum[r])
        else:
          u = qmatmul_kernels.dot_q8_0(up_w[i], up_d[i], h[r])
        acts[r, i] = _contribution(common.activation(g[r, i], u, code), cuts[1])
  return acts, counts


@numba.njit(parallel=True, **common.JIT)
def up_pass_int8(g, h, up_w, up_d, up_m, cuts, code, n_threads, q4):
  """`up_pass` with up . h an integer dot on h quantized per block (`host_ops.qdot`; compiled
  only where qdot.AVAILABLE). When SwiGLU's gate cut is 0 (the contribution rule) every up row
  is read, so the dense gemv reads them (the same dot per row; SmolLM2's up pass 92 -> ~65 us:
  BUILD_NOTES.md, issue 11)."""
  b, f = g.shape
  if code == 0 and cuts[0] <= 0:
    u = np.empty((b, f), np.float32)
    if q4:
      qdot.gemv_q4_1(up_w, up_d, up_m, h, u)
    else:
      qdot.gemv_q8_0(up_w, up_d, h, u)
    # Vectorized over neurons (`common.silu_f32`); one decode row serially: a parallel loop
    # over neurons cost SmolLM2 ~10 us per layer more. Prefill rows in parallel.
    acts = np.empty((b, f), np.float32)
    if b == 1:
      _contribution_row(acts[0], g[0], u[0], cuts[1], code)
    else:
      for r in numba.prange(b):
        _contribution_row(acts[r], g[r], u[r], cuts[1], code)
    return acts, np.full(b, f, np.int64)
  ids, counts = _active_ids(g, cuts[0], code)
  xq, dx, xsum = qdot.quantize_x(h)
  xqp = qdot.pair_blocks(xq) if q4 else xq
  u = np.empty((b, f), np.float32)  # up . h of the j-th passed neuron of row r at u[r, j].
  # The next passed row is prefetched while this one is summed: its codes a line per 64 bytes
  # read (`qdot.row_dot_*_next`), its scales whole. The activations come after the parallel
  # region: in the row loop they halved its rows/s. 7B shapes from DRAM, 2 threads, 50% of
  # rows passing: 1.75-1.96x the dense gemv's time per row before, 1.28 now (BUILD_NOTES.md,
  # issue 11).
  far = common.far_gather(up_w.shape[1])
  for t in numba.prange(n_threads):
    for r in range(b):
      lo = t * counts[r] // n_threads
      hi = (t + 1) * counts[r] // n_threads
      if far:  # Rows of >= 1 KB: prefetched into L2 (`common.far_gather`), FAR_AHEAD ahead.
        for j in range(lo, min(lo + FAR_AHEAD, hi)):
          common.prefetch_row_l2(up_w[ids[r, j]])
      elif lo < hi:
        common.prefetch_row(up_w[ids[r, lo]])
      for j in range(lo, hi):
        i = ids[r, j]
        if far:
          nxt = ids[r, j + FAR_AHEAD] if j + FAR_AHEAD < hi else i
          common.prefetch_row_l2(up_d[nxt])
          if q4:
            common.prefetch_row_l2(up_m[nxt])
            u[r, j] = qdot.row_dot_q4_1_pairs_far(up_w[i], up_d[i], up_m[i], xqp[r], dx[r],
                                                   xsum[r], up_w[nxt])
          else:
            u[r, j] = qdot.row_dot_q8_0_far(up_w[i], up_d[i], xq[r], dx[r], up_w[nxt])
          continue
        nxt = ids[r, j + 1] if j + 1 < hi else i
        common.prefetch_row(up_d[nxt])
        if q4:
          common.prefetch_row(up_m[nxt])
          u[r, j] = qdot.row_dot_q4_1_pairs_next(up_w[i], up_d[i], up_m[i], xqp[r], dx[r],
                                                  xsum[r], up_w[nxt])
        else:
          u[r, j] = qdot.row_dot_q8_0_next(up_w[i], up_d[i], xq[r], dx[r], up_w[nxt])
  acts = np.zeros((b, f), np.float32)
  for r in range(b):
    for j in range(counts[r]):
      i = ids[r, j]
      acts[r, i] = _contribution(common.activation(g[r, i], u[r, j], code), cuts[1])
  return acts, counts


@numba.njit(**common.JIT)
def _gated_kernel(g, h, up_w, up_d, up_m, dt, cuts, code, n_threads, block, q4):
  """y[r] = sum over active i of act(g[r, i], up_i . h[r]) * down_t[i]; returns (y, active
  i64[b]: neurons with a nonzero activation, passed i64[b]: neurons whose gate passed).

  g: f32[b, F] gate pre-activations; h: f32[b, D]; up: Q4_1 rows [F, D] (q4 true: up_w nibbles
  u8[F, D/2], up_d and up_m u16[F, D/32]) or Q8_0 (up_w i8[F, D], up_d; up_m unused);
  dt: neuron-major down rows [F, D], Q8_0 (q i8[F, D], d u16[F, D/32]) or `FileDownRows`'
  arrays; scales as f16 bits; cuts: f32[2], the gate cut and the contribution
  cut (`up_pass`).
  """
  acts, passed = up_pass(g, h, up_w, up_d, up_m, cuts, code, n_threads, q4)
  y, counts = down_pass(acts, dt, n_threads, block, False)
  return y, counts, passed


@numba.njit(**common.JIT)
def _gated_int8_kernel(g, h, up_w, up_d, up_m, dt, cuts, code, n_threads, block, q4):
  """`_gated_kernel` with up . h as an integer dot on h quantized per block (`host_ops.qdot`),
  and `FileDownRows` added in integers (`gated_down._add_block_file_next`)."""
  acts, passed = up_pass_int8(g, h, up_w, up_d, up_m, cuts, code, n_threads, q4)
  y, counts = down_pass(acts, dt, n_threads, block, True)
  return y, counts, passed


def gated_ffn(g, h, up: qmatmul.QMatrix, down_t: qmatmul.QMatrix, *, cut: float, family: str,
              dot: str = qmatmul.DOT_F32, contribution_cut: float = 0.0
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The gate-first sparse FFN (module docstring).

  Args:
    g: f32[b, F] gate pre-activations (gate . h, computed densely by the caller).
    h: f32[b, D] the FFN input (after ffn_norm).
    up: [F, D] Q4_1 or Q8_0; down_t: [F, D] neuron-major, Q8_0 QMatrix rows or
      `FileDownRows`.
    cut: SwiGLU: minimum |silu(g)| of an active neuron (>= 0); ignored by ReLU families.
    family: "swiglu" | "reglu" | "drelu".
    dot: "f32", or "int8": up . h on h quantized per block of 32 (`host_ops.qdot`), and
      `FileDownRows` on activations quantized per block of 32 neurons (`gated_down`); f32
      where qdot.AVAILABLE is False.
    contribution_cut: minimum |act(g, up . h)| of a neuron whose down row is read (>= 0; 0:
      off). The exact-contribution rule: with cut 0 every up row is read and only down rows
      are skipped (SmolLM2 with transformers, issue 11: +2.4% perplexity at 48% sparsity;
      the gate rule here: +12.5% at 38%, BUILD_NOTES.md).

  Returns:
    (y: f32[b, D], active: i64[b] neurons with a nonzero activation per row (down rows read),
    passed: i64[b] neurons whose gate passed (up rows read)).

  Raises:
    HostOpError: shapes or formats that do not match, an unknown dot.
  """
  code = common.family_code(family)
  g = np.ascontiguousarray(g, np.float32)
  h, _ = common.prepare_x(h, up.shape[1])
  f = up.shape[0]
  if g.shape != (h.shape[0], f) or down_t.shape != up.shape or down_t.kind not in DOWN_KINDS:
    raise HostOpError(f"gated_ffn: g {g.shape}, h {h.shape}, up {up.shape}, down_t "
                      f"{down_t.kind} {down_t.shape} do not match (down_t must be "
                      f"{' or '.join(DOWN_KINDS)} [F, D])")
  cuts = np.array([common.cut_value("gated_ffn: cut", cut),
                   common.cut_value("gated_ffn: contribution_cut", contribution_cut)])
  if dot not in qmatmul.DOTS:
    raise HostOpError(f"gated_ffn: dot must be one of {', '.join(qmatmul.DOTS)}, got {dot!r}")
  q4 = up.kind == qmatmul.Q4_1
  m = up.arrays[2] if q4 else up.arrays[1]  # Q8_0: a placeholder u16[F, D/32], never read.
  kernel = _gated_int8_kernel if dot == qmatmul.DOT_INT8 and qdot.AVAILABLE else _gated_kernel
  return kernel(g, h, up.arrays[0], up.arrays[1], m, down_t.arrays, cuts, code,
                common.ensure_host_threads(), np.int64(qmatmul.BLOCK), q4)


def gated_ffn_reference(g, h, up: qmatmul.QMatrix, down_t: qmatmul.QMatrix, *, cut: float,
                        family: str, dot: str = qmatmul.DOT_F32, contribution_cut: float = 0.0
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Float64 NumPy reference of `gated_ffn` (dot "int8": up . h as `qdot.matmul_reference`;
  up rows of other kinds, the decoder's gate-first path for them, on h quantized per 32)."""
  g = np.asarray(g, np.float64)
  if dot == qmatmul.DOT_INT8 and qdot.AVAILABLE and up.kind not in (qmatmul.Q4_1, qmatmul.Q8_0):
    # Other kinds' file rows (`predicted_ffn.gated_up`): h quantized per 32 values.
    u = qpack_reference.x_hat_reference(qmatmul.Q4_0, h) @ qmatmul.dequantize_reference(up).T
  elif dot == qmatmul.DOT_INT8 and qdot.AVAILABLE:
    u = qdot.matmul_reference(up.kind, up.arrays, np.asarray(h, np.float32)).astype(np.float64)
  else:
    u = np.asarray(h, np.float64) @ qmatmul.dequantize_reference(up).T
  a = common.activation_reference(g, u, family)
  if family == "swiglu":
    with np.errstate(over="ignore"):
      keep = np.abs(common.activation_reference(g, 1.0, family)) >= cut
  else:
    keep = g > 0
  a = np.where(keep, a, 0.0)
  if contribution_cut > 0:
    a = np.where(np.abs(a) >= contribution_cut, a, 0.0)
  y = down_reference(a.astype(np.float32), down_t, dot=dot)
  return y, (a != 0).sum(axis=1), keep.sum(axis=1)
