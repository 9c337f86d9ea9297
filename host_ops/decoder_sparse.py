"""The host decoder's sparse FFNs, switched on and off: gate-first (`enable_gated`, issue 11) and
PowerInfer's predicted FFN (`enable_predicted`, issue 32), their own copies of rows, cut
calibration and the bytes a token reads.

`HostDecoder` (`host_ops.decoder`) inherits these methods: they read its pool, layers and
counters and set what `_forward` passes to `layers.layers_kernel` (cuts, up rows, down rows, the
predictor tuple). Apart from the decoder because it is a second job: the decoder runs passes,
this module decides which rows those passes read.
"""

from __future__ import annotations

import numpy as np

from host_ops import common
from host_ops import gated_ffn
from host_ops import pool as pool_lib
from host_ops import predicted_ffn
from host_ops import qblocks
from host_ops import qmatmul
from host_ops.common import HostOpError
from host_ops.layers import NO_PREDICTOR, RECORD_CONTRIBUTION, RECORD_GATE


class SparseFFN:
  """Sparse FFN setup and accounting for `host_ops.decoder.HostDecoder` (a mixin: every
  attribute it reads is the decoder's)."""

  def sparse_nbytes(self) -> int:
    """Bytes of the sparse FFNs' own copies (`enable_gated`, `enable_predicted`): the
    neuron-major down rows, the up rows (split, or records for ReLU families), the predicted
    FFN's predictor pool and gate and up rows; 0 before they are built. Held while off."""
    held = 0 if self._stacked_down_t is None else sum(a.nbytes for a in self._stacked_down_t)
    if self._pred_pool is not None:
      held += self._pred_pool.nbytes + self._pred_rows[0].nbytes + self._pred_rows[1].nbytes
    if self._up is not None:
      first = self._up[0]
      if first.base is not None and first.strides[1] != first.shape[2] * first.itemsize:
        held += first.shape[0] * first.shape[1] * first.strides[1]  # Records: one buffer.
      else:
        held += sum(a.nbytes for a in self._up)
    return int(held)


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
    dense; re-quantized Q4_1 rows, a second 4-bit rounding at 28.45, were removed).
    None: "file" where every layer's down projection is Q4_1, else "q8_0". Built on first use
    and when the format changes; the old rows are dropped first (never both held), so if
    building fails the sparse FFN is left off.
    Memory: the gate-first passes read their own copies, built here from the pool: the
    neuron-major down rows and the up rows (Q4_1 / Q8_0 codes and scales stacked per layer;
    ReLU families as one record per row, `_build_up_records`). They stay held when the sparse
    FFN is turned off (the bench toggles it); `nbytes` counts them (`sparse_nbytes`).

    Up rows of other kinds (Q4_0, K-quants, ...: their file blocks, `predicted_ffn.gated_up`)
    for ReLU families without contribution cuts. Turning it on turns the predicted FFN off.

    Raises:
      HostOpError: cuts of the wrong count or value, an unknown format, a GeGLU model, up rows
        of mixed kinds, or not Q4_1 / Q8_0 for SwiGLU or with contribution cuts.
    """
    down_format = self._down_format(down_format)
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
    up_kind = self._up_kind()
    split = up_kind in (qmatmul.Q4_1, qmatmul.Q8_0)
    cuts = self._cut_list("cuts", cuts)
    ccuts = [0.0] * self.n_layers if contribution_cuts is None else \
        self._cut_list("contribution_cuts", contribution_cuts)
    if not split and (self.code not in predicted_ffn.RELU_CODES or any(ccuts)):
      raise HostOpError(f"the gate-first sparse FFN reads {up_kind} up rows for ReGLU/dReLU "
                        "without contribution cuts only; SwiGLU and the contribution rule need "
                        "Q4_1 or Q8_0 up rows")
    self._ensure_down_rows(down_format)
    if self._up is None or (len(self._up) == 2 and self._up[0].dtype == np.uint8) == split:
      self._up = None
      self._up = self._build_up() if split else self._raw_up()
    self.enable_predicted(None)
    self.gate_cuts = cuts
    self.contribution_cuts = None if contribution_cuts is None else ccuts
    # What `layers_kernel` reads, once, not per pass: f32[L, 2] (gate cut, contribution cut).
    self._cuts = np.ascontiguousarray(np.stack([cuts, ccuts], axis=1), np.float32)

  def _down_format(self, down_format: str | None) -> str:
    """down_format checked, None resolved: "file" where every layer's down projection is Q4_1
    (exact, fewest bytes read), else "q8_0". Raises HostOpError for an unknown one."""
    if down_format is None:
      down_format = gated_ffn.DOWN_FILE if all(
          layer.down.kind == qmatmul.Q4_1 and layer.down.shape[0] % qmatmul.BLOCK == 0
          for layer in self.layers) else qmatmul.Q8_0
    if down_format not in gated_ffn.DOWN_KINDS:
      raise HostOpError(f"down_format must be one of {', '.join(gated_ffn.DOWN_KINDS)}, got "
                        f"{down_format!r}")
    return down_format

  def _up_kind(self) -> str:
    """The up rows' one kind, or HostOpError (mixed kinds, or none a row dot reads)."""
    kinds = {layer.up.kind for layer in self.layers}
    if len(kinds) != 1 or next(iter(kinds)) not in qblocks.KIND_CODES:
      raise HostOpError(f"the sparse FFNs read up rows of one format in every layer; this "
                        f"model's are {', '.join(sorted(kinds))}")
    return next(iter(kinds))

  def _ensure_down_rows(self, down_format: str) -> None:
    """Builds the neuron-major down rows in down_format unless held. The sparse FFNs are turned
    off first and the old rows freed while the new ones are built, so if building fails they
    are left off."""
    if self._down_t is not None and self._down_t[0].kind == down_format:
      return
    self.enable_gated(None)
    self.enable_predicted(None)
    self._down_t = self._stacked_down_t = None
    down_t, stacked_t = [], None
    for i, layer in enumerate(self.layers):  # One layer's f32 copy at a time.
      if down_format == gated_ffn.DOWN_FILE:
        w = gated_ffn.FileDownRows.from_down(layer.down.parts[0].qmatrix())
      else:
        w = qmatmul.quantize_q8_0(np.ascontiguousarray(layer.down.dequantize().T))
      if i == 0:
        stacked_t = tuple(common.empty_aligned((self.n_layers,) + a.shape, a.dtype)
                          for a in w.arrays)
      for stacked, a in zip(stacked_t, w.arrays):
        stacked[i] = a
      views = tuple(a[i] for a in stacked_t)
      down_t.append(gated_ffn.FileDownRows(*views) if down_format == gated_ffn.DOWN_FILE
                    else qmatmul.QMatrix(down_format, views))
    self._down_t, self._stacked_down_t = down_t, stacked_t

  @property
  def down_rows(self) -> list | None:
    """Per layer, the neuron-major down rows the sparse FFNs read (Q8_0 QMatrix or
    `gated_ffn.FileDownRows`), None before any were built."""
    return self._down_t

  def _stacked_rows(self, name: str, layout: int = -1) -> np.ndarray:
    """u8[L, F, row bytes]: every layer's `name` ("gate" | "up") rows as their file blocks,
    stacked (64-byte aligned; one layer's copy at a time); with layout
    a `predicted_ffn.RECORDS` code, in that record layout (`predicted_ffn.records`)."""
    out = None
    for i, layer in enumerate(self.layers):
      rows = pool_lib.file_rows(getattr(layer, name).parts[0])
      if layout >= predicted_ffn.RECORDS:
        rows = predicted_ffn.records(rows.view(np.uint8), layout - predicted_ffn.RECORDS)
      if out is None:
        out = common.empty_aligned((self.n_layers,) + rows.shape, np.uint8)
      out[i] = rows.view(np.uint8)
    return out

  def _raw_up(self) -> tuple[np.ndarray, np.ndarray]:
    """The gate-first up rows of a kind without split arrays: (rows u8[L, F, row bytes], its
    qblocks code i64[1]), `layers.layer_gated`'s raw form."""
    return (self._stacked_rows("up"),
            np.array([qblocks.KIND_CODES[self._up_kind()]], np.int64))

  def enable_predicted(self, fc1s, fc2s=None, thresholds=None,
                       down_format: str | None = None) -> None:
    """Turns on PowerInfer's predicted sparse FFN (`host_ops.predicted_ffn`), or off with
    fc1s None.

    Per layer l and token: logits = fc2_l @ relu(fc1_l @ x), x the residual entering the FFN
    block; only neurons with logits >= thresholds[l] read their gate row (g = 0 for the
    others), then up rows where g > 0 and down rows where the activation is nonzero. The
    predictor's products run as the decoder's (int8 or f32, its own pool); gate and up rows are
    gathered from copies of their file blocks (any kind), down rows are `enable_gated`'s
    (down_format: "q8_0" | "file" | None, as there; shared with the gate-first FFN).

    Args:
      fc1s: per layer a [r_l, D] QMatrix (any host kind; r_l a multiple of fc2's block).
      fc2s: per layer a [F, r_l] QMatrix.
      thresholds: float[L], finite.
      down_format: see `enable_gated`.

    Memory: the predictors (pooled), the gate and up rows ([L, F, row bytes] each) and the down
    rows; held while off (`sparse_nbytes`). Turning it on turns the gate-first FFN off.

    Raises:
      HostOpError: a non-ReLU family, counts or shapes that do not match, a kind without a host
        kernel, mixed gate/up kinds, a threshold that is not finite.
    """
    if fc1s is None:
      self.thresholds = None
      self._pred = NO_PREDICTOR
      self.last_active[:] = 1.0
      self.last_passed[:] = 1.0
      self.last_nonzero[:] = 1.0
      return
    predicted_ffn.check_relu(self.family)
    fc1s, fc2s = list(fc1s), list(fc2s)
    n, d, f = self.n_layers, self.hidden_size, self.intermediate_size
    try:
      thresholds = [float(t) for t in thresholds]
    except TypeError:
      raise HostOpError(f"enable_predicted needs {n} thresholds, got {thresholds!r}") from None
    if len(fc1s) != n or len(fc2s) != n or len(thresholds) != n:
      raise HostOpError(f"enable_predicted needs {n} fc1, fc2 and thresholds (one per layer), "
                        f"got {len(fc1s)}, {len(fc2s)}, {len(thresholds)}")
    for i, (fc1, fc2, t) in enumerate(zip(fc1s, fc2s, thresholds)):
      if fc1.shape[1] != d or fc2.shape != (f, fc1.shape[0]):
        raise HostOpError(f"layer {i}: predictor fc1 {fc1.shape} / fc2 {fc2.shape}, expected "
                          f"[r, {d}] / [{f}, r]")
      if not np.isfinite(np.float32(t)):
        raise HostOpError(f"layer {i}: threshold {t} is not finite in f32")
    gate_kinds = {layer.gate.kind for layer in self.layers}
    if gate_kinds != {self._up_kind()}:
      raise HostOpError(f"the predicted FFN reads gate and up rows of one kind; this model's "
                        f"are {', '.join(sorted(gate_kinds))} / {self._up_kind()}")
    self.enable_predicted(None)
    self._ensure_down_rows(self._down_format(down_format))
    self._build_predictor_pool([(a, b) for a, b in zip(fc1s, fc2s)])
    self._ensure_pred_rows()
    self.gate_cuts = self.contribution_cuts = None
    self.thresholds = thresholds
    self._pred = (self._pred_pool.pool, self._pred_pool.mats, self._pred_roles,
                  self._pred_needs, np.asarray(thresholds, np.float32)) + self._pred_rows

  def _ensure_pred_rows(self) -> None:
    """Builds the predicted FFN's gate and up rows unless held in the layout its gathered dots
    read fastest for the decoder's dot (`predicted_ffn.gather_kind`: Q4_0 / Q4_1 / Q8_0 as
    records with int8 dots, file blocks with f32 ones, whose records dot is a scalar loop).
    Called again when the dot changes; the old rows are dropped first (never both held), and
    if building fails the predicted FFN is left off."""
    layout = predicted_ffn.gather_kind(qblocks.KIND_CODES[self._up_kind()],
                                       self.dot == qmatmul.DOT_INT8)
    if self._pred_rows is not None and self._pred_rows[2] == layout:
      return
    head, thresholds = self._pred[:5], self.thresholds  # The kernel's arguments but the rows.
    self._pred_rows = None
    self.enable_predicted(None)
    self._pred_rows = (self._stacked_rows("gate", layout), self._stacked_rows("up", layout),
                       np.int64(layout))
    if thresholds is not None:  # A dot switch with the predicted FFN on: on again.
      self.thresholds = thresholds
      self._pred = head + self._pred_rows

  def _build_predictor_pool(self, pairs) -> None:
    """The predictors [(fc1, fc2)] per layer copied into a WeightPool of their own (packed for
    int8 products as the decoder's), and their role table for `layers_kernel`."""
    roles = [m for pair in pairs for m in pair]
    self._pred_pool = pool_lib.WeightPool(roles, self.dot == qmatmul.DOT_INT8)
    pooled = self._pred_pool.roles
    self.predictor_roles = [(pooled[2 * i], pooled[2 * i + 1]) for i in range(self.n_layers)]
    self._pred_roles = np.stack([r.ids for r in pooled]).reshape(
        self.n_layers, 2, pool_lib.MAX_PARTS)
    self._pred_needs = np.asarray([r.needs for r in pooled], np.int64).reshape(
        self.n_layers, 2, 2)
    if self.thresholds is not None:  # A dot switch: the kernel's argument follows the pool.
      self._pred = (self._pred_pool.pool, self._pred_pool.mats, self._pred_roles,
                    self._pred_needs) + self._pred[4:]

  def predictor_bytes(self) -> int:
    """GGUF block bytes of every layer's fc1 and fc2 (read by every predicted token); 0 when
    no predictor was given."""
    if self.predictor_roles is None:
      return 0
    return sum(m.file_bytes() for pair in self.predictor_roles for m in pair)

  def _build_up(self):
    """The gate-first up rows: every layer's Q4_1 (qs, d, m) or Q8_0 (q, d) arrays stacked
    [L, F, ...] (64-byte aligned), or for ReLU families one record per row (`_build_up_records`).
    """
    n_layers = self.n_layers
    stacked = None
    for i, layer in enumerate(self.layers):  # One layer's split copy at a time.
      arrays = layer.up.parts[0].qmatrix().arrays
      if stacked is None:
        stacked = tuple(common.empty_aligned((n_layers,) + a.shape, a.dtype) for a in arrays)
      for s, a in zip(stacked, arrays):
        s[i] = a
    if self.code in (common.FAMILY_CODES["reglu"], common.FAMILY_CODES["drelu"]):
      return self._build_up_records(stacked)
    return stacked

  @staticmethod
  def _build_up_records(parts):
    """The stacked up rows again, each row's codes and scales side by side in one record
    (views into u8[L, F, R], R the row's bytes rounded up to 64, every record on a cache line),
    for the gathered up pass of ReLU families (gate-first reads only the rows whose gate
    passes). One 2560-byte gathered read per 7B Q4_1 row instead of three (2048 + 256 + 256):
    the up pass at 50% / 25% of rows 708-758 -> 514-601 / 406-433 -> 282-302 us
    (BUILD_NOTES.md, issue 11)."""
    n_layers, f = parts[0].shape[:2]
    widths = [a.shape[2] * a.itemsize for a in parts]
    row = -(-sum(widths) // 64) * 64
    buf = common.empty_aligned((n_layers, f, row), np.uint8)
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
    return [float(common.cut_value(f"enable_gated: {name}", v)) for v in values]

  @property
  def down_format(self) -> str | None:
    """The format of the neuron-major down rows built ("q8_0" | "file"; kept while the
    sparse FFN is off), None before any."""
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
    recorded = [self.record_ffn(chunk, contribution).reshape(self.n_layers, -1)
                for chunk in chunks]
    values = np.concatenate(recorded, axis=1)
    return [float(np.quantile(v, sparsity)) for v in values]

  def record_ffn(self, tokens, contribution: bool = True) -> np.ndarray:
    """f32[L, T, F]: per layer and token, every FFN neuron's |act(gate . h, up . h)|
    (contribution=True) or |act_gate(gate . h)| as this decoder's products compute them, for
    tokens: int[T] run densely from position 0 in a cache of their own."""
    tokens = np.asarray(tokens).reshape(-1)
    saved = self.gate_cuts
    self.gate_cuts = None
    try:
      record = np.empty((self.n_layers, tokens.shape[0], self.intermediate_size), np.float32)
      self._forward(self.new_cache(1, tokens.shape[0]), tokens,
                    np.zeros(tokens.shape[0], np.int64), np.arange(tokens.shape[0]),
                    [tokens.shape[0] - 1], record,
                    RECORD_CONTRIBUTION if contribution else RECORD_GATE)
      return record
    finally:
      self.gate_cuts = saved

  def ffn_bytes_per_token(self, active_fraction: float | None = None,
                          passed_fraction: float | None = None) -> int:
    """FFN weight bytes one token reads (GGUF block bytes): dense, or gate-first with
    active_fraction of the neurons computed (their neuron-major down rows read: Q8_0, or Q4_1
    once `enable_gated` built those) and passed_fraction passing the gate (their up rows
    read; ReGLU/dReLU read more up rows than down rows). passed_fraction None: active_fraction
    times the ratio measured over this decoder's gate-first passes so far (`read_sums`), or
    active_fraction before any.

    Predicted FFN on (`enable_predicted`): active_fraction p is the fraction of neurons
    predicted (computed: their gate rows read), and
      bytes = predictor (every fc1, fc2) + sum_l (p gate_l + p_up up_l) + down(p_down),
    p_up = passed_fraction (None: p times the measured ratio of up rows to gate rows read,
    `pred_read_sums`), p_down = p times the measured ratio of down rows to gate rows read, and
    down(q) = (q per_block + fixed) x blocks of the neuron-major down rows (`DOWN_BLOCK_BYTES`).
    """
    if active_fraction is None:
      return sum(w.file_bytes() for layer in self.layers for w in (layer.gate, layer.up,
                                                                    layer.down))
    if self.thresholds is not None:
      gates, passed, nonzero = self.pred_read_sums
      ratio = (lambda v: v / gates) if gates > 0 else (lambda v: 1.0)
      if passed_fraction is None:
        passed_fraction = active_fraction * ratio(passed)
      per_block, fixed = gated_ffn.DOWN_BLOCK_BYTES[self._down_t[0].kind]
      blocks = sum(layer.down.shape[0] * layer.down.shape[1] // 32 for layer in self.layers)
      down_fraction = active_fraction * ratio(nonzero)
      return int(self.predictor_bytes() + sum(
          active_fraction * layer.gate.file_bytes() + passed_fraction * layer.up.file_bytes()
          for layer in self.layers) + (down_fraction * per_block + fixed) * blocks)
    if passed_fraction is None:
      active_sum, passed_sum = self.read_sums
      passed_fraction = active_fraction * (passed_sum / active_sum if active_sum > 0 else 1.0)
    kind = qmatmul.Q8_0 if self._down_t is None else self._down_t[0].kind
    per_block, fixed = gated_ffn.DOWN_BLOCK_BYTES[kind]
    blocks = sum(layer.down.shape[0] * layer.down.shape[1] // 32 for layer in self.layers)
    return int(sum(layer.gate.file_bytes() + passed_fraction * layer.up.file_bytes()
                   for layer in self.layers) + (active_fraction * per_block + fixed) * blocks)
