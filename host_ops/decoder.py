"""A whole decoder on the host: weights in quantized blocks, KV caches in host RAM (numba).

A CPU decode step reads every weight once per token, so its speed is the speed at which weights
are read; here the weights stay in llama.cpp's block formats (4-8 bits per weight), copied once
into one buffer (`host_ops.pool`): packed 16 rows at a time where integer products run
(`host_ops.qpack`), the file's rows else.

One layer body for every pass (issue 30): `layers.layers_kernel` runs every layer for a ragged
batch of tokens (a prompt's chunk, one token of one or of several sequences, or a mix). Each
output of every kernel depends only on its own row, so a sequence's logits are the same alone or
batched (bit for bit with int8 products; with f32 products up to `pool.GEMV_MAX_ROWS` rows per
pass, where the f32 product changes kernel).

The whole forward pass (embedding, layers, LM head) is one host call, so only token ids and
logits cross a JAX callback (BUILD_NOTES.md, issue 5); the layers are one compiled call.

Arithmetic with dot "int8" (the default): every product quantizes its input per block as
llama.cpp does (K-quants against 256-value blocks, the others against 32-value blocks:
`qpack`); with dot "f32": the f32 dense model's products on the same weight values, up to
summation order.

State is explicit: `HostDecoder.new_cache` returns a `HostKVCache` of `batch` slots that the
caller owns and passes to every `forward`.

Layout per STYLE.md: numba kernels (`host_ops.layers`, the layer loop; `host_ops.attention`;
matmuls in `host_ops.pool`) -> HostDecoder (validates) -> `decoder_reference` (float64 NumPy,
whole model).
"""

from __future__ import annotations

import dataclasses
import mmap

import numpy as np

from host_ops import common
from host_ops import attention as attn_lib
from host_ops import gated_ffn
from host_ops import pool as pool_lib
from host_ops import predicted_ffn
from host_ops import qblocks
from host_ops import qdot
from host_ops import qmatmul
from host_ops import qpack
from host_ops.common import HostOpError
# PHASES and RECORD_* are part of the decoder's API (`phase_cycles`, `calibrate_gate_cuts`).
from host_ops.layers import HostLayer  # noqa: F401 (API: the decoder is built from these)
from host_ops.layers import (NO_DOWN_T, NO_PHASES, NO_PREDICTOR, NO_RECORD, NO_UP, PHASES,
                             RECORD_CONTRIBUTION, RECORD_GATE, RECORD_NONE, ROLES, layers_kernel)
# The oracle lives in its own module; `decoder.decoder_reference` stays its public name.
from host_ops.decoder_reference import decoder_reference  # noqa: F401


def _lazy_zeros(shape: tuple[int, ...]) -> np.ndarray:
  """f32 zeros whose 4 KiB pages become resident only when written (an anonymous map). numpy
  asks for 2 MiB transparent huge pages on large arrays, so a KV cache written at a few
  positions per layer was resident in full (94 MB for SmolLM2 at 2048 tokens)."""
  n = int(np.prod(shape))
  return np.frombuffer(mmap.mmap(-1, max(4 * n, 1)), np.float32, count=n).reshape(shape)


