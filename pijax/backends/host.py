"""The host backend: the whole decoder in numba on the GGUF's own quantized blocks, KV caches in
host RAM, one `io_callback` per forward pass; XLA only samples.

On a CPU backend every decode token reads every weight, and XLA reads only f32 fast, so the dense
f32 path reads 538 MB per SmolLM2 token where the file's Q4_1 blocks and Q8_0 embedding read 97 MB
on the same weight values (activations stay f32).

Weight formats (`--host_weights`):
  "gguf": tensors of a type a host kernel reads (`qmatmul.GGML_KINDS`: Q4_0, Q4_1, Q5_0, Q5_1,
    Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16) keep their blocks (lossless); any other type (F32, other
    quants) is dequantized and re-quantized to Q8_0, with one stderr line saying so. A layer's
    q, k, v keep their own formats when the file mixes them (`qconcat.RowConcat`).
  "q8_0": every matrix in Q8_0 (Q8_0 tensors kept, the rest re-quantized from their f32 values).
"auto" picks "gguf" on a CPU backend for a float32 run of a GGUF whose matrices are all of those
types, token embedding and output head included (nothing re-quantized), and "off" (the XLA
backend) otherwise.
"""

from __future__ import annotations

import itertools
import os
import sys
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

import host_ops
from host_ops import decoder as decoder_lib
from host_ops import gated_ffn
from host_ops import pool as pool_lib
from host_ops import predicted_ffn
from host_ops import qconcat
from host_ops import qmatmul
from pijax.formats import gguf as gguf_io
from pijax.formats import loader
from pijax.arch import spec
from pijax.arch.spec import ModelConfig
from pijax.backends import base
from pijax import heap
from pijax import steps as steps_lib
from pijax.backends import bridge
from pijax.config import FFN_FAMILIES, ROPE_ADJACENT
from pijax.errors import ConfigError, GGUFError

WEIGHTS_OFF = "off"
WEIGHTS_GGUF = "gguf"
WEIGHTS_Q8_0 = "q8_0"
WEIGHTS_AUTO = "auto"
WEIGHT_CHOICES = (WEIGHTS_AUTO, WEIGHTS_OFF, WEIGHTS_GGUF, WEIGHTS_Q8_0)
# What the calibrated cuts of --sparse=gate|contribution apply to (`build`).
GATE_RULE_GATE = "gate"
GATE_RULE_CONTRIBUTION = "contribution"
GATE_RULES = (GATE_RULE_GATE, GATE_RULE_CONTRIBUTION)
# GGML type name -> host kernel format, for every type a host kernel reads from its blocks.
_KEPT_TYPES = qmatmul.GGML_KINDS


def _tensor_kind(tensor: Any) -> str | None:
  return _KEPT_TYPES.get(tensor.tensor_type.name)


def _read_matrix(reader, tensors: dict[str, Any], plan: dict, path: str, weights: str,
                 requantized: dict[str, int], role: str, layer: int | None,
                 packed_head: bool | None = None):
  """One role's matrix of a GGUF (`loader.weight_plan`'s `plan`), kept in its blocks when
  allowed (`weights` "gguf", or a Q8_0 tensor), else re-quantized to Q8_0 (counted by GGML
  type in `requantized` under "gguf"). packed_head (the head's tied flag, None: not the head
  or f32 products): a Q8_0 head `pool.head_packable` accepts is packed straight from the map
  (`pool.PackedMatrix`, chunk by chunk: no split copy beside the packed one).

  Raises:
    GGUFError: a missing tensor, or NaN / inf scales.
  """
  where, shape = plan[role, layer]
  if where.name not in tensors:
    raise GGUFError(f"{path}: tensor {where.name!r} is missing; the file is incomplete.")
  t = tensors[where.name]
  rows = loader.slice_rows(t, where, shape, path)
  kind = _tensor_kind(t)
  if kind is not None and (weights == WEIGHTS_GGUF or kind == qmatmul.Q8_0) and \
      shape[1] % qmatmul.block_size(kind) == 0:
    first = 0 if rows is None else rows[0]
    data = t.data if rows is None else t.data[rows[0]:rows[1]]
    row_bytes = t.n_bytes // t.data.shape[0]

    def copied(lo: int, hi: int) -> None:  # Rows copied out of the map: their pages may go.
      reader.release_pages(t.data_offset + (first + lo) * row_bytes, (hi - lo) * row_bytes)

    if packed_head is not None and kind == qmatmul.Q8_0 and \
        pool_lib.head_packable(kind, shape, packed_head):
      blocks = np.ascontiguousarray(data).reshape(-1).view(np.uint8).reshape(shape[0], -1)
      m = pool_lib.PackedMatrix.from_rows(kind, lambda lo, hi: blocks[lo:hi], shape, copied)
    else:
      m = qmatmul.from_gguf_blocks(kind, data, shape, copied=copied)
    if not m.all_finite():  # The f16 scales (codes are integers), checked in place.
      raise GGUFError(f"{path}: tensor {t.name!r} holds NaN or inf values; the file is "
                      "corrupt (re-download or re-convert it).")
    return m
  if weights == WEIGHTS_GGUF:
    requantized[t.tensor_type.name] = requantized.get(t.tensor_type.name, 0) + 1
  return qmatmul.quantize_q8_0(loader.read_weight(tensors, where, shape, path))


