"""Hybrid sparse FFN: hot neurons on the device, cold neurons on the host, one jitted step.

Per layer and token (PowerInfer, arXiv 2312.12456 §4-5):
  1. the active set: the predictor's (logit >= cut, mode "predictor") or the true one computed
     densely from the layer's activity threshold (mode "oracle", for correctness checks);
  2. neurons are stored sorted by activation frequency, so the first `hot_count` are hot:
     the device computes y_dev = sum over active hot i of act(gate_i.h, up_i.h) * down_i
     (Pallas gather kernel on GPU for decode, the plain-jnp path on CPU) over int8 rows with
     one f32 scale per 32 values (Q8_0-style: 1.125 bytes per weight);
  3. the host computes the same over the active cold neurons, reading only their rows, on the
     host engine's quantized rows (`host_ops.cold_ffn`: the source GGUF's gate/up blocks,
     neuron-major Q8_0 down rows), reached by one `jax.pure_callback` per layer
     (`pijax.backends.bridge`: only h and the index vector cross it; the callback closes over
     the layer's host rows);
  4. y = y_dev + y_host.
Each token uses its own active set (prefill rows too), so every path computes the same
function: a dense FFN with the inactive neurons zeroed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from pijax.nn import transformer as model_lib
from pijax.backends import bridge
from pijax.offline import predictor as predictor_lib
from pijax.nn import sparsity
from pijax.arch.spec import ModelConfig
from pijax.errors import ConfigError

MODE_OFF = "off"
MODE_ORACLE = "oracle"
MODE_PREDICTOR = "predictor"
MODES = (MODE_OFF, MODE_ORACLE, MODE_PREDICTOR)
# Row formats of the hot (device) and cold (host) neurons: "int8" (the product: int8 device
# rows, the host engine's quantized rows) or "f32" (the test oracle: exact f32 rows on both
# sides, what transformers' dense model with neurons zeroed reproduces to 1e-5).
ROWS_INT8 = "int8"
ROWS_F32 = "f32"
ROW_FORMATS = (ROWS_INT8, ROWS_F32)


@dataclasses.dataclass(frozen=True)
class SparseSpec:
  """Static description of a hybrid run (hashable: part of the jit cache key).

  Attributes:
    mode: MODE_ORACLE or MODE_PREDICTOR.
    hot_counts: device-resident neurons per layer (the first hot_counts[l] stored neurons).
    host_layers: per layer, the cold rows (`host_ops.cold_ffn.QuantColdFFN`, or with f32 rows
      `host_ops.sparse_ffn.HostFFNWeights`; None: no cold rows). Objects hash by identity, so a
      spec is still a valid static argument.
    ranks: per-layer predictor rank (mode predictor, MLP predictors).
    use_pallas: compute the hot part of decode with the Pallas kernel (on a CPU backend in
      Pallas' interpreter: for tests).
    predictor_kind: "mlp" (fc2(relu(fc1(x)))) or "lowbit" (4-bit gate/up estimate), see
      `pijax.offline.predictor`.
    overlap: run the host part concurrently with the device's hot part: a first callback
      hands (h, ids) to a worker thread and returns at once, the device computes the hot
      part, and a second callback (which depends on the hot result) collects the host
      partial. Two callbacks per layer instead of one; measured in BUILD_NOTES.md (issue 4).
      Applies to host parts whose ids the device computed (not with host_predict).
    host_predict: low-bit predictor only: the host predicts its own (cold) neurons inside
      its callback, from a 4-bit copy kept in host RAM (`host_ops.lowbit`), so neither the
      cold codes nor the cold mask touch the device; the device predicts only its hot rows.
    prefill_dense_tokens: a forward pass over at least this many tokens (batch x sequence)
      computes every neuron (no active-set selection); 0 = never. Over a prefill chunk the
      union of the tokens' active sets is nearly every neuron, so selecting costs more than it
      skips (measured switch point: BUILD_NOTES.md, issue 4).
  """

  mode: str
  hot_counts: tuple[int, ...]
  host_layers: tuple[Any, ...]
  ranks: tuple[int, ...] = ()
  use_pallas: bool = False
  predictor_kind: str = "mlp"
  prefill_dense_tokens: int = 0
  overlap: bool = False
  host_predict: bool = False
  overlap_worker: Any = None  # pijax.backends.bridge.Overlap when overlap is on.
  row_format: str = ROWS_INT8  # ROW_FORMATS: the hot rows' params and the cold rows' class.

  def make_ffn(self, config: ModelConfig, layer: int, name: str) -> nn.Module:
    """The FFN module of `layer` (what `pijax.nn.transformer.Block` runs when given a spec)."""
    return HybridFFN(config, self, layer, name=name)


Q8_BLOCK = 32  # Values per f32 scale of the int8 rows (`pallas_kernels.sparse_ffn.Q8_BLOCK`).


def quantize_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """f32[n, D] -> (i8[n, D], f32[n, D/32]): Q8_0-style blocks of 32 (scale = max|block| / 127,
  q = round(value / scale)), as `pallas_kernels.sparse_ffn.quantize_rows_q8` (in NumPy, so a
  bundle's rows are quantized at load without a device copy of the f32 rows)."""
  from host_ops import quant
  q8 = quant.quantize_q8(np.asarray(rows, np.float32))
  return q8.q, q8.scales


def dequantize_rows(q: jax.Array, scales: jax.Array) -> jax.Array:
  """(i8[n, D], f32[n, D/32]) -> f32[n, D] = q * its block's scale."""
  n, d = q.shape
  blocks = q.astype(jnp.float32).reshape(n, d // Q8_BLOCK, Q8_BLOCK) * scales[..., None]
  return blocks.reshape(n, d)


def _cold_ids(cold_mask: jax.Array | None, n_cold: int) -> jax.Array:
  if cold_mask is None:
    return jnp.arange(n_cold, dtype=jnp.int32)
  return jnp.where(cold_mask, jnp.arange(cold_mask.shape[-1], dtype=jnp.int32), -1)


class HybridFFN(nn.Module):
  """The hybrid FFN of one layer (see the module docstring).

  Params (neuron-major, rows sorted by activation frequency):
    hot_{gate, up, down}: i8[n_hot, D] device-resident rows with hot_{gate, up, down}_scale:
      f32[n_hot, D/32] (row format int8; f32 rows: [n_hot, D] of the model dtype, no scales).
    fc1: f32[D, r], fc2: f32[r, F], cut: f32[], rms_bound: f32[] (mode predictor, MLP; tokens
      with residual rms above rms_bound run dense, see `pijax.offline.predictor.predict_active`).
    gate_codes, up_codes: uint8[F, D/2], gate_scales, up_scales: f16[F, D/32], cut: f32[]
      (mode predictor, low-bit: active when the estimated contribution >= cut).
    all/{gate, up}: [F, D] and threshold: f32[] (mode oracle: the true active set).
  """

  config: ModelConfig
  spec: SparseSpec
  layer: int

  @nn.compact
  def __call__(self, x: jax.Array, h: jax.Array) -> jax.Array:
    """x: [B, T, D] residual stream (predictor input); h: [B, T, D] normed FFN input."""
    cfg, spec = self.config, self.spec
    b, t, d = h.shape
    f = cfg.intermediate_size
    n_hot = spec.hot_counts[self.layer]
    zeros = nn.initializers.zeros
    # A pass over many tokens computes every neuron: the union of their active sets is
    # nearly all of them (SparseSpec.prefill_dense_tokens).
    dense = bool(spec.prefill_dense_tokens) and b * t >= spec.prefill_dense_tokens
    g_all = u_all = None
    if spec.mode == MODE_ORACLE:
      gate_all = self.param("all_gate", zeros, (f, d), h.dtype)
      up_all = self.param("all_up", zeros, (f, d), h.dtype)
      threshold = self.param("threshold", zeros, (), jnp.float32)
      if not dense:
        g_all = jnp.einsum("BTD,FD->BTF", h, gate_all, preferred_element_type=jnp.float32)
        u_all = jnp.einsum("BTD,FD->BTF", h, up_all, preferred_element_type=jnp.float32)
        mask = sparsity.active_mask(g_all, u_all, cfg.ffn_family, threshold)  # [B, T, F]
    elif spec.mode == MODE_PREDICTOR and spec.predictor_kind == predictor_lib.PREDICTOR_LOWBIT:
      blocks = d // predictor_lib.LOWBIT_BLOCK
      rows = n_hot if spec.host_predict else f  # Host-predicted rows stay in host RAM.
      pred = {name: self.param(name, zeros, shape, dtype) for name, shape, dtype in (
          ("gate_codes", (rows, d // 2), jnp.uint8), ("gate_scales", (rows, blocks), jnp.float16),
          ("up_codes", (rows, d // 2), jnp.uint8), ("up_scales", (rows, blocks), jnp.float16))}
      cut = self.param("cut", zeros, (), jnp.float32)
      if not dense:  # [B, T, rows]: the hot rows only when the host predicts its own.
        mask = predictor_lib.lowbit_contribution(pred, h, cfg.ffn_family) >= cut
    elif spec.mode == MODE_PREDICTOR:
      rank = spec.ranks[self.layer]
      fc1 = self.param("fc1", zeros, (d, rank), jnp.float32)
      fc2 = self.param("fc2", zeros, (rank, f), jnp.float32)
      cut = self.param("cut", zeros, (), jnp.float32)
      rms_bound = self.param("rms_bound", zeros, (), jnp.float32)
      if not dense:
        mask = predictor_lib.predict_active({"fc1": fc1, "fc2": fc2}, cut,
                                            x.astype(jnp.float32), rms_bound)  # [B, T, F]
    else:
      raise ValueError(f"unknown sparse mode {spec.mode!r}")
    if dense:
      mask = jnp.ones((b, t, f), bool)
    host_predicts = (spec.host_predict and not dense and n_hot < f
                     and spec.mode == MODE_PREDICTOR)
    if not host_predicts:
      self.sow("intermediates", "active_fraction", jnp.mean(mask.astype(jnp.float32)))
      self.sow("masks", "mask", mask)  # Only kept when applied with mutable=[..., "masks"].

    ticket = None
    if host_predicts:
      y_host, n_cold_active = bridge.cold_partial_predicted(spec.host_layers[self.layer],
                                                            h.reshape(b * t, d))
      hot_active = jnp.sum(mask[..., :n_hot], axis=-1).reshape(b * t) if n_hot else 0
      self.sow("intermediates", "active_fraction",
               jnp.mean((hot_active + n_cold_active).astype(jnp.float32)) / f)
      h_dev = h
    elif n_hot < f and spec.overlap:  # Start the host part before the device's hot part.
      cold_ids = _cold_ids(None if dense else mask[..., n_hot:].reshape(b * t, f - n_hot),
                           f - n_hot)
      ticket = spec.overlap_worker.start(self.layer, spec.host_layers[self.layer],
                                         h.reshape(b * t, d), cold_ids)
      h_dev, ticket = jax.lax.optimization_barrier((h, ticket))  # Hot part after the start.
    else:
      h_dev = h
    y = jnp.zeros((b, t, d), jnp.float32)
    if n_hot:
      int8 = spec.row_format == ROWS_INT8
      rows = [self.param(f"hot_{name}", zeros, (n_hot, d), jnp.int8 if int8 else h.dtype)
              for name in ("gate", "up", "down")]
      scales = [self.param(f"hot_{name}_scale", zeros, (n_hot, d // Q8_BLOCK), jnp.float32)
                for name in ("gate", "up", "down")] if int8 else None
      hot_mask = mask[..., :n_hot]
      if spec.use_pallas and b * t == 1:
        from pallas_kernels import sparse_ffn as pallas_ffn
        size = pallas_ffn.next_pow2(n_hot)
        idx = jnp.nonzero(hot_mask.reshape(-1), size=size, fill_value=-1)[0].astype(jnp.int32)
        y = y + pallas_ffn.sparse_ffn(h_dev.reshape(1, d), *rows, idx, family=cfg.ffn_family,
                                      scales=None if scales is None else tuple(scales),
                                      interpret=jax.default_backend() != "gpu"  # CPU tests.
                                      ).reshape(b, t, d)
      else:
        if int8:  # XLA: the rows dequantized in the step (XLA CPU converts them each step).
          rows = [dequantize_rows(q, sc).astype(h.dtype) for q, sc in zip(rows, scales)]
        hot_gate, hot_up, hot_down = rows
        if g_all is not None and not int8:  # Oracle, f32: computed for the mask already.
          g, u = g_all[..., :n_hot], u_all[..., :n_hot]
        else:
          g = jnp.einsum("BTD,ND->BTN", h_dev, hot_gate, preferred_element_type=jnp.float32)
          u = jnp.einsum("BTD,ND->BTN", h_dev, hot_up, preferred_element_type=jnp.float32)
        a = model_lib.ffn_activation(g, u, cfg.ffn_family) * hot_mask
        y = y + jnp.einsum("BTN,ND->BTD", a.astype(h.dtype), hot_down,
                           preferred_element_type=jnp.float32)
    if host_predicts:
      y = y + y_host.reshape(b, t, d)
    elif n_hot < f:
      if ticket is not None:
        y_host = spec.overlap_worker.finish(self.layer, ticket, y, b * t, d)
      else:
        cold_ids = _cold_ids(None if dense else mask[..., n_hot:].reshape(b * t, f - n_hot),
                             f - n_hot)
        y_host = bridge.cold_partial(spec.host_layers[self.layer], h.reshape(b * t, d),
                                     cold_ids)
      y = y + y_host.reshape(b, t, d)
    return y.astype(h.dtype)


def forward(params: Any, cache: model_lib.KVCache, tokens: jax.Array, pos: jax.Array, *,
            config: ModelConfig, kv_len: int, sparse: SparseSpec,
            logits_index: jax.Array | None = None
            ) -> tuple[jax.Array, model_lib.KVCache, jax.Array]:
  """Hybrid forward pass; returns (logits, cache, active_fraction f32[L]).

  active_fraction[l] is the fraction of layer l's FFN neurons active, averaged over tokens
  (measured FFN sparsity = 1 - its mean).
  """
  (logits, cache), state = model_lib.Transformer(config, kv_len, sparse).apply(
      {"params": params}, tokens, pos, cache, logits_index, mutable=["intermediates"])
  inter = state["intermediates"]
  active = jnp.stack([inter[f"layers_{i}"]["ffn"]["active_fraction"][0]
                      for i in range(config.n_layers)])
  return logits, cache, active


def forward_with_masks(params: Any, tokens: jax.Array, *, config: ModelConfig,
                       sparse: SparseSpec) -> tuple[jax.Array, jax.Array]:
  """Logits f32[B, T, V] of a fresh sequence and the active masks bool[L, B, T, F] used.

  For checking a hybrid run against an independent dense run that zeroes the same neurons.

  Raises:
    ValueError: a host-predicted spec (its cold masks never leave the host); build the spec
      with host_predict=False.
  """
  if sparse.host_predict:
    raise ValueError("forward_with_masks needs the whole mask on the device: configure the "
                     "sparse mode with host_predict=False.")
  b, t = tokens.shape
  cache = model_lib.init_cache(config, b, t)
  (logits, _), state = model_lib.Transformer(config, t, sparse).apply(
      {"params": params}, tokens, jnp.zeros((), jnp.int32), cache, None,
      mutable=["intermediates", "masks"])
  masks = jnp.stack([state["masks"][f"layers_{i}"]["ffn"]["mask"][0]
                     for i in range(config.n_layers)])
  return logits, masks


def hybrid_prefill(params, cache, tokens, length, *, config, kv_len, sparse, pos=0,
                   all_logits=False):
  """`pijax.nn.transformer.prefill` with the hybrid FFN; also returns active_fraction f32[L]."""
  index = None if all_logits else jnp.asarray(length, jnp.int32) - 1
  return forward(params, cache, tokens, jnp.asarray(pos, jnp.int32), config=config,
                 kv_len=kv_len, sparse=sparse, logits_index=index)


def hybrid_decode_step(params, cache, tokens, pos, *, config, kv_len, sparse):
  """`pijax.nn.transformer.decode_step` with the hybrid FFN; also returns active_fraction f32[L]."""
  return forward(params, cache, tokens[:, None], pos, config=config, kv_len=kv_len,
                 sparse=sparse, logits_index=jnp.zeros((), jnp.int32))


def build_hybrid(model, *, mode: str, hot_counts: list[int] | None = None,
                 oracle_threshold: float | None = None, use_pallas: bool | None = None,
                 threshold_scale: float = 1.0, cut_offset: float = 0.0,
                 predictor_kind: str = "auto", prefill_dense_tokens: int = 0,
                 overlap: bool = False, host_predict: bool | None = None,
                 row_format: str = ROWS_INT8, host_dot: str | None = None
                 ) -> tuple[SparseSpec, dict[str, Any]]:
  """Device params and host registrations for a bundle-loaded model.

  Args:
    model: engine Model with `.sparse` (a loaded bundle).
    mode: MODE_ORACLE or MODE_PREDICTOR.
    hot_counts: per-layer hot neurons (default: the bundle's placement).
    oracle_threshold: replaces every layer's contribution threshold in oracle mode (0 = every
      neuron active), for checking the split and merge.
    threshold_scale: multiplies every layer's contribution threshold (oracle mode, and the
      low-bit predictor's cut, which is that threshold): > 1 skips more neurons.
    cut_offset: added to every MLP predictor logit cut (predictor mode): > 0 skips more.
    predictor_kind: "mlp", "lowbit", or "auto" (a low-bit bundle's own predictor, else
      `default_predictor_kind`).
    prefill_dense_tokens, overlap: see `SparseSpec`.
    host_predict: see `SparseSpec` (default: on for the low-bit predictor).
    use_pallas: Pallas for the hot part of decode (default: when the backend is GPU).
    row_format: "int8" (hot rows int8 on the device, cold rows the host engine's: the source
      GGUF's gate/up blocks and Q8_0 down rows, `host_ops.cold_ffn`) or "f32" (exact f32 rows
      on both sides: the test oracle).
    host_dot: the cold part's products ("int8" default, or "f32"; row format int8 only).

  Returns:
    (spec, params): params is the model's param tree with each layer's "ffn" replaced by the
    HybridFFN params. The spec holds each layer's cold rows (QuantColdFFN, f32: HostFFNWeights).

  Raises:
    ConfigError: not a bundle, bad mode or hot counts.
  """
  from host_ops import cold_ffn
  from host_ops import sparse_ffn as host_ffn
  if model.sparse is None:
    raise ConfigError(f"{model.path}: --sparse={mode} needs a bundle made by pijax.convert; "
                      "this is a plain GGUF (run with --sparse=off or convert it).")
  if mode not in (MODE_ORACLE, MODE_PREDICTOR):
    raise ConfigError(f"--sparse={mode!r} must be one of {', '.join(MODES)}.")
  cfg = model.config
  if mode == MODE_PREDICTOR:
    predictor_kind = resolve_predictor_kind(model, predictor_kind)
  elif predictor_kind == "auto":  # Oracle mode reads no predictor.
    predictor_kind = default_predictor_kind(cfg.ffn_family)
  if predictor_kind not in predictor_lib.PREDICTOR_KINDS:
    raise ConfigError(f"--predictor_kind={predictor_kind!r} must be auto, "
                      f"{' or '.join(predictor_lib.PREDICTOR_KINDS)}.")
  if not (math.isfinite(threshold_scale) and threshold_scale >= 0):
    raise ConfigError(f"--threshold_scale={threshold_scale} must be a finite number >= 0 "
                      "(1 = the calibrated thresholds, 0 = every neuron active).")
  if math.isnan(cut_offset):
    raise ConfigError(f"--cut_offset={cut_offset} must be a number (0 = the calibrated cuts).")
  if overlap and host_predict:
    raise ConfigError("--overlap runs a device-predicted host part in a worker thread; it does "
                      "not combine with --host_predict (pass --nohost_predict with --overlap).")
  if host_predict is None:
    host_predict = default_host_predict(predictor_kind, overlap)
  host_predict = bool(host_predict) and mode == MODE_PREDICTOR and \
      predictor_kind == predictor_lib.PREDICTOR_LOWBIT
  check_row_format(row_format)
  from host_ops import qmatmul
  if host_dot is not None and host_dot not in qmatmul.DOTS:
    raise ConfigError(f"--host_dot={host_dot!r} must be one of {', '.join(qmatmul.DOTS)} "
                      "(the cold part's products on the host engine's rows).")
  if host_dot is not None and row_format != ROWS_INT8:
    raise ConfigError(f"host_dot applies to the int8 row format's host rows; row_format="
                      f"{row_format!r} computes exact f32 rows (drop host_dot).")
  if int(prefill_dense_tokens) < 0:
    raise ConfigError(f"--prefill_dense_tokens={prefill_dense_tokens} must be >= 0 (0 = never).")
  f = cfg.intermediate_size
  hot = list(model.sparse.hot_counts if hot_counts is None else hot_counts)
  if len(hot) != cfg.n_layers or any(not 0 <= int(n) <= f for n in hot):
    raise ConfigError(f"hot counts must be {cfg.n_layers} values in [0, {f}], got {hot}.")
  if use_pallas is None:
    use_pallas = jax.default_backend() == "gpu"
  dtype = model.dtype
  params = dict(model.params)
  bundle_rows = model.sparse.ffn  # Built with model.params (`pijax.bundle_load.attach`).
  int8 = row_format == ROWS_INT8
  file_rows = None
  if int8 and model.file_stamp is not None and any(int(n) < f for n in hot):
    # The cold gate/up rows: the source GGUF's own blocks (a model built in memory, with no
    # file: its rows re-quantized to Q8_0 below).
    from pijax import load_checks
    from pijax.backends import host as host_backend
    load_checks.check_unchanged(*model.file_stamp)  # Its blocks are read now.
    file_rows = host_backend.ffn_file_matrices(model.file_stamp[0], cfg)
  host_layers = []
  for i in range(cfg.n_layers):
    rows = bundle_rows[f"layers_{i}"]
    n_hot = int(hot[i])
    ffn: dict[str, Any] = {}
    if n_hot:
      for name in ("gate", "up", "down"):
        if int8:
          q, sc = quantize_rows(rows[name][:n_hot])
          ffn[f"hot_{name}"], ffn[f"hot_{name}_scale"] = jnp.asarray(q), jnp.asarray(sc)
        else:
          ffn[f"hot_{name}"] = jnp.asarray(rows[name][:n_hot], dtype)
    if mode == MODE_ORACLE:
      ffn["all_gate"] = jnp.asarray(rows["gate"], dtype)
      ffn["all_up"] = jnp.asarray(rows["up"], dtype)
      t = (model.sparse.thresholds[i] * threshold_scale if oracle_threshold is None
           else oracle_threshold)
      ffn["threshold"] = jnp.asarray(t, jnp.float32)
    elif predictor_kind == predictor_lib.PREDICTOR_LOWBIT:
      if model.sparse.lowbit is not None:  # Built by convert (same function, same rows).
        lowbit = {k: np.asarray(v) for k, v in model.sparse.lowbit[f"layers_{i}"].items()}
      else:
        lowbit = predictor_lib.lowbit_params(np.asarray(rows["gate"], np.float32),
                                             np.asarray(rows["up"], np.float32))
      # With host_predict the device holds (and reads) only its hot rows' codes.
      keep = n_hot if host_predict else f
      ffn.update({k: jnp.asarray(v[:keep]) for k, v in lowbit.items()})
      ffn["cut"] = jnp.asarray(model.sparse.thresholds[i] * threshold_scale, jnp.float32)
    else:
      pred = model.sparse.predictors[f"layers_{i}"]
      ffn["fc1"] = jnp.asarray(pred["fc1"], jnp.float32)
      ffn["fc2"] = jnp.asarray(pred["fc2"], jnp.float32)
      ffn["cut"] = jnp.asarray(model.sparse.cuts[i] + cut_offset, jnp.float32)
      ffn["rms_bound"] = jnp.asarray(model.sparse.rms_bounds[i], jnp.float32)
    if n_hot < f and int8:
      if file_rows is not None:
        cold = np.asarray(model.sparse.perm[i][n_hot:])  # File neuron ids, in bundle order.
        gate, up = (m.take_rows(cold) for m in file_rows[i])
        file_rows[i] = None  # This layer's whole matrices are no longer needed.
      else:
        gate, up = (qmatmul.quantize_q8_0(np.ascontiguousarray(rows[k][n_hot:], np.float32))
                    for k in ("gate", "up"))
      down_t = qmatmul.quantize_q8_0(np.ascontiguousarray(rows["down"][n_hot:], np.float32))
      weights = cold_ffn.QuantColdFFN(gate, up, down_t,
                                      cfg.ffn_family,
                                      dot=qmatmul.DOT_INT8 if host_dot is None else host_dot)
    elif n_hot < f:
      weights = host_ffn.HostFFNWeights(
          np.ascontiguousarray(rows["gate"][n_hot:], np.float32),
          np.ascontiguousarray(rows["up"][n_hot:], np.float32),
          np.ascontiguousarray(rows["down"][n_hot:], np.float32), cfg.ffn_family)
    if n_hot < f:
      if host_predict:
        from host_ops import lowbit as host_lowbit
        weights.lowbit = host_lowbit.LowbitPredictor(
            lowbit["gate_codes"][n_hot:], lowbit["gate_scales"][n_hot:].astype(np.float32),
            lowbit["up_codes"][n_hot:], lowbit["up_scales"][n_hot:].astype(np.float32),
            float(model.sparse.thresholds[i] * threshold_scale))
      host_layers.append(weights)
    else:
      host_layers.append(None)
    layer = dict(params[f"layers_{i}"])
    layer["ffn"] = ffn
    params[f"layers_{i}"] = layer
  ranks = tuple(int(model.sparse.predictors[f"layers_{i}"]["fc1"].shape[1])
                if model.sparse.predictors else 0 for i in range(cfg.n_layers))
  spec = SparseSpec(mode=mode, hot_counts=tuple(int(n) for n in hot),
                    host_layers=tuple(host_layers), ranks=ranks, use_pallas=bool(use_pallas),
                    predictor_kind=predictor_kind, prefill_dense_tokens=int(prefill_dense_tokens),
                    overlap=bool(overlap), host_predict=host_predict,
                    overlap_worker=bridge.Overlap() if overlap else None,
                    row_format=row_format)
  return spec, params


def check_row_format(row_format: str) -> str:
  """row_format, or ConfigError when it is not one of ROW_FORMATS."""
  if row_format not in ROW_FORMATS:
    raise ConfigError(f"row_format={row_format!r} must be one of {', '.join(ROW_FORMATS)}.")
  return row_format


def default_host_predict(predictor_kind: str, overlap: bool) -> bool:
  """--host_predict's default: on for the low-bit predictor, unless --overlap asks."""
  return predictor_kind == predictor_lib.PREDICTOR_LOWBIT and not overlap


def resolve_predictor_kind(model, kind: str) -> str:
  """The predictor a predictor-mode run of a bundle-loaded `model` uses: "auto" is the bundle's
  low-bit predictor when convert built one, else the family's (`default_predictor_kind`).

  Raises:
    ConfigError: not auto, mlp or lowbit; mlp on a bundle that holds no MLP predictors.
  """
  if kind == "auto":
    kind = predictor_lib.PREDICTOR_LOWBIT \
        if model.sparse.predictor_kind == predictor_lib.PREDICTOR_LOWBIT \
        else default_predictor_kind(model.config.ffn_family)
  if kind not in predictor_lib.PREDICTOR_KINDS:
    raise ConfigError(f"--predictor_kind={kind!r} must be auto, "
                      f"{' or '.join(predictor_lib.PREDICTOR_KINDS)}.")
  if kind == predictor_lib.PREDICTOR_MLP and not model.sparse.predictors:
    raise ConfigError(f"{model.path}: this bundle holds the low-bit predictor, not MLP "
                      "predictors; use --predictor_kind=auto (or lowbit), or re-convert with "
                      "--predictor_kind=mlp.")
  return kind


def default_predictor_kind(family: str) -> str:
  """"mlp" for ReLU families (exact zeros: PowerInfer's predictors work), "lowbit" for
  SwiGLU/GeGLU, whose contributions the MLP predictors could not rank (`pijax.offline.predictor`)."""
  return predictor_lib.PREDICTOR_MLP if sparsity.has_exact_zeros(family) else \
      predictor_lib.PREDICTOR_LOWBIT