@dataclasses.dataclass
class HostKVCache:
  """Keys and values of `batch` sequence slots on the host.

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


_EXTRAS = ("qkv_bias", "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm")


class HostDecoder:
  """A whole decoder's weights on the host (see the module docstring for the call sequence).

  Args:
    embedding: [V, D] QMatrix (token embedding rows).
    layers: HostLayer per layer (their matrices are copied into the decoder's pool and replaced
      by `pool.PooledRole` views of it: nothing held twice).
    final_norm: f32[D].
    lm_head: [V, D] QMatrix (the embedding itself when the model ties them).
    eps: RMSNorm epsilon; family: FFN family ("swiglu" | "reglu" | "drelu" | "geglu").
    rope_freq_factors: R/2 divisors of RoPE's inverse frequencies (LLaMA-3.1), or ().
    layer_rope: per layer (theta, position scale, factors), overriding the three above (Gemma 3's
      local layers have their own base); None = every layer the same.
    windows: per layer, the sliding window in tokens (0 = global); None = all global.
    attn_scale: the factor on q . k (None = head_dim ** -0.5).
    embedding_scale: the token embeddings are multiplied by it (Gemma: sqrt(hidden_size)).
    dot: "int8" (products quantize activations per block and sum integers, as llama.cpp;
      `host_ops.qpack`, `host_ops.qdot`) or "f32" (the f32 dense path's values up to summation
      order). `self.dot` holds what runs: "f32" where qdot.AVAILABLE is False.

  Raises:
    HostOpError: inconsistent shapes, an unknown family or a kind without a host kernel.
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
    self._dot = dot if qdot.AVAILABLE else qmatmul.DOT_F32
    self.code = common.family_code(family)
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
    self._down_t = None  # Per-layer neuron-major down rows for it (Q8_0, Q4_1 or file rows).
    self._stacked_down_t = None  # The same rows stacked [L, F, ...] for `layers_kernel`.
    self._up = None  # Its up rows: stacked split Q4_1 / Q8_0 arrays, or records (ReLU families).
    self.last_active = np.ones(len(layers), np.float32)  # Active FFN fraction, last forward.
    self.last_passed = np.ones(len(layers), np.float32)  # Gate-passed fraction (up rows read).
    self.last_nonzero = np.ones(len(layers), np.float32)  # Down rows read (nonzero activations).
    # The predicted FFN (`enable_predicted`): per-layer thresholds when on, the predictors'
    # pooled roles [(fc1, fc2)] and their pool, the gathered gate and up rows (raw file blocks
    # [L, F, row bytes] and their qblocks code), and layers_kernel's argument.
    self.thresholds = None
    self.predictor_roles = None
    self._pred_pool = None
    self._pred_rows = None
    self._pred = NO_PREDICTOR
    # Sums over predicted forward passes of the mean fractions of gate rows (predicted), up
    # rows and down rows read, for `ffn_bytes_per_token`.
    self.pred_read_sums = np.zeros(3)
    # Sums over gate-first forward passes of mean(last_active), mean(last_passed): the up rows
    # read per computed neuron, for the bytes per token (`ffn_bytes_per_token`).
    self.read_sums = np.zeros(2)
    # i64[L, len(PHASES)]: when set, the layer loop adds each layer's cycles per phase.
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
    self._check_layers(d)
    if lm_head.shape[1] != d or self.final_norm.shape != (d,):
      raise HostOpError(f"lm_head {lm_head.shape} / final_norm {self.final_norm.shape} do not "
                        f"match hidden size {d}")
    self._build_pool()

  @property
  def dot(self) -> str:
    """"int8" or "f32": how products treat activations (class docstring)."""
    return self._dot

  @dot.setter
  def dot(self, value: str) -> None:
    """Switches the products; the pool is rebuilt (packed for "int8", rows for "f32") from the
    pooled matrices' file blocks. Raises HostOpError for an unknown value."""
    if value not in qmatmul.DOTS:
      raise HostOpError(f"dot must be one of {', '.join(qmatmul.DOTS)}, got {value!r}")
    value = value if qdot.AVAILABLE else qmatmul.DOT_F32
    if value != self._dot:
      self._dot = value
      self._build_pool()
      if self.predictor_roles is not None:
        self._build_predictor_pool(self.predictor_roles)

  def _check_layers(self, d: int) -> None:
    n_heads, n_kv_heads, head_dim = self.n_heads, self.n_kv_heads, self.head_dim
    f = self.layers[0].gate.shape[0]
    for i, layer in enumerate(self.layers):
      want = {"qkv": ((n_heads + 2 * n_kv_heads) * head_dim, d),
              "attn_out": (d, n_heads * head_dim), "gate": (f, d), "up": (f, d), "down": (d, f)}
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

  def _build_pool(self) -> None:
    """Copies every layer matrix into one WeightPool (one layer at a time, each layer's source
    matrices dropped as it is done) and stacks norms and extras for `layers_kernel`."""
    n_layers = self.n_layers
    int8 = self.dot == qmatmul.DOT_INT8
    roles = [getattr(layer, name) for layer in self.layers for name in ROLES]

    def copied(i: int) -> None:  # The source matrix is dropped as soon as it is in the pool.
      roles[i] = None
      setattr(self.layers[i // len(ROLES)], ROLES[i % len(ROLES)], None)

    self.pool = pool_lib.WeightPool(roles, int8, copied)
    self._roles = np.stack([r.ids for r in self.pool.roles]).reshape(
        n_layers, len(ROLES), pool_lib.MAX_PARTS)
    needs = np.zeros((n_layers, len(ROLES), 2), np.int64)
    for i, layer in enumerate(self.layers):
      for k, name in enumerate(ROLES):
        role = self.pool.roles[i * len(ROLES) + k]
        setattr(layer, name, role)
        needs[i, k] = role.needs
    self._needs = needs
    self._norms = np.ascontiguousarray(
        np.stack([[layer.attn_norm, layer.ffn_norm] for layer in self.layers]), np.float32)
    for i, layer in enumerate(self.layers):
      layer.attn_norm, layer.ffn_norm = self._norms[i, 0], self._norms[i, 1]
    self._extras = tuple(np.ascontiguousarray(np.stack(parts), np.float32) for parts in
                         zip(*(self._extras_of(layer) for layer in self.layers)))

  def _extras_of(self, layer: HostLayer) -> tuple[np.ndarray, ...]:
    """The layer's family extras for the kernels: f32 arrays, empty where absent."""
    return tuple(np.zeros(0, np.float32) if getattr(layer, n) is None else getattr(layer, n)
                 for n in _EXTRAS)

  @property
  def n_layers(self) -> int:
    return len(self.layers)

  @property
  def qkv_size(self) -> int:
    return self.layers[0].qkv.shape[0]

  @property
  def vocab_size(self) -> int:
    return self.lm_head.shape[0]

  @property
  def intermediate_size(self) -> int:
    return self.layers[0].gate.shape[0]

  def bytes_per_token(self, active_fraction: float | None = None) -> int:
    """Weight bytes one decode token reads, in GGUF block bytes (f16 scales): the attention
    matrices, the FFN (`ffn_bytes_per_token`) and the LM head (the embedding lookup reads one
    row, not counted)."""
    attn = sum(w.file_bytes() for layer in self.layers for w in (layer.qkv, layer.attn_out))
    return attn + self.ffn_bytes_per_token(active_fraction) + self.lm_head.file_bytes()

  def nbytes(self) -> int:
    """Host bytes held: the pool, the embedding and head (a tied head counted once), norms,
    plus the sparse FFN's copies once built (`sparse_nbytes`)."""
    mats = [self.embedding] + ([] if self.lm_head is self.embedding else [self.lm_head])
    return (self.pool.nbytes + sum(w.nbytes for w in mats) + self._norms.nbytes
            + self.final_norm.nbytes + self.sparse_nbytes())

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

  # ------------------------------------------------------------------------- KV cache
  def new_cache(self, batch: int, max_seq_len: int) -> HostKVCache:
    """A zeroed host KV cache of `batch` sequence slots of `max_seq_len` tokens (the caller owns
    it; pages become resident as they are written)."""
    if batch < 1 or max_seq_len < 1:
      raise HostOpError(f"a KV cache needs batch >= 1 and max_seq_len >= 1, got {batch}, "
                        f"{max_seq_len}")
    shape = (self.n_layers, int(batch), int(max_seq_len), self.n_kv_heads, self.head_dim)
    nbytes = 2 * 4 * self.n_layers * int(batch) * int(max_seq_len) * self.n_kv_heads * \
        self.head_dim  # Python ints: no overflow.
    ram = common.physical_memory_bytes()
    if ram and nbytes > ram:  # Lazily resident, but a full cache must fit in memory.
      raise HostOpError(f"a KV cache of {batch} slots x {max_seq_len} tokens needs "
                        f"{nbytes / 2 ** 30:.1f} GiB, more than this machine's "
                        f"{ram / 2 ** 30:.1f} GiB; use fewer slots or a shorter max_seq_len")
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

  def _stacked_rows(self, name: str) -> np.ndarray:
    """u8[L, F, row bytes]: every layer's `name` ("gate" | "up") rows as their file blocks,
    stacked (64-byte aligned; one layer's copy at a time)."""
    out = None
    for i, layer in enumerate(self.layers):
      rows = pool_lib.file_rows(getattr(layer, name).parts[0])
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
    if self._pred_rows is None:
      self._pred_rows = (self._stacked_rows("gate"), self._stacked_rows("up"),
                         np.int64(qblocks.KIND_CODES[self._up_kind()]))
    self.gate_cuts = self.contribution_cuts = None
    self.thresholds = thresholds
    self._pred = (self._pred_pool.pool, self._pred_pool.mats, self._pred_roles,
                  self._pred_needs, np.asarray(thresholds, np.float32)) + self._pred_rows

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

  # ------------------------------------------------------------------------- forward
  def forward(self, cache: HostKVCache, tokens, pos: int, rows=None) -> np.ndarray:
    """Runs b sequences of t tokens each (cache slots 0..b-1) at positions pos + [0, t).

    Args:
      cache: from `new_cache` with at least b slots (positions [pos, pos + t) are written).
      tokens: int[b, t].
      pos: position of tokens[:, 0]; pos + t <= the cache's max_seq_len.
      rows: None for logits at every position, or int[k] flat rows (r * t + i) to keep.

    Returns:
      f32[b * t, V] logits (or f32[k, V]).

    Raises:
      HostOpError: a cache of another shape, a batch/length that does not fit it, bad ids.
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 2:
      raise HostOpError(f"tokens must be int[b, t], got shape {tokens.shape}")
    b, t = tokens.shape
    self._check_cache(cache)
    if b > cache.batch or not 0 <= pos <= cache.max_seq_len - t:
      raise HostOpError(f"tokens [{b}, {t}] at position {pos} do not fit the KV cache "
                        f"[{cache.batch} rows, {cache.max_seq_len} positions]")
    slots = np.repeat(np.arange(b, dtype=np.int64), t)
    positions = int(pos) + np.tile(np.arange(t, dtype=np.int64), b)
    return self._forward(cache, tokens.reshape(-1), slots, positions, rows)

  def forward_rows(self, cache: HostKVCache, tokens, slots, positions, rows=None) -> np.ndarray:
    """Runs a ragged batch: token i of sequence slot slots[i] at position positions[i] (decode
    steps of several sequences, chunks of prompts, or both; module docstring).

    Args:
      cache: from `new_cache`; every position before positions[i] of slot slots[i] must hold
        that sequence's keys (from earlier passes, or earlier tokens of this pass).
      tokens, slots, positions: int[N].
      rows: None for logits of every token, or int[k] indices into the N tokens to keep.

    Returns:
      f32[N, V] logits (or f32[k, V]).

    Raises:
      HostOpError: arrays of other lengths, a slot or position outside the cache, a
        (slot, position) given twice, bad ids.
    """
    tokens, slots, positions = (common.int_array(f"forward_rows: {name}", a) for name, a in (
        ("tokens", tokens), ("slots", slots), ("positions", positions)))
    self._check_cache(cache)
    n = tokens.shape[0]
    if slots.shape != (n,) or positions.shape != (n,) or n == 0:
      raise HostOpError(f"forward_rows needs tokens, slots and positions of one length >= 1, "
                        f"got {tokens.shape}, {slots.shape}, {positions.shape}")
    if slots.min() < 0 or slots.max() >= cache.batch or positions.min() < 0 or \
        positions.max() >= cache.max_seq_len:
      raise HostOpError(f"slots {slots.min()}..{slots.max()} / positions {positions.min()}.."
                        f"{positions.max()} outside the KV cache [{cache.batch} slots, "
                        f"{cache.max_seq_len} positions]")
    if np.unique(slots * cache.max_seq_len + positions).shape[0] != n:
      raise HostOpError("forward_rows: a (slot, position) appears twice in one pass")
    if rows is not None:
      rows = common.int_array("forward_rows: rows", rows)
      if rows.size == 0 or rows.min() < 0 or rows.max() >= n:
        raise HostOpError(f"forward_rows: rows must index the {n} tokens (0..{n - 1}), got "
                          f"{rows.tolist()[:8]}")
    return self._forward(cache, tokens, slots, positions, rows)

  def _check_cache(self, cache) -> None:
    want = (self.n_layers, self.n_kv_heads, self.head_dim)
    ok = isinstance(cache, HostKVCache) and all(
        isinstance(a, np.ndarray) and a.ndim == 5 and a.dtype == np.float32 and
        a.flags.c_contiguous and a.flags.writeable for a in (cache.k, cache.v))
    if not ok or cache.k.shape != cache.v.shape or \
        (cache.k.shape[0],) + cache.k.shape[3:] != want:
      raise HostOpError(f"forward needs a HostKVCache of this decoder (new_cache: writable f32 "
                        f"keys and values of one shape), got {type(cache).__name__}")

  def _forward(self, cache, tokens, slots, positions, rows, record=NO_RECORD,
               record_mode=RECORD_NONE) -> np.ndarray:
    phases = self.phase_cycles
    if phases is not None and (not isinstance(phases, np.ndarray) or phases.dtype != np.int64
                               or phases.shape != (self.n_layers, len(PHASES))
                               or not phases.flags.c_contiguous or not phases.flags.writeable):
      raise HostOpError(f"phase_cycles must be None or a writable C-contiguous i64[{self.n_layers}"
                        f", {len(PHASES)}] array")
    cos, sin = attn_lib.rope_tables(self._ropes, self.rope_dim, positions)
    x = self.embedding.rows_f32(tokens)  # [N, D]
    if self.embedding_scale != 1.0:
      x *= np.float32(self.embedding_scale)
    n_threads = common.ensure_host_threads()
    recording = record_mode != RECORD_NONE  # Dense, whatever sparse FFN is on.
    pred = NO_PREDICTOR if recording else self._pred
    if self.gate_cuts is None or recording:
      cuts, up = np.zeros((0, 2), np.float32), NO_UP
      dt = self._stacked_down_t if self.thresholds is not None and not recording else NO_DOWN_T
    else:
      cuts, up, dt = self._cuts, self._up, self._stacked_down_t
    x = layers_kernel(x, slots, positions, self.pool.pool, self.pool.mats, self._roles,
                       self._needs, self._norms, self._extras, cache.k, cache.v, cos, sin,
                       self._rope_of, self.windows, self.rope_adjacent, self.n_heads,
                       self.n_kv_heads, self.head_dim, np.float32(self.attn_scale), self.eps,
                       self.code, self.dot == qmatmul.DOT_INT8, cuts, up, dt, pred,
                       self.last_active, self.last_passed, self.last_nonzero, n_threads,
                       NO_PHASES if phases is None else phases, record, record_mode)
    if self.gate_cuts is not None and not recording:
      self.read_sums += (float(self.last_active.mean()), float(self.last_passed.mean()))
    if self.thresholds is not None and not recording:
      self.pred_read_sums += (float(self.last_active.mean()), float(self.last_passed.mean()),
                              float(self.last_nonzero.mean()))
    if rows is not None:
      x = x[np.asarray(rows, np.int64)]
    h = attn_lib.rms_norm(np.ascontiguousarray(x), self.final_norm, self.eps)
    return self.lm_head.matmul(h, dot=self.dot)

  def __repr__(self) -> str:
    kinds = sorted({w.kind for layer in self.layers for w in layer.matrices()})
    return (f"HostDecoder({self.n_layers} layers, {'/'.join(kinds)}, head {self.lm_head.kind}, "
            f"{self.nbytes() / 1e6:.1f} MB)")