def ffn_file_matrices(path: str | os.PathLike[str], config: ModelConfig
                      ) -> list[tuple[qmatmul.QMatrix, qmatmul.QMatrix]]:
  """Per layer, (gate, up): QMatrix [F, D] of the GGUF's FFN gate and up projections in the
  file's own blocks (types no host kernel reads re-quantized to Q8_0, as `build_decoder`'s
  "gguf"): the rows the hybrid backend's cold part gathers (`host_ops.cold_ffn`).

  Raises:
    GGUFError: missing tensors or corrupt scales.
  """
  path = os.fspath(path)
  reader, _ = gguf_io.open_gguf(path)
  tensors = {t.name: t for t in reader.tensors}
  plan = {(role, i): (where, shape) for role, i, where, shape in loader.weight_plan(config, path)}
  out = [tuple(_read_matrix(reader, tensors, plan, path, WEIGHTS_GGUF, {}, role, i)
               for role in ("gate", "up")) for i in range(config.n_layers)]
  reader.release_pages()
  return out


def file_is_block_quantized(path: str | os.PathLike[str]) -> bool:
  """True when every matrix of the GGUF (layers, token embedding, output head) is of a type a
  host kernel reads (`qmatmul.GGML_KINDS`), so "gguf" re-quantizes nothing."""
  reader, _ = gguf_io.open_gguf(os.fspath(path))
  mats = [t for t in reader.tensors if len(t.shape) == 2]
  return bool(mats) and all(_tensor_kind(t) is not None for t in mats)


