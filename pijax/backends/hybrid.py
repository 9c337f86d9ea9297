"""The hybrid sparse backend (PowerInfer, arXiv 2312.12456 §4-5): hot FFN neurons on the device,
cold ones on the host, active sets from predictors (or the oracle); attention and everything
outside the FFN in XLA. The FFN itself is `pijax.nn.hybrid.HybridFFN`."""

from __future__ import annotations

import math
from typing import Any

from pijax.arch.spec import ModelConfig
from pijax.backends import base
from pijax.backends import xla
from pijax.errors import ConfigError
from pijax.nn import hybrid as hybrid_lib
from pijax.offline import placement as placement_lib
from pijax.offline import predictor as predictor_lib


class HybridBackend(xla.XlaBackend):
  """A bundle run in a sparse mode: the XLA backend's device params and KV cache, with the
  FFN of every layer replaced by `pijax.nn.hybrid.HybridFFN`.

  Args:
    config: ModelConfig.
    spec: pijax.nn.hybrid.SparseSpec (static: mode, hot counts, the host rows of each layer).
    params: the hybrid param tree (`pijax.nn.hybrid.build_hybrid`).
    dtype: numpy dtype of the device params and KV cache.
  """

  name = "hybrid"
  # Sparse bundles are converted and tested for llama-family files only: other families are
  # refused by name until `pijax.convert` handles them.
  implemented_switches = frozenset()

  def __init__(self, config: ModelConfig, spec: hybrid_lib.SparseSpec, params: Any, dtype: Any):
    super().__init__(config, params, dtype)
    self.spec = spec

  @property
  def mode(self) -> str:
    return self.spec.mode

  @property
  def label(self) -> str:
    """How the weights are held, e.g. "float32 + int8 hot + q4_1/q8_0 host int8": the XLA
    part's dtype, then (int8 row format) the hot rows and the cold rows' gate/up + down kinds
    and products."""
    spec = self.spec
    if spec.row_format != hybrid_lib.ROWS_INT8:
      return f"{self.dtype} (f32 hot and cold rows)"
    parts = [str(self.dtype)]
    if any(spec.hot_counts):
      parts.append("int8 hot")
    cold = [w for w in spec.host_layers if w is not None]
    if cold:
      kinds = sorted({w.kind for w in cold} | {w.down_t.kind for w in cold})
      parts.append(f"{'/'.join(kinds)} host {cold[0].dot}")
    return " + ".join(parts)

  def prefill(self, params, state, tokens, length, pos, *, kv_len, all_logits):
    return hybrid_lib.hybrid_prefill(params, state, tokens, length, config=self.config,
                                     kv_len=kv_len, sparse=self.spec, pos=pos,
                                     all_logits=all_logits)

  def decode(self, params, state, tokens, pos, *, kv_len):
    return hybrid_lib.hybrid_decode_step(params, state, tokens, pos, config=self.config,
                                         kv_len=kv_len, sparse=self.spec)

  def weight_bytes_per_token(self, ffn_sparsity: float = 0.0) -> tuple[int, int]:
    """Everything but the FFN, plus predictors (f32 MLP or 4-bit low-bit), plus every hot row
    (the CPU path reads every hot row; the GPU kernel only active ones; int8 rows:
    `placement.int8_neuron_bytes` per neuron), plus the active share of the cold rows
    (approximated by the overall active share; each layer's host bytes per neuron)."""
    cfg, spec = self.config, self.spec
    item = self.dtype.itemsize
    total = cfg.n_params() * item
    ffn = 3 * cfg.hidden_size * cfg.intermediate_size * cfg.n_layers * item
    neuron = 3 * cfg.hidden_size * item
    hot_neuron = placement_lib.int8_neuron_bytes(cfg) \
        if spec.row_format == hybrid_lib.ROWS_INT8 else neuron
    hot = sum(spec.hot_counts) * hot_neuron
    cold = sum((cfg.intermediate_size - n) * (w.bytes_per_neuron if w is not None else 0)
               for n, w in zip(spec.hot_counts, spec.host_layers))
    if spec.mode == hybrid_lib.MODE_PREDICTOR and \
        spec.predictor_kind == predictor_lib.PREDICTOR_LOWBIT:
      pred = predictor_lib.lowbit_bytes(cfg.hidden_size, cfg.intermediate_size) * cfg.n_layers
    elif spec.mode == hybrid_lib.MODE_PREDICTOR:
      pred = sum(4 * r * (cfg.hidden_size + cfg.intermediate_size) for r in spec.ranks)
    else:  # Oracle: the whole gate and up matrices decide the active set.
      pred = 2 * cfg.hidden_size * cfg.intermediate_size * cfg.n_layers * item
    return int(total - ffn + hot + (1.0 - ffn_sparsity) * cold + pred), total



