"""The hybrid backend's cold neurons on the host engine's quantized rows (numba).

The hybrid backend (`pijax.nn.hybrid`) keeps a layer's hot neurons on the device and sends the
active cold ones here, one `jax.pure_callback` per layer (`pijax.backends.bridge.cold_partial`).
The rows are the ones the host engine reads (issue 32, item 3), not f32 copies:

  gate, up: the source GGUF's own blocks of the cold neurons (any kind `host_ops.qblocks` reads;
            Q4_0 / Q4_1 / Q8_0 as `predicted_ffn` records for the integer dots), gathered per
            active id by `predicted_ffn.gathered_dots`;
  down:     neuron-major Q8_0 rows (the file's down blocks run along the neuron axis, so the
            host engine re-quantizes them once at load, as `--sparse=gate` does), added by
            `gated_down.down_pass` for the neurons whose activation is nonzero.

For a token h: f32[D] (the normed FFN input) and its active cold neurons A:

  y = sum_{i in A} act(gate_i . h, up_i . h) * down_i                              f32[D]

with the products of the decoder's dot: "int8" (h quantized per 32 values, as every dense host
product reads it) or "f32". ReLU families read the up row only where the gate passes (a neuron
with gate <= 0 is an exact zero). Ids: i32[b, k] per row or i32[k] shared, negative = padding
wherever it sits; a repeated id counts once. Outputs do not depend on the thread count for the gathered dots; the down pass
sums per-thread partials in thread order (bitwise reproducible for a fixed thread count).

Layout per STYLE.md: kernel (`_cold_kernel`) -> `QuantColdFFN` (validates; what a callback
closes over) -> `QuantColdFFN.reference` (float64 NumPy).
"""

from __future__ import annotations

import numba
import numpy as np

from host_ops import common
from host_ops import gated_down
from host_ops import predicted_ffn
from host_ops import qblocks
from host_ops import qmatmul
from host_ops import qpack_reference
from host_ops.common import HostOpError


@numba.njit(**common.JIT)
def _compact(ids, n):
  """ids i32[b, k] (negative = padding anywhere, each id < n) -> (i32[b, n] the distinct valid
  ids first, in first-seen order; i64[b] counts). A repeated id counts once."""
  b = ids.shape[0]
  out = np.zeros((b, n), np.int32)
  counts = np.zeros(b, np.int64)
  seen = np.zeros(n, np.bool_)
  for r in range(b):
    c = 0
    for j in range(ids.shape[1]):
      i = ids[r, j]
      if i >= 0 and not seen[i]:
        seen[i] = True
        out[r, c] = i
        c += 1
    for j in range(c):  # Reset for the next row.
      seen[out[r, j]] = False
    counts[r] = c
  return out, counts


@numba.njit(**common.JIT)
def _cold_kernel(h, ids, counts, gate_rows, up_rows, kind, code, relu, dt, int8, n_threads,
                 block):
  """(y f32[b, D], nonzero i64[b]): the cold FFN of the listed neurons (module docstring)."""
  xq, dx, xsum = predicted_ffn.row_activations(h, int8)
  g = predicted_ffn.gathered_dots(kind, gate_rows, ids, counts, xq, dx, xsum, h, int8,
                                  n_threads)
  b, n = ids.shape
  if relu:  # Up rows only where the gate passes.
    acts, _ = predicted_ffn.gated_up(g, ids, counts, xq, dx, xsum, h, up_rows, kind, code,
                                     int8, n_threads)
  else:
    u = predicted_ffn.gathered_dots(kind, up_rows, ids, counts, xq, dx, xsum, h, int8,
                                    n_threads)
    acts = np.zeros((b, n), np.float32)
    for r in range(b):
      for j in range(counts[r]):
        acts[r, ids[r, j]] = common.activation(g[r, j], u[r, j], code)
  return gated_down.down_pass(acts, dt, n_threads, block, int8)