def build_decoder(path: str | os.PathLike[str], config: ModelConfig, weights: str,
                  dot: str = qmatmul.DOT_INT8) -> decoder_lib.HostDecoder:
  """Reads a GGUF, through its family's tensor map, into a HostDecoder in the `weights` format
  ("gguf" | "q8_0") with decode products in `dot` ("int8" | "f32").

  Raises:
    GGUFError: missing tensors or types gguf cannot dequantize.
    ConfigError: an unknown weights format, sizes not a multiple of the block, a non-gated FFN.
  """
  if weights not in (WEIGHTS_GGUF, WEIGHTS_Q8_0):
    raise ConfigError(f"--host_weights={weights!r}: build needs 'gguf' or 'q8_0'.")
  path = os.fspath(path)
  if config.ffn_family not in FFN_FAMILIES:
    raise ConfigError(f"--host_weights needs a gated FFN (swiglu, reglu, drelu); this model's "
                      f"FFN is {config.ffn_family}; use --host_weights=off.")
  if config.hidden_size % qmatmul.BLOCK or config.intermediate_size % qmatmul.BLOCK:
    raise ConfigError(f"--host_weights={weights}: {path} has hidden_size {config.hidden_size} / "
                      f"intermediate_size {config.intermediate_size}, not multiples of "
                      f"{qmatmul.BLOCK} (the block size); use --host_weights=off.")
  reader, _ = gguf_io.open_gguf(path)
  tensors = {t.name: t for t in reader.tensors}
  plan = {(role, i): (where, shape) for role, i, where, shape in loader.weight_plan(config, path)}
  requantized: dict[str, int] = {}  # GGML type -> tensors re-quantized to Q8_0.
  head_role = "embedding" if config.tied_output else "lm_head"

  def f32(role: str, layer: int | None = None) -> np.ndarray:
    return loader.read_weight(tensors, *plan[role, layer], path)

  def one(role: str, layer: int | None) -> qmatmul.QMatrix:
    pack = (role == head_role and dot == qmatmul.DOT_INT8)  # `_read_matrix` checks the rest.
    return _read_matrix(reader, tensors, plan, path, weights, requantized, role, layer,
                        packed_head=config.tied_output if pack else None)

  def matrix(roles: list[str], layer: int | None = None):
    """The roles' matrices stacked by rows (one QMatrix when they share a format)."""
    mats = [one(role, layer) for role in roles]
    if len(mats) == 1:
      return mats[0]
    if len({m.kind for m in mats}) == 1:
      stacked = qmatmul.stack_rows(mats)  # A copy: the sources' file pages may go.
      for role in roles:
        t = tensors[plan[role, layer][0].name]
        reader.release_pages(t.data_offset, t.n_bytes)
      return stacked
    return qconcat.RowConcat(mats)

  def extra(role: str, layer: int) -> np.ndarray | None:
    return f32(role, layer) if (role, layer) in plan else None

  layers = []
  for i in range(config.n_layers):
    bias = None
    if config.qkv_bias:
      bias = np.concatenate([f32("q_bias", i), f32("k_bias", i), f32("v_bias", i)])
    layers.append(decoder_lib.HostLayer(
        attn_norm=f32("attn_norm", i),
        qkv=matrix(["q", "k", "v"], i),
        attn_out=matrix(["o"], i),
        ffn_norm=f32("ffn_norm", i),
        gate=matrix(["gate"], i),
        up=matrix(["up"], i),
        down=matrix(["down"], i),
        qkv_bias=bias, q_norm=extra("q_norm", i), k_norm=extra("k_norm", i),
        post_attn_norm=extra("post_attn_norm", i), post_ffn_norm=extra("post_ffn_norm", i)))
  embedding = matrix(["embedding"])
  head = embedding if config.tied_output else matrix(["lm_head"])
  if requantized:
    print(f"pijax: {path}: no host kernel for "
          f"{', '.join(f'{n} {k}' for k, n in sorted(requantized.items()))} tensor(s); "
          "re-quantized them to Q8_0 at load.", file=sys.stderr)
  dec = decoder_lib.HostDecoder(
      embedding, layers, f32("final_norm"), head, eps=config.rms_norm_eps,
      family=config.ffn_family, n_heads=config.n_heads, n_kv_heads=config.n_kv_heads,
      head_dim=config.head_dim, rope_theta=config.rope_theta, rope_dim=config.rope_dim,
      rope_scale=config.rope_scale, rope_adjacent=config.rope_style == ROPE_ADJACENT,
      layer_rope=[config.rope_params(i) for i in range(config.n_layers)],
      windows=[config.sliding_window if config.is_local(i) else 0
               for i in range(config.n_layers)],
      attn_scale=config.attention_scale, embedding_scale=config.embedding_scale, dot=dot)
  # The copies are made: the file's pages read so far leave the resident set (blocks kept
  # as views of the map fault back in as decoding reads them).
  reader.release_pages()  # The f32 norms and re-quantized tensors were read too.
  return dec


@flax.struct.dataclass
class HostState:
  """The decode state of the host backend: which of its host KV caches a sequence uses.

  cache_id: i32[1] (a traced value, so one executable serves every cache).
  """

  cache_id: jax.Array


# State ids are unique in the process, so a state handed to another backend finds no cache
# (an error) instead of another sequence's.
_STATE_IDS = itertools.count(1)