def replace_counts(model, *, hot_ratio: float | None = None,
                   device_budget_gb: float | None = None, predictor_kind: str | None = None,
                   host_predict: bool = True) -> list[int]:
  """Per-layer hot counts of a bundle-loaded `model`, re-placed from the bundle's activation
  frequencies for a hot ratio or a device budget (`pijax.offline.placement.place`).

  predictor_kind: the predictor that will run ("mlp": its ranks count; "lowbit": the codes of
  the hot rows with host_predict, of every row without; None: the bundle's own).

  Raises:
    ConfigError: not a bundle, or a budget that is not a finite number > 0.
    BudgetError: the budget is too small for the dense part.
  """
  if model.sparse is None:
    raise ConfigError(f"{model.path}: re-placing neurons needs a bundle (pijax.convert).")
  if device_budget_gb is not None and not (device_budget_gb > 0
                                           and math.isfinite(device_budget_gb)):
    raise ConfigError(f"--device_budget_gb={device_budget_gb} must be a finite number > 0 "
                      "(GB = 1e9 bytes); omit it for no re-placement.")
  cfg = model.config
  kind = model.sparse.predictor_kind if predictor_kind is None else predictor_kind
  ranks = [int(layer["predictor_rank"]) for layer in model.sparse.manifest["layers"]]
  per_neuron, dense_codes = 0, None
  if kind == predictor_lib.PREDICTOR_LOWBIT:
    ranks = []  # No MLP predictor goes to the device.
    if host_predict:
      per_neuron = predictor_lib.hot_neuron_bytes(cfg.hidden_size, kind)
    else:
      dense_codes = predictor_lib.lowbit_bytes(cfg.hidden_size, cfg.intermediate_size) * \
          cfg.n_layers
  placement = placement_lib.place(
      cfg, model.sparse.frequencies,
      budget_bytes=None if device_budget_gb is None else int(device_budget_gb * 1e9),
      max_seq_len=model.max_seq_len, dtype_bytes=model.dtype.itemsize, predictor_ranks=ranks,
      tile=int(model.sparse.manifest["placement"].get("tile", 64)), hot_ratio=hot_ratio,
      predictor_neuron_bytes=per_neuron, predictor_bytes=dense_codes,
      hot_neuron_bytes=placement_lib.int8_neuron_bytes(cfg))
  return list(placement.hot_counts)


def for_model(model, mode: str = hybrid_lib.MODE_OFF, *, hot_ratio: float | None = None,
              device_budget_gb: float | None = None, host_threads: int | None = None,
              oracle_threshold: float | None = None, threshold_scale: float = 1.0,
              cut_offset: float = 0.0, predictor_kind: str = "auto",
              prefill_dense_tokens: int = 0, overlap: bool = False,
              host_predict: bool | None = None, use_pallas: bool | None = None,
              row_format: str = hybrid_lib.ROWS_INT8, host_dot: str | None = None
              ) -> base.Backend:
  """The backend for `model` (`pijax.engine.Model`) in sparse mode `mode`.

  Args:
    mode: "off" (dense: the model's dense backend, XLA after a sparse one) | "oracle" |
      "predictor" (sparse modes need a bundle).
    hot_ratio: re-place at load: this fraction of each layer's neurons is hot.
    device_budget_gb: re-place at load with the MILP for this device budget (1e9 bytes).
    host_threads: numba threads for the cold neurons.
    oracle_threshold: replaces the contribution thresholds in oracle mode (0 = all active).
    threshold_scale: multiplies the contribution thresholds (oracle mode; in predictor mode
      the low-bit predictor's cuts, which are those thresholds).
    cut_offset: added to the MLP predictor logit cuts (predictor mode; > 0 skips more).
    predictor_kind: "auto" (the bundle's low-bit predictor when convert built one, else
      low-bit for SwiGLU/GeGLU and MLP for ReLU families), "mlp" or "lowbit" (see
      `pijax.offline.predictor`).
    prefill_dense_tokens, overlap, host_predict: see `pijax.nn.hybrid.SparseSpec`.
    use_pallas: force the Pallas kernel for the hot part of decode (default: on GPU).
    row_format, host_dot: see `pijax.nn.hybrid.build_hybrid` ("int8": the product; "f32":
      the exact test oracle).

  Raises:
    ConfigError: bad mode, a plain GGUF with a sparse mode, bad hot_ratio or thread count.
    BudgetError: the budget is too small for the dense part.
  """
  from pijax.backends import host
  if mode not in hybrid_lib.MODES:
    raise ConfigError(f"--sparse={mode!r} must be one of {', '.join(hybrid_lib.MODES)}.")
  if host_threads is not None:
    host.set_threads(host_threads)
  if mode == hybrid_lib.MODE_OFF:  # Dense: leave a dense backend (XLA or host) as it is.
    if isinstance(model.backend, HybridBackend):
      return xla.XlaBackend(model.config, model.params, model.dtype)
    if isinstance(model.backend, host.HostBackend) and model.backend.bundle_mode is None:
      # A GGUF's host weights: its sparse FFN off (the copies kept for a later switch).
      model.backend.decoder.enable_gated(None)
      model.backend.decoder.enable_predicted(None)
    return model.backend
  hot_counts = None
  if hot_ratio is not None or device_budget_gb is not None:
    kind = None  # Oracle mode: the bundle's accounting.
    if mode == hybrid_lib.MODE_PREDICTOR and model.sparse is not None:
      kind = hybrid_lib.resolve_predictor_kind(model, predictor_kind)
    hot_counts = replace_counts(
        model, hot_ratio=hot_ratio, device_budget_gb=device_budget_gb, predictor_kind=kind,
        host_predict=hybrid_lib.default_host_predict(kind, overlap) if host_predict is None
        else bool(host_predict))
  spec, params = hybrid_lib.build_hybrid(
      model, mode=mode, hot_counts=hot_counts, oracle_threshold=oracle_threshold,
      threshold_scale=threshold_scale, cut_offset=cut_offset, predictor_kind=predictor_kind,
      prefill_dense_tokens=prefill_dense_tokens, overlap=overlap, host_predict=host_predict,
      use_pallas=use_pallas, row_format=row_format, host_dot=host_dot)
  return HybridBackend(model.config, spec, params, model.dtype)
