"""The non-matmul parts of a host decoder layer: RMSNorm, RoPE and grouped-query attention over
host KV caches (numba).

Attention takes a ragged batch: N tokens, token i of sequence slot `slots[i]` at position
`positions[i]` (decode steps of several sequences, a chunk of one prompt, or both in one pass).
Its keys and values are written to the cache at (slot, position) first, then each token
attends to positions [0, position] of its own slot (a sliding window: the last `window`), so a
token's result depends on its own sequence only: a sequence decodes the same alone or batched.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils
from numba.core import types
from numba.extending import intrinsic

from host_ops import common
from host_ops.llvm_ir import F32 as _F32, I64 as _I64, const as _const, splat as _splat, \
    switch_codegen, vec as _vec


@numba.njit(**common.JIT)
def rms_norm(x, scale, eps):
  """x: f32[b, D] -> x / sqrt(mean(x^2) + eps) * scale (sum of squares in f64)."""
  out = np.empty_like(x)
  for r in range(x.shape[0]):
    ss = 0.0
    for j in range(x.shape[1]):
      ss += np.float64(x[r, j]) * np.float64(x[r, j])
    inv = np.float32(1.0 / np.sqrt(ss / x.shape[1] + eps))
    for j in range(x.shape[1]):
      out[r, j] = x[r, j] * inv * scale[j]
  return out


@numba.njit(inline="always", **common.JIT)
def _rope_head(src, dst, cos_t, sin_t, adjacent):
  """dst = src (one head, f32[H]) with its first R = 2 len(cos_t) dims rotated."""
  half = cos_t.shape[0]
  for j in range(src.shape[0]):
    dst[j] = src[j]
  for j in range(half):
    if adjacent:  # pairs (2j, 2j + 1): GGUF llama layout
      a, c = 2 * j, 2 * j + 1
    else:  # pairs (j, j + R/2): NeoX / Hugging Face layout
      a, c = j, j + half
    x0 = src[a]
    x1 = src[c]
    dst[a] = x0 * cos_t[j] - x1 * sin_t[j]
    dst[c] = x0 * sin_t[j] + x1 * cos_t[j]


@numba.njit(inline="always", **common.JIT)
def _head_norm(src, dst, scale, eps):
  """dst = RMSNorm(src) * scale over one head (f32[H]); a no-op copy when scale is empty."""
  if scale.shape[0] == 0:
    for j in range(src.shape[0]):
      dst[j] = src[j]
    return
  ss = 0.0
  for j in range(src.shape[0]):
    ss += np.float64(src[j]) * np.float64(src[j])
  inv = np.float32(1.0 / np.sqrt(ss / src.shape[0] + eps))
  for j in range(src.shape[0]):
    dst[j] = src[j] * inv * scale[j]


# ----------------------------------------------------------------------------- blocked kernels
KEY_TILE = 16  # Keys per score tile (one vector of 16 f32 lanes).
MAX_SCORE_ROWS = 8  # Query rows per score-tile call (8 chains of FMAs hide their latency).
MAX_PV_ROWS = 4  # Probability rows per P @ V call (4 rows x 64 values = 16 vector sums).
PV_COLS = 64  # Value columns per P @ V call (the head dim's tail: 16 at a time).
QUERY_BLOCK = 16  # Consecutive tokens of one sequence whose queries share one pass over keys.
_V16 = _vec(_F32, 16)


def _scores_codegen(R):
  """IR of s[r0 + r, col:col + 16] = sum_j q[r0 + r, j] kt[j, :] for r < R: one FMA chain per
  score along j in index order (so a score's bits do not depend on R or on the other rows).
  Args: q f32[M, H], kt f32[H, 16], s f32[M, T], r0, col (i64)."""

  def codegen(context, bd, sig, args):
    q, kt, sc = (context.make_array(t)(context, bd, a) for t, a in zip(sig.args[:3], args[:3]))
    r0, col = args[3], args[4]
    hd = bd.extract_value(q.shape, 1)
    ncol = bd.extract_value(sc.shape, 1)
    qs = [bd.gep(q.data, [bd.mul(bd.add(r0, _const(_I64, r)), hd)]) for r in range(R)]
    zero = ir.Constant(_V16, [0.0] * 16)
    acc = [cgutils.alloca_once_value(bd, zero) for _ in range(R)]
    with cgutils.for_range(bd, hd) as loop:
      j = loop.index
      kv = bd.load(bd.bitcast(bd.gep(kt.data, [bd.mul(j, _const(_I64, 16))]), _V16.as_pointer()),
                   align=4)
      for r in range(R):
        qj = _splat(bd, bd.load(bd.gep(qs[r], [j])), 16)
        bd.store(common.fma(bd, qj, kv, bd.load(acc[r])), acc[r])
    for r in range(R):
      at = bd.add(bd.mul(bd.add(r0, _const(_I64, r)), ncol), col)
      bd.store(bd.load(acc[r]), bd.bitcast(bd.gep(sc.data, [at]), _V16.as_pointer()), align=4)
    return context.get_dummy_value()

  return codegen


def _pv_codegen(R, C):
  """IR of o[r0 + r, c0:c0 + 16 C] = sum_t p[r0 + r, t] v[t, c0:c0 + 16 C] over t in [t0, t1),
  for r < R: one FMA chain per output along t in increasing order. Args: p f32[M, T], v f32[S,
  K, H] (one slot's values), kv, o f32[M, H], r0, c0, t0, t1, pcol (i64: column of p for t0)."""

  def codegen(context, bd, sig, args):
    p, v, o = (context.make_array(t)(context, bd, a) for t, a in
               zip((sig.args[0], sig.args[1], sig.args[3]), (args[0], args[1], args[3])))
    kv, r0, c0, t0, t1, pcol = args[2], args[4], args[5], args[6], args[7], args[8]
    ncol = bd.extract_value(p.shape, 1)
    n_kv = bd.extract_value(v.shape, 1)
    hd = bd.extract_value(v.shape, 2)
    rows = [bd.add(r0, _const(_I64, r)) for r in range(R)]
    prow = [bd.gep(p.data, [bd.add(bd.mul(rr, ncol), pcol)]) for rr in rows]
    zero = ir.Constant(_V16, [0.0] * 16)
    acc = [[cgutils.alloca_once_value(bd, zero) for _ in range(C)] for _ in range(R)]
    base = bd.add(bd.mul(kv, hd), c0)
    with cgutils.for_range_slice(bd, t0, t1, _const(_I64, 1), inc=True) as (t, _):
      vrow = bd.gep(v.data, [bd.add(bd.mul(t, bd.mul(n_kv, hd)), base)])
      vs = [bd.load(bd.bitcast(bd.gep(vrow, [_const(_I64, 16 * c)]), _V16.as_pointer()), align=4)
            for c in range(C)]
      dt = bd.sub(t, t0)
      for r in range(R):
        w = _splat(bd, bd.load(bd.gep(prow[r], [dt])), 16)
        for c in range(C):
          bd.store(common.fma(bd, w, vs[c], bd.load(acc[r][c])), acc[r][c])
    for r in range(R):
      orow = bd.gep(o.data, [bd.add(bd.mul(rows[r], hd), c0)])
      for c in range(C):
        bd.store(bd.load(acc[r][c]), bd.bitcast(bd.gep(orow, [_const(_I64, 16 * c)]),
                                                _V16.as_pointer()), align=4)
    return context.get_dummy_value()

  return codegen


def _vexp(bd, x):
  """e^x on <16 x float> as `common.exp_f32` (Cody-Waite reduction, Taylor to r^7, 2^n from
  its bits), IEEE order: the same bits as the scalar function; NaN stays NaN."""
  x0 = x

  def c(v):
    return ir.Constant(_V16, [float(v)] * 16)

  def fmin(a, b):
    return bd.select(bd.fcmp_ordered("<", a, b), a, b)

  def fmax(a, b):
    return bd.select(bd.fcmp_ordered(">", a, b), a, b)

  x = fmin(fmax(x, c(common._EXP_LO)), c(common._EXP_HI))
  rint = cgutils.get_or_insert_function(bd.module, ir.FunctionType(_V16, [_V16]),
                                        "llvm.rint.v16f32")
  n = bd.call(rint, [common.fmul(bd, x, c(common._LOG2E))])
  r = common.fsub(bd, common.fsub(bd, x, common.fmul(bd, n, c(common._LN2_HI))),
                  common.fmul(bd, n, c(common._LN2_LO)))
  p = c(np.float32(1.0 / 5040.0))
  for k in (1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0):
    p = common.fadd(bd, common.fmul(bd, p, r), c(np.float32(k)))
  i32 = _vec(ir.IntType(32), 16)
  bits = bd.shl(bd.add(bd.fptosi(n, i32), ir.Constant(i32, [127] * 16)),
                ir.Constant(i32, [23] * 16))
  e = common.fmul(bd, p, bd.bitcast(bits, _V16))
  return bd.select(bd.fcmp_unordered("uno", x0, x0), x0, e)


def _nanmax(bd, a, b):
  """max(a, b) lane by lane, NaN if either is (a corrupt score must reach the output)."""
  return bd.select(bd.or_(bd.fcmp_unordered("uno", a, a), bd.fcmp_ordered(">", a, b)), a, b)


def _softmax_codegen():
  """IR of row r of s over columns [lo, hi): s = softmax(s * scale) there, 0 in the rest of
  the 16-column vectors that hold them. Lanes are the columns mod 16 (callers start rows at a
  multiple of 16 keys), and the max, exp and sum run per lane then a fixed tree: a row's bits
  depend on its own scores only. A NaN score (or +inf: exp(inf - inf) is NaN) makes the row
  NaN, as the reference's softmax does. Args: s f32[M, T] (T a multiple of 16), r, lo, hi
  (i64), scale (f32)."""

  def codegen(context, bd, sig, args):
    sc = context.make_array(sig.args[0])(context, bd, args[0])
    r, lo, hi, scale = args[1:5]
    ncol = bd.extract_value(sc.shape, 1)
    row = bd.gep(sc.data, [bd.mul(r, ncol)])
    start = bd.and_(lo, _const(_I64, -16))
    end = bd.and_(bd.add(hi, _const(_I64, 15)), _const(_I64, -16))
    nvec = bd.lshr(bd.sub(end, start), _const(_I64, 4))
    lane = ir.Constant(_vec(_I64, 16), list(range(16)))
    ninf = ir.Constant(_V16, [float("-inf")] * 16)
    zero = ir.Constant(_V16, [0.0] * 16)
    vscale = _splat(bd, scale, 16)

    def at(k):
      b = bd.add(start, bd.shl(k, _const(_I64, 4)))
      ptr = bd.bitcast(bd.gep(row, [b]), _V16.as_pointer())
      idx = bd.add(_splat(bd, b, 16), lane)
      ok = bd.and_(bd.icmp_signed(">=", idx, _splat(bd, lo, 16)),
                   bd.icmp_signed("<", idx, _splat(bd, hi, 16)))
      return ptr, ok

    top = cgutils.alloca_once_value(bd, ninf)
    with cgutils.for_range(bd, nvec) as loop:
      ptr, ok = at(loop.index)
      x = bd.select(ok, common.fmul(bd, bd.load(ptr, align=4), vscale), ninf)
      bd.store(x, ptr, align=4)
      bd.store(_nanmax(bd, x, bd.load(top)), top)
    m = bd.load(top)
    n = 16
    while n > 1:
      h = n // 2
      a = bd.shuffle_vector(m, m, _const(ir.IntType(32), list(range(h))))
      b = bd.shuffle_vector(m, m, _const(ir.IntType(32), list(range(h, n))))
      m = _nanmax(bd, a, b)
      n = h
    vtop = _splat(bd, bd.extract_element(m, _const(ir.IntType(32), 0)), 16)
    total = cgutils.alloca_once_value(bd, zero)
    with cgutils.for_range(bd, nvec) as loop:
      ptr, ok = at(loop.index)
      e = bd.select(ok, _vexp(bd, common.fsub(bd, bd.load(ptr, align=4), vtop)), zero)
      bd.store(e, ptr, align=4)
      bd.store(common.fadd(bd, bd.load(total), e), total)
    vsum = _splat(bd, common.hsum(bd, bd.load(total)), 16)
    with cgutils.for_range(bd, nvec) as loop:
      ptr, _ = at(loop.index)
      bd.store(bd.fdiv(bd.load(ptr, align=4), vsum, flags=common.ORDERED), ptr, align=4)
    return context.get_dummy_value()

  return codegen


@intrinsic
def _softmax_row(typingctx, sc, r, lo, hi, scale):
  return types.void(sc, r, lo, hi, scale), _softmax_codegen()


def _transpose_masks():
  """Shuffle masks of a 16 x 16 transpose in 4 stages: stage k swaps bit k of the row and the
  column index, each new row a two-source shuffle of rows r & ~2^k and r | 2^k."""
  stages = []
  for k in range(4):
    bit = 1 << k
    rows = []
    for r in range(16):
      lo, hi = r & ~bit, r | bit
      mask = []
      for c in range(16):
        src = hi if c & bit else lo
        col = (c | bit) if r & bit else (c & ~bit)
        mask.append((16 if src == hi else 0) + col)
      rows.append((lo, hi, mask))
    stages.append(rows)
  return stages


_TRANSPOSE = _transpose_masks()


def _transpose_codegen():
  """IR of kt[16 b + j, u] = k[t0 + u, kv, 16 b + j] for u < cnt (0 for cnt <= u < 16), b <
  H / 16: 16 keys' rows transposed in registers, 16 x 16 at a time (4 stages of 16 two-source
  shuffles). Args: k f32[S, K, H] (one slot's keys, H a multiple of 16), kv, t0, cnt (i64), kt
  f32[H, 16]."""

  def codegen(context, bd, sig, args):
    k = context.make_array(sig.args[0])(context, bd, args[0])
    kt = context.make_array(sig.args[4])(context, bd, args[4])
    kv, t0, cnt = args[1], args[2], args[3]
    n_kv = bd.extract_value(k.shape, 1)
    hd = bd.extract_value(k.shape, 2)
    stride = bd.mul(n_kv, hd)
    base = bd.gep(k.data, [bd.add(bd.mul(t0, stride), bd.mul(kv, hd))])
    zero = ir.Constant(_V16, [0.0] * 16)
    i32 = ir.IntType(32)
    with cgutils.for_range(bd, bd.udiv(hd, _const(_I64, 16))) as loop:
      col = bd.mul(loop.index, _const(_I64, 16))
      rows = []
      for u in range(16):
        ptr = bd.bitcast(bd.gep(base, [bd.add(bd.mul(_const(_I64, u), stride), col)]),
                         _V16.as_pointer())
        # A key past cnt is not read (it may lie past the cache's end): zeros instead.
        with bd.if_else(bd.icmp_signed("<", _const(_I64, u), cnt)) as (then, other):
          with then:
            blk_a = bd.block
            va = bd.load(ptr, align=4)
          with other:
            blk_b = bd.block
        phi = bd.phi(_V16)
        phi.add_incoming(va, blk_a)
        phi.add_incoming(zero, blk_b)
        rows.append(phi)
      for stage in _TRANSPOSE:
        rows = [bd.shuffle_vector(rows[lo], rows[hi], _const(i32, mask)) for lo, hi, mask in stage]
      out = bd.gep(kt.data, [bd.mul(col, _const(_I64, 16))])
      for j in range(16):
        bd.store(rows[j], bd.bitcast(bd.gep(out, [_const(_I64, 16 * j)]), _V16.as_pointer()),
                 align=4)
    return context.get_dummy_value()

  return codegen


@intrinsic
def _transpose_keys(typingctx, k, kv, t0, cnt, kt):
  return types.void(k, kv, t0, cnt, kt), _transpose_codegen()


@intrinsic
def _scores(typingctx, q, kt, sc, r0, col, rows):
  """Scores of `rows` (1..MAX_SCORE_ROWS) query rows from r0 (see `_scores_codegen`)."""
  variants = {r: _scores_codegen(r) for r in range(1, MAX_SCORE_ROWS + 1)}
  return types.void(q, kt, sc, r0, col, rows), switch_codegen(variants)


@intrinsic
def _pv(typingctx, p, v, kv, o, r0, c0, t0, t1, pcol, key):
  """P @ V of R (1..MAX_PV_ROWS) rows x C vectors (4: PV_COLS columns, or 1) from r0, c0:
  key = C * 8 + R (see `_pv_codegen`)."""
  variants = {c * 8 + r: _pv_codegen(r, c) for c in (1, PV_COLS // 16)
              for r in range(1, MAX_PV_ROWS + 1)}
  return types.void(p, v, kv, o, r0, c0, t0, t1, pcol, key), switch_codegen(variants)


@numba.njit(**common.JIT_ORDERED)
def query_blocks(slots, positions, block):
  """i64[nb, 2] (first token, count): runs of up to `block` consecutive tokens of one slot at
  consecutive positions (a prompt chunk is one run per block; each decode token its own)."""
  n = slots.shape[0]
  out = np.empty((n, 2), np.int64)
  nb = 0
  i = 0
  while i < n:
    m = 1
    while m < block and i + m < n and slots[i + m] == slots[i] and \
        positions[i + m] == positions[i] + m:
      m += 1
    out[nb, 0] = i
    out[nb, 1] = m
    nb += 1
    i += m
  return out[:nb]


@numba.njit(parallel=True, **common.JIT_ORDERED)
def attention(qkv, cache_k, cache_v, slots, positions, cos, sin, adjacent, n_heads, n_kv, scale,
              window, q_norm, k_norm, eps):
  """Causal grouped-query attention for N new tokens, writing their keys and values first.

  qkv: f32[N, N_h + 2K, H] (q heads, then k, then v, before RoPE); cache_k, cache_v: f32[slots,
  S, K, H] (keys stored after RoPE); slots, positions: i64[N]; cos, sin: f32[N, R/2] (each
  token's RoPE angles); window: > 0 attends only positions > p - window; q_norm, k_norm: f32[H]
  RMSNorm scales applied to each head before RoPE (QK-norm), or empty arrays for none.
  Returns f32[N, N_h H]: softmax(q k^T * scale) v per head over the attended positions.

  Blocked (flash-attention's tiling without its online softmax): the queries of up to
  QUERY_BLOCK consecutive tokens of one sequence and the `group` heads sharing a KV head are
  multiplied with tiles of KEY_TILE keys (transposed once per tile), then softmax per row, then
  P @ V. Every score is one FMA chain along the head dim and every output one along the keys
  in order, and a row's masked keys add exact zeros, so a token's result does not depend on
  its block: decode (one token per block) equals prefill bit for bit.
  """
  n, _, hd = qkv.shape
  group = n_heads // n_kv
  for job in numba.prange(n * n_kv):
    i = job // n_kv
    kv = job % n_kv
    s, p = slots[i], positions[i]
    kn = np.empty(hd, np.float32)
    _head_norm(qkv[i, n_heads + kv], kn, k_norm, eps)
    _rope_head(kn, cache_k[s, p, kv], cos[i], sin[i], adjacent)
    for j in range(hd):
      cache_v[s, p, kv, j] = qkv[i, n_heads + n_kv + kv, j]
  out = np.empty((n, n_heads * hd), np.float32)
  blocks = query_blocks(slots, positions, QUERY_BLOCK)
  nb = blocks.shape[0]
  wide_cols = hd - hd % PV_COLS
  for job in numba.prange(nb * n_kv):
    # Blocks from both ends in turn: later blocks attend to more keys, and the threads take
    # contiguous ranges of jobs.
    half = job // n_kv
    bi = half // 2 if half % 2 == 0 else nb - 1 - half // 2
    kv = job % n_kv
    i0, m = blocks[bi, 0], blocks[bi, 1]
    s, p0 = slots[i0], positions[i0]
    # Keys from a multiple of 16 (the softmax's lanes are the keys mod 16 whatever the block).
    kmin = (max(0, p0 - window + 1) if window > 0 else 0) & -KEY_TILE
    kmax = p0 + m - 1
    nkeys = kmax - kmin + 1
    rows = m * group
    q = np.empty((rows, hd), np.float32)
    qn = np.empty(hd, np.float32)
    for tt in range(m):
      for g in range(group):
        _head_norm(qkv[i0 + tt, kv * group + g], qn, q_norm, eps)
        _rope_head(qn, q[tt * group + g], cos[i0 + tt], sin[i0 + tt], adjacent)
    ntiles = (nkeys + KEY_TILE - 1) // KEY_TILE
    sc = np.empty((rows, ntiles * KEY_TILE), np.float32)
    kt = np.zeros((hd, KEY_TILE), np.float32)
    for tile in range(ntiles):
      t0 = kmin + tile * KEY_TILE
      cnt = min(KEY_TILE, kmax + 1 - t0)
      if hd % 16 == 0:
        _transpose_keys(cache_k[s], kv, t0, cnt, kt)
      else:
        for u in range(cnt):
          krow = cache_k[s, t0 + u, kv]
          for j in range(hd):
            kt[j, u] = krow[j]
        for u in range(cnt, KEY_TILE):
          for j in range(hd):
            kt[j, u] = 0.0
      r = 0
      while r < rows:
        R = min(MAX_SCORE_ROWS, rows - r)
        _scores(q, kt, sc, r, tile * KEY_TILE, R)
        r += R
    for r in range(rows):  # Softmax over each row's own keys; zeros elsewhere.
      last = p0 + r // group
      first = max(0, last - window + 1) if window > 0 else 0
      lo, hi = first - kmin, last - kmin + 1
      _softmax_row(sc, r, lo, hi, scale)
      for t in range(0, lo & -16):
        sc[r, t] = 0.0
      for t in range((hi + 15) & -16, nkeys):
        sc[r, t] = 0.0
    o = np.empty((rows, hd), np.float32)
    r = 0
    while r < rows:
      R = min(MAX_PV_ROWS, rows - r)
      # Keys from the first of these rows' windows to the last row's position.
      t_lo = max(0, p0 + r // group - window + 1) if window > 0 else 0
      t_hi = p0 + (r + R - 1) // group + 1
      c = 0
      while c < wide_cols:
        _pv(sc, cache_v[s], kv, o, r, c, t_lo, t_hi, t_lo - kmin, (PV_COLS // 16) * 8 + R)
        c += PV_COLS
      while c + 16 <= hd:
        _pv(sc, cache_v[s], kv, o, r, c, t_lo, t_hi, t_lo - kmin, 8 + R)
        c += 16
      for cc in range(c, hd):  # A head dim's last hd % 16 columns, one at a time.
        for rr in range(r, r + R):
          acc = np.float32(0.0)
          for t in range(t_lo, t_hi):
            acc += sc[rr, t - kmin] * cache_v[s, t, kv, cc]
          o[rr, cc] = acc
      r += R
    for tt in range(m):
      for g in range(group):
        head = kv * group + g
        for j in range(hd):
          out[i0 + tt, head * hd + j] = o[tt * group + g, j]
  return out


def rope_tables(ropes, rope_dim: int, positions) -> tuple[np.ndarray, np.ndarray]:
  """cos, sin: f32[n, N, R/2] for each distinct RoPE (theta, position scale, frequency divisors)
  of `ropes` at positions i64[N] (RoFormer §3.4; as pijax.nn.transformer.rope_angles)."""
  half = rope_dim // 2
  pos = np.asarray(positions, np.float32)
  cos, sin = [], []
  for theta, scale, factors in ropes:
    inv_freq = np.float32(theta) ** (
        -np.arange(half, dtype=np.float32) * np.float32(2.0) / np.float32(rope_dim))
    if factors:
      inv_freq = inv_freq / np.asarray(factors, np.float32)
    angles = pos[:, None] / np.float32(scale) * inv_freq.astype(np.float32)
    cos.append(np.cos(angles).astype(np.float32))
    sin.append(np.sin(angles).astype(np.float32))
  return np.stack(cos), np.stack(sin)