class HostBackend(base.Backend):
  """Quantized host weights; the backend owns the host KV caches of its sequences.

  Args:
    config: ModelConfig.
    decoder: host_ops.decoder.HostDecoder built by `build_decoder`.
    weights: "gguf" | "q8_0" (the format it was built in).
  """

  name = "host"
  # Sampling compiled apart, with XLA's loop emitters: its MLIR fusion emitters take ~100 MB of
  # transient compile heap for the sampler, the loop emitters ~25 MB, at the same speed. Apart,
  # because in one program with the callback those emitters move the callback off the calling
  # thread, and numba's OpenMP pools then starve each other (BUILD_NOTES, "Memory and load time").
  # None: forward pass and sampling compiled as one program (`compile_step`).
  sampler_compiler_options: dict[str, Any] | None = {"xla_cpu_use_fusion_emitters": False}
  implemented_switches = frozenset(spec.SWITCHES)  # Every family's switches.

  def __init__(self, config: ModelConfig, decoder: decoder_lib.HostDecoder, weights: str,
               bundle_mode: str | None = None):
    super().__init__(config)
    self.decoder = decoder
    self.weights = weights
    # A bundle's --sparse mode when the backend runs one (`for_bundle`): the stats line says
    # "predictor", the rule in force is the decoder's.
    self.bundle_mode = bundle_mode
    self._caches: dict[int, decoder_lib.HostKVCache] = {}

  @property
  def label(self) -> str:
    dec = self.decoder
    kinds = {w.kind for layer in dec.layers for w in layer.matrices()} | {dec.lm_head.kind}
    # The dot mode is part of the label (bench rows, stats line): int8 and f32 runs differ.
    # F16 / BF16 matrices always multiply in f32: a file of only those says so.
    dot = dec.dot if kinds - {qmatmul.F16, qmatmul.BF16} else qmatmul.DOT_F32
    return "+".join(sorted(kinds)) + f" host {dot}"

  @property
  def mode(self) -> str:
    if self.bundle_mode is not None:
      return self.bundle_mode
    if self.decoder.thresholds is not None:
      return "predictor"
    if self.decoder.gate_cuts is None:
      return "off"
    return "gate" if self.decoder.contribution_cuts is None else "contribution"

  @property
  def weights_format(self) -> str:
    return self.weights

  @property
  def params(self) -> Any:
    return {}  # The weights live in the host decoder.

  # ----------------------------------------------------------------------------- state
  def init_state(self, batch: int, max_seq_len: int) -> HostState:
    cache_id = next(_STATE_IDS)
    self._caches[cache_id] = self.decoder.new_cache(batch, max_seq_len)
    return HostState(cache_id=jnp.asarray([cache_id], jnp.int32))

  def releaser(self, state: HostState):
    cache_id = int(np.asarray(state.cache_id)[0])
    return lambda: self._caches.pop(cache_id, None)

  def host_cache(self, state: HostState) -> decoder_lib.HostKVCache:
    """The host KV cache behind a state (ConfigError if it was released)."""
    try:
      return self._caches[int(np.asarray(state.cache_id)[0])]
    except KeyError:
      raise ConfigError("this decode state's host KV cache was released (or belongs to "
                        "another backend); start from init_state.") from None

  @property
  def live_states(self) -> int:
    """How many host KV caches this backend holds."""
    return len(self._caches)

  # ----------------------------------------------------------------------------- steps
  def _forward_cb(self, all_rows: bool, cache_id, tokens, pos, index):
    try:
      cache = self._caches[int(np.asarray(cache_id)[0])]
    except KeyError:
      raise ConfigError("a host KV cache was used after release_state.") from None
    b, t = tokens.shape
    rows = None if all_rows else np.arange(b) * t + int(index)
    logits = self.decoder.forward(cache, np.asarray(tokens), int(pos), rows)
    if all_rows:
      logits = logits.reshape(b, t, self.config.vocab_size)
    return logits, self.decoder.last_active.astype(np.float32)

  def _forward(self, state: HostState, tokens, pos, index):
    b, t = tokens.shape
    all_rows = index is None
    shape = (b, t, self.config.vocab_size) if all_rows else (b, self.config.vocab_size)
    out = (jax.ShapeDtypeStruct(shape, jnp.float32),
           jax.ShapeDtypeStruct((self.config.n_layers,), jnp.float32))
    logits, active = bridge.host_forward(
        lambda *args: self._forward_cb(all_rows, *args), state.cache_id, tokens, pos,
        jnp.zeros((), jnp.int32) if all_rows else index, out)
    return logits, state, active

  # ----------------------------------------------------------------------------- compiling
  def attention_window(self, needed: int, max_seq_len: int) -> int:
    del needed, max_seq_len  # The host attends exactly [0, pos + T): one executable for all.
    return 0

  def compile_step(self, kind, kv_len, args, shared):
    """Sampling steps as the forward pass called directly (`eager_forward`) then a sampler
    compiled apart (`sampler_compiler_options`); the other steps as one program."""
    if self.sampler_compiler_options is None or kind not in steps_lib.SPLIT_STEPS:
      return super().compile_step(kind, kv_len, args, shared)
    return steps_lib.compile_split(kind, self, kv_len, args, forward=self.eager_forward(kind),
                                   sampler_options=self.sampler_compiler_options,
                                   shared=shared)

  def eager_forward(self, kind):
    """The sampling steps' forward pass (`prefill` for kind "prefill*", all_logits False;
    `decode` for "decode*") as a plain function of host values, same arguments (without the
    keywords) and results, called directly: the io_callback around it cost ~0.9 ms of XLA
    dispatch and copies per SmolLM2 token (6.5 against 5.6 ms; BUILD_NOTES.md, issue 11)."""
    if kind.startswith("decode"):
      return lambda params, state, tokens, pos: self._forward_now(
          state, np.asarray(tokens)[:, None], pos, 0)
    def prefill(params, state, tokens, length, pos):
      # Only the chunk's real tokens: the pad columns of its bucket are never computed
      # (they cost 10-40% of a short prompt's prefill; issue 30, time to first token).
      length = int(np.asarray(length))
      tokens = np.asarray(tokens)
      return self._forward_now(state, tokens[:, :length] if tokens.shape[0] == 1 else tokens,
                               pos, length - 1)
    return prefill

  def _forward_now(self, state: HostState, tokens, pos, index: int):
    logits, active = self._forward_cb(False, state.cache_id, tokens, pos, index)
    return logits, state, active

  def prefill(self, params, state, tokens, length, pos, *, kv_len, all_logits):
    del params, kv_len  # The host attends exactly [0, pos + T).
    index = None if all_logits else jnp.asarray(length, jnp.int32) - 1
    return self._forward(state, tokens, pos, index)

  def decode(self, params, state, tokens, pos, *, kv_len):
    del params, kv_len
    return self._forward(state, tokens[:, None], pos, jnp.zeros((), jnp.int32))

  # ----------------------------------------------------------------------------- accounting
  def weight_bytes_per_token(self, ffn_sparsity: float = 0.0) -> tuple[int, int]:
    """GGUF block bytes (gate-first: every gate row, the active share of up and down rows;
    predicted: the predictors, the computed share of gate rows, the measured shares of up and
    down rows: `HostDecoder.ffn_bytes_per_token`)."""
    sparse = self.decoder.gate_cuts is not None or self.decoder.thresholds is not None
    active = 1.0 - ffn_sparsity if sparse else None
    return self.decoder.bytes_per_token(active), self.decoder.bytes_per_token()

  def weight_bytes(self) -> int:
    return self.decoder.nbytes()