class QuantColdFFN:
  """One layer's cold neurons in the host engine's formats; call as `w(x, ids) -> f32[b, D]`.

  Attributes:
    family: "swiglu" | "reglu" | "drelu".
    dot: "int8" | "f32" (the products, `host_ops.qmatmul.DOTS`).
    n, d: cold neurons and hidden size.
    kind: the gate/up rows' block kind (a `qmatmul` kind name, e.g. "q4_1").
    down_t: Q8_0 QMatrix [n, D], neuron-major (row i = neuron i's output weights).
    lowbit: a `host_ops.lowbit.LowbitPredictor` of these neurons, for `run_predicted`.
  """

  def __init__(self, gate: qmatmul.QMatrix, up: qmatmul.QMatrix, down_t: qmatmul.QMatrix,
               family: str, dot: str = qmatmul.DOT_INT8):
    """gate, up: QMatrix [n, D] of one kind of `qblocks.KIND_CODES` (the cold neurons' rows in
    the bundle's order); down_t: Q8_0 QMatrix [n, D] of the same neurons, neuron-major.

    Raises:
      HostOpError: shapes or kinds that do not match, an unknown family or dot.
    """
    self.code = common.family_code(family)
    if dot not in qmatmul.DOTS:
      raise HostOpError(f"dot must be one of {', '.join(qmatmul.DOTS)}, got {dot!r}")
    n, d = gate.shape
    if (up.shape != (n, d) or up.kind != gate.kind or gate.kind not in qblocks.KIND_CODES
        or down_t.shape != (n, d) or down_t.kind != qmatmul.Q8_0):
      raise HostOpError(f"cold rows: gate {gate.kind} {gate.shape}, up {up.kind} {up.shape}, "
                        f"down_t {down_t.kind} {down_t.shape}; need gate and up of one block "
                        f"kind and Q8_0 down_t, all [n, D]")
    self.family, self.dot, self.n, self.d = family, dot, n, d
    self.kind, self.down_t = gate.kind, down_t  # gate/up are kept only in the dots' layout.
    self.int8 = predicted_ffn.int8_dots(gate.kind, dot)
    code = qblocks.KIND_CODES[gate.kind]
    self._gate_rows, self._kind = predicted_ffn.gather_rows(predicted_ffn.file_rows(gate),
                                                            code, self.int8)
    self._up_rows, _ = predicted_ffn.gather_rows(predicted_ffn.file_rows(up), code, self.int8)
    self._relu = self.code in predicted_ffn.RELU_CODES
    self.lowbit = None

  @property
  def nbytes(self) -> int:
    """Host bytes held: gate and up rows (as laid out for the dots) and the down rows."""
    return int(self._gate_rows.nbytes + self._up_rows.nbytes + self.down_t.nbytes)

  @property
  def bytes_per_neuron(self) -> int:
    """Bytes read per active neuron: its gate, up and down rows."""
    return self.nbytes // max(self.n, 1)

  def _ids(self, ids, b: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu" or ids.ndim not in (1, 2) or \
        (ids.ndim == 2 and ids.shape[0] != b):
      raise HostOpError(f"ids must be int[k] or int[{b}, k], got {ids.dtype}{list(ids.shape)}")
    if ids.size and ids.max() >= self.n:
      raise HostOpError(f"cold id {int(ids.max())} out of range [0, {self.n})")
    ids = np.where(ids < 0, -1, ids) if ids.size and ids.min() < 0 else ids  # Any negative pads.
    ids2 = np.broadcast_to(ids.reshape(1, -1), (b, ids.shape[-1])) if ids.ndim == 1 else ids
    return _compact(np.ascontiguousarray(ids2, np.int32), self.n)

  def _input(self, x) -> tuple[np.ndarray, bool]:
    h, squeeze = common.prepare_x(x, self.d)
    if not np.isfinite(h).all():  # The int8 quantizer would turn NaN / inf into finite noise.
      raise HostOpError("cold FFN input holds NaN or inf (the model diverged upstream)")
    return h, squeeze

  def _run(self, h: np.ndarray, ids: np.ndarray, counts: np.ndarray) -> np.ndarray:
    y, _ = _cold_kernel(h, ids, counts, self._gate_rows, self._up_rows, np.int64(self._kind),
                        self.code, self._relu, self.down_t.arrays, self.int8,
                        common.ensure_host_threads(), np.int64(qmatmul.BLOCK))
    return y

  def __call__(self, x, ids) -> np.ndarray:
    """x: f32[b, D] or f32[D] (the normed FFN input); ids: int[b, k] or int[k] cold ids
    (negative = padding) -> f32[b, D] (f32[D] for 1-D x).

    Raises:
      HostOpError: bad shapes, an id >= n, NaN or inf in x.
    """
    h, squeeze = self._input(x)
    ids, counts = self._ids(ids, h.shape[0])
    y = self._run(h, ids, counts)
    return y[0] if squeeze else y

  def run_predicted(self, x) -> tuple[np.ndarray, np.ndarray]:
    """The attached low-bit predictor picks the active neurons, then `__call__`'s kernel runs
    them: x f32[b, D] -> (y f32[b, D], active i64[b])."""
    if self.lowbit is None:
      raise HostOpError("run_predicted needs a low-bit predictor attached (lowbit)")
    h, _ = self._input(x)
    ids, counts = self.lowbit.active_ids(h, self.family)
    return self._run(h, ids, counts.astype(np.int64)), counts.astype(np.int64)

  def values(self, name: str) -> np.ndarray:
    """f64[n, D]: the held "gate" or "up" rows' values (records laid back into file blocks,
    then `qmatmul.dequantize_reference`): what the references read."""
    rows = self._gate_rows if name == "gate" else self._up_rows
    if self._kind >= predicted_ffn.RECORDS:  # Records -> the file's blocks.
      code_bytes, head = predicted_ffn.RECORD_BLOCKS[self._kind - predicted_ffn.RECORDS]
      nb = self.d // qmatmul.BLOCK
      nq = code_bytes * nb
      blocks = np.empty((self.n, nb, code_bytes + head), np.uint8)
      blocks[..., head:] = rows[:, :nq].reshape(self.n, nb, code_bytes)
      for k in range(head // 2):  # d, then (Q4_1) m.
        blocks[..., 2 * k:2 * k + 2] = rows[:, nq + 2 * nb * k:nq + 2 * nb * (k + 1)].reshape(
            self.n, nb, 2)
      rows = blocks.reshape(self.n, -1)
    return qmatmul.dequantize_reference(qmatmul.from_gguf_blocks(self.kind, rows,
                                                                 (self.n, self.d)))

  def reference(self, x, ids) -> np.ndarray:
    """Float64 NumPy reference of `self(x, ids)`: the dequantized rows, h quantized per 32
    values as the int8 dots read it (`predicted_ffn`'s convention)."""
    int8 = self.int8
    x = np.asarray(x, np.float32)
    x2 = x.reshape(1, -1) if x.ndim == 1 else x
    gate, up = self.values("gate"), self.values("up")
    xk = qpack_reference.x_hat_reference(qmatmul.Q4_0, x2) if int8 else x2.astype(np.float64)
    ids = np.asarray(ids)
    ids2 = np.broadcast_to(ids.reshape(1, -1), (x2.shape[0], ids.shape[-1])) \
        if ids.ndim == 1 else ids
    acts = np.zeros((x2.shape[0], self.n), np.float64)
    for r in range(x2.shape[0]):
      act_ids = np.unique(ids2[r][ids2[r] >= 0])
      g = gate[act_ids] @ xk[r]
      u = up[act_ids] @ xk[r]
      if self._relu:
        a = np.where(g > 0, common.activation_reference(g, u, self.family), 0.0)
      else:
        a = common.activation_reference(g, u, self.family)
      acts[r, act_ids] = a
    y = gated_down.down_reference(acts.astype(np.float32), self.down_t, dot=self.dot)
    return (y[0] if x.ndim == 1 else y).astype(np.float32)

  def __repr__(self) -> str:
    return (f"QuantColdFFN(n={self.n}, d={self.d}, family={self.family!r}, "
            f"rows={self.kind}, dot={self.dot!r}, nbytes={self.nbytes})")
