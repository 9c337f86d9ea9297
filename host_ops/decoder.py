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

The sparse FFNs (gate-first, PowerInfer's predicted one) are switched on and accounted for in
`host_ops.decoder_sparse`, whose methods HostDecoder inherits.

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
from host_ops import pool as pool_lib
from host_ops import qdot
from host_ops import qmatmul
from host_ops.common import HostOpError
# PHASES and RECORD_* are part of the decoder's API (`phase_cycles`, `calibrate_gate_cuts`).
from host_ops.layers import HostLayer  # noqa: F401 (API: the decoder is built from these)
from host_ops.layers import RECORD_CONTRIBUTION, RECORD_GATE  # noqa: F401 (API)
from host_ops.layers import (NO_DOWN_T, NO_PHASES, NO_PREDICTOR, NO_RECORD, NO_UP, PHASES,
                             RECORD_NONE, ROLES, layers_kernel)
# The oracle lives in its own module; `decoder.decoder_reference` stays its public name.
from host_ops.decoder_reference import decoder_reference  # noqa: F401
from host_ops.decoder_sparse import SparseFFN


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


class HostDecoder(SparseFFN):
  """A whole decoder's weights on the host (see the module docstring for the call sequence).

  Args:
    embedding: [V, D] QMatrix (token embedding rows), or `pool.PackedMatrix` (Q8_0).
    layers: HostLayer per layer (their matrices are copied into the decoder's pool and replaced
      by `pool.PooledRole` views of it: nothing held twice).
    final_norm: f32[D].
    lm_head: [V, D] QMatrix or `pool.PackedMatrix` (the embedding itself when the model ties
      them); with int8 products a packable head is packed here (`pool.head_packable`).
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
    self._place_head()

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
      self._place_head()
      if self.predictor_roles is not None:
        self._build_predictor_pool(self.predictor_roles)
        self._ensure_pred_rows()  # Their gate and up rows' layout follows the dot.

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

  def _place_head(self) -> None:
    """The LM head (and the embedding tied to it) packed for int8 products where
    `pool.head_packable` allows (`pool.PackedMatrix`: ~2x the row kernels' speed from 4 rows up,
    the same at 1), back to a QMatrix for f32 products."""
    head, tied = self.lm_head, self.lm_head is self.embedding
    if self.dot == qmatmul.DOT_INT8 and isinstance(head, qmatmul.QMatrix) and \
        pool_lib.head_packable(head.kind, head.shape, tied):
      head = pool_lib.PackedMatrix.from_qmatrix(head)
    elif self.dot != qmatmul.DOT_INT8 and isinstance(head, pool_lib.PackedMatrix):
      head = head.qmatrix()
    else:
      return
    self.lm_head = head
    if tied:
      self.embedding = head

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