def choose_weights(weights: str, *, path: str, dtype: Any, is_bundle: bool) -> str:
  """Resolves --host_weights: "auto" -> "gguf" on a CPU backend for a float32 run of a plain
  GGUF whose matrices are all Q4_1/Q8_0, else "off"; other values are checked.

  Raises:
    ConfigError: an unknown value, or host weights asked for a bundle.
  """
  if weights not in WEIGHT_CHOICES:
    raise ConfigError(f"--host_weights={weights!r} must be one of {', '.join(WEIGHT_CHOICES)}.")
  if weights == WEIGHTS_AUTO:
    return WEIGHTS_GGUF if (jax.default_backend() == "cpu" and not is_bundle
                            and np.dtype(dtype) == np.float32
                            and file_is_block_quantized(path)) else WEIGHTS_OFF
  if weights != WEIGHTS_OFF and is_bundle:
    raise ConfigError(f"--host_weights={weights} runs the dense model from a GGUF; {path} is a "
                      "sparse bundle (use --host_weights=off there).")
  return weights


def build(config: ModelConfig, path: str, weights: str, *, gate_cuts=None,
          calibration_chunks=None, gate_sparsity: float = 0.5,
          dot: str = qmatmul.DOT_INT8, gate_down: str | None = None,
          gate_rule: str = GATE_RULE_GATE, contribution_cuts=None,
          bundle_mode: str | None = None, predictors=None) -> HostBackend:
  """A HostBackend for a GGUF, its numba kernels loaded (compiled on first use) before returning.

  Args:
    weights: "gguf" | "q8_0".
    dot: "int8" | "f32": how decode matmuls treat activations (`HostDecoder`, --host_dot).
    gate_cuts: turn on the gate-first sparse FFN (`host_ops.gated_ffn`): None = off, True =
      on with cuts calibrated on `calibration_chunks` (int[t] token arrays) for `gate_sparsity`
      (SwiGLU), or zero cuts (ReLU families and gate_sparsity 0: exact zeros skipped).
    gate_down: the neuron-major down rows' format, "q8_0" | "file" | None (file
      where the down projections are Q4_1, else q8_0; `HostDecoder.enable_gated`).
    gate_rule: "gate" (the cuts are on |act_gate(g)|) or "contribution" (gate cuts 0, the
      calibrated cuts on |act(g, u)|: every up row read, down rows skipped).
    contribution_cuts: float[L] cuts on |act(g, u)| given, not calibrated (a bundle's
      thresholds, `for_bundle`); with gate_cuts, in place of calibration_chunks.
    bundle_mode: the bundle's --sparse mode this backend runs (`HostBackend.mode`).
    predictors: a PowerInfer file's `powerinfer.Predictors`: the predicted sparse FFN
      (`HostDecoder.enable_predicted`) with its fc1/fc2 blocks and threshold; None = off.

  Raises:
    ConfigError, GGUFError: see `build_decoder`; UnsupportedError for a family it cannot run.
  """
  HostBackend.supports(config)
  try:
    dec = build_decoder(path, config, weights, dot=dot)
    heap.release_free_heap()  # The per-layer copies the stacking freed.
    # Load (first run: compile) numba's kernels now, not inside the first timed generation:
    # one decode-sized pass and one prefill-sized pass (above the gemv row limit).
    rows = qmatmul.GEMV_MAX_ROWS + 1
    cache = dec.new_cache(1, rows + 1)
    dec.forward(cache, np.zeros((1, rows), np.int64), 0)
    dec.forward(cache, np.zeros((1, 1), np.int64), rows)
    if gate_cuts:
      cuts = [0.0] * dec.n_layers
      contribution = gate_rule == GATE_RULE_CONTRIBUTION
      if contribution_cuts is not None:
        cuts = [float(c) for c in contribution_cuts]
      elif calibration_chunks is not None:
        cuts = dec.calibrate_gate_cuts(calibration_chunks, gate_sparsity, contribution)
      if contribution:
        dec.enable_gated([0.0] * dec.n_layers, down_format=gate_down, contribution_cuts=cuts)
      else:
        dec.enable_gated(cuts, down_format=gate_down)
    if predictors is not None:
      dec.enable_predicted(*predictor_matrices(predictors), down_format=gate_down)
      heap.release_free_heap()
      dec.forward(cache, np.zeros((1, rows), np.int64), 0)  # Its kernels loaded too.
      dec.forward(cache, np.zeros((1, 1), np.int64), rows)
    heap.release_free_heap()
  except host_ops.HostOpError as err:
    raise ConfigError(f"--host_weights={weights}: {err}") from None
  return HostBackend(config, dec, weights, bundle_mode)


