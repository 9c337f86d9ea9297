"""Gather-based sparse FFN over the device-resident hot neurons (Pallas).

For the active hot neurons `i` of one layer (PowerInfer's per-token step, arXiv 2312.12456):

  y[b, :] = sum_i act(gate_i . x[b], up_i . x[b]) * down_i

with weights stored neuron-major ("row-column bundling"): `gate_rows`, `up_rows`
and `down_rows` are all `[n_hot, d]`, the down projection transposed so that
neuron `i`'s down weights are row `i`. Only the rows named by `indices` are
read, so the cost follows the active set, not `n_hot`.

Four layers, as in jax's `pallas/ops/gpu/paged_attention.py`:
  `_sparse_ffn_kernel`  one grid step: one block of indices x one batch tile.
  `_sparse_ffn_call`    builds the named `pl.pallas_call` ("sparse_ffn").
  `sparse_ffn`          jitted public function; validates, plans blocks, pads.
  `sparse_ffn_reference`  plain jnp (jnp.take + mask); the engine's CPU path.

Design choices (GPU = Pallas' Triton lowering, the only Pallas GPU lowering
that takes a plain `pallas_call` grid with gathers):

* Accumulation: every grid step writes its own partial `f32[block_b, d]` into
  `partials[n_blocks, b_pad, d]`, summed over blocks outside the kernel. The
  Triton backend launches all grid steps as concurrent programs with no
  sequential ("arbitrary") axis, so accumulating into one shared output block
  across steps would be a data race there (it only looks right in interpret
  mode, which runs steps in order). The partials cost `n_blocks * b * d * 4`
  bytes, written and read once: for LLaMA-7B shapes at b = 1, block_n = 32,
  about 3-8% of the active rows' bytes (f32 full set .. bf16 10% set). Atomic
  adds into one output would avoid that but make the summation order, and so
  the result, nondeterministic. Fewer, larger blocks cut the partials; more,
  smaller blocks keep more SMs busy on small active sets (tune block_n with
  scripts/gpu_check_kernels.py).
* Sentinel blocks: an index `< 0` or `>= n_hot` is ignored (its row is read as
  row 0 and its activation masked to 0). A block whose indices are all
  sentinels skips every weight read (`pl.when` on "any valid index in the
  block"; works wherever the sentinels sit, not only at the end) and just
  writes zeros. With `pad_indices` the padding sits at the end, so padding to
  a power of two costs no weight traffic.
* Hidden size: every load/store in the kernel is a `[*, block_d]` tile, so
  Triton's power-of-two rule only needs `d % block_d == 0` with `block_d` a
  power of two; `d` itself need not be one. SmolLM2's d = 576 = 9 * 64 runs
  unpadded with `block_d = 64` (padding to 1024 would read 78% zeros). When
  `d` has no power-of-two factor >= 16, pad weights and x once at load time
  with `pad_hidden(rows, 64)` and slice the output.
* Contractions: for a batch tile below 16 rows (decode), `x @ rows.T` and
  `act @ down` are broadcast-multiply-reduce in f32 (`tl.dot` needs M >= 16
  and would waste 15/16 of the MMA); from 16 rows up (prefill) they are
  `lax.dot_general(..., precision=HIGHEST)` (IEEE f32 on Triton, not TF32).
  Weights of any float dtype are upcast to f32 after the gather: f32
  accumulation regardless of weight dtype.
* Tiles: `block_b * block_n * block_d <= 4096` elements by default (about 32
  f32 registers per thread per tile at 4 warps) so the gate and up tiles plus
  their products stay in registers; `d` is walked in a `fori_loop`.
* Triton params (`num_warps`, `num_stages`) are passed only when not
  interpreting and `jax.default_backend() == "gpu"`. Defaults 4 warps, 2
  stages (the `fori_loop` over `d` is software-pipelined).

Indices must be unique: a duplicated id is counted twice (the reference does
the same). `pad_indices` rejects duplicates for host (NumPy) inputs.

Int8 rows (`scales=`, issue 11): gate/up/down rows int8 with one f32 scale per
32 values of a row (Q8_0's layout: `quantize_rows_q8`), 1.125 bytes per weight
against 2 for bf16. The kernel walks d in tiles of exactly 32 columns, so each
tile has one scale per row: a [block_n] gather, broadcast over the tile, after
the int8 tile is upcast to f32 (no reshapes, every tile a power of two).
Checked in interpret mode against `sparse_ffn_reference`; not yet compiled or
timed on a GPU (no device in the session that wrote it).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp
import numpy as np

FAMILIES = ("swiglu", "reglu", "drelu")
SENTINEL = -1
WEIGHT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16),
                 jnp.dtype(jnp.float16))
Q8_BLOCK = 32  # Values per f32 scale of int8 rows.

# Largest [block_b, block_n, block_d] product (and [block_n, block_d] tile)
# the default block_d keeps in registers.
_TILE_ELEMS = 4096
_MAX_BLOCK_B = 32
_MIN_DOT = 16  # tl.dot needs every dimension >= 16.
_MIN_AUTO_BLOCK_D = 16
_MAX_I32_OFFSET = 2**31  # Triton pointer offsets are int32.
_DEFAULT_NUM_WARPS = 4
_DEFAULT_NUM_STAGES = 2


def next_pow2(n: int) -> int:
  """Smallest power of two >= n (1 for n <= 1)."""
  n = int(n)
  if n < 0:
    raise ValueError(f"next_pow2 needs n >= 0, got {n}")
  return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _prev_pow2(n: int) -> int:
  """Largest power of two <= n, for n >= 1."""
  return 1 << (int(n).bit_length() - 1)


def _is_pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def pad_indices(active_ids: np.ndarray | jax.Array, size: int):
  """Pads active hot-neuron ids with the sentinel -1 to `size` entries.

  Args:
    active_ids: int[n] unique ids in [0, n_hot), any order (ascending is best
      for memory locality). NumPy input is checked for duplicates and
      negatives; a jax.Array (possibly traced) is not.
    size: total length, >= n; for `sparse_ffn` a power of two (`next_pow2`).

  Returns:
    i32[size]: the ids, then -1s. NumPy in -> NumPy out; jax.Array in ->
    jax.Array out (jittable with a static `size`).
  """
  size = int(size)
  if isinstance(active_ids, jax.Array):
    ids = active_ids.reshape(-1)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise ValueError(f"active_ids must be integers, got {ids.dtype}")
    if ids.shape[0] > size:
      raise ValueError(f"{ids.shape[0]} active ids do not fit in size={size}")
    return jnp.pad(ids.astype(jnp.int32), (0, size - ids.shape[0]),
                   constant_values=SENTINEL)
  ids = np.asarray(active_ids).reshape(-1)
  if ids.size and not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"active_ids must be integers, got {ids.dtype}")
  if ids.size > size:
    raise ValueError(f"{ids.size} active ids do not fit in size={size}")
  if ids.size and ids.min() < 0:
    raise ValueError(f"active ids must be >= 0, got min {ids.min()}")
  if np.unique(ids).size != ids.size:
    raise ValueError("active ids must be unique (a duplicate would be counted"
                     " twice by sparse_ffn)")
  out = np.full((size,), SENTINEL, np.int32)
  out[:ids.size] = ids
  return out


def pad_hidden(rows, multiple: int):
  """Zero-pads the last (hidden) axis up to a multiple of `multiple`.

  Use once at load time on gate/up/down rows (and on x per call) when the
  hidden size has no power-of-two factor >= 16; slice the output back.

  Args:
    rows: [..., d] NumPy or jax array (weights [n_hot, d] or x [b, d]).
    multiple: positive int, e.g. 64.

  Returns:
    [..., ceil(d / multiple) * multiple], same kind and dtype as `rows`.
  """
  if multiple <= 0:
    raise ValueError(f"multiple must be positive, got {multiple}")
  d = rows.shape[-1]
  extra = -d % multiple
  if extra == 0:
    return rows
  pad = [(0, 0)] * (rows.ndim - 1) + [(0, extra)]
  if isinstance(rows, jax.Array):
    return jnp.pad(rows, pad)
  return np.pad(rows, pad)


def _activation(g: jax.Array, u: jax.Array, family: str) -> jax.Array:
  """act(g, u) for f32 g, u of the same shape."""
  if family == "swiglu":
    return g * jax.nn.sigmoid(g) * u
  if family == "reglu":
    return jnp.maximum(g, 0.0) * u
  if family == "drelu":
    return jnp.maximum(g, 0.0) * jnp.maximum(u, 0.0)
  raise ValueError(f"unknown FFN family {family!r}; expected one of {FAMILIES}")


def _matmul_nt(a: jax.Array, b: jax.Array, use_dot: bool) -> jax.Array:
  """a: f32[m, k], b: f32[n, k] -> f32[m, n] = a @ b.T."""
  if use_dot:
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                           precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)
  (m, k), (n, _) = a.shape, b.shape
  # [m, n, k]
  prod = (lax.broadcast_in_dim(a, (m, n, k), (0, 2))
          * lax.broadcast_in_dim(b, (m, n, k), (1, 2)))
  return jnp.sum(prod, axis=2)


def _matmul_nn(a: jax.Array, b: jax.Array, use_dot: bool) -> jax.Array:
  """a: f32[m, k], b: f32[k, n] -> f32[m, n] = a @ b."""
  if use_dot:
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                           precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)
  (m, k), (_, n) = a.shape, b.shape
  # [m, k, n]
  prod = (lax.broadcast_in_dim(a, (m, k, n), (0, 1))
          * lax.broadcast_in_dim(b, (m, k, n), (1, 2)))
  return jnp.sum(prod, axis=1)


def _sparse_ffn_kernel(
    idx_ref,   # i32[block_n]: this step's hot-neuron ids; <0 or >=n_hot = skip
    x_ref,     # f32[block_b, d]: this step's batch tile
    gate_ref,  # w[n_hot, d]: whole array, gathered by row
    up_ref,    # w[n_hot, d]: whole array, gathered by row
    down_ref,  # w[n_hot, d]: whole array (down transposed), gathered by row
    o_ref,     # f32[block_b, d]: this step's partial (n_blocks axis squeezed)
    *,
    family: str,
    block_d: int,
    use_dot: bool,
):
  """One block of `block_n` indices times one batch tile -> one partial."""
  block_b, d = x_ref.shape
  n_hot = gate_ref.shape[0]
  block_n = idx_ref.shape[0]
  n_d = d // block_d

  idx = idx_ref[...]  # [block_n]
  valid = (idx >= 0) & (idx < n_hot)  # [block_n]
  rows = jnp.where(valid, idx, 0)  # [block_n], in range for the gather
  any_valid = jnp.sum(valid.astype(jnp.int32)) > 0

  def cols(j):
    if isinstance(j, int):
      return pl.ds(j * block_d, block_d)
    return pl.ds(pl.multiple_of(j * block_d, block_d), block_d)

  def loop(body, init):
    """Runs body(j, carry) for j in [0, n_d); unrolled away when n_d == 1."""
    if n_d == 1:
      return body(0, init)
    return lax.fori_loop(0, n_d, body, init)

  @pl.when(any_valid)
  def _compute():
    def gate_up_step(j, carry):
      g, u = carry  # [block_b, block_n] each
      c = cols(j)
      xs = x_ref[:, c].astype(jnp.float32)  # [block_b, block_d]
      gs = gate_ref[rows, c].astype(jnp.float32)  # [block_n, block_d]
      us = up_ref[rows, c].astype(jnp.float32)  # [block_n, block_d]
      return g + _matmul_nt(xs, gs, use_dot), u + _matmul_nt(xs, us, use_dot)

    zeros = jnp.zeros((block_b, block_n), jnp.float32)
    g, u = loop(gate_up_step, (zeros, zeros))
    # [block_b, block_n]; sentinel columns contribute nothing.
    a = jnp.where(valid[None, :], _activation(g, u, family), 0.0)

    def down_step(j, carry):
      c = cols(j)
      ds = down_ref[rows, c].astype(jnp.float32)  # [block_n, block_d]
      o_ref[:, c] = _matmul_nn(a, ds, use_dot)  # [block_b, block_d]
      return carry

    loop(down_step, 0)

  @pl.when(jnp.logical_not(any_valid))
  def _all_sentinel():
    def zero_step(j, carry):
      o_ref[:, cols(j)] = jnp.zeros((block_b, block_d), jnp.float32)
      return carry

    loop(zero_step, 0)


def quantize_rows_q8(rows) -> tuple[jax.Array, jax.Array]:
  """rows: float[n, d] (d a multiple of 32) -> (q: i8[n, d], scales: f32[n, d / 32]).

  Per block of 32 values: scale = max|block| / 127, q = round(rows / scale)
  (0 for an all-zero block), as GGUF's Q8_0.
  """
  rows = jnp.asarray(rows, jnp.float32)
  n, d = rows.shape
  if d % Q8_BLOCK:
    raise ValueError(f"int8 rows need d a multiple of {Q8_BLOCK}, got {d}")
  blocks = rows.reshape(n, d // Q8_BLOCK, Q8_BLOCK)
  scales = jnp.max(jnp.abs(blocks), axis=-1) / 127.0  # [n, d / 32]
  inv = jnp.where(scales > 0, 1.0 / jnp.where(scales > 0, scales, 1.0), 0.0)
  q = jnp.clip(jnp.round(blocks * inv[..., None]), -127, 127).astype(jnp.int8)
  return q.reshape(n, d), scales.astype(jnp.float32)


def _sparse_ffn_q8_kernel(
    idx_ref,   # i32[block_n]
    x_ref,     # f32[block_b, d]
    gate_ref,  # i8[n_hot, d]
    up_ref,    # i8[n_hot, d]
    down_ref,  # i8[n_hot, d] (down transposed)
    gs_ref,    # f32[n_hot, d / 32]: scales of gate_ref
    us_ref,    # f32[n_hot, d / 32]
    ds_ref,    # f32[n_hot, d / 32]
    o_ref,     # f32[block_b, d]
    *,
    family: str,
    use_dot: bool,
):
  """`_sparse_ffn_kernel` on int8 rows: tiles of 32 columns, one scale each."""
  block_b, d = x_ref.shape
  n_hot = gate_ref.shape[0]
  n_d = d // Q8_BLOCK
  idx = idx_ref[...]
  valid = (idx >= 0) & (idx < n_hot)
  rows = jnp.where(valid, idx, 0)
  any_valid = jnp.sum(valid.astype(jnp.int32)) > 0

  def cols(j):
    return pl.ds(pl.multiple_of(j * Q8_BLOCK, Q8_BLOCK), Q8_BLOCK)

  def tile(w_ref, s_ref, j):  # f32[block_n, 32]: the int8 tile times its row scales
    w = w_ref[rows, cols(j)].astype(jnp.float32)
    return w * s_ref[rows, pl.ds(j, 1)]  # [block_n, 1] broadcast over the tile

  @pl.when(any_valid)
  def _compute():
    def gate_up_step(j, carry):
      g, u = carry
      xs = x_ref[:, cols(j)].astype(jnp.float32)  # [block_b, 32]
      return (g + _matmul_nt(xs, tile(gate_ref, gs_ref, j), use_dot),
              u + _matmul_nt(xs, tile(up_ref, us_ref, j), use_dot))

    zeros = jnp.zeros((block_b, idx.shape[0]), jnp.float32)
    g, u = lax.fori_loop(0, n_d, gate_up_step, (zeros, zeros))
    a = jnp.where(valid[None, :], _activation(g, u, family), 0.0)

    def down_step(j, carry):
      o_ref[:, cols(j)] = _matmul_nn(a, tile(down_ref, ds_ref, j), use_dot)
      return carry

    lax.fori_loop(0, n_d, down_step, 0)

  @pl.when(jnp.logical_not(any_valid))
  def _all_sentinel():
    def zero_step(j, carry):
      o_ref[:, cols(j)] = jnp.zeros((block_b, Q8_BLOCK), jnp.float32)
      return carry

    lax.fori_loop(0, n_d, zero_step, 0)


def _sparse_ffn_call(
    x: jax.Array,          # f32[b_pad, d]
    gate_rows: jax.Array,  # w[n_hot, d]
    up_rows: jax.Array,    # w[n_hot, d]
    down_rows: jax.Array,  # w[n_hot, d]
    indices: jax.Array,    # i32[n_idx]
    *,
    family: str,
    block_n: int,
    block_b: int,
    block_d: int,
    use_dot: bool,
    interpret: bool,
    compiler_params: plgpu.CompilerParams | None,
    scales: tuple[jax.Array, jax.Array, jax.Array] | None = None,
) -> jax.Array:
  """Builds and runs the pallas_call; returns partials f32[n_blocks, b_pad, d].

  Grid: (n_idx // block_n index blocks, b_pad // block_b batch tiles). The
  index vector is blocked per step; the three weight arrays use whole-array
  BlockSpecs and are indexed with the loaded ids inside the kernel.
  """
  b_pad, d = x.shape
  n_hot = gate_rows.shape[0]
  n_blocks = indices.shape[0] // block_n
  grid = (n_blocks, b_pad // block_b)
  whole = pl.BlockSpec((n_hot, d), lambda i, j: (0, 0))
  in_specs = [
      pl.BlockSpec((block_n,), lambda i, j: (i,)),  # indices
      pl.BlockSpec((block_b, d), lambda i, j: (j, 0)),  # x
      whole,  # gate_rows
      whole,  # up_rows
      whole,  # down_rows
  ]
  args = (indices, x, gate_rows, up_rows, down_rows)
  if scales is None:
    kernel = functools.partial(
        _sparse_ffn_kernel, family=family, block_d=block_d, use_dot=use_dot)
  else:
    kernel = functools.partial(_sparse_ffn_q8_kernel, family=family, use_dot=use_dot)
    in_specs += [pl.BlockSpec((n_hot, d // Q8_BLOCK), lambda i, j: (0, 0))] * 3
    args += tuple(scales)
  return pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=in_specs,
      out_specs=pl.BlockSpec((None, block_b, d), lambda i, j: (i, j, 0)),
      out_shape=jax.ShapeDtypeStruct((n_blocks, b_pad, d), jnp.float32),
      interpret=interpret,
      compiler_params=compiler_params,
      name="sparse_ffn_q8" if scales is not None else "sparse_ffn",
  )(*args)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static block sizes for one call (all powers of two)."""
  b: int
  b_pad: int
  block_b: int
  block_n: int
  block_d: int
  use_dot: bool


def _validate_scales(gate_rows, scales) -> None:
  """int8 rows need scales (three f32[n_hot, d / 32]); float rows take none."""
  is_int8 = jnp.dtype(gate_rows.dtype) == jnp.dtype(jnp.int8)
  if scales is None:
    if is_int8:
      raise ValueError("int8 rows need scales=(gate, up, down) f32[n_hot, d / 32] "
                       "(see quantize_rows_q8)")
    return
  if not is_int8:
    raise ValueError(f"scales are for int8 rows; the rows are {gate_rows.dtype}")
  n_hot, d = gate_rows.shape
  if d % Q8_BLOCK:
    raise ValueError(f"int8 rows need d a multiple of {Q8_BLOCK}, got {d}")
  if len(scales) != 3:
    raise ValueError(f"scales must be (gate, up, down), got {len(scales)} arrays")
  for name, sc in zip(("gate", "up", "down"), scales):
    if sc.shape != (n_hot, d // Q8_BLOCK) or sc.dtype != jnp.float32:
      raise ValueError(f"{name} scales must be f32[{n_hot}, {d // Q8_BLOCK}], got "
                       f"{sc.dtype}{list(sc.shape)}")


def _validate(x, gate_rows, up_rows, down_rows, indices, family, scales=None) -> None:
  """Checks ranks, shapes and dtypes shared by kernel and reference."""
  _validate_scales(gate_rows, scales)
  if family not in FAMILIES:
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
  if x.ndim not in (1, 2):
    raise ValueError(f"x must be [d] or [b, d], got shape {x.shape}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"x must be floating point, got {x.dtype}")
  for name, w in (("gate_rows", gate_rows), ("up_rows", up_rows),
                  ("down_rows", down_rows)):
    if w.ndim != 2:
      raise ValueError(f"{name} must be [n_hot, d], got shape {w.shape}")
    if w.shape != gate_rows.shape:
      raise ValueError(f"{name} has shape {w.shape} but gate_rows has"
                       f" {gate_rows.shape}; all three must be [n_hot, d]")
    if w.dtype != gate_rows.dtype:
      raise ValueError(f"{name} has dtype {w.dtype} but gate_rows has"
                       f" {gate_rows.dtype}")
  if jnp.dtype(gate_rows.dtype) not in WEIGHT_DTYPES and scales is None:
    raise ValueError(f"weights must be one of {[str(t) for t in WEIGHT_DTYPES]},"
                     f" got {gate_rows.dtype}")
  if x.shape[-1] != gate_rows.shape[1]:
    raise ValueError(f"x has hidden size {x.shape[-1]} but the weights have"
                     f" {gate_rows.shape[1]} (pad both with pad_hidden)")
  if indices.ndim != 1:
    raise ValueError(f"indices must be i32[n_idx], got shape {indices.shape}")
  if indices.dtype != jnp.int32:
    raise ValueError(f"indices must be int32, got {indices.dtype}")


def _plan(b: int, d: int, n_idx: int, block_n: int,
          block_d: int | None) -> _Plan:
  """Validates the kernel's block constraints and picks the missing sizes."""
  if not _is_pow2(n_idx):
    raise ValueError(f"len(indices) must be a power of two (pad with"
                     f" pad_indices(ids, next_pow2(n))), got {n_idx}")
  if not _is_pow2(block_n):
    raise ValueError(f"block_n must be a power of two, got {block_n}")
  block_n = min(block_n, n_idx)  # both powers of two: divides n_idx.
  block_b = min(next_pow2(b), _MAX_BLOCK_B)
  b_pad = -(-b // block_b) * block_b
  if block_d is None:
    pow2_factor = d & -d
    if block_b >= _MIN_DOT:  # dot path: [block_n | block_b, block_d] tiles
      budget = _TILE_ELEMS // max(block_n, block_b)
    else:  # broadcast path: [block_b, block_n, block_d] products
      budget = _TILE_ELEMS // (block_b * block_n)
    block_d = min(pow2_factor, _prev_pow2(max(budget, 1)))
    if pow2_factor < _MIN_AUTO_BLOCK_D and pow2_factor < d:
      raise ValueError(
          f"hidden size {d} has power-of-two factor {pow2_factor} (tiles of"
          f" {pow2_factor} columns would be slow); pad the weights and x once"
          f" with pad_hidden(rows, 64) or pass block_d")
  elif not _is_pow2(block_d) or d % block_d:
    raise ValueError(f"block_d must be a power of two dividing d={d}, got"
                     f" {block_d}")
  use_dot = min(block_b, block_n, block_d) >= _MIN_DOT
  return _Plan(b=b, b_pad=b_pad, block_b=block_b, block_n=block_n,
               block_d=block_d, use_dot=use_dot)


def _sparse_ffn_impl(x, gate_rows, up_rows, down_rows, indices, *, family,
                     block_n, block_d, interpret, compiler_params, scales=None):
  """Unjitted body of `sparse_ffn` (compiler_params chosen by the caller)."""
  _validate(x, gate_rows, up_rows, down_rows, indices, family, scales)
  x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)  # [b, d]
  b, d = x2.shape
  if scales is not None:
    if block_d not in (None, Q8_BLOCK):
      raise ValueError(f"int8 rows are walked in tiles of {Q8_BLOCK} columns; got "
                       f"block_d={block_d}")
    block_d = Q8_BLOCK
  plan = _plan(b, d, indices.shape[0], block_n, block_d)
  n_hot = gate_rows.shape[0]
  n_out = indices.shape[0] // plan.block_n * plan.b_pad * d
  if max(n_hot * d, n_out) >= _MAX_I32_OFFSET:
    raise ValueError(
        f"the Triton kernel addresses with int32 offsets: n_hot * d ="
        f" {n_hot * d} and n_blocks * b_pad * d = {n_out} must stay below"
        f" 2**31; split the weights or the batch, or raise block_n")
  if plan.b_pad != b:
    x2 = jnp.pad(x2, ((0, plan.b_pad - b), (0, 0)))
  partials = _sparse_ffn_call(
      x2, gate_rows, up_rows, down_rows, indices, family=family,
      block_n=plan.block_n, block_b=plan.block_b, block_d=plan.block_d,
      use_dot=plan.use_dot, interpret=interpret,
      compiler_params=compiler_params, scales=scales)  # [n_blocks, b_pad, d]
  y = jnp.sum(partials, axis=0)[:b]  # [b, d]
  return y.reshape(x.shape[:-1] + (d,))


@functools.partial(
    jax.jit,
    static_argnames=("family", "block_n", "block_d", "num_warps", "num_stages",
                     "interpret"))
def sparse_ffn(
    x: jax.Array,
    gate_rows: jax.Array,
    up_rows: jax.Array,
    down_rows: jax.Array,
    indices: jax.Array,
    *,
    family: str = "swiglu",
    block_n: int = 32,
    block_d: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
    scales: tuple[jax.Array, jax.Array, jax.Array] | None = None,
) -> jax.Array:
  """Sparse FFN over active hot neurons with a Pallas gather kernel.

  Args:
    x: float[b, d] or float[d] FFN input (after the norm); computed in f32.
    gate_rows: w[n_hot, d] gate projection rows, w in {f32, bf16, f16}.
    up_rows: w[n_hot, d] up projection rows.
    down_rows: w[n_hot, d] down projection, transposed (row i = neuron i).
    indices: i32[n_idx] unique active ids, n_idx a power of two; entries < 0
      or >= n_hot (use -1, see `pad_indices`) are ignored.
    family: "swiglu" silu(g)*u, "reglu" relu(g)*u, "drelu" relu(g)*relu(u).
    block_n: indices per grid step, a power of two (clamped to n_idx).
    block_d: hidden-size tile, a power of two dividing d; None picks the
      largest that divides d and fits the register budget.
    num_warps: Triton warps per program (GPU only; default 4).
    num_stages: Triton pipeline stages (GPU only; default 2).
    interpret: run the Pallas interpreter (CPU tests) instead of compiling.
    scales: with int8 rows, their f32[n_hot, d / 32] scales (gate, up, down),
      e.g. from `quantize_rows_q8`; block_d is then 32.

  Returns:
    f32[b, d] (f32[d] for 1-D x): sum over valid i of act(gate_i.x, up_i.x)
    * down_i, accumulated in f32.

  Raises:
    ValueError: shapes, dtypes or block sizes the kernel cannot take.
  """
  backend = jax.default_backend()
  compiler_params = None
  if not interpret:
    if backend != "gpu":
      raise ValueError(
          f"sparse_ffn(interpret=False) compiles for GPU but the backend is"
          f" {backend!r}; use sparse_ffn_reference on CPU or interpret=True")
    compiler_params = plgpu.CompilerParams(
        num_warps=_DEFAULT_NUM_WARPS if num_warps is None else num_warps,
        num_stages=_DEFAULT_NUM_STAGES if num_stages is None else num_stages)
  return _sparse_ffn_impl(
      x, gate_rows, up_rows, down_rows, indices, family=family,
      block_n=block_n, block_d=block_d, interpret=interpret,
      compiler_params=compiler_params, scales=scales)


@functools.partial(jax.jit, static_argnames=("family",))
def sparse_ffn_reference(
    x: jax.Array,
    gate_rows: jax.Array,
    up_rows: jax.Array,
    down_rows: jax.Array,
    indices: jax.Array,
    *,
    family: str = "swiglu",
    scales: tuple[jax.Array, jax.Array, jax.Array] | None = None,
) -> jax.Array:
  """Plain-jnp sparse FFN (the CPU path): gather rows, mask, two matmuls.

  Same contract as `sparse_ffn` except that `len(indices)` may be any size
  (no power-of-two rule). Gathered rows are upcast to f32 before the
  matmuls (precision HIGHEST), so bf16 weights never hit a bf16 dot.

  Args:
    x: float[b, d] or float[d].
    gate_rows, up_rows, down_rows: w[n_hot, d] (down transposed).
    indices: i32[n_idx]; entries < 0 or >= n_hot are ignored.
    family: "swiglu", "reglu" or "drelu".
    scales: with int8 rows, their f32[n_hot, d / 32] scales (gate, up, down);
      gathered rows are dequantized (row * its block's scale) before the
      matmuls.

  Returns:
    f32[b, d] (f32[d] for 1-D x).
  """
  _validate(x, gate_rows, up_rows, down_rows, indices, family, scales)
  n_hot, d = gate_rows.shape
  x2 = x.reshape(-1, d).astype(jnp.float32)  # [b, d]
  valid = (indices >= 0) & (indices < n_hot)  # [n_idx]
  rows = jnp.where(valid, indices, 0)  # [n_idx]

  def take(w, k):
    out = jnp.take(w, rows, axis=0, mode="clip").astype(jnp.float32)  # [n_idx, d]
    if scales is not None:
      sc = jnp.take(scales[k], rows, axis=0, mode="clip")  # [n_idx, d / 32]
      out = out * jnp.repeat(sc, Q8_BLOCK, axis=1)
    return out

  hi = lax.Precision.HIGHEST
  g = jnp.einsum("bd,nd->bn", x2, take(gate_rows, 0), precision=hi)  # [b, n_idx]
  u = jnp.einsum("bd,nd->bn", x2, take(up_rows, 1), precision=hi)  # [b, n_idx]
  a = jnp.where(valid[None, :], _activation(g, u, family), 0.0)  # [b, n_idx]
  y = jnp.einsum("bn,nd->bd", a, take(down_rows, 2), precision=hi)  # [b, d]
  return y.reshape(x.shape[:-1] + (d,))