def predictor_matrices(predictors) -> tuple[list, list, list[float]]:
  """(fc1s, fc2s, thresholds) for `HostDecoder.enable_predicted` from a PowerInfer file's
  `powerinfer.Predictors`: each matrix in its own blocks where a host kernel reads its type
  (Q4_0, Q5_0, F16, ...; `qmatmul.GGML_KINDS`), else re-quantized to Q8_0 from its values.

  Raises:
    GGUFError: a matrix that cannot be read.
  """
  def matrix(m):
    kind = qmatmul.GGML_KINDS.get(m.ggml_type)
    if kind is not None and m.shape[1] % qmatmul.block_size(kind) == 0:
      return qmatmul.from_gguf_blocks(kind, m.data, m.shape)
    return qmatmul.quantize_q8_0(m.f32())
  fc1s = [matrix(p.fc1) for p in predictors.layers]
  fc2s = [matrix(p.fc2) for p in predictors.layers]
  return fc1s, fc2s, [predictors.threshold] * len(fc1s)


def set_threads(threads: int) -> None:
  """Sets the numba threads of every host kernel (--host_threads).

  Raises:
    ConfigError: below 1 or above numba's thread count.
  """
  if threads < 1:
    raise ConfigError(f"--host_threads={threads} must be >= 1.")
  try:
    host_ops.set_host_threads(int(threads))
  except host_ops.HostOpError as err:
    raise ConfigError(f"--host_threads={threads}: {err}.") from None


def calibration_chunks(model, path: str | None, n_chunks: int = 8, length: int = 256
                       ) -> list[np.ndarray]:
  """Up to n_chunks int[length] token arrays from a text file (gate-cut calibration data).

  Raises:
    ConfigError: no file given, unreadable, or too short.
  """
  if not path:
    raise ConfigError("--sparse=gate on SwiGLU and --sparse=contribution calibrate their cuts "
                      "on text (unless --gate_sparsity=0): pass "
                      "--calibration_file=FILE (e.g. ../shared/data/tinyshakespeare/input.txt; "
                      "never the evaluation text).")
  try:
    with open(path, encoding="utf-8") as fh:
      text = fh.read(400_000)
  except (OSError, UnicodeDecodeError) as err:
    raise ConfigError(f"--calibration_file={path}: cannot read it ({err}).") from None
  ids = model.tokenizer.encode(text, add_special=False)
  length = min(length, model.max_seq_len)
  chunks = [np.asarray(ids[i:i + length]) for i in range(0, len(ids) - length + 1, length)]
  if not chunks:
    raise ConfigError(f"--calibration_file={path} holds {len(ids)} tokens; need at least "
                      f"{length}.")
  return chunks[:n_chunks]


def for_model(model, weights: str = WEIGHTS_AUTO, *, gate_sparse: bool = False,
              gate_sparsity: float = 0.5, calibration_file: str | None = None,
              dot: str | None = None, gate_down: str | None = None,
              gate_rule: str | None = None, predictor: bool = False) -> base.Backend:
  """The backend for a dense run of `model` (`pijax.engine.Model`) with `--host_weights`.

  Args:
    weights: "off" | "gguf" | "q8_0" | "auto" (see `choose_weights`).
    gate_sparse: the gate-first sparse FFN (`host_ops.gated_ffn`): ReGLU/dReLU skip exact
      zeros; SwiGLU skips neurons with |silu(gate . h)| below a per-layer cut calibrated for
      `gate_sparsity` on `calibration_file` (CATS, arXiv 2404.08763 §3; never the evaluation
      text).
    gate_sparsity: SwiGLU target fraction of FFN neurons skipped, in [0, 1) (with
      gate_rule "contribution": any family's, counting exact zeros).
    gate_rule: with gate_sparse, what the calibrated cuts apply to: "gate" (None means it;
      |act_gate(gate . h)|: skipped neurons read neither up nor down rows) or "contribution"
      (|act(gate . h, up . h)|: every up row read, down rows skipped; the sound rule for
      SwiGLU on 4-bit weights, issue 11).
    gate_down: with gate_sparse, the format of the neuron-major down rows: "file" (a Q4_1
      file's blocks transposed, exact: 0.5 bytes/weight per active neuron plus 0.125) or
      "q8_0" (1.0625, re-quantized); None: file where the down
      projections are Q4_1, else q8_0.
    dot: "int8" (every matmul, prefill included, quantizes activations per block and sums
      integer products, llama.cpp's arithmetic; the default) or "f32" (exact f32 activations;
      slower).
    predictor: a PowerInfer GGUF's own predictors and threshold (`powerinfer.read_predictors`)
      run the predicted sparse FFN (`host_ops.predicted_ffn`; ReGLU/dReLU); weights "auto"
      means "gguf" then (the derived down projection re-quantized to Q8_0 for the dense path).

  Returns:
    A HostBackend, or the dense XlaBackend when the choice is "off".

  Raises:
    ConfigError: an unknown format, host weights for a bundle, gate_sparse without host
      weights, a bad sparsity or a missing calibration file.
  """
  from pijax.backends import xla
  if not (0.0 <= gate_sparsity < 1.0):
    raise ConfigError(f"--gate_sparsity={gate_sparsity} must be in [0, 1).")
  if dot is not None and dot not in qmatmul.DOTS:
    raise ConfigError(f"--host_dot={dot!r} must be one of {', '.join(qmatmul.DOTS)}.")
  if predictor and (gate_sparse or model.sparse is not None):
    raise ConfigError("--sparse=predictor runs a PowerInfer GGUF's own predictors; it does not "
                      "combine with --sparse=gate|contribution or a bundle's.")
  if predictor and weights == WEIGHTS_AUTO:
    weights = WEIGHTS_GGUF  # The predicted FFN runs on host weights only.
  weights = choose_weights(weights, path=model.path, dtype=model.dtype,
                           is_bundle=model.sparse is not None)
  if predictor and (weights == WEIGHTS_OFF or
                    model.config.ffn_family not in predicted_ffn.RELU_FAMILIES):
    raise ConfigError(f"--sparse=predictor runs on quantized host weights (not "
                      f"--host_weights=off) for ReGLU/dReLU FFNs; this run: --host_weights="
                      f"{weights}, FFN {model.config.ffn_family}.")
  if dot is not None and weights == WEIGHTS_OFF:
    raise ConfigError(f"--host_dot={dot} sets how host weights multiply, but this run keeps "
                      "the weights in XLA (--host_weights=off, a non-float32 dtype or a "
                      "GGUF with other types); drop --host_dot or use --host_weights=gguf.")
  if gate_down is not None and (not (gate_sparse or predictor)
                                or gate_down not in gated_ffn.DOWN_KINDS):
    raise ConfigError(f"--gate_down={gate_down} sets the down rows of --sparse=gate or "
                      f"contribution: use one of {', '.join(gated_ffn.DOWN_KINDS)} with one of "
                      "them, or drop it.")
  gate_rule = GATE_RULE_GATE if gate_rule is None else gate_rule
  if gate_rule not in GATE_RULES or (gate_rule != GATE_RULE_GATE and not gate_sparse):
    raise ConfigError(f"sparse rule {gate_rule!r}: use --sparse=gate or --sparse=contribution "
                      f"(rules: {', '.join(GATE_RULES)}).")
  if gate_sparse and weights == WEIGHTS_OFF:
    raise ConfigError(f"--sparse={gate_rule} runs on quantized host weights: add "
                      "--host_weights=gguf (or q8_0); it needs a plain GGUF.")
  if gate_sparse and model.config.ffn_family not in ("swiglu", "reglu", "drelu"):
    raise ConfigError(f"--sparse={gate_rule} skips neurons by their gate (SwiGLU, ReGLU, dReLU "
                      f"FFNs); this model's FFN is {model.config.ffn_family}: use --sparse=off.")
  if weights == WEIGHTS_OFF:
    return xla.XlaBackend(model.config, model.params, model.dtype)
  chunks = None
  if gate_sparse and gate_sparsity > 0 and (model.config.ffn_family == "swiglu" or
                                            gate_rule == GATE_RULE_CONTRIBUTION):
    chunks = calibration_chunks(model, calibration_file)
  predictors = None
  if predictor:
    from pijax.formats import powerinfer
    predictors = powerinfer.read_predictors(model.path)
  return build(model.config, model.path, weights, gate_cuts=gate_sparse or None,
               calibration_chunks=chunks, gate_sparsity=gate_sparsity,
               dot=qmatmul.DOT_INT8 if dot is None else dot, gate_down=gate_down,
               gate_rule=gate_rule, predictors=predictors)


# Families whose bundle runs `--sparse=predictor` on the host engine with the contribution rule
# (no exact zeros: on <= 5-bit rows a separate predictor reads about as many bytes as it saves,
# BUILD_NOTES "Bundles on the host engine"). ReLU families keep their trained MLP predictors.
CONTRIBUTION_FAMILIES = ("swiglu",)


def bundle_runs_on_host(model, mode: str) -> bool:
  """Whether bundle `model` (`pijax.engine.Model` with `sparse`) runs `mode` ("off" or
  "predictor") on the host engine: a CPU backend, float32, a source GGUF whose matrices a host
  kernel reads, and for "predictor" a family of CONTRIBUTION_FAMILIES."""
  if model.sparse is None or model.file_stamp is None or mode not in ("off", "predictor"):
    return False
  if mode == "predictor" and model.config.ffn_family not in CONTRIBUTION_FAMILIES:
    return False
  return (jax.default_backend() == "cpu" and np.dtype(model.dtype) == np.float32
          and file_is_block_quantized(model.file_stamp[0]))


def for_bundle(model, mode: str, *, threshold_scale: float = 1.0, dot: str | None = None,
               gate_down: str | None = None) -> HostBackend:
  """A bundle run on the host engine over its source GGUF's own blocks (no f32 copy of the
  rows): "off" dense; "predictor" the exact contribution rule, a neuron's down row read only
  if |act(gate . h, up . h)| >= threshold_scale x its layer's threshold t_l (the thresholds
  `pijax.convert` calibrated on the calibration text, the bundle's `thresholds`). Every neuron
  is on the host, so the neuron order is the file's: the rule is per layer, not per neuron.

  Raises:
    ConfigError: `bundle_runs_on_host` is false, or a bad threshold_scale / dot / gate_down.
  """
  if not bundle_runs_on_host(model, mode):
    raise ConfigError(f"--sparse={mode} on this bundle does not run on the host engine (it "
                      "needs a CPU backend, float32 and a block-quantized SwiGLU source).")
  if not (np.isfinite(threshold_scale) and threshold_scale >= 0):
    raise ConfigError(f"--threshold_scale={threshold_scale} must be a finite number >= 0.")
  if dot is not None and dot not in qmatmul.DOTS:
    raise ConfigError(f"--host_dot={dot!r} must be one of {', '.join(qmatmul.DOTS)}.")
  if gate_down is not None and gate_down not in gated_ffn.DOWN_KINDS:
    raise ConfigError(f"--gate_down={gate_down} must be one of "
                      f"{', '.join(gated_ffn.DOWN_KINDS)}.")
  from pijax import load_checks
  load_checks.check_unchanged(*model.file_stamp)
  sparse = mode == "predictor"
  cuts = np.asarray(model.sparse.thresholds, np.float64) * threshold_scale
  return build(model.config, model.file_stamp[0], WEIGHTS_GGUF, gate_cuts=sparse or None,
               dot=qmatmul.DOT_INT8 if dot is None else dot, gate_down=gate_down,
               gate_rule=GATE_RULE_CONTRIBUTION, contribution_cuts=cuts if sparse else None,
               bundle_mode=mode)
